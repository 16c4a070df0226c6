"""Pipeline schedules as data: generators of per-rank :class:`MetaStep` lists, and :func:`build`.

The generators return compute steps only; :func:`with_communication` adds the sends and receives, and
:func:`build` does both and validates. Every schedule works for any ``micro >= 1``; the shape the schedule
is known for needs ``micro >= ranks`` (1F1B, ZB-H1: a steady phase; interleaved: one full group of
``ranks`` micro-batches per chunk) or ``micro >= 2 * ranks`` (ZBV: its steady phase).
"""

from __future__ import annotations

import bisect
from collections import deque

from .actions import MetaStep, StageLayout
from .actions import MetaStepType as T
from .timeline import blocking_times, compute_times, dependencies, output_key
from .validate import ScheduleError, check_comm, validate

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")
# the zero-bubble ones: each backward split into an input-gradient and a weight-gradient step
SPLIT_WEIGHT_SCHEDULES = ("zbh1", "zbv")
# the ones that run several model chunks (stages) per rank
CHUNKED_SCHEDULES = ("interleaved", "zbv")


def _f(m, s):
    return MetaStep(m, T.FWD, s)


def _b(m, s, split=False):
    return MetaStep(m, T.BWD_INPUT if split else T.BWD, s)


def gpipe(ranks: int, micro: int) -> list[list[MetaStep]]:
    """All forwards, then all backwards, both in micro-batch order (B0 first: the runner frees in order).

    Bubble (p-1)/(m+p-1); every rank holds all m activations.
    """
    return [[_f(m, r) for m in range(micro)] + [_b(m, r) for m in range(micro)] for r in range(ranks)]


def one_f_one_b(ranks: int, micro: int, *, split: bool = False, overlap_b_f: bool = False
                ) -> list[list[MetaStep]]:
    """Megatron's 1F1B: rank r runs w = min(p-1-r, m) warm-up forwards, then (F, B) pairs, then w backwards.

    Peak live activations min(p-r, m) on rank r; bubble (p-1)/(m+p-1). ``split`` writes I instead of B;
    ``overlap_b_f`` merges each steady (F, B) pair into one FWD_BWD step; a pair hands its forward output
    over only when it ends, so rank r then warms up 2(p-1-r)+1 forwards (rank r+1 consumes what rank r made
    two pairs earlier): same bubble, live activations min(2(p-r), m).
    """
    lists = []
    for r in range(ranks):
        w = min(2 * (ranks - 1 - r) + 1 if overlap_b_f else ranks - 1 - r, micro)
        steps = [_f(m, r) for m in range(w)]
        for i in range(micro - w):
            steps += _steady(_f(w + i, r), _b(i, r, split), overlap_b_f)
        lists.append(steps + [_b(m, r, split) for m in range(micro - w, micro)])
    return lists


def _feasible(lists, layout) -> bool:
    try:
        compute_times(lists, layout)
        return True
    except ScheduleError:
        return False


def _groups(ranks, micro):
    """Micro-batches in groups of ``ranks``; a remainder joins the last group (never a group under ``ranks``
    unless micro < ranks): a short group would make rank 0 wait for its own chunk's output to come round."""
    bounds = list(range(0, micro - micro % ranks, ranks))[1:] if micro >= ranks else []
    edges = [0] + bounds + [micro]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


def _steady(f: MetaStep, b: MetaStep, overlap: bool) -> list[MetaStep]:
    """A steady-state (F, B) pair: one FWD_BWD step when overlapping (never for one micro-batch: that B
    needs that F's output)."""
    if overlap and f.micro_index != b.micro_index:
        return [MetaStep(f.micro_index, T.FWD_BWD, f.stage_index, pair=b)]
    return [f, b]


