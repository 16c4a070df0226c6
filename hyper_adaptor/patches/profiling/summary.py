"""The few lines a profiled rank prints when its window closes: the top operators by self time, and
the share of communication, so that a user sees something without opening a viewer.

The operators are ranked by self time from the profiler's averages (``key_averages``), so nested
ranges count once. Communication is the time in the window during which at least one collective was
in flight, from the profiler's raw events on every thread (the union of their intervals): the backends
run collectives on their own threads (gloo's ``gloo:all_reduce`` ranges, which ``key_averages`` lists
with no self time) or streams (NCCL / HCCL kernels), so neither a sum of self times nor the training
thread alone would see them. Collectives can overlap compute: the share says how long communication was
under way, not how long training waited for it.
"""

from __future__ import annotations

import re

# collectives as torch.profiler names them: c10d's ops on the training thread, the backends' own
# ranges (gloo:all_reduce on gloo's threads, nccl:* / NCCL kernels, HCCL) and record_param_comms
COMMUNICATION = re.compile(r"^c10d::|^gloo:|nccl|hccl|^hcom|record_param_comms", re.IGNORECASE)
STEP = re.compile(r"^ProfilerStep[#*]")


def in_flight_ms(intervals) -> float:
    """Length of the union of ``(start_ns, end_ns)`` intervals, in ms."""
    total, end = 0, None
    for lo, hi in sorted(intervals):
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total / 1e6


def lines(averages, device_time: bool, wall_ms: float, comm_intervals=(), top: int = 5) -> list[str]:
    if averages is None:
        return ["summary: see the profiler's own analysis under the trace directory"]
    attr = "self_device_time_total" if device_time else "self_cpu_time_total"
    times = [(e.key, float(getattr(e, attr, 0.0) or 0.0) / 1e3) for e in averages]  # us -> ms
    if not any(t for _, t in times):
        return ["no operator time recorded"]
    where = "device" if device_time else "host"
    comm = in_flight_ms(comm_intervals)
    ops = sorted(((n, t) for n, t in times if not STEP.match(n)), key=lambda x: -x[1])[:top]
    share = (lambda ms: f"{100 * ms / wall_ms:.1f}%") if wall_ms > 0 else (lambda ms: "-")
    return [
        f"communication {comm:.1f} ms = {share(comm)} of the window (a collective in flight, any thread)",
        f"top {where} self time: " + " | ".join(f"{n} {t:.1f} ms ({share(t)})" for n, t in ops),
    ]
