"""Simulated timing of a schedule: when each compute step runs, the bubble, live activations, an ASCII chart.

The model: each rank runs its compute steps in list order, one at a time; a step starts when the rank is free
and its inputs exist: F(m, s) needs F(m, s-1); B/I(m, s) needs F(m, s) and B/I(m, s+1); W(m, s) needs
I(m, s). An input made on another rank arrives ``comm`` later. Communication actions in the lists are
ignored (sends are taken as asynchronous): this is the schedule's ideal timing, the one the bubble formulas
describe. ``FWD_BWD`` costs F + B (or F + I) and hands both outputs over when it ends.

Bubble = idle / (ranks x makespan) with idle = makespan minus the rank's busy time.
"""

from __future__ import annotations

import dataclasses

from .actions import MetaStep, StageLayout
from .actions import MetaStepType as T
from .validate import ScheduleError, check_comm, comm_units, match_fifo

DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def dependencies(half: MetaStep, num_stages: int) -> list[tuple[str, int, int]]:
    """Keys ("F" | "B" | "W", micro, stage) of the steps whose outputs ``half`` uses; "B" stands for B or I."""
    m, s, t = half.micro_index, half.stage_index, half.step_type
    if t is T.FWD:
        return [("F", m, s - 1)] if s > 0 else []
    if t is T.BWD_WEIGHT:
        return [("B", m, s)]
    return [("F", m, s)] + ([("B", m, s + 1)] if s < num_stages - 1 else [])


def output_key(half: MetaStep) -> tuple[str, int, int]:
    kind = {T.FWD: "F", T.BWD: "B", T.BWD_INPUT: "B", T.BWD_WEIGHT: "W"}[half.step_type]
    return (kind, half.micro_index, half.stage_index)


@dataclasses.dataclass
class Timeline:
    """Result of :func:`simulate`. ``spans[r]``: (step, start, end) of rank r's compute steps in order."""

    layout: StageLayout
    spans: list[list[tuple[MetaStep, float, float]]]
    makespan: float
    bubble: float                      # idle / (ranks * makespan)
    rank_bubble: list[float]           # idle of each rank / makespan
    peak_inflight: list[int]           # per rank: most (micro, stage) with F done and B/I not yet
    peak_inflight_w: list[int]         # same, counted until B/W (activations kept for the weight gradient)


def step_cost(step: MetaStep, costs) -> float:
    return sum(costs[h.step_type.value] for h in step.halves())


def compute_times(lists, layout: StageLayout, costs=None, comm: float = 0.0):
    """(step, start, end) per rank for the compute steps; ScheduleError if the order cannot finish."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    computes = [[x for x in steps if x.step_type.is_compute] for steps in lists]
    spans: list[list] = [[] for _ in lists]
    done: dict[tuple, tuple[float, int]] = {}            # key -> (end time, rank)
    free = [0.0] * len(lists)
    nxt = [0] * len(lists)
    def ready_at(r, step):
        start = free[r]
        for half in step.halves():
            for key in dependencies(half, layout.num_stages):
                if key not in done:
                    return None
                end, src = done[key]
                start = max(start, end + (comm if src != r else 0.0))
        return start

    moved = True
    while moved:
        moved = False
        for r, steps in enumerate(computes):
            while nxt[r] < len(steps):
                step = steps[nxt[r]]
                start = ready_at(r, step)
                if start is None:
                    break
                end = start + step_cost(step, costs)
                for half in step.halves():
                    done[output_key(half)] = (end, r)
                spans[r].append((step, start, end))
                free[r], nxt[r], moved = end, nxt[r] + 1, True
    stuck = [r for r in range(len(lists)) if nxt[r] < len(computes[r])]
    if stuck:
        raise ScheduleError("the compute order cannot finish: " + "; ".join(
            f"rank {r} waits at {computes[r][nxt[r]]}" for r in stuck))
    return spans


def blocking_times(lists, layout: StageLayout, costs=None, comm: float = 0.0):
    """(step, start, end) per rank when sends and receives block as in the runtime without overlap_p2p: a
    rank reaching a batch of adjacent comm actions leaves it once every op's partner is posted too (plus
    ``comm``); compute steps then need no other wait (their inputs came through the receives before them)."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    partner = match_fifo(lists, layout)
    split = [comm_units(steps) for steps in lists]
    cur, clock = [0] * len(lists), [0.0] * len(lists)
    reached: dict[tuple[int, int], float] = {}
    spans: list[list] = [[] for _ in lists]
    moved = True
    while moved:
        moved = False
        for r, (units, _) in enumerate(split):
            while cur[r] < len(units):
                u = units[cur[r]]
                reached[(r, cur[r])] = clock[r]
                if isinstance(u, list):
                    peers = [(pr, split[pr][1][pi]) for pr, pi in (partner[(r, i)] for i in u)]
                    if any(pu not in range(cur[pr] + 1) or (pr, pu) not in reached for pr, pu in peers):
                        break
                    clock[r] = max([clock[r]] + [reached[x] for x in peers]) + comm
                else:
                    step = lists[r][u]
                    spans[r].append((step, clock[r], clock[r] + step_cost(step, costs)))
                    clock[r] += step_cost(step, costs)
                cur[r] += 1
                moved = True
    if any(cur[r] < len(units) for r, (units, _) in enumerate(split)):
        check_comm(lists, layout)        # raises, naming the deadlock
    return spans


