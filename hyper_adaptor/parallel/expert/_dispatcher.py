"""The all-to-all token dispatcher: routed tokens to the ranks that hold their experts, and back.

``dispatch`` runs, per forward:

1. (capacity) drop each expert's copies beyond its capacity, and optionally pad every expert to it;
2. ``permute``: this rank's routed copies, expert-major over all E experts;
3. ``exchange_counts``: every rank learns how many rows each source sends for each of its experts —
   dropless dispatch cannot size its receive buffer without it;
4. ``all_to_all``: the rows themselves (uneven splits; blocks by destination rank);
5. (ETP) gather the received rows over the expert-tensor-parallel group, whose ranks each hold a
   column/row shard of the same experts and so must all see every row for them;
6. ``reorder``: from [source][local expert] to [local expert][source], what the grouped GEMM wants.

``combine`` undoes each step in reverse: reorder back, (ETP) reduce-scatter the partial outputs of
the row-parallel second projection, all-to-all back, and ``unpermute`` weighted by the router's
probabilities. The probabilities never travel: the weighting happens on the rank that owns the token,
so their gradient stays local too.

gloo has no uneven all_gather / reduce_scatter, so both ETP collectives are written as all-to-alls
(every ETP peer sends its whole block to every peer; the reduce side sums the received copies), which
also makes them differentiable through ``all_to_all`` alone: the backward of the gather is exactly the
reduce-scatter and vice versa.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyper_adaptor.parallel.expert._comm import (
    _comm_device,
    all_to_all,
    exchange_counts,
    expert_order,
    experts_per_rank,
    inverse,
    reorder,
    send_splits,
)
from hyper_adaptor.parallel.expert._permute import (
    DROP_POLICIES,
    Permutation,
    capacity,
    capacity_mask,
    permute,
    unpermute,
)


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass
class _InFlight:
    """What ``combine`` needs from the ``dispatch`` of the same forward."""

    perm: Permutation
    ep_in_splits: list[int]      # rows this rank sent to each EP rank
    ep_out_splits: list[int]     # rows it received from each
    etp_rows: list[int]          # rows each ETP peer contributed to the gather ([] without ETP)
    index: torch.Tensor | None   # [source][expert] -> [expert][source]; None: already in that order
    rows_out: int                # M, the rows handed to the experts


class AllToAllDispatcher:
    """Dropless (or capacity-bounded) all-to-all dispatch over ``ep_group``, with optional expert tensor
    parallel over ``etp_group``.

    - ``num_experts``: E, the routing map's width.
    - ``ep_group``: the expert-parallel process group (``None``: one process, no exchange — the
      same code path, which is what makes the single-process MoE a faithful reference).
    - ``etp_group``: expert tensor parallel; its ranks hold the same experts (the same EP rank),
      each a shard of every expert's hidden dimension.
    - ``capacity_factor``: at most ceil(T * topk / E * factor) copies per expert from this rank's
      T tokens (megatron's per-rank capacity); ``drop_policy`` says which copies stay ("probs":
      the most probable, "position": the earliest tokens). ``pad_to_capacity``: every expert gets
      exactly that many rows from each source (zeros where short), so shapes are static.
    - ``topk``: for the capacity; read from the routing map (its fullest row) when not given.
    - ``placement``: experts per EP rank, in expert order (default: an even split). Uneven
      placements serve hot-expert replicas.

    ``dispatch(tokens [T, H], routing_map [T, E] bool, probs [T, E])`` returns ``(expert_in [M, H],
    tokens_per_local_expert)``; ``combine(expert_out [M, H])`` returns [T, H]. Exactly one combine
    follows each dispatch; the state between the two lives on the instance and nowhere else.
    """

    def __init__(self, num_experts: int, ep_group=None, *, etp_group=None, capacity_factor: float | None = None,
                 pad_to_capacity: bool = False, drop_policy: str = "probs", topk: int | None = None,
                 placement: list[int] | None = None):
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        if pad_to_capacity and capacity_factor is None:
            raise ValueError("pad_to_capacity=True needs a capacity_factor (the capacity it pads to)")
        if topk is not None and not 1 <= topk <= num_experts:
            raise ValueError(f"topk must be in 1..{num_experts}, got {topk}")
        ep_size = _size(ep_group)
        if placement is None:
            placement = experts_per_rank(num_experts, ep_size)
        placement = [int(p) for p in placement]
        if len(placement) != ep_size or sum(placement) != num_experts or min(placement) < 0:
            raise ValueError(f"placement {placement} must give each of the {ep_size} expert-parallel ranks a "
                             f"number of experts >= 0, summing to num_experts={num_experts}")
        self.num_experts, self.ep_group, self.etp_group = num_experts, ep_group, etp_group
        self.capacity_factor, self.pad_to_capacity, self.drop_policy = capacity_factor, pad_to_capacity, drop_policy
        self.topk, self.placement = topk, placement
        self.ep_rank = _rank(ep_group)
        self.local_experts = placement[self.ep_rank]
        self.first_expert = sum(placement[:self.ep_rank])
        self._in_flight: _InFlight | None = None

    @property
    def local_expert_ids(self) -> list[int]:
        """The global ids of the experts whose rows this rank receives."""
        return list(range(self.first_expert, self.first_expert + self.local_experts))

    # ------------------------------------------------------------------------------ dispatch
    def dispatch(self, tokens: torch.Tensor, routing_map: torch.Tensor,
                 probs: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        if self._in_flight is not None:
            raise RuntimeError("AllToAllDispatcher.dispatch called twice without a combine in between")
        if tokens.dim() != 2 or routing_map.shape != (tokens.shape[0], self.num_experts):
            raise ValueError(f"dispatch: tokens [T, H] and routing_map [T, {self.num_experts}] expected, got "
                             f"{tuple(tokens.shape)} and {tuple(routing_map.shape)}")
        if probs.shape != routing_map.shape:
            raise ValueError(f"dispatch: probs {tuple(probs.shape)} must match routing_map {tuple(routing_map.shape)}")
        pad_to = None
        if self.capacity_factor is not None:
            topk = self.topk or max(int(routing_map.sum(dim=1).max().item()) if routing_map.numel() else 1, 1)
            cap = capacity(tokens.shape[0], self.num_experts, topk, self.capacity_factor)
            routing_map = capacity_mask(routing_map, probs, cap, self.drop_policy)
            pad_to = cap if self.pad_to_capacity else None
        rows, perm = permute(tokens, routing_map, probs, pad_to=pad_to)

        # the EP exchange
        in_splits = send_splits(perm.tokens_per_expert, self.placement)
        if _size(self.ep_group) > 1:
            received = exchange_counts(perm.tokens_per_expert, self.placement, self.ep_group)
            out_splits = [int(n) for n in received.sum(dim=1).tolist()]
            rows = all_to_all(rows, out_splits, in_splits, self.ep_group)
        else:
            received = torch.tensor(perm.tokens_per_expert, dtype=torch.int64).view(1, -1)
            out_splits = list(in_splits)

        # the ETP gather: every peer's received rows, in peer order
        etp_rows: list[int] = []
        if _size(self.etp_group) > 1:
            received = self._gather_counts(received)                 # [etp * P, L]
            peers = _size(self.etp_group)
            etp_rows = [int(n) for n in received.view(peers, -1).sum(dim=1).tolist()]
            mine = rows.shape[0]
            rows = all_to_all(rows.repeat(peers, 1), etp_rows, [mine] * peers, self.etp_group)

        index, per_expert = expert_order(received)
        rows = reorder(rows, index)
        self._in_flight = _InFlight(perm, in_splits, out_splits, etp_rows, index, rows.shape[0])
        return rows, per_expert

    def _gather_counts(self, received: torch.Tensor) -> torch.Tensor:
        """All ETP peers' [P, L] count tables, stacked in peer order (fixed size: a plain all_gather)."""
        device = _comm_device(self.etp_group)
        mine = received.to(device).contiguous()
        tables = [torch.empty_like(mine) for _ in range(_size(self.etp_group))]
        dist.all_gather(tables, mine, group=self.etp_group)
        if any(t.shape[1] != mine.shape[1] for t in tables):
            raise RuntimeError("expert tensor parallel peers must hold the same experts")
        return torch.cat(tables).cpu()

    # ------------------------------------------------------------------------------- combine
    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        state, self._in_flight = self._in_flight, None
        if state is None:
            raise RuntimeError("AllToAllDispatcher.combine called without a dispatch before it")
        if expert_out.dim() != 2 or expert_out.shape[0] != state.rows_out:
            raise ValueError(f"combine: expected [{state.rows_out}, H] expert outputs, got {tuple(expert_out.shape)}")
        rows = reorder(expert_out, inverse(state.index))
        if state.etp_rows:
            # reduce-scatter: my block back from every peer, then the peers' partial sums added
            peers, mine = len(state.etp_rows), state.ep_out_splits
            count = sum(mine)
            rows = all_to_all(rows, [count] * peers, state.etp_rows, self.etp_group)
            rows = rows.view(peers, count, rows.shape[-1]).sum(dim=0)
        if _size(self.ep_group) > 1:
            rows = all_to_all(rows, state.ep_in_splits, state.ep_out_splits, self.ep_group)
        return unpermute(rows, state.perm, weighted=True)
