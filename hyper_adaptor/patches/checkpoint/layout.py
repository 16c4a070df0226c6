"""What a checkpoint records about the layout that saved it, and the check before loading it elsewhere."""

from __future__ import annotations

FEATURE = "checkpoint"


def validate(args) -> None:
    """Refuse, before anything is built, a --load whose checkpoint cannot move to this layout."""


def patches(args) -> list:
    return []