def inflight_peaks(lists) -> tuple[list[int], list[int]]:
    """Per rank: peak live activations counted until B/I, and until B/W (list order = time order on a rank)."""
    until_i, until_w = [], []
    for steps in lists:
        a = b = pa = pb = 0
        for step in steps:
            for half in step.halves():
                t = half.step_type
                a += 1 if t is T.FWD else -1 if t in (T.BWD, T.BWD_INPUT) else 0
                b += 1 if t is T.FWD else -1 if t in (T.BWD, T.BWD_WEIGHT) else 0
                pa, pb = max(pa, a), max(pb, b)
        until_i.append(pa)
        until_w.append(pb)
    return until_i, until_w


def simulate(lists, layout: StageLayout, costs=None, comm: float = 0.0, *, blocking: bool = False) -> Timeline:
    """Timing of ``lists`` (``costs`` per step type F/B/I/W): the ideal model of the module docstring, or with
    ``blocking`` the lists' own sends and receives as blocking batches (:func:`blocking_times`)."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    spans = (blocking_times if blocking else compute_times)(lists, layout, costs, comm)
    makespan = max((sp[-1][2] for sp in spans if sp), default=0.0)
    busy = [sum(e - s for _, s, e in sp) for sp in spans]
    rank_bubble = [(makespan - b) / makespan if makespan else 0.0 for b in busy]
    bubble = sum(rank_bubble) / len(spans) if spans else 0.0
    until_i, until_w = inflight_peaks(lists)
    return Timeline(layout, spans, makespan, bubble, rank_bubble, until_i, until_w)


def theoretical_bubble(name: str, ranks: int, micro: int, chunks: int = 1, costs=None) -> float:
    """Textbook bubble fraction idle / (ranks x makespan), p = ranks, m = micro, v = chunks:

    - gpipe, 1f1b: (p-1) / (m+p-1) — every rank waits (p-1)(F+B) in all;
    - interleaved: (p-1) / (v*m + p-1) — the same wait, each step 1/v as long (exact when p divides m);
    - zbh1: (p-1)(F+I-W) / (m(F+I+W) + (p-1)(F+I-W)) — W fills part of the wait (Qi et al.);
      (p-1) / (3m+p-1) with equal costs;
    - zbv: (p-1)F / (2m(F+I+W) + (p-1)F) — a lower bound, not a formula of the paper: the last rank cannot
      start before p-1 forward steps, and every rank holds 2m x (F+I+W) of work. (p-1)/(6m+p-1) equal costs.
    """
    c = {**DEFAULT_COSTS, **(costs or {})}
    p, m, v = ranks, micro, chunks
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zbh1":
        wait = (p - 1) * max(c["F"] + c["I"] - c["W"], 0.0)
        return wait / (m * (c["F"] + c["I"] + c["W"]) + wait)
    if name == "zbv":
        wait = (p - 1) * c["F"]
        return wait / (2 * m * (c["F"] + c["I"] + c["W"]) + wait)
    raise ValueError(f"theoretical_bubble: unknown schedule name {name!r}")


def _label(step: MetaStep, layout: StageLayout) -> str:
    half = step.halves()
    text = "".join(f"{h.step_type.value}{h.micro_index}" + (f".{layout.chunk_of(h.stage_index)}"
                                                              if layout.chunks > 1 else "") for h in half)
    return text


def render(lists, layout: StageLayout, costs=None, comm: float = 0.0, unit: float | None = None, *,
           blocking: bool = False) -> str:
    """ASCII timeline: one row per rank, one cell per ``unit`` of time (default: the smallest step cost).

    A step shows its label (type, micro, ``.chunk`` when a rank holds several) in its first cell and ``-`` in
    the others; ``.`` is idle. Ends with the bubble line.
    """
    costs = {**DEFAULT_COSTS, **(costs or {})}
    tl = simulate(lists, layout, costs, comm, blocking=blocking)
    unit = unit or min(v for v in costs.values() if v > 0)
    cells = int(round(tl.makespan / unit))
    width = max([len(_label(s, layout)) for sp in tl.spans for s, _, _ in sp] + [1]) + 1
    rows = []
    for r, sp in enumerate(tl.spans):
        row = ["." * (width - 1)] * cells
        for step, start, end in sp:
            a, b = int(round(start / unit)), int(round(end / unit))
            for k in range(a, max(b, a + 1)):
                if k < cells:
                    row[k] = _label(step, layout) if k == a else "-" * (width - 1)
        rows.append(f"rank {r}: " + " ".join(c.ljust(width - 1) for c in row))
    per_rank = ", ".join(f"{b:.1%}" for b in tl.rank_bubble)
    rows.append(f"bubble {tl.bubble:.1%} (per rank {per_rank}); makespan {tl.makespan:g}; "
                f"peak in-flight {tl.peak_inflight} (until W: {tl.peak_inflight_w})")
    return "\n".join(rows)


__all__ = ["DEFAULT_COSTS", "Timeline", "simulate", "theoretical_bubble", "render", "compute_times", "blocking_times",
           "dependencies", "inflight_peaks"]
