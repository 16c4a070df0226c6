"""One way to tell the user something: ``[hyper_adaptor] message`` on stdout, from global rank 0,
once per message per process (every rank makes the same switches; the user wants to read it once)."""

from __future__ import annotations

import os

_said: set[str] = set()


def notice(message: str) -> None:
    # RANK is set by torchrun before any process group exists.
    if message in _said or os.environ.get("RANK", "0") != "0":
        return
    _said.add(message)
    print(f"[hyper_adaptor] {message}", flush=True)


def forget() -> None:
    """Let every message be said again (tests that read the notices of several runs in one process)."""
    _said.clear()