def interleaved(ranks: int, chunks: int, micro: int, overlap_b_f: bool = False) -> list[list[MetaStep]]:
    """Interleaved 1F1B (Megatron's virtual pipeline) over ``chunks`` loop-layout chunks per rank.

    Forward order, the same on every rank: micro-batches in groups of p; per group, chunk 0..v-1, each over
    the group's micro-batches. Backward order: the same with chunks reversed. Rank r warms up with
    2(p-1-r) + (v-1)p forwards (Megatron's count), then alternates F and B, then drains the backwards.
    When p does not divide m the last group is smaller (Megatron refuses that case); where the warm-up is
    then too short for the order to finish, every rank's warm-up grows by one until it does (checked by
    simulation). Bubble about (p-1)/(v*m+p-1) when p divides m. ``overlap_b_f`` merges the steady (F, B)
    pairs into FWD_BWD steps, with one more warm-up forward (see :func:`one_f_one_b`).
    """
    layout = StageLayout(ranks, chunks)
    fwd = [(m, c) for grp in _groups(ranks, micro) for c in range(chunks) for m in grp]
    bwd = [(m, c) for grp in _groups(ranks, micro) for c in reversed(range(chunks)) for m in grp]
    total = len(fwd)
    for extra in range(int(overlap_b_f), total + 1):
        lists = []
        for r in range(ranks):
            w = min(total, 2 * (ranks - 1 - r) + (chunks - 1) * ranks + extra)
            steps = [_f(m, layout.stage_of(r, c)) for m, c in fwd[:w]]
            for k in range(total - w):
                (mf, cf), (mb, cb) = fwd[w + k], bwd[k]
                steps += _steady(_f(mf, layout.stage_of(r, cf)), _b(mb, layout.stage_of(r, cb)), overlap_b_f)
            lists.append(steps + [_b(m, layout.stage_of(r, c)) for m, c in bwd[total - w:]])
        if _feasible(lists, layout):
            return lists
    raise ScheduleError(f"interleaved: no order found for ranks={ranks} chunks={chunks} micro={micro}")


def _greedy(layout: StageLayout, micro: int, pick) -> list[list[MetaStep]]:
    """Unit-time list scheduling: each time step, every rank calls ``pick(r, ready, state)`` and runs what it
    returns (or idles). ``ready(step)``: are the step's inputs done by now. Returns the order it ran.
    Results of time t are usable from t+1 on (on any rank): one unit per F, I and W.
    """
    done: dict[tuple, int] = {}
    lists: list[list[MetaStep]] = [[] for _ in range(layout.ranks)]
    total = layout.num_stages * micro * 3
    t, count = 0, 0

    def ready(step):
        return all(done.get(k, t + 1) <= t for k in dependencies(step, layout.num_stages))

    while count < total:
        ran = []
        for r in range(layout.ranks):
            step = pick(r, ready, force=False)
            if step is not None:
                ran.append((r, step))
        if not ran:      # nothing ready anywhere: let ranks ignore their memory cap to make progress
            ran = [(r, s) for r in range(layout.ranks) if (s := pick(r, ready, force=True)) is not None]
            if not ran:
                raise ScheduleError("greedy schedule stuck")  # cannot happen: something is always ready
        for r, step in ran:
            lists[r].append(step)
            done[output_key(step)] = t + 1
            count += 1
        t += 1
    return lists


