"""One managed parameter: its shard (what the optimizer sees) and its gathered full copy (what
forward and backward compute with).

Sharding is along dim 0, padded to a multiple of the shard-group size: rank r owns rows
``[r*c, (r+1)*c)`` of the padded parameter (c = ceil(rows / S)), the ``torch.chunk`` split that
DTensor's ``Shard(0)`` describes, so the registered shard is a DTensor that torch's optimizers,
``clip_grad_norm_`` and ``torch.distributed.checkpoint`` understand. Parameters below the size
threshold (and 0-d ones) stay whole on every rank (a ``Replicate()`` DTensor) and have their
gradients all-reduced.

Memory, per level (Ψ elements, N shard ranks, same dtype for compute and master):
* level 1: full parameter + full gradient kept; the shard and its gradient are *views* of this
  rank's rows of them, so only the optimizer state is sharded (ZeRO-1).
* level 2: full parameter kept, the shard is a view of it; the full gradient is released once
  reduced; the gradient shard is its own buffer (ZeRO-2).
* level 3: only the shard and its gradient are kept; the full parameter is gathered for forward and
  again for backward, and released after each (ZeRO-3).
With a separate compute dtype (mixed precision) the shard is its own master-dtype buffer.

Tensor parallel (a parameter that is a DTensor on a 1-D TP mesh, as torch's ``parallelize_module``
leaves it): everything above applies to its TP-local tensor, which is sharded over the data-parallel
ranks along dim 0. The full copy stays a DTensor with the TP placement (what the TP module computes
with); the shard is a DTensor on the (data-parallel dims..., tp) mesh. Where TP also shards dim 0
(``ColwiseParallel``), this rank's rows are a sub-chunk of its TP chunk: chunk t over TP first, then
chunk d over data parallel, the reverse of DTensor's left-to-right order for ``(Shard(0), Shard(0))``,
so the data-parallel placement is ``_StridedShard(0, split_factor=TP)`` (FSDP2's choice for the same
layout), under which optimizers, ``clip_grad_norm_`` and ``torch.distributed.checkpoint`` see the true
global offsets. A plain parameter of such a module (a norm weight without sequence parallel) is
replicated over TP; it is placed ``Replicate()`` on the tp dim so that every shard lives on one mesh.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_adaptor.parallel.hsdp._config import HSDPConfig
from hyper_adaptor.parallel.hsdp._mesh import HSDPMesh


class HSDPParam:
    def __init__(self, param: nn.Parameter, owners: list[tuple[nn.Module, str]], config: HSDPConfig,
                 mesh: HSDPMesh, device: torch.device, tp=None):
        self.owners = owners
        self.fqn = owners[0][1]
        self.config = config
        self.mesh = mesh
        # tp: None, or (tp DeviceMesh, the (dp dims..., tp) DeviceMesh the shards live on)
        self.tp_mesh, self.shard_mesh = tp if tp is not None else (None, mesh.device_mesh)
        self.global_shape = param.shape
        self.tp_placements = None
        # the full copy is a DTensor only where the module had one; a plain parameter of a TP module
        # stays plain for the module, only its shard is placed on the (dp..., tp) mesh
        self.is_tp = isinstance(param, DTensor)
        if self.is_tp:
            self.tp_placements = tuple(param.placements)
            param = param.to_local()
        elif self.tp_mesh is not None:
            self.tp_placements = (Replicate(),)
        self.shape = param.shape  # the TP-local shape: what is sharded over data parallel
        self.master_dtype = param.dtype
        self.compute_dtype = config.param_dtype or param.dtype
        self.reduce_dtype = config.reduce_dtype or self.compute_dtype
        self.device = device
        self.shard_device = torch.device("cpu") if config.offload else device
        nbytes = param.numel() * param.element_size()
        self.sharded = param.dim() > 0 and mesh.shard_size > 1 and nbytes >= config.threshold * 1024
        S, r = (mesh.shard_size, mesh.shard_rank) if self.sharded else (1, 0)
        rows = self.shape[0] if param.dim() > 0 else 1
        self.row_numel = param.numel() // rows if rows else 0
        self.rows_per_rank = math.ceil(rows / S)
        self.chunk_numel = self.rows_per_rank * self.row_numel  # padded numel each rank sends
        self.local_rows = max(0, min(rows - r * self.rows_per_rank, self.rows_per_rank))
        self.row_start = r * self.rows_per_rank
        self.aliased = (self.master_dtype == self.compute_dtype and not config.reshard_after_forward
                        and not config.offload)
        self.grad_state = "empty"  # empty | local (accumulated, unreduced) | reduced
        self._stash: torch.Tensor | None = None
        # True once the shard has changed since the full copy was gathered (set after every optimizer
        # step and state-dict load, see _state.py); level 1/2 re-gather lazily at the next forward.
        self.stale = False
        self._specs: dict = {}

        data = param.detach().to(device)
        # The full copy is one leaf Parameter object for the whole run: autograd saves it for backward,
        # hooks are attached to it, and level 3 frees / refills its storage in place.
        full = data.to(self.compute_dtype, copy=True)
        if self.is_tp:
            full = DTensor.from_local(full, self.tp_mesh, self.tp_placements, run_check=False,
                                      shape=self.global_shape, stride=_contiguous_stride(self.global_shape))
        self.full = nn.Parameter(full, requires_grad=param.requires_grad)
        if self.aliased:
            local = (self.full_data[self.row_start : self.row_start + self.local_rows] if self.sharded
                     else self.full_data)
        else:
            local = self._own_rows(data).to(self.shard_device, self.master_dtype, copy=True)
        self.local = local
        self.sharded_param = nn.Parameter(self._as_dtensor(local), requires_grad=param.requires_grad)
        # Frameworks tag parameters with attributes (Megatron: tensor_model_parallel, partition_dim,
        # sequence_parallel, shared, ...) that their optimizers and gradient hooks read: keep them.
        for key, value in vars(param).items():
            setattr(self.sharded_param, key, value)
            setattr(self.full, key, value)
        self.sharded_param._hsdp_param = self  # marks the parameter as managed (nested wrapping skips it)
        if self.full.requires_grad:
            self.full.register_hook(self._before_accumulate)
        if config.reshard_after_forward:
            self.free_full()

    # -- views -------------------------------------------------------------------------------------
    @property
    def full_data(self) -> torch.Tensor:
        """The full copy's local tensor without autograd (``.data``; under TP, the TP-local one)."""
        return self.full._local_tensor if self.is_tp else self.full.data

    def _own_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return tensor
        return tensor[self.row_start : self.row_start + self.local_rows]

    def _as_dtensor(self, local: torch.Tensor) -> DTensor:
        spec = self._specs.get(local.dtype)
        if spec is not None and local.shape == self.local.shape:
            # The layout never changes: build the DTensor from the spec of the first one.
            # ``from_local`` re-derives the spec each call, once per gradient per step (its cost:
            # docs/features/hsdp.md, Design, "Copies").
            return DTensor(local, spec, requires_grad=False)
        dp_ndim = self.mesh.device_mesh.ndim
        tp = list(self.tp_placements or ())
        dp = Shard(0)
        if any(pl.is_shard(0) for pl in tp):
            dp = _StridedShard(0, split_factor=self.tp_mesh.size())  # TP chunk first, then ours: see the module doc
        placements = [Replicate()] * (dp_ndim - 1) + [dp if self.sharded else Replicate()] + tp
        out = DTensor.from_local(
            local, self.shard_mesh, placements, run_check=False, shape=self.global_shape,
            stride=_contiguous_stride(self.global_shape),
        )
        self._specs[local.dtype] = out._spec
        return out

    def register_full(self) -> None:
        for module, name in self.owners:
            module._parameters[name] = self.full

    def register_sharded(self) -> None:
        for module, name in self.owners:
            module._parameters[name] = self.sharded_param

    # -- parameter gathering -----------------------------------------------------------------------
    def needs_gather(self) -> bool:
        if self.config.reshard_after_forward and self.full_data.untyped_storage().size() == 0:
            return True
        return self.stale

    def gather_input(self, out: torch.Tensor) -> None:
        """Write this rank's padded rows, flat, in the compute dtype into ``out`` (chunk_numel)."""
        n = self.local.numel()
        out[:n].copy_(self.local.reshape(-1))
        out[n:].zero_()

    def alloc_full(self) -> None:
        data = self.full_data
        storage = data.untyped_storage()
        needed = data.numel() * data.element_size()
        if storage.size() != needed:
            storage.resize_(needed)

    def free_full(self) -> None:
        self.full_data.untyped_storage().resize_(0)

    def write_gathered(self, rank_major: torch.Tensor) -> None:
        """``rank_major`` is (S, chunk_numel): every rank's padded rows; keep the unpadded ones."""
        self.alloc_full()
        with torch.no_grad():
            # .data: the version counter of the leaf autograd saved must not move
            _blocks_to_flat(rank_major, self.full_data.view(-1))
        self.stale = False

    def refresh_unsharded(self) -> None:
        """A replicated (below-threshold) parameter: the full copy is the shard, cast if needed."""
        self.alloc_full()
        if not self.aliased:
            with torch.no_grad():
                self.full_data.copy_(self.local)
        self.stale = False

    # -- gradients ---------------------------------------------------------------------------------
    def _before_accumulate(self, grad):
        """Runs before autograd adds this backward's gradient into ``full.grad``.

        Level 1 keeps the full gradient between steps, but once it has been reduced its content is
        spent: it is dropped here so that autograd takes this backward's gradient as the new
        ``full.grad`` as is, rather than zeroing the old buffer and adding into it (two passes over
        the full gradient per step). If a reduced shard gradient is still held (two synced
        backwards in one step), it is stashed so the next reduction adds to it exactly."""
        if self.grad_state == "reduced" and self.config.keeps_full_grads and self.full.grad is not None:
            if self.sharded_param.grad is not None:
                self._stash = self._own_rows(self._full_grad_local()).clone()
            self.full.grad = None
            self.grad_state = "empty"
        return grad

    def reduce_input(self, slot: torch.Tensor) -> None:
        """Write the full gradient, padded, into ``slot`` ((S, chunk_numel), possibly a strided
        column block of a fused bucket); zeros when this backward produced no gradient for it."""
        grad = self._full_grad_local() if self.full.grad is not None else None
        if grad is None:
            slot.zero_()
        else:
            _flat_to_blocks(grad.reshape(-1), slot)

    def accept_reduced(self, local_grad_flat: torch.Tensor) -> None:
        """``local_grad_flat``: this rank's reduced (summed and scaled) padded rows."""
        local = local_grad_flat[: self.local.numel()].view(self.local.shape)
        if self.config.keeps_full_grads and self.full.grad is not None:
            full_grad = self._full_grad_local()
            mine = self._own_rows(full_grad)
            mine.copy_(local)
            if self._stash is not None:
                mine.add_(self._stash)
                self._stash = None
            # The other rows still hold this rank's unreduced contribution; nothing reads them
            # (the full gradient is internal, and the next backward drops it) so they are not
            # cleared: that would be another pass over most of the full gradient per step.
            grad_local = mine if self.aliased else mine.to(self.shard_device, self.master_dtype)
            held = self.sharded_param.grad
            if held is None or (self.aliased and held.to_local().data_ptr() != grad_local.data_ptr()):
                # wrap once; later steps write the same view in place (no new DTensor per step)
                self.sharded_param.grad = self._as_dtensor(grad_local)
            elif not self.aliased:
                held.to_local().copy_(grad_local)
        else:
            # ``local`` is this parameter's part of a buffer each reduction allocates anew, so it
            # can be the gradient itself (no copy)
            local = local.to(self.shard_device, self.master_dtype)
            if self.sharded_param.grad is None:
                self.sharded_param.grad = self._as_dtensor(local)
            else:
                self.sharded_param.grad.to_local().add_(local)
            self.full.grad = None
        self.grad_state = "reduced"

    def _full_grad_local(self) -> torch.Tensor:
        """The full gradient's TP-local tensor, in the parameter's own TP placement: one that autograd
        left ``Partial`` (a replicated weight applied to a sequence-sharded input) is replaced by its
        reduction over TP, once, so that level 1 reads back the rows it writes into it."""
        grad = self.full.grad
        if isinstance(grad, DTensor) and tuple(grad.placements) != self.tp_placements:
            self.full.grad = grad = grad.redistribute(self.tp_mesh, self.tp_placements)
        return grad._local_tensor if isinstance(grad, DTensor) else grad.data

    def zero_grad(self) -> None:
        self.sharded_param.grad = None
        if self.full.grad is not None:
            if self.config.keeps_full_grads:
                self.full.grad.data.zero_()
            else:
                self.full.grad = None
        self._stash = None
        self.grad_state = "empty"


def _contiguous_stride(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def _flat_to_blocks(flat: torch.Tensor, blocks: torch.Tensor) -> None:
    """``blocks`` (S, c), possibly a strided column block of a bucket, := ``flat`` padded with zeros
    to S*c, in one copy (no contiguous staging buffer)."""
    S, c = blocks.shape
    whole, rest = divmod(flat.numel(), c) if c else (0, 0)
    if whole:
        blocks[:whole].copy_(flat[: whole * c].view(whole, c))
    if rest:
        blocks[whole, :rest].copy_(flat[whole * c :])
        blocks[whole, rest:].zero_()
        whole += 1
    if whole < S:
        blocks[whole:].zero_()


def _blocks_to_flat(blocks: torch.Tensor, flat: torch.Tensor) -> None:
    """Inverse of :func:`_flat_to_blocks`: the first ``flat.numel()`` elements of ``blocks``."""
    S, c = blocks.shape
    whole, rest = divmod(flat.numel(), c) if c else (0, 0)
    if whole:
        flat[: whole * c].view(whole, c).copy_(blocks[:whole])
    if rest:
        flat[whole * c :].copy_(blocks[whole, :rest])
