"""What holds the device memory at a megatron run's peak, by the source line that allocated it (CUDA).

Runs a pretrain script (the adaptor's import line in it) under torch's allocator history and, after
``--trace-iters`` iterations, prints the blocks alive at the peak of ``memory_allocated`` grouped by the
first frame in hyper_adaptor or megatron that allocated them: a "why is this flag's peak higher than
that one's" tool, not a bench figure. One rank::

    torchrun --nproc-per-node 1 bench/peak_trace.py --trace-iters 2 --top 15 -- \\
        examples/pretrain_gpt.py <megatron args>

Uses ``torch.cuda.memory._record_memory_history`` / ``_snapshot`` (torch's own allocator trace).
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys
from collections import Counter
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from hyper_adaptor.testing.peak_trace import alive_at_peak, site  # noqa: E402


def report(top: int) -> None:
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, at_peak = alive_at_peak(trace)
    by_site = Counter()
    for size, frames in at_peak.values():
        by_site[site(frames)] += size
    print(f"[peak_trace] max_memory_allocated {torch.cuda.max_memory_allocated() / 2**20:.2f} MiB; traced "
          f"peak {peak / 2**20:.2f} MiB over {len(trace)} events (blocks allocated before tracing began "
          f"are not in it); alive at the traced peak, by site:", flush=True)
    for where, size in by_site.most_common(top):
        print(f"[peak_trace] {size / 2**20:10.2f} MiB  {where}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace-iters", type=int, default=2, help="report after this many train steps")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/peak_trace.py: needs a CUDA device (torch's allocator history is CUDA's)")
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    importlib.import_module("hyper_adaptor.megatron_adaptor")  # the script's own import line is then a no-op
    training = importlib.import_module("megatron.training.training")

    step, done = training.train_step, [0]

    def traced_train_step(*a, **k):
        out = step(*a, **k)
        done[0] += 1
        if done[0] == args.trace_iters:
            report(args.top)
        return out

    training.train_step = traced_train_step
    sys.argv = [args.script, *[a for a in args.script_args if a != "--"]]
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
