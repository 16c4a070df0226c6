"""Pretrain a GPT with megatron.training's own ``pretrain`` entry point and hyper_adaptor.

The only adaptor-specific line is the import right after ``import torch``; everything else is a
plain megatron.training script driven by Megatron-LM's usual flags, plus hyper_adaptor's flags
(``--optimization-level``, ``--device-type``, one per feature). Data: ``--data-path`` (a Megatron
indexed dataset; ``examples/corpus.py`` builds the embedded default) or ``--mock-data``.

Launch (see examples/run_demo.sh for the full command):
    torchrun --nproc-per-node 4 examples/pretrain_gpt.py --tensor-model-parallel-size 2 ...
"""

from functools import partial

import torch

import hyper_adaptor.megatron_adaptor  # noqa: F401  (the one line)

from megatron.core import parallel_state as mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_cp_rank
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils.common_utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage


def get_batch(data_iterator, vp_stage=None):
    """The batch on stages that need it (first: tokens; last: labels). Every TP rank reads the same
    samples from its own loader (the data sampler is keyed by the data-parallel rank only), so no
    broadcast over the TP group is needed."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    batch = next(data_iterator)
    device = torch.cuda.current_device()
    fields = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    batch = {k: batch[k].to(device, non_blocking=True) if batch.get(k) is not None else None for k in fields}
    # context parallel: this rank's load-balanced chunks of every sequence (2 x CP chunks, rank r keeps
    # r and 2 x CP - 1 - r), as Megatron-LM's pretrain_gpt.py does; a no-op at CP 1
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return tuple(batch[k] for k in fields)


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan=False):
    """One micro-batch's forward. megatron's combined 1F1B (``--overlap-moe-expert-parallel-comm``) asks
    instead for the model's schedule plan over the same inputs, whose nodes it runs itself, interleaved
    with another micro-batch's backward."""
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    if return_schedule_plan:
        plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        return plan, partial(loss_func, loss_mask)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None):
    return is_first_or_last_pipeline_stage(vp_stage)


def dataset_config(args):
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_type.__name__} train/valid/test datasets ...")
    return BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        dataset_config(args),
    ).build()


def main(forward_step_func=forward_step):
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    cfg = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step_func)


if __name__ == "__main__":
    main()
