"""Megatron's mixed-precision (bf16 / fp16) optimizer over HSDP shards.

``Float16OptimizerWithFloat16Params`` steps fp32 main copies of the bf16 shards and then writes
them back into the shards (``_copy_main_params_to_model_params``). HSDP learns that a shard
changed from the torch optimizer's step hook, which here sees only the main copies, so the write
back is where the shards are marked: without it levels 1 and 2 would keep computing with the
gathered parameters of the step before (seen: bf16 losses off Megatron DDP's from iteration 3).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from hyper_adaptor.parallel.hsdp import mark_stale


def mark_shards_stale(original):
    @functools.wraps(original)
    def _copy_main_params_to_model_params(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        mark_stale(p for group in self.float16_groups for p in group)
        return result

    return _copy_main_params_to_model_params


def found_inf_over_data_parallel(original):
    """megatron's mixed-precision optimizers look for inf/nan in their main gradients and agree on
    the answer over the model-parallel group only — right when every data-parallel rank holds the
    whole (identical) gradient, wrong for HSDP's shards: one rank's shard can overflow while the
    others' do not, and that rank alone would skip the step (the replicas silently diverge). The
    wrap takes the maximum over the data-parallel group too, as megatron's distributed optimizer
    does by reducing over the world."""

    @functools.wraps(original)
    def _unscale_main_grads_and_check_for_nan(self, *args, **kwargs):
        found = original(self, *args, **kwargs)
        group = _hsdp_data_parallel_group(self)
        if group is None:
            return found
        flag = torch.tensor([1.0 if found else 0.0], device=self.found_inf.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        found = bool(flag.item() > 0)
        self.found_inf.fill_(1.0 if found else 0.0)
        return found

    return _unscale_main_grads_and_check_for_nan


def _hsdp_data_parallel_group(optimizer):
    for group in getattr(optimizer, "float16_groups", ()):
        for param in group:
            managed = getattr(param, "_hsdp_param", None)
            if managed is not None and managed.sharded:
                return managed.mesh.dp_group
    return None
