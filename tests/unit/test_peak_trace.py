"""The walk over torch's allocator events behind bench/peak_trace.py (the CUDA run itself is a GPU-machine tool)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyper_adaptor.testing.peak_trace import alive_at_peak, site

ROOT = Path(__file__).resolve().parents[2]


def event(action, addr, size=0, where="/x/hyper_adaptor/memory/a.py"):
    return {"action": action, "addr": addr, "size": size, "frames": [
        {"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
        {"filename": where, "line": 7, "name": "f"}]}


def test_the_blocks_alive_at_the_peak_and_their_sites():
    trace = [event("alloc", 1, 100), event("alloc", 2, 50, "/s/megatron/core/optimizer/o.py"),
             event("free_requested", 1), event("free_completed", 1), event("alloc", 3, 120),
             event("alloc", 4, 10), event("free_requested", 3), event("alloc", 5, 20)]
    peak, alive = alive_at_peak(trace)
    assert peak == 180  # blocks 2, 3 and 4; the later 20-byte block comes after 3 was freed
    assert sorted(alive) == [2, 3, 4]
    assert site(alive[2][1]) == "core/optimizer/o.py:7 f"  # the first project / megatron frame
    assert site(alive[3][1]) == "memory/a.py:7 f"
    assert site([]) == "(no python frame)"


def test_frees_of_blocks_allocated_before_tracing_are_ignored():
    peak, alive = alive_at_peak([event("free_requested", 9), event("alloc", 1, 5)])
    assert (peak, sorted(alive)) == (5, [1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_says_so():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "peak_trace.py"), "examples/pretrain_gpt.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "needs a CUDA device" in out.stderr
