"""Which ranks ``--profile-ranks`` names (shared by the feature's checks and the profiling window)."""

from __future__ import annotations


def every_rank(args) -> bool:
    """Megatron: ``--profile-ranks`` empty; MindSpeed: ``--profile-ranks -1`` (its default)."""
    ranks = list(getattr(args, "profile_ranks", None) or [])
    return not ranks or -1 in ranks


def profiled_ranks(args) -> list[int] | None:
    """The global ranks to profile; None: every rank."""
    return None if every_rank(args) else sorted(set(args.profile_ranks))
