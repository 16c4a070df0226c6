"""The process groups one context-parallel group needs.

A CP group of N ranks is used whole by Ulysses, ring and all-gather. Hybrid splits it in two
directions: Ulysses groups of U neighbouring positions (g*U .. g*U+U-1) and ring groups of the ranks at
the same place in every Ulysses group ({g*U + u for every g}); see ``_hybrid.py`` for why that layout
lets the ring run on the Ulysses output unchanged.

``dist.new_group`` is collective over the whole world: every rank must create every group, in the same
order, even the groups it is not part of. Hence ``build_cp_groups`` takes all CP groups' rank lists,
not only this rank's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

ALGORITHMS = ("ulysses", "ring", "allgather", "hybrid")  # here: both the dispatcher and the style need it


@dataclass
class CPGroups:
    """This rank's groups for one CP group."""

    cp: ProcessGroup                  # the whole CP group; position in it = ``cp.rank()``
    ulysses: ProcessGroup | None      # positions g*U .. g*U+U-1 (hybrid only)
    ring: ProcessGroup | None         # positions {g*U + u for every g} (hybrid only)
    ulysses_degree: int               # U; N (the CP size) for pure Ulysses, 1 for ring / all-gather


def check_ulysses_degree(ulysses_degree, cp_size: int) -> int:
    """U as an int (None = the whole CP group); ValueError naming the argument otherwise."""
    if ulysses_degree is None:
        return cp_size
    if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) or ulysses_degree < 1:
        raise ValueError(f"ulysses_degree must be None or a positive int, got {ulysses_degree!r}")
    if cp_size % ulysses_degree:
        raise ValueError(f"ulysses_degree must divide the context-parallel size {cp_size}, "
                         f"got {ulysses_degree}")
    return ulysses_degree


def _check_rank_lists(cp_rank_lists) -> list[list[int]]:
    if not isinstance(cp_rank_lists, (list, tuple)) or not cp_rank_lists:
        raise ValueError(f"cp_rank_lists must be a non-empty list of rank lists, got {cp_rank_lists!r}")
    lists = []
    for ranks in cp_rank_lists:
        if (not isinstance(ranks, (list, tuple)) or not ranks
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)):
            raise ValueError(f"cp_rank_lists must hold non-empty lists of global ranks, got {ranks!r}")
        # torch sorts a new group's ranks, so group.rank() is the position only for ascending lists
        # (megatron's CP groups are ascending); a permuted list would silently mis-place the shards.
        if list(ranks) != sorted(set(ranks)):
            raise ValueError(f"cp_rank_lists: each CP group must list its ranks in ascending order without "
                             f"repeats (position in the group = group.rank()), got {list(ranks)}")
        lists.append(list(ranks))
    sizes = {len(ranks) for ranks in lists}
    if len(sizes) != 1:
        raise ValueError(f"cp_rank_lists: every CP group must have the same size, got sizes {sorted(sizes)}")
    flat = [r for ranks in lists for r in ranks]
    if len(set(flat)) != len(flat):
        raise ValueError(f"cp_rank_lists: a rank appears in two CP groups: {lists}")
    return lists


def build_cp_groups(cp_rank_lists: list[list[int]], ulysses_degree: int | None = None,
                    cp_group: ProcessGroup | None = None) -> CPGroups:
    """Create the CP groups (collective over the world) and return this rank's.

    ``cp_rank_lists``: every CP group's global ranks, each in position order (ascending), the same on
    every rank. ``ulysses_degree``: None = the whole CP group (pure Ulysses), 1 (ring or all-gather) or a
    divisor of the CP size; only 1 < U < N creates the hybrid's Ulysses and ring groups. ``cp_group``:
    an existing group to use as ``.cp`` (megatron's CP group) instead of creating one per list.
    """
    lists = _check_rank_lists(cp_rank_lists)
    cp_size = len(lists[0])
    degree = check_ulysses_degree(ulysses_degree, cp_size)
    me = dist.get_rank()
    mine = [ranks for ranks in lists if me in ranks]
    if not mine:
        raise ValueError(f"cp_rank_lists: rank {me} is in none of the CP groups {lists}")
    mine = mine[0]

    def create(rank_lists):
        # every rank creates every group in the same order; only the one holding this rank is kept
        kept = None
        for ranks in rank_lists:
            group = dist.new_group(ranks)
            if me in ranks:
                kept = group
        return kept

    if cp_group is None:
        cp_group = create(lists)
    elif dist.get_process_group_ranks(cp_group) != mine:
        raise ValueError(f"cp_group holds ranks {dist.get_process_group_ranks(cp_group)}, but this rank's "
                         f"CP group in cp_rank_lists is {mine}")
    ulysses = ring = None
    if 1 < degree < cp_size:
        ulysses = create([ranks[g * degree:(g + 1) * degree] for ranks in lists
                          for g in range(cp_size // degree)])
        ring = create([ranks[u::degree] for ranks in lists for u in range(degree)])
    return CPGroups(cp=cp_group, ulysses=ulysses, ring=ring, ulysses_degree=degree)
