"""Megatron's data-parallel wrapper, served by the HSDP engine (hyper_adaptor/parallel/hsdp).

Seam: megatron.training (0.19.2) builds its DP wrapper in ``models/dist_utils._ddp_wrap``, which
looks the class up as the module global ``DistributedDataParallel`` at call time and constructs it
as ``DP(config=, ddp_config=, module=, disable_bucketing=, pg_collection=)``. Under ``--use-hsdp``
that one name (in that one module) is bound to :class:`HSDPDataParallel`; nothing else of
megatron's set-up changes. The class derives from megatron's torch-FSDP2 wrapper only so that
``unwrap_model`` and the DTensor-aware paths of ``finalize_model_grads`` and the optimizer treat it
as the DTensor-sharded model it is; it runs none of that wrapper's code.

The optimizer megatron builds on top sees the DTensor shards as its parameters, so its state is
sharded; gradients arrive in ``param.grad`` already reduced (inside backward, or when the last
micro-batch's backward ends: megatron's ``no_sync_func`` is set to keep the others local).

Expert parallelism: the experts of each ``MoELayer`` (the parameters megatron marks
``allreduce = False``) hold different experts on different EP ranks, so they are their own unit,
nested in their layer's and wrapped first, over megatron's expert-data-parallel group — the group
megatron's DDP reduces them over. Their gradients are summed over that group and divided by the
data-parallel (+CP) size, as megatron's DDP scales them (the tokens an expert saw come from every
data-parallel rank of its EP group): ``grad_scale`` = expert-DP size / DP size, since the engine
averages over the unit's own group. Where the two groups hold the same ranks (EP 1, expert TP = TP)
the experts stay in their layer's unit, as without expert parallelism.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from hyper_adaptor.parallel.hsdp import hsdp, hsdp_sync_stream, mark_stale
from hyper_adaptor.patches.hsdp.checkpoint import dtensor_model_state_dict

from megatron.core import parallel_state
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer


def _is_hsdp_no_sync(func) -> bool:
    return getattr(getattr(func, "__self__", None), "_hsdp_wrapper", False)


def make_wrapper_class(hsdp_kwargs: dict) -> type:
    class HSDPDataParallel(TorchFullyShardedDataParallel):
        """megatron's DP-wrapper interface over HSDP (one instance per model chunk)."""

        _hsdp_wrapper = True

        def __init__(self, config, ddp_config, module, disable_bucketing=False, pg_collection=None, **unused):
            _BaseDataParallel.__init__(self, config=config, module=module)
            self.ddp_config = ddp_config
            if pg_collection is not None and getattr(pg_collection, "dp_cp", None) is not None:
                group = pg_collection.dp_cp
            else:
                group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            expert_group = _expert_group(pg_collection, group)
            if expert_group is not None:
                expert_kwargs = _expert_kwargs(hsdp_kwargs, expert_group, group)
                for moe in [m for m in module.modules() if isinstance(m, MoELayer)]:
                    hsdp(moe.experts, group=expert_group, **expert_kwargs)
            # One HSDP unit per transformer layer (level 3 then holds a layer's full parameters
            # while it runs, plus the next one prefetched), and the chunk root for the rest
            # (embeddings, final norm, output layer). The root and the last layer stay gathered
            # from forward to backward (the engine's default reshard schedule).
            for layer in [m for m in module.modules() if isinstance(m, TransformerLayer)]:
                hsdp(layer, group=group, **hsdp_kwargs)
            hsdp(module, group=group, **hsdp_kwargs)
            if expert_group is not None:
                _check_expert_groups(module, expert_group)
            # megatron's schedules keep every micro-batch but the last local through this; with model chunks
            # (virtual pipeline stages) the schedules take one function per chunk, in chunk order
            previous = config.no_sync_func
            if not getattr(module, "vp_stage", None):  # the first (or only) chunk
                config.no_sync_func = self.no_sync
            elif isinstance(previous, list) and all(_is_hsdp_no_sync(f) for f in previous):
                config.no_sync_func = [*previous, self.no_sync]
            elif _is_hsdp_no_sync(previous):
                config.no_sync_func = [previous, self.no_sync]
            else:
                config.no_sync_func = self.no_sync

        @contextlib.contextmanager
        def no_sync(self):
            self.module.set_requires_grad_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_grad_sync(True)

        def start_grad_sync(self, *unused):
            pass  # reductions start from backward hooks

        def finish_grad_sync(self, force_all_reduce: bool = False):
            hsdp_sync_stream()

        def scale_gradients(self, scaling_factor: float) -> None:
            for param in self.module.parameters():
                if param.grad is not None:
                    param.grad.to_local().mul_(scaling_factor)

        def zero_grad_buffer(self):
            self.module.zero_grads()

        def broadcast_params(self):
            raise RuntimeError("--use-hsdp does not support --data-parallel-random-init")

        def load_state_dict(self, state_dict, strict=True):
            # a checkpoint gives this rank's rows (or whole tensors) as plain tensors
            result = self.module.load_state_dict(dtensor_model_state_dict(self.module, state_dict), strict=strict)
            # the engine's load hooks sit on the wrapped modules, and megatron's Float16Module
            # loads its child directly (its own hooks never run): mark every shard here
            mark_stale(self.module.parameters())
            return result

    return HSDPDataParallel


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def _expert_group(pg_collection, dense_group):
    """megatron's expert-data-parallel group where it differs from the dense one (by ranks), else None."""
    group = getattr(pg_collection, "expt_dp", None) if pg_collection is not None else None
    if group is None:
        group = parallel_state.get_expert_data_parallel_group(check_initialized=False)
    if group is None or _ranks(group) == _ranks(dense_group):
        return None
    return group


def _expert_kwargs(hsdp_kwargs: dict, expert_group, dense_group) -> dict:
    edp, dp = dist.get_world_size(expert_group), dist.get_world_size(dense_group)
    shard = hsdp_kwargs["shard_size"]
    if shard != -1:
        # the flag counts ranks of the data-parallel group; the expert-DP group may be smaller
        shard = -1 if shard >= edp else shard
        if shard != -1 and edp % shard:
            raise ValueError(f"--hsdp-shard-size {hsdp_kwargs['shard_size']} must be -1 or divide the "
                             f"expert data-parallel size {edp}")
    # megatron's DDP: expert gradients summed over the expert-DP group, times 1 / (DP x CP)
    return {**hsdp_kwargs, "shard_size": shard, "grad_scale": hsdp_kwargs.get("grad_scale", 1.0) * edp / dp}


def _check_expert_groups(module, expert_group) -> None:
    """Each parameter is reduced over the group megatron's DDP would use (by its ``allreduce`` mark):
    an expert-parallel one outside an ``MoELayer``'s experts would be summed with other experts', a
    replicated one inside them would miss the data-parallel ranks outside the expert-DP group."""
    for name, param in module.named_parameters():
        managed = getattr(param, "_hsdp_param", None)
        if managed is None:
            continue
        expert = not getattr(param, "allreduce", True)
        if expert != (managed.mesh.dp_group is expert_group):
            where = "outside an MoELayer's experts" if expert else "inside an MoELayer's experts"
            raise RuntimeError(f"--use-hsdp: parameter {name} (allreduce={not expert}) is {where}; HSDP would reduce "
                               f"it over the {'data-parallel' if expert else 'expert data-parallel'} group")
