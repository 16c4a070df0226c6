"""A pretrain script whose batch, loss and forward step go through the helpers Megatron-LM's own
``pretrain_gpt.py`` (branch core_r0.19.0) calls, for tests/e2e/test_pipeline_megatron.py.

Megatron-LM's script is not in this repository and cannot be fetched offline; what matters for the
pipeline schedules is how its ``get_batch`` decides which fields a stage gets: it asks
``is_first_or_last_pipeline_stage(vp_stage)`` whether the chunk needs data at all, then hands
``megatron.core.utils.get_batch_on_this_tp_rank`` the *pipeline rank's* answers of
``mpu.is_pipeline_first_stage()`` / ``mpu.is_pipeline_last_stage()`` (no ``vp_stage``), which keeps
tokens on the first rank and labels / loss mask on the last. Its ``loss_func`` reads ``loss_mask``.
Those calls are made here the same way (TP source rank reads the iterator, the helper broadcasts
over the TP group, then the context-parallel split). Datasets and the model come from
examples/pretrain_gpt.py, which build them as Megatron-LM's script does for a plain GPT.
"""

import os
import sys
from functools import partial

import torch  # noqa: F401  (the one line goes after torch, as in Megatron-LM's script)

import hyper_adaptor.megatron_adaptor  # noqa: F401  (the one line)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from examples.pretrain_gpt import loss_func, main

from megatron.core import mpu
from megatron.core.parallel_state import get_context_parallel_group
from megatron.core.utils import (
    flatten_batch_for_packed_sequences,
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training import get_args
from megatron.training.utils import is_first_or_last_pipeline_stage

FIELDS = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "labels", "loss_mask", "max_seqlen",
          "position_ids", "tokens")


def get_batch(data_iterator, vp_stage=None):
    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        sample = next(data_iterator)
        batch = {k: sample[k].cuda(non_blocking=True) if sample.get(k) is not None else None for k in FIELDS}
    batch = get_batch_on_this_tp_rank(
        batch,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        # the pipeline rank's answers, as Megatron-LM's script passes them
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = flatten_batch_for_packed_sequences(batch)
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=get_context_parallel_group())
    return tuple(batch[k] for k in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids"))


def forward_step(data_iterator, model):
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


if __name__ == "__main__":
    main(forward_step)
