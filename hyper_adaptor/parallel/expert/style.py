"""``ExpertParallel`` and ``ExpertTensorParallel``: torch ``ParallelStyle``s that shard a ``MoE`` block.

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    moe = MoE(hidden, ffn, num_experts=8, topk=2, shared_ffn=ffn)   # the same init on every rank
    parallelize_module(moe, init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)), ExpertParallel())
    parallelize_module(moe2, init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp")), ExpertTensorParallel())

Each rank keeps only its experts' weights, sliced from the full ones (so a block initialised
identically everywhere becomes the sharded one; with the style's ``src_data_rank`` left at 0 the full
weights are first broadcast from the mesh's first rank, which makes that hold even when the ranks'
initialisations differ), and under ``ExpertTensorParallel`` only its column shard of ``w_gate`` /
``w_up`` and row shard of ``w_down``. The weights stay plain local tensors, not DTensors: the grouped
GEMM, the optimizer and hot-expert replicas all work on the local block, and a DTensor would only be
unwrapped again in every forward. Parallelize before building the optimizer (the parameters are
replaced).

Tokens: every rank of the mesh hands the block its own tokens (a sequence- or data-parallel shard).
Ranks of one "tp" row that hold identical tokens (tensor parallel without sequence parallel) must
pass a 1/tp slice each, as megatron's sequence parallel does — otherwise each token is routed tp times.

Gradients, after backward:

- a kept expert weight's gradient is the slice of the gradient the single-process block would have
  for all the mesh's tokens (the all-to-all backward brings every token's contribution to its owner).
  Under ``ExpertParallel`` on a 2-D ("ep", "tp") mesh the experts are replicated over "tp", so sum
  their gradients over "tp" too; with data parallel on top, reduce them over the expert-data-parallel
  ranks (the replicas of this mesh) as usual.
- the router and the shared expert stay replicated, and each rank's gradient covers only its own
  tokens: the user sums (or averages, matching the loss scaling) them over every rank of the mesh and
  over data parallel — exactly as for any other dense parameter of the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from hyper_adaptor.parallel.expert._dispatcher import AllToAllDispatcher
from hyper_adaptor.parallel.expert._experts import GroupedExperts


def _mesh_groups(style: str, mesh, want_tp: bool):
    """(ep group, tp group or None, mesh dims in broadcast order) of a 1-D or 2-D ("ep", "tp") mesh."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1 and not want_tp:
        return mesh.get_group(), None, [mesh.get_group()]
    if mesh.ndim == 2 and set(names) == {"ep", "tp"}:
        ep, tp = mesh["ep"].get_group(), mesh["tp"].get_group()
        return ep, tp, [ep, tp]
    want = "a 2-D mesh with dims ('ep', 'tp')" if want_tp else "a 1-D mesh or a 2-D mesh with dims ('ep', 'tp')"
    raise ValueError(f"{style} needs {want}; got a {mesh.ndim}-D mesh with dims {names or None}")


def _check_module(style: str, module: nn.Module) -> GroupedExperts:
    experts = getattr(module, "experts", None)
    if not isinstance(experts, GroupedExperts) or not isinstance(getattr(module, "dispatcher", None),
                                                                AllToAllDispatcher):
        raise TypeError(f"{style} applies to a MoE block (an `experts` GroupedExperts and a `dispatcher`), "
                        f"got {type(module).__name__}")
    if experts.first_expert != 0 or experts.num_experts != module.dispatcher.num_experts:
        raise ValueError(f"{style}: the block is already sharded (it holds {experts.num_experts} of "
                         f"{module.dispatcher.num_experts} experts)")
    return experts


def _broadcast_from_first(module: nn.Module, groups) -> None:
    """Every parameter and buffer from the mesh's rank (0, 0, ...): one broadcast along each mesh dim."""
    with torch.no_grad():
        for group in groups:
            if dist.get_world_size(group) == 1:
                continue
            src = dist.get_global_rank(group, 0)
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=src, group=group)


class _ExpertStyle(ParallelStyle):
    _etp = False

    def __init__(self, *, placement: list[int] | None = None):
        self.placement = placement

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        name = type(self).__name__
        experts = _check_module(name, module)
        ep_group, tp_group, order = _mesh_groups(name, device_mesh, want_tp=self._etp)
        old = module.dispatcher
        if self.src_data_rank is not None:
            _broadcast_from_first(module, order)
        etp_group = tp_group if self._etp else None
        dispatcher = AllToAllDispatcher(old.num_experts, ep_group, etp_group=etp_group,
                                        capacity_factor=old.capacity_factor, pad_to_capacity=old.pad_to_capacity,
                                        drop_policy=old.drop_policy, topk=old.topk, placement=self.placement)
        shards = dist.get_world_size(etp_group) if etp_group is not None else 1
        shard = dist.get_rank(etp_group) if etp_group is not None else 0
        if experts.ffn % shards:
            raise ValueError(f"{name}: the experts' ffn size {experts.ffn} does not divide over the 'tp' mesh "
                             f"dimension of size {shards}")
        first, count = dispatcher.first_expert, dispatcher.local_experts
        width = experts.ffn // shards
        with torch.no_grad():
            for proj, full in experts.projections().items():
                kept = full[first:first + count]
                dim = 2 if proj == "w_down" else 1     # w_down is row-parallel, the others column-parallel
                kept = kept.narrow(dim, shard * width, width)
                setattr(experts, proj, nn.Parameter(kept.clone(), requires_grad=full.requires_grad))
        experts.num_experts, experts.first_expert, experts.ffn = count, first, width
        module.dispatcher = dispatcher
        return module


class ExpertParallel(_ExpertStyle):
    """Experts split over the "ep" dimension (a 1-D mesh, or the "ep" dim of a 2-D ("ep", "tp") mesh,
    over whose "tp" dim the experts are then replicated); tokens reach them by all-to-all.
    ``placement``: experts per EP rank in expert order (default: an even split)."""


class ExpertTensorParallel(_ExpertStyle):
    """Experts split over "ep" and each expert's FFN split over "tp" of a 2-D ("ep", "tp") mesh: the
    dispatched rows are gathered over "tp" before the experts and the partial outputs reduce-scattered
    after them."""

    _etp = True
