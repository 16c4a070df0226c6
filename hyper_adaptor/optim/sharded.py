"""Muon over sharded and tensor-parallel parameters: each matrix orthogonalised once per group.

Newton-Schulz needs a whole matrix; the layouts hyper_adaptor trains with hand the optimizer pieces:

* HSDP (``fully_shard`` / ``--use-hsdp``): the parameter is a DTensor whose rows are split over a
  shard group (``Shard(0)``, replicated over any other mesh dimension). Each matrix gets an *owner*
  rank in that group, chosen so the Newton-Schulz flops are balanced (``owners.assign_owners``); the
  owner gathers the momentum rows, orthogonalises, and scatters the update rows back. Every shard
  group runs each matrix once, not once per rank.
* Tensor parallel (megatron's ``--muon-tp-mode``): the (gathered) matrix is one TP rank's slice along
  ``partition_dim``. ``blockwise``: the slice is orthogonalised on its own; ``duplicated``: the slices
  are all-gathered, every TP rank orthogonalises the whole matrix and keeps its slice; ``distributed``:
  the iteration runs on the slices with the Gram matrices summed over the TP group.
* Layer-wise ownership (megatron's distributed optimizer with Muon): each rank's optimizer only holds
  the whole matrices it owns; nothing to gather.

The update rule is megatron's Muon (``emerging_optimizers``' ``OrthogonalizedOptimizer``): momentum as
an exponential average ``B = lerp(B, g, 1 - mu)``; Nesterov ``u = lerp(g, B, mu)``; decoupled weight
decay ``p *= 1 - lr * wd`` (or L2: ``g += wd * p``); ``p -= lr * scale * extra * NS(u)``.
Hand-written because torch's own ``torch.optim.Muon`` has neither sharded parameters nor these
schedules, and the owner-rank orthogonalisation is this library's own.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .muon import COEFFICIENT_SETS, SCALE_MODES, newton_schulz, run_closure, scale_factor
from .owners import assign_owners, ns_flops

TP_MODES = ("blockwise", "duplicated", "distributed")
MATMUL_PRECISIONS = ("low", "medium", "high", "highest")


@contextlib.contextmanager
def _fp32_matmul_precision(precision: str):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium" if precision == "low" else precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _row_shard(p):
    """(group, shard count, this rank's index) when ``p`` is a DTensor with rows split over one mesh
    dimension (replicated over the others); None when it is whole on this rank."""
    if not isinstance(p, DTensor):
        return None
    sharded = [i for i, placement in enumerate(p.placements) if not isinstance(placement, Replicate)]
    if not sharded:
        return None
    if len(sharded) > 1 or p.placements[sharded[0]] != Shard(0):
        raise ValueError(f"sharded Muon takes parameters split along rows over one mesh dimension; got placements "
                         f"{p.placements} for a parameter of shape {tuple(p.shape)}")
    group = p.device_mesh.get_group(sharded[0])
    return group, dist.get_world_size(group), dist.get_rank(group)


class ShardedMuon(torch.optim.Optimizer):
    """Muon with megatron's update rule for whole, row-sharded (DTensor) and tensor-parallel matrices.

    ``tp_of(p)`` -> ``(tp_group, partition_dim)`` or None: the parameter (its gathered rows) is one
    tensor-parallel slice along ``partition_dim`` (0 or 1) over ``tp_group``. ``qkv_split(p)`` -> list
    of row counts or None: a fused QKV matrix viewed as ``[groups, sum(split), cols]`` whose Q, K and V
    parts are orthogonalised as separate matrices. ``orthogonalised`` counts, on this rank, the matrices
    this rank ran Newton-Schulz on and their flops (so a rank that skipped or repeated one shows).
    """

    def __init__(self, params, lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.01, decoupled_weight_decay: bool = True,
                 coefficient_type: str = "quintic", num_ns_steps: int = 5, scale_mode: str = "spectral",
                 extra_scale_factor: float = 1.0, fp32_matmul_prec: str = "highest", tp_mode: str = "duplicated",
                 tp_of=None, qkv_split=None, eps: float = 1e-7):
        if not lr >= 0.0:
            raise ValueError(f"Muon: lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        if not (isinstance(num_ns_steps, int) and num_ns_steps >= 1):
            raise ValueError(f"Muon: num_ns_steps must be a positive int, got {num_ns_steps!r}")
        if coefficient_type not in COEFFICIENT_SETS:
            raise ValueError(f"Muon: coefficient type {coefficient_type!r} is not one of {tuple(COEFFICIENT_SETS)}")
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"Muon: scale mode {scale_mode!r} is not one of {SCALE_MODES}")
        if tp_mode not in TP_MODES:
            raise ValueError(f"Muon: tp mode {tp_mode!r} is not one of {TP_MODES}")
        if fp32_matmul_prec not in MATMUL_PRECISIONS:
            raise ValueError(f"Muon: fp32 matmul precision {fp32_matmul_prec!r} is not one of {MATMUL_PRECISIONS}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon only takes 2-D matrices; got a parameter of shape {tuple(p.shape)}")
        self.nesterov = nesterov
        self.decoupled_weight_decay = decoupled_weight_decay
        self.coefficient_type = coefficient_type
        self.num_ns_steps = num_ns_steps
        self.scale_mode = scale_mode
        self.extra_scale_factor = extra_scale_factor
        self.fp32_matmul_prec = fp32_matmul_prec
        self.tp_mode = tp_mode
        self.tp_of = tp_of or (lambda p: None)
        self.qkv_split = qkv_split or (lambda p: None)
        self.eps = eps
        self.orthogonalised = {"matrices": 0, "flops": 0.0}
        self._owners: dict = {}

    # -- state ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _init_group(self, group, skip_non_grad_params: bool = True) -> None:
        """Create the momentum buffers (megatron calls this with ``skip_non_grad_params=False`` to lay out
        a checkpoint before the first step)."""
        for p in group["params"]:
            if skip_non_grad_params and p.grad is None:
                continue
            state = self.state[p]
            if len(state) == 0:
                state["momentum_buffer"] = torch.zeros_like(p)

    # -- step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        with _fp32_matmul_precision(self.fp32_matmul_prec):
            for group in self.param_groups:
                self._init_group(group)
                lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    param, grad = _local(p), _local(p.grad)
                    buf = _local(self.state[p]["momentum_buffer"])
                    if wd:
                        if self.decoupled_weight_decay:
                            # p + (-lr wd) p, not p (1 - lr wd): the same rounding as megatron's Muon
                            param.add_(param, alpha=-lr * wd)
                        else:
                            grad = grad.add(param, alpha=wd)
                    buf.lerp_(grad, 1.0 - mu)
                    update = grad.lerp(buf, mu) if self.nesterov else buf
                    param.add_(self._orthogonalise_sharded(p, update), alpha=-lr)
        return loss

    # -- the owner rank of a row-sharded matrix -------------------------------------------------------------
    def _owner(self, p, shard_count: int) -> int:
        key = (id(p), shard_count)
        if key not in self._owners:
            # every rank of the group lists the same matrices in the same order (the optimizer's groups)
            matrices = [q for group in self.param_groups for q in group["params"]
                        if _row_shard(q) is not None and _row_shard(q)[1] == shard_count]
            costs = [self._cost(q) for q in matrices]
            for q, owner in zip(matrices, assign_owners(costs, shard_count), strict=True):
                self._owners[(id(q), shard_count)] = owner
        return self._owners[key]

    def _cost(self, p) -> float:
        split = self.qkv_split(p)
        rows, cols = p.shape
        if split:
            groups = rows // sum(split)
            return sum(ns_flops((groups * part, cols), self.num_ns_steps) for part in split)
        return ns_flops((rows, cols), self.num_ns_steps)

    def _orthogonalise_sharded(self, p, update):
        shard = _row_shard(p)
        if shard is None:
            return self._orthogonalise(p, update)
        group, count, index = shard
        rows = p.shape[0]
        per_rank = -(-rows // count)  # torch.chunk's split, which Shard(0) describes
        local_rows = update.shape[0]
        padded = update.new_zeros((per_rank, update.shape[1]))
        padded[:local_rows].copy_(update)
        owner = self._owner(p, count)
        owner_global = dist.get_global_rank(group, owner)
        pieces = [torch.empty_like(padded) for _ in range(count)] if index == owner else None
        dist.gather(padded, pieces, dst=owner_global, group=group)
        out_pieces = None
        if index == owner:
            full = torch.cat(pieces)[:rows]
            ortho = self._orthogonalise(p, full)
            out = ortho.new_zeros((per_rank * count, ortho.shape[1]))
            out[:rows].copy_(ortho)
            out_pieces = list(out.chunk(count))
        received = torch.empty_like(padded)
        dist.scatter(received, out_pieces, src=owner_global, group=group)
        return received[:local_rows]

    # -- one (tensor-parallel) matrix -------------------------------------------------------------------------
    def _orthogonalise(self, p, matrix):
        split = self.qkv_split(p)
        if not split:
            return self._orthogonalise_tp(p, matrix)
        rows, cols = matrix.shape
        total = sum(split)
        if rows % total:
            raise ValueError(f"Muon: QKV split {split} does not divide the {rows} rows of a matrix of shape "
                             f"{tuple(matrix.shape)}")
        parts = matrix.view(rows // total, total, cols).split(split, dim=1)
        done = [self._orthogonalise_tp(p, part.reshape(-1, cols)).view(rows // total, -1, cols) for part in parts]
        return torch.cat(done, dim=1).view(rows, cols)

    def _orthogonalise_tp(self, p, matrix):
        tp = self.tp_of(p)
        group, dim = tp if tp is not None else (None, None)
        if dim not in (0, 1) or self.tp_mode == "blockwise":
            group = None
        size = list(matrix.shape)
        low = self.fp32_matmul_prec in ("low", "medium")  # bfloat16 iterations, as megatron's medium
        kwargs = dict(steps=self.num_ns_steps, eps=self.eps, coefficients=self.coefficient_type, low_precision=low)
        if group is None:
            ortho = newton_schulz(matrix.float(), **kwargs)
        else:
            tp_size, tp_rank = dist.get_world_size(group), dist.get_rank(group)
            size[dim] *= tp_size
            if self.tp_mode == "duplicated":
                pieces = [torch.empty_like(matrix) for _ in range(tp_size)]
                dist.all_gather(pieces, matrix.contiguous(), group=group)
                ortho = newton_schulz(torch.cat(pieces, dim=dim).float(), **kwargs).chunk(tp_size, dim=dim)[tp_rank]
            else:
                # the Gram matrix contracts over the split dimension: transpose when rows are split
                ortho = newton_schulz(matrix.float(), transpose=(dim == 0), group=group, **kwargs)
        self.orthogonalised["matrices"] += 1
        self.orthogonalised["flops"] += ns_flops(size, self.num_ns_steps)
        scale = scale_factor(size[0], size[1], self.scale_mode) * self.extra_scale_factor
        return (ortho * scale).to(matrix.dtype)
