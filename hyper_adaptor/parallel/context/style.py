"""``ContextParallel``: context parallel as a PyTorch ``ParallelStyle`` (HyperParallel's name and arguments).

    parallelize_module(core_attention, cp_mesh, ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=None))

``core_attention`` is a module whose ``forward(q, k, v)`` computes softmax attention of 4-D q/k/v with
the sequence at ``seq_dim``, the heads at ``head_dim``, the head size last and the batch in the
remaining dimension (``[b, s, h, d]``: seq_dim=1, head_dim=2; ``[b, h, s, d]``: seq_dim=2, head_dim=1;
megatron's ``[s, b, h, d]``: seq_dim=0, head_dim=2), k/v possibly with fewer (GQA) heads. After the style
is applied, q/k/v and the result are this rank's sequence shard and the result has q's layout (heads
not merged). The style replaces the module's attention computation by the CP engine: a block-wise ring
or an all-to-all cannot be expressed through an arbitrary module's forward, so the module's own
forward is not called; its semantics are given to the style instead (``causal``, ``scale``: plain softmax
attention, causal or unmasked; ``dropout_p``: attention dropout while the module is training, by default
the ``p`` of the module's ``attention_dropout`` (megatron's name) if it has one, else none). Extra
forward arguments must be None (a mask is refused rather than silently ignored).

Algorithms (``mesh`` of N ranks):

- ``ulysses_degree=None`` (or N): Ulysses over the whole mesh; N must divide the query heads;
- ``ulysses_degree=1``: all-gather (HyperParallel's ``ulysses_degree=1`` mode): K/V gathered, q local;
- ``1 < ulysses_degree < N``: hybrid, Ulysses in groups of ``ulysses_degree`` neighbouring ranks, ring
  attention across the groups;
- ``algo="ring"`` (with ``ulysses_degree`` None or 1): ring attention over the whole mesh; ``algo`` may
  name any of ``ALGORITHMS`` explicitly, and must then agree with ``ulysses_degree``.

``load_balance=True`` says the caller shards the sequence as megatron's ``get_batch_on_this_cp_rank``
does (2N chunks, rank r holds chunks r and 2N-1-r); False: rank r holds contiguous slice r. Unlike
HyperParallel (which redistributes Q for its all-gather mode only), it is a statement about the input
layout and works with every algorithm; causal work is balanced only with it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import ParallelStyle

from hyper_adaptor.ops.backend import BACKENDS
from hyper_adaptor.parallel.context._dropout import check_p
from hyper_adaptor.parallel.context._groups import ALGORITHMS, CPGroups, build_cp_groups, check_ulysses_degree


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_dim(name: str, value) -> int:
    if not _is_int(value) or not -4 <= value <= 2 or value == -1:
        raise ValueError(f"{name} must be an int naming dimension 0, 1 or 2 of the 4-D q/k/v (the last "
                         f"dimension is the head size), got {value!r}")
    return value % 4


class ContextParallel(ParallelStyle):
    """Sequence-sharded attention of a core-attention module over a 1-D CP mesh; see the module doc."""

    def __init__(self, seq_dim: int = 1, head_dim: int = 2, ulysses_degree: int | None = None,
                 load_balance: bool = False, *, algo: str | None = None, causal: bool = True,
                 scale: float | None = None, backend: str | None = None, dropout_p: float | None = None):
        self.seq_dim = _check_dim("seq_dim", seq_dim)
        self.head_dim = _check_dim("head_dim", head_dim)
        if self.head_dim == self.seq_dim:
            raise ValueError(f"head_dim must differ from seq_dim ({seq_dim}), got {head_dim!r}")
        if ulysses_degree is not None and (not _is_int(ulysses_degree) or ulysses_degree < 1):
            raise ValueError(f"ulysses_degree must be None or a positive int, got {ulysses_degree!r}")
        for name, value in (("load_balance", load_balance), ("causal", causal)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if algo is not None and algo not in ALGORITHMS:
            raise ValueError(f"algo must be None or one of {ALGORITHMS}, got {algo!r}")
        if algo in ("ring", "allgather") and ulysses_degree not in (None, 1):
            raise ValueError(f"ulysses_degree must be None or 1 with algo={algo!r}, got {ulysses_degree!r}")
        if algo == "hybrid" and ulysses_degree is None:
            raise ValueError("ulysses_degree must be given with algo='hybrid' (a divisor of the mesh size "
                             "between 1 and the mesh size, exclusive), got None")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
            raise ValueError(f"scale must be None or a positive number, got {scale!r}")
        if dropout_p is not None:
            check_p(dropout_p)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
        self.batch_dim = ({0, 1, 2} - {self.seq_dim, self.head_dim}).pop()
        self.ulysses_degree, self.load_balance, self.algo = ulysses_degree, load_balance, algo
        self.causal, self.scale, self.backend, self.dropout_p = causal, scale, backend, dropout_p

    # ---------------------------------------------------------------------------------- apply
    def _resolve_algo(self, cp_size: int) -> tuple[str, int]:
        degree = check_ulysses_degree(self.ulysses_degree, cp_size)
        if self.algo is None:
            return ("ulysses" if degree == cp_size else "allgather" if degree == 1 else "hybrid"), degree
        if self.algo in ("ring", "allgather"):
            return self.algo, 1
        if self.algo == "ulysses" and degree != cp_size:
            raise ValueError(f"ulysses_degree must be None or the mesh size {cp_size} with algo='ulysses', "
                             f"got {self.ulysses_degree!r}")
        if self.algo == "hybrid" and not 1 < degree < cp_size:
            raise ValueError(f"ulysses_degree must lie strictly between 1 and the mesh size {cp_size} with "
                             f"algo='hybrid', got {self.ulysses_degree!r}")
        return self.algo, degree

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        if getattr(module, "_context_parallel_style", None) is not None:
            raise ValueError(f"module already has a ContextParallel style applied: {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"device_mesh must be 1-D (the context-parallel ranks, e.g. mesh['cp']), got a "
                             f"{device_mesh.ndim}-D mesh")
        ranks = device_mesh.mesh.tolist()
        if ranks != sorted(ranks):
            # positions are group.rank(), i.e. ascending global ranks; a permuted mesh would not match
            raise ValueError(f"device_mesh must list its ranks in ascending order, got {ranks}")
        algo, degree = self._resolve_algo(len(ranks))
        cp_group = device_mesh.get_group()
        if algo == "hybrid":
            # the hybrid subgroups are created by every rank of the world for every CP group
            lists = [ranks]
            if dist.get_world_size() != len(ranks):
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, ranks)
                lists = sorted({tuple(r) for r in every})
            groups = build_cp_groups([list(r) for r in lists], degree, cp_group=cp_group)
        else:
            groups = CPGroups(cp=cp_group, ulysses=None, ring=None, ulysses_degree=degree)
        module._context_parallel_style = self
        module.forward = functools.partial(self._forward, groups=groups, algo=algo, module=module)
        return module

    # -------------------------------------------------------------------------------- forward
    def _dropout(self, module) -> float:
        if not module.training:
            return 0.0
        if self.dropout_p is not None:
            return self.dropout_p
        return float(getattr(getattr(module, "attention_dropout", None), "p", 0.0))

    def _forward(self, q, k, v, *args, groups: CPGroups, algo: str, module, **kwargs):
        extra = [f"positional argument {i + 4}" for i, a in enumerate(args) if a is not None]
        extra += [name for name, a in kwargs.items() if a is not None]
        if extra:
            raise ValueError(f"ContextParallel serves causal or unmasked attention of (q, k, v) only; got "
                             f"{', '.join(extra)} (must be None)")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a 4-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
        from hyper_adaptor.parallel.context import context_parallel_attention  # the package imports this file

        order = (self.seq_dim, self.batch_dim, self.head_dim, 3)  # -> megatron's [s, b, heads, d]
        out = context_parallel_attention(
            *(t.permute(order) for t in (q, k, v)), groups=groups, algo=algo, causal=self.causal,
            load_balanced=self.load_balance, scale=self.scale, backend=self.backend,
            dropout_p=self._dropout(module))
        back = sorted(range(4), key=order.__getitem__)  # the inverse permutation
        return out.permute(back).contiguous()
