"""Reading a device allocator's history (the event list of torch's memory snapshot, as plain dicts): what
was alive at the peak, and which source line allocated it. This module only reads the events; recording
them is device code and stays in bench/peak_trace.py, which runs on a GPU."""

from __future__ import annotations


def site(frames: list) -> str:
    """The first frame in the project or megatron (innermost first), else the innermost Python frame."""
    for f in frames:
        name = f.get("filename", "")
        if "hyper_adaptor" in name or "/megatron/" in name or "/examples/" in name:
            short = name.split("/hyper_adaptor/")[-1] if "/hyper_adaptor/" in name else name.split("/megatron/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return f"{frames[0].get('filename', '?')}:{frames[0].get('line')}" if frames else "(no python frame)"


def alive_at_peak(trace: list) -> tuple[int, dict]:
    """Walk the allocator's events: the peak of the bytes allocated, and the blocks alive at it."""
    alive, total, peak, at_peak = {}, 0, 0, {}
    for event in trace:
        action = event.get("action")
        if action == "alloc":
            alive[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(alive)
        elif action == "free_requested" and event["addr"] in alive:
            total -= alive.pop(event["addr"])[0]
    return peak, at_peak
