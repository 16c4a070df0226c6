"""The expert-parallel exchange: token counts, uneven all-to-all (differentiable, sync or async), and
the reordering between "by source rank" and "by local expert".

Layout conventions (EP group of size P, E experts, L = E / P local experts; rank r owns experts
r*L .. r*L+L-1, the contiguous split megatron and HyperParallel use):

- a rank's permuted rows are expert-major over all E experts, so the rows for destination rank d are
  one contiguous block: ``send_splits[d]`` = sum of its ``tokens_per_expert`` over d's experts
  (``placement`` lists how many experts each rank holds, in expert order: E / P each by default,
  uneven when hot experts have replicas);
- ``exchange_counts`` gives ``received`` [P, L]: row s = how many rows source s sends for each of my
  local experts (one all-to-all of E integers per rank — the only thing the dispatch must know before
  it can size its receive buffer, which is what makes dropless dispatch need it);
- after the all-to-all the received rows are grouped by source, then by expert; the experts want them
  grouped by expert, then by source: ``chunk_order`` builds that permutation once per step and
  ``reorder`` applies it (an index_select, whose backward is the inverse reordering).

``all_to_all`` is torch.distributed's ``all_to_all_single`` with list split sizes (what every backend,
gloo included, accepts) inside an autograd Function whose backward is the reverse exchange.
``all_to_all_async`` returns at once with a handle; the caller computes while the bytes move and calls
``handle.wait()`` before reading the result — the forward half of the overlap engine. Written here
rather than taken from ``torch.distributed.nn.functional.all_to_all_single`` because that one is
synchronous only and its backward cannot be started early.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def experts_per_rank(num_experts: int, ep_size: int) -> list[int]:
    """The even split: E / P experts on every rank (an error when P does not divide E)."""
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts cannot be split evenly over an expert-parallel group of {ep_size}")
    return [num_experts // ep_size] * ep_size


def send_splits(tokens_per_expert: list[int], placement: list[int]) -> list[int]:
    """Rows for each destination rank from expert-major ``tokens_per_expert``; ``placement[d]`` experts
    (in order) live on rank d (``experts_per_rank`` for the even split; replicas make it uneven)."""
    if sum(placement) != len(tokens_per_expert):
        raise ValueError(f"placement {placement} does not cover {len(tokens_per_expert)} experts")
    splits, start = [], 0
    for count in placement:
        splits.append(sum(tokens_per_expert[start:start + count]))
        start += count
    return splits


def exchange_counts(tokens_per_expert: list[int], placement: list[int], group) -> torch.Tensor:
    """``received`` [P, L] (int64, on the CPU), L = ``placement[my rank]``: row s = the rows source s
    sends for each of my experts."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(placement) != size:
        raise ValueError(f"placement {placement} has {len(placement)} ranks; the group has {size}")
    local = placement[rank]
    device = _comm_device(group)
    mine = torch.tensor(tokens_per_expert, dtype=torch.int64, device=device)
    received = torch.empty(size * local, dtype=torch.int64, device=device)
    if size == 1:
        received.copy_(mine)
    else:
        dist.all_to_all_single(received, mine, [local] * size, list(placement), group=group)
    return received.view(size, local).cpu()


def _comm_device(group) -> torch.device:
    """The device a collective of ``group`` wants its tensors on (gloo: the CPU)."""
    backend = dist.get_backend(group)
    if backend == "gloo":
        return torch.device("cpu")
    from hyper_adaptor import platform

    return platform.current_device()


def chunk_order(received: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """For rows laid out [source][local expert] with counts ``received`` [P, L]: the index that lays them
    out [local expert][source], and the rows per local expert."""
    counts = received.reshape(-1).tolist()
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += count
    sources, local = received.shape
    pieces = []
    for e in range(local):
        for s in range(sources):
            k = s * local + e
            pieces.append(torch.arange(starts[k], starts[k] + counts[k], dtype=torch.int64))
    index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    return index, [int(c) for c in received.sum(dim=0).tolist()]


def expert_order(received: torch.Tensor) -> tuple[torch.Tensor | None, list[int]]:
    """``chunk_order``, with None for the index where the rows are in expert order already (one source or
    one local expert): ``reorder`` and ``inverse`` pass None through, so no reordering copy is made."""
    if received.shape[0] == 1 or received.shape[1] == 1:
        return None, [int(c) for c in received.sum(dim=0).tolist()]
    return chunk_order(received)


class _Reorder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        # a permutation: its inverse scatter is a plain index_copy (no accumulation needed)
        return grad.new_empty(grad.shape).index_copy_(0, index, grad), None


def reorder(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Rows of ``x`` in the order ``index`` (a permutation of its rows; None: as they are), differentiable."""
    return x if index is None else _Reorder.apply(x, index.to(x.device))


def inverse(index: torch.Tensor | None) -> torch.Tensor | None:
    if index is None:
        return None
    return torch.empty_like(index).index_copy_(0, index, torch.arange(index.numel(), dtype=index.dtype))


# ------------------------------------------------------------------------------------- all-to-all
def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, async_op: bool):
    if dist.get_world_size(group) == 1:
        return x.clone(), None
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    handle = dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group,
                                    async_op=async_op)
    return out, handle


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group, async_op=False)[0]

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, async_op=False)[0], None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows ``x`` [sum(in_splits), ...] sent in blocks ``in_splits`` to the group's ranks; returns the
    [sum(out_splits), ...] received, block s from rank s. Differentiable (backward: the reverse)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class PendingExchange:
    """An all-to-all in flight: ``wait()`` returns its (differentiable) result."""

    def __init__(self, result: torch.Tensor, handle):
        self._result, self._handle = result, handle

    def wait(self) -> torch.Tensor:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        return self._result


class _AsyncAllToAll(torch.autograd.Function):
    """Forward starts the exchange and returns the (not yet filled) output buffer; the caller must
    wait on ``ctx``'s handle (through PendingExchange) before reading it. Backward is synchronous."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, holder):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out, holder[0] = _exchange(x, out_splits, in_splits, group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, async_op=False)[0], None, None, None, None


def all_to_all_async(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> PendingExchange:
    """``all_to_all`` started now, finished by ``.wait()``."""
    holder = [None]
    out = _AsyncAllToAll.apply(x, list(out_splits), list(in_splits), group, holder)
    return PendingExchange(out, holder[0])