def zbh1(ranks: int, micro: int) -> list[list[MetaStep]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with B split into I and W.

    F and I run in exactly 1F1B's order (same warm-up, so live activations until I peak at min(p-r, m) on
    rank r); each W goes into the first slot of a unit-time simulation where the next F/I is not ready yet,
    or where running the F would hold more than p activations not yet freed by their W (1F1B's peak, on
    rank 0); the rest drain at the end. Every W follows its I. With equal F/I/W costs and m >= p the
    simulated bubble is exactly (p-1)/(3m+p-1): a third of 1F1B's idle time; activations held until W peak
    at min(p, m) on every rank.
    """
    layout = StageLayout(ranks, 1)
    main = one_f_one_b(ranks, micro, split=True)
    pos = [0] * ranks
    pending = [deque() for _ in range(ranks)]
    live = [0] * ranks                       # F done, W not yet
    cap = ranks

    def pick(r, ready, force):
        nxt = main[r][pos[r]] if pos[r] < len(main[r]) else None
        over = nxt is not None and nxt.step_type is T.FWD and live[r] >= cap
        if nxt is not None and ready(nxt) and not (over and pending[r] and not force):
            pos[r] += 1
            if nxt.step_type is T.FWD:
                live[r] += 1
            else:
                pending[r].append(MetaStep(nxt.micro_index, T.BWD_WEIGHT, nxt.stage_index))
            return nxt
        if pending[r]:
            live[r] -= 1
            return pending[r].popleft()
        return None

    return _greedy(layout, micro, pick)


def zbv(ranks: int, micro: int) -> list[list[MetaStep]]:
    """ZB-V: two chunks per rank in a V (stage s < p on rank s, stage s >= p on rank 2p-1-s), F, I, W each.

    Built by unit-time list scheduling; a free rank runs, in this order of preference: a ready I (oldest
    micro-batch, later stage first), a ready F (oldest micro-batch, later stage first) while it holds fewer
    than 2p activations not yet freed by their W (the peak of 1F1B on rank 0, counted in half-size chunks),
    else its oldest pending W. With equal costs the bubble approaches the bound (p-1)/(6m+p-1) (the last
    rank cannot start before p-1 forwards).
    """
    layout = StageLayout(ranks, 2, "v")
    stages = [layout.stages_of(r) for r in range(ranks)]
    next_f = {s: 0 for s in range(layout.num_stages)}
    waiting_i = [[] for _ in range(ranks)]     # (micro, stage) whose F ran and I did not
    pending = [deque() for _ in range(ranks)]
    live = [0] * ranks
    cap = 2 * ranks

    def pick(r, ready, force):
        cands = [MetaStep(m, T.BWD_INPUT, s) for m, s in waiting_i[r]]
        cands = [c for c in cands if ready(c)]
        if cands:
            step = min(cands, key=lambda c: (c.micro_index, -c.stage_index))
            waiting_i[r].remove((step.micro_index, step.stage_index))
            pending[r].append(MetaStep(step.micro_index, T.BWD_WEIGHT, step.stage_index))
            return step
        fs = [_f(next_f[s], s) for s in stages[r] if next_f[s] < micro]
        fs = [c for c in fs if ready(c)]
        if fs and (live[r] < cap or force or not pending[r]):
            step = min(fs, key=lambda c: (c.micro_index, -c.stage_index))
            next_f[step.stage_index] += 1
            waiting_i[r].append((step.micro_index, step.stage_index))
            live[r] += 1
            return step
        if pending[r]:
            live[r] -= 1
            return pending[r].popleft()
        return None

    return _greedy(layout, micro, pick)


def forward_only(layout: StageLayout, micro: int) -> list[list[MetaStep]]:
    """Evaluation: F of every micro-batch through every stage. Every rank follows one order of (micro, chunk):
    groups of p micro-batches, per group chunk 0..v-1 (interleaved's forward order), which always finishes:
    each step waits only on steps earlier in that same order."""
    fwd = [(m, c) for grp in _groups(layout.ranks, micro) for c in range(layout.chunks) for m in grp]
    return [[_f(m, layout.stage_of(r, c)) for m, c in fwd] for r in range(layout.ranks)]


_forward_only = forward_only


def _simple_comm(compute_lists, layout):
    """Receives right before the step that uses them, sends right after the step that makes them."""
    last = layout.num_stages - 1
    out = []
    for r, steps in enumerate(compute_lists):
        seq = []
        for step in steps:
            pre, post = [], []
            for h in step.halves():
                m, s = h.micro_index, h.stage_index
                if h.step_type is T.FWD:
                    if s > 0 and layout.rank_of(s - 1) != r:
                        pre.append(MetaStep(m, T.RECV_F, s))
                    if s < last and layout.rank_of(s + 1) != r:
                        post.append(MetaStep(m, T.SEND_F, s))
                elif h.step_type in (T.BWD, T.BWD_INPUT):
                    if s < last and layout.rank_of(s + 1) != r:
                        pre.append(MetaStep(m, T.RECV_B, s))
                    if s > 0 and layout.rank_of(s - 1) != r:
                        post.append(MetaStep(m, T.SEND_B, s))
            seq += pre + [step] + post
        out.append(seq)
    return out


def _phased_comm(compute_lists, layout):
    """Deadlock-free placement for any compute order that finishes with asynchronous sends.

    Time the compute order (default costs, sends free). Each transfer from rank a (made at t1) to rank b
    (needed at t2 >= t1) gets a phase tau in [t1, t2]: the first moment neither rank is inside a step, else
    t2. On every rank a transfer's action sits after the steps that started before tau, so actions follow
    phase order on each rank and both ends of a transfer share its phase. Then no deadlock is possible: take
    the earliest phase with an unfinished op; every rank has reached all its ops of that phase (they form one
    batch, and all earlier phases completed), so they all complete. Within a phase, ops sort by
    (phase, direction, micro, stage) on both ends, which keeps FIFO order per rank pair.
    """
    spans = compute_times(compute_lists, layout)
    starts = [[a for _, a, _ in sp] for sp in spans]
    ends = {}
    for sp in spans:
        for step, _, e in sp:
            for h in step.halves():
                ends[output_key(h)] = e

    def inside(r, tau):
        i = bisect.bisect_left(starts[r], tau) - 1
        return i >= 0 and spans[r][i][2] > tau

    gaps = [dict() for _ in compute_lists]     # rank -> gap index -> [(sort key, action)]

    def place(r, tau, key, action):
        g = bisect.bisect_left(starts[r], tau)
        gaps[r].setdefault(g, []).append((key, action))

    last = layout.num_stages - 1
    for b, sp in enumerate(spans):
        for step, t2, _ in sp:
            for h in step.halves():
                m, s = h.micro_index, h.stage_index
                if h.step_type is T.FWD and s > 0 and layout.rank_of(s - 1) != b:
                    src, direction = s - 1, "F"
                elif h.step_type in (T.BWD, T.BWD_INPUT) and s < last and layout.rank_of(s + 1) != b:
                    src, direction = s + 1, "B"
                else:
                    continue
                a = layout.rank_of(src)
                t1 = ends[("F" if direction == "F" else "B", m, src)]
                cands = sorted({t1, t2} | {e for x in (a, b) for _, _, e in spans[x] if t1 < e < t2})
                tau = next((c for c in cands if not inside(a, c) and not inside(b, c)), t2)
                key = (tau, direction, m, src)
                place(a, tau, key, MetaStep(m, T.SEND_F if direction == "F" else T.SEND_B, src))
                place(b, tau, key, MetaStep(m, T.RECV_F if direction == "F" else T.RECV_B, s))
    out = []
    for r, steps in enumerate(compute_lists):
        seq = []
        for g in range(len(steps) + 1):
            seq += [action for _, action in sorted(gaps[r].get(g, []), key=lambda x: x[0])]
            if g < len(steps):
                seq.append(steps[g])
        out.append(seq)
    return out


def with_communication(compute_lists, layout: StageLayout) -> list[list[MetaStep]]:
    """Add SEND_F/RECV_F/SEND_B/RECV_B to compute-only lists.

    Two placements: Megatron's (each receive right before its step, each send right after its step, so a
    step's sends and the next step's receives form one batch: send_forward_recv_backward and friends), and
    phases of the schedule's own timing (see :func:`_phased_comm`), which is provably deadlock-free. The
    first is kept where it is valid (no deadlock, no crossed FIFO order) and no slower with blocking
    communication (:func:`~.timeline.blocking_times`; e.g. ZB-H1's deferred W make a sender wait there).
    """
    phased = _phased_comm(compute_lists, layout)
    simple = _simple_comm(compute_lists, layout)
    try:
        check_comm(simple, layout)
    except ScheduleError:
        return phased
    return min((simple, phased), key=lambda lists: _makespan(blocking_times(lists, layout)))


def _makespan(spans):
    return max((sp[-1][2] for sp in spans if sp), default=0.0)


STEADY = 4  # past STEADY x ranks micro-batches, steady_micro gives a shorter count with the same peaks


def steady_micro(name: str, ranks: int, micro: int) -> int:
    """A micro-batch count whose lists keep every rank's in-flight peaks (``timeline.inflight_peaks``) and pass
    the same checks as ``micro``'s, built in a fraction of the time: past ``STEADY`` x ranks, 3 x ranks + micro
    mod ranks (the warm-up, one whole steady round and the same cool-down; a thousand-micro-batch list takes
    seconds to a minute to build). GPipe keeps every micro-batch in flight, so its count is never shortened.
    tests/unit/test_dryrun_plan.py checks the peaks against the whole lists for each schedule."""
    return 3 * ranks + micro % ranks if name != "gpipe" and micro > STEADY * ranks else micro


def build(name: str, ranks: int, micro: int, chunks: int | None = None, *, forward_only: bool = False,
          overlap_b_f: bool = False) -> tuple[StageLayout, list[list[MetaStep]]]:
    """The layout and validated per-rank lists (with communication) of schedule ``name``.

    ``chunks``: stages per rank; None means 1 (gpipe, 1f1b, zbh1) or 2 (zbv); interleaved needs >= 2.
    ``forward_only``: the evaluation order for the same layout (overlap_b_f is then ignored).
    ``overlap_b_f``: merge steady (F, B) pairs into FWD_BWD steps (1f1b and interleaved only).
    """
    if name not in SCHEDULES:
        raise ValueError(f"build: name must be one of {SCHEDULES}, got {name!r}")
    for arg, value in (("ranks", ranks), ("micro", micro)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"build: {arg} must be an int >= 1, got {value!r}")
    if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool)):
        raise ValueError(f"build: chunks must be an int, got {chunks!r}")
    if name == "interleaved":
        if chunks is None or chunks < 2:
            raise ValueError(f"build: interleaved needs chunks >= 2 (stages per rank), got {chunks!r}")
    elif name == "zbv":
        if chunks not in (None, 2):
            raise ValueError(f"build: zbv runs exactly 2 chunks per rank (a V), got chunks={chunks}")
        chunks = 2
    elif chunks not in (None, 1):
        raise ValueError(f"build: {name} runs one stage per rank (chunks=1), got chunks={chunks}; "
                         "use 'interleaved' for several")
    if overlap_b_f and name not in ("1f1b", "interleaved"):
        raise ValueError(f"build: overlap_b_f applies to '1f1b' and 'interleaved', not {name!r}")
    layout = StageLayout(ranks, chunks or 1, "v" if name == "zbv" else "loop")
    if forward_only:
        compute = _forward_only(layout, micro)
    elif name == "gpipe":
        compute = gpipe(ranks, micro)
    elif name == "1f1b":
        compute = one_f_one_b(ranks, micro, overlap_b_f=overlap_b_f)
    elif name == "interleaved":
        compute = interleaved(ranks, chunks, micro, overlap_b_f)
    elif name == "zbh1":
        compute = zbh1(ranks, micro)
    else:
        compute = zbv(ranks, micro)
    lists = with_communication(compute, layout)
    validate(lists, layout, micro, forward_only=forward_only,
             split_weight=None if forward_only else name in SPLIT_WEIGHT_SCHEDULES)
    return layout, lists


__all__ = ["SCHEDULES", "SPLIT_WEIGHT_SCHEDULES", "CHUNKED_SCHEDULES", "gpipe", "one_f_one_b", "interleaved",
           "zbh1", "zbv", "forward_only",
           "with_communication", "build", "steady_micro", "STEADY"]
