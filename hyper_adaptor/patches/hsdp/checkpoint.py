"""Megatron ``torch_dist`` checkpoints for HSDP's DTensor shards.

What megatron-core 0.19.2 does with a DTensor parameter that is not one of its own FSDP2 ones: the
model's ``sharded_state_dict`` describes it as the whole (TP-local) tensor, replicated over data
parallel, with the DTensor itself as data; the optimizer's state is described the same way but with
``to_local()`` data (shape mismatch), and parameters are matched to optimizer slots by the ``id`` of
that data. So the checkpoint layout has to be said by us, three small seams:

* ``localize_sharded_state_dict`` runs after the unwrapped model's ``sharded_state_dict`` (an
  instance attribute set by the HSDP wrapper, so no class is patched): every entry whose data is an
  HSDP DTensor becomes this rank's rows of it — the ``torch.chunk`` split along dim 0 that
  ``Shard(0)`` means, uneven at the end, possibly empty — at its true global offset, on an irregular
  grid (megatron hands uneven shards to torch DCP, which checks coverage and overlap), with the
  replica id of the replicate (hybrid) coordinate. Keys, global shapes and offsets are exactly those
  of megatron's DDP checkpoint, so a checkpoint moves between ``--use-hsdp`` and plain DDP, and
  between shard sizes and levels. Factories (SwiGLU's ``linear_fc1`` [W; V] split) are rebuilt
  from a row-index tracer: the factory builds its pieces from a tensor whose every element is its
  row number, which tells which rows of the parameter each piece holds, and each piece keeps the
  rows of it this rank owns.
* ``hsdp_param_id_map`` (wrap of ``get_param_id_to_sharded_param_map``) matches the optimizer's
  DTensor parameters to those local entries.
* ``hsdp_optimizer_load`` (wrap of the optimizers' ``load_state_dict``) and the wrapper's
  ``load_state_dict`` turn loaded local rows back into DTensors shaped like the live ones.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, dict_list_map_outplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory


# -- where this rank's rows are ---------------------------------------------------------------------
def row_split(dtensor: DTensor) -> tuple[int, int, int] | None:
    """``(row_start, rows, replica_index)`` of this rank's piece of a dim-0 sharded DTensor, or
    None when it is replicated on every rank."""
    mesh, placements = dtensor.device_mesh, dtensor.placements
    shard_dims = [i for i, p in enumerate(placements) if p.is_shard()]
    if not shard_dims:
        return None
    if len(shard_dims) != 1 or not placements[shard_dims[0]].is_shard(dim=0):
        raise NotImplementedError(f"hsdp checkpoint: placements {placements} (only Shard(0) on one mesh dim)")
    dim = shard_dims[0]
    size, rank = mesh.size(dim), mesh.get_local_rank(dim)
    total = dtensor.shape[0]
    per_rank = math.ceil(total / size)
    start = min(rank * per_rank, total)
    rows = max(0, min(total - start, per_rank))
    replica = 0
    for i in range(mesh.ndim):
        if i != dim:
            replica = replica * mesh.size(i) + mesh.get_local_rank(i)
    return start, rows, replica


def _replica(replica_id, replica: int):
    # megatron's last replica-id component is the data-parallel rank; for a sharded tensor the ranks
    # holding the same rows are the ones with the same shard coordinate, told apart by the replica one
    if isinstance(replica_id, tuple):
        return (*replica_id[:-1], replica)
    return (replica_id, replica)


def _place_rows(sh_ten: ShardedTensor, data: torch.Tensor, offset: int, rows: int, replica_id) -> ShardedTensor:
    """``sh_ten`` (megatron's entry for the whole tensor) narrowed to ``rows`` rows from ``offset``.

    The grid becomes irregular, and megatron 0.19.2 writes irregular entries through a path that
    ignores prepended axes (layer-stacked keys), so those are folded into the local shape as
    leading 1s: same global shape and offsets, ``prepend_axis_num`` 0. The loaded value comes back
    in that shape; ``_unfold`` (in the merge functions) views it back."""
    axis = sh_ten.prepend_axis_num
    global_offset = list(sh_ten.global_offset)
    global_offset[axis] += offset
    if rows == 0:
        # DCP finds a stored chunk by its offset: an empty one must not share a real chunk's, and
        # the end of the axis is nobody's start
        global_offset[axis] = sh_ten.global_shape[axis]
    local_shape = (1,) * axis + (rows, *sh_ten.local_shape[1:])
    return replace(
        sh_ten, data=data.reshape(local_shape), dtype=data.dtype, local_shape=local_shape,
        global_offset=tuple(global_offset), axis_fragmentations=None, prepend_axis_num=0,
        replica_id=replica_id,
    )


def _unfold(loaded, ndim: int) -> torch.Tensor:
    if isinstance(loaded, (list, tuple)):
        (loaded,) = loaded
    return loaded.reshape(loaded.shape[loaded.dim() - ndim :])


# -- model sharded state dict -> this rank's rows -------------------------------------------------
def localize_sharded_state_dict(state_dict):
    """Rewrite, in place, every ShardedTensor / factory whose data is an HSDP DTensor."""

    def localize(node):
        if isinstance(node, (ShardedTensor, ShardedTensorFactory)) and isinstance(node.data, DTensor):
            source = node.data
            node = _localize_tensor(node) if isinstance(node, ShardedTensor) else _localize_factory(node)
            node._hsdp_source = source  # what hsdp_param_id_map matches the optimizer's parameters with
        return node

    return dict_list_map_inplace(localize, state_dict)


def _localize_tensor(sh_ten: ShardedTensor):
    """A replicated DTensor: its local tensor, as megatron described it. A sharded one: a factory
    whose one piece is this rank's rows (a factory, so the optimizer's states get the same layout
    and the loaded value is viewed back to the local shape)."""
    dtensor = sh_ten.data
    local = dtensor._local_tensor
    split = row_split(dtensor)
    if split is None:
        return replace(sh_ten, data=local)
    start, rows, replica = split
    if tuple(local.shape) != (rows, *dtensor.shape[1:]):
        raise RuntimeError(f"hsdp checkpoint: {sh_ten.key}: local shard {tuple(local.shape)} is not rows "
                           f"[{start}, {start + rows}) of {tuple(dtensor.shape)}")
    template = replace(sh_ten, data=None)
    ndim = dtensor.dim()

    def build_fn(key, data, replica_id, flattened_range):
        piece = replace(template, key=key, replica_id=replica_id)
        return _place_rows(piece, data, start, rows, _replica(replica_id, replica))

    def merge_fn(loaded):
        return _unfold(loaded, ndim)

    return ShardedTensorFactory(sh_ten.key, local, build_fn, merge_fn, sh_ten.replica_id)


def _localize_factory(factory: ShardedTensorFactory) -> ShardedTensorFactory:
    dtensor = factory.data
    split = row_split(dtensor)
    if split is None:
        return replace(factory, data=dtensor._local_tensor)
    start, rows, replica = split
    full_shape = tuple(dtensor.shape)
    build, merge = factory.build_fn, factory.merge_fn

    @functools.wraps(build)
    def build_fn(key, data, replica_id, flattened_range):
        # ``data``: this rank's rows (of the parameter, or of an optimizer state shaped like it)
        tracer = torch.arange(full_shape[0], dtype=torch.float64)
        tracer = tracer.view(-1, *([1] * (len(full_shape) - 1))).expand(full_shape)
        pieces = build(key, tracer, replica_id, flattened_range)
        return dict_list_map_outplace(lambda piece: _cut_piece(piece, data, start, rows, replica, full_shape), pieces)

    @functools.wraps(merge)
    def merge_fn(loaded):
        return merge(dict_list_map_outplace(
            lambda t: _unfold(t, len(full_shape)) if isinstance(t, torch.Tensor) else t, loaded))

    return replace(factory, data=dtensor._local_tensor, build_fn=build_fn, merge_fn=merge_fn)


def _cut_piece(piece, data, start, rows, replica, full_shape):
    if not isinstance(piece, ShardedTensor):
        return piece
    traced = piece.data
    if tuple(traced.shape[1:]) != full_shape[1:]:
        raise NotImplementedError(
            f"hsdp checkpoint: factory piece {piece.key} splits a dimension other than 0 "
            f"({tuple(traced.shape)} of {full_shape})")
    first_col = traced.reshape(traced.shape[0], -1)[:, 0] if traced.numel() else traced.new_empty(0)
    lo = int(first_col[0]) if first_col.numel() else 0
    hi = lo + traced.shape[0]
    if not torch.equal(first_col, torch.arange(lo, hi, dtype=first_col.dtype)):
        raise NotImplementedError(f"hsdp checkpoint: factory piece {piece.key} is not a contiguous row range")
    a, b = max(lo, start), min(hi, start + rows)
    if b <= a:  # none of this piece's rows are here: an empty chunk (placed by _place_rows)
        a = b = lo
    local = data[a - start : b - start] if b > a else data[:0]
    return _place_rows(piece, local, a - lo, b - a, _replica(piece.replica_id, replica))


class _Localizing:
    """A model chunk as ``generate_state_dict`` sees it: its ``sharded_state_dict`` localized, every
    other attribute the chunk's own."""

    def __init__(self, chunk):
        self._chunk = chunk

    def sharded_state_dict(self, *args, **kwargs):
        return localize_sharded_state_dict(self._chunk.sharded_state_dict(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._chunk, name)


def localized_state_dict(original):
    """megatron.training builds every checkpoint's description (save, and the template a load fills)
    in ``generate_state_dict``, which calls ``sharded_state_dict`` on each unwrapped model chunk and
    then hands the result to the optimizer's. Localize the model's entries there, before the
    optimizer maps its state onto them — a wrap of that one function rather than a method set on
    each model instance (which the patch manager could neither list nor undo)."""

    @functools.wraps(original)
    def generate_state_dict(args, model, *rest, **kwargs):
        return original(args, [_Localizing(chunk) for chunk in model], *rest, **kwargs)

    return generate_state_dict


# -- optimizer: parameter ids -> local entries ----------------------------------------------------
def hsdp_param_id_map(original):
    @functools.wraps(original)
    def get_param_id_to_sharded_param_map(model_sharded_state_dict, optim_params_iter):
        params = list(optim_params_iter)
        result = original(model_sharded_state_dict, params)
        by_source = {id(entry._hsdp_source): entry for entry in nested_values(model_sharded_state_dict)
                     if getattr(entry, "_hsdp_source", None) is not None}
        if by_source:
            first_index = {}
            for index, param in enumerate(params):
                first_index.setdefault(id(param), index)
            for pid, index in first_index.items():
                if index not in result and pid in by_source:
                    result[index] = by_source[pid]
        return result

    return get_param_id_to_sharded_param_map


# -- loading: local rows -> DTensors ----------------------------------------------------------------
def to_dtensor_like(value: torch.Tensor, like: DTensor, name: str = "") -> DTensor:
    """``value`` (this rank's rows, or the whole tensor) as a DTensor laid out like ``like``."""
    if isinstance(value, DTensor):
        return value
    local_shape = tuple(like._local_tensor.shape)
    if tuple(value.shape) == local_shape:
        local = value
    elif tuple(value.shape) == tuple(like.shape):
        split = row_split(like)
        local = value if split is None else value[split[0] : split[0] + split[1]]
    else:
        raise ValueError(f"hsdp checkpoint: {name or 'tensor'} has shape {tuple(value.shape)}; expected this "
                         f"rank's rows {local_shape} or the whole {tuple(like.shape)}")
    local = local.to(device=like._local_tensor.device, dtype=like.dtype)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def _dtensor_optimizer_state(torch_optimizer) -> None:
    for param, state in torch_optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        for key, value in state.items():
            if (isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() == param.dim()
                    and value.dim() > 0):
                state[key] = to_dtensor_like(value, param, f"optimizer state {key}")


def hsdp_optimizer_load(original):
    """Wrap a megatron optimizer's ``load_state_dict``: fp32 main copies are DTensors laid out like
    the live ones before megatron copies them in; the torch optimizer's state after it loads."""

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        for key in ("fp32_from_fp16_params", "fp32_from_fp16"):
            if isinstance(state_dict, dict) and key in state_dict and hasattr(self, "fp32_from_float16_groups"):
                state_dict[key] = [
                    [to_dtensor_like(saved, current, "fp32 main parameter") if isinstance(current, DTensor) else saved
                     for current, saved in zip(current_group, saved_group)]
                    for current_group, saved_group in zip(self.fp32_from_float16_groups, state_dict[key])
                ]
        result = original(self, state_dict)
        _dtensor_optimizer_state(self.optimizer)
        return result

    return load_state_dict


def dtensor_model_state_dict(module: torch.nn.Module, state_dict: dict) -> dict:
    """A loaded model state dict with plain tensors where the module holds DTensors, converted."""
    live = module.state_dict(keep_vars=True)
    out = dict(state_dict)
    for key, value in state_dict.items():
        current = live.get(key)
        if isinstance(current, DTensor) and isinstance(value, torch.Tensor):
            out[key] = to_dtensor_like(value, current, key)
    return out
