"""Check a schedule (per-rank lists of :class:`MetaStep`) before any rank runs it.

:func:`validate` checks, in this order, and raises :class:`ScheduleError` naming ranks and steps:

1. shape: one list per rank; every step's stage lives on that rank (``layout.rank_of``); micro in range;
   communication only across ranks (never between two stages of one rank, never past either end);
2. counts: each (micro, stage) has exactly one F and, unless ``forward_only``, exactly one B or one I and one
   W; each cross-rank edge has exactly one send and one receive per micro-batch and direction;
3. order on each rank: F before B/I before W of a stage; the input of F (RECV_F, or the F of stage s-1 held
   by the same rank) before it; the gradient of B/I (RECV_B, or the B/I of stage s+1 on the same rank)
   before it; SEND_F / SEND_B after the step producing what they send; F of a stage in micro order;
4. FIFO: per ordered rank pair, the k-th send meets the k-th receive and both name the same transfer;
5. deadlock: the conservative rendezvous model of ``pipe_common.md`` (an op completes once it and its
   partner are posted; a rank leaves a batch of adjacent comm actions when all its ops completed).

Everything is a linear pass or a fixed-point loop over the per-rank action lists (milliseconds for 8 ranks x
64 micro-batches).
"""

from __future__ import annotations

from .actions import MetaStep, StageLayout
from .actions import MetaStepType as T

_BACKWARDS = (T.BWD, T.BWD_INPUT)


class ScheduleError(ValueError):
    """A schedule that would run wrong (missing/duplicate step, bad order, crossed FIFO order, deadlock)."""


def peer_of(step: MetaStep, layout: StageLayout) -> int:
    """The rank a communication action talks to."""
    s, t = step.stage_index, step.step_type
    return layout.rank_of(s + 1 if t in (T.SEND_F, T.RECV_B) else s - 1)


def transfer_of(step: MetaStep) -> tuple[str, int, int]:
    """(direction, micro, sending stage): the same tuple for a send and the receive that meets it."""
    t, m, s = step.step_type, step.micro_index, step.stage_index
    if t is T.SEND_F or t is T.SEND_B:
        return (t.value[1], m, s)
    return (t.value[1], m, s - 1 if t is T.RECV_F else s + 1)


def is_send(step: MetaStep) -> bool:
    return step.step_type in (T.SEND_F, T.SEND_B)


def validate(lists, layout: StageLayout, micro: int, *, forward_only: bool = False,
             split_weight: bool | None = None) -> None:
    """Raise :class:`ScheduleError` unless ``lists`` runs every micro-batch through every stage correctly.

    ``split_weight``: True requires I + W for every backward, False requires B, None accepts either.
    """
    check_steps(lists, layout, micro, forward_only=forward_only, split_weight=split_weight)
    check_comm(lists, layout)


def check_steps(lists, layout, micro, *, forward_only=False, split_weight=None) -> None:
    """Checks 1-3 of the module docstring (everything local to one rank's list)."""
    if len(lists) != layout.ranks:
        raise ScheduleError(f"{len(lists)} lists for a pipeline of {layout.ranks} ranks")
    last = layout.num_stages - 1
    where: dict[tuple, tuple[int, tuple[int, int]]] = {}     # (type value, micro, stage) -> (rank, position)
    for r, steps in enumerate(lists):
        last_fwd: dict[int, int] = {}
        for i, step in enumerate(steps):
            if not isinstance(step, MetaStep):
                raise ScheduleError(f"rank {r} position {i}: {step!r} is not a MetaStep")
            t = step.step_type
            if t.is_comm:
                s = step.stage_index
                towards = s + 1 if t in (T.SEND_F, T.RECV_B) else s - 1
                if 0 <= s <= last and layout.rank_of(s) == r and (not 0 <= towards <= last
                                                                  or layout.rank_of(towards) == r):
                    raise ScheduleError(f"rank {r}: {step} has no other rank to talk to (stage {towards})")
                if forward_only and t in (T.SEND_B, T.RECV_B):
                    raise ScheduleError(f"rank {r}: {step} in a forward-only schedule")
            for half_no, half in enumerate(step.halves()):
                ht, m, s = half.step_type, half.micro_index, half.stage_index
                if not 0 <= s <= last or layout.rank_of(s) != r:
                    raise ScheduleError(f"rank {r} runs {step}, but stage {s} is "
                                        + (f"on rank {layout.rank_of(s)}" if 0 <= s <= last
                                           else "not in the pipeline"))
                if not 0 <= m < micro:
                    raise ScheduleError(f"rank {r}: {step} names micro-batch {m}, outside 0..{micro - 1}")
                if forward_only and ht.is_compute and ht is not T.FWD:
                    raise ScheduleError(f"rank {r}: {step} in a forward-only schedule")
                if split_weight is True and ht is T.BWD:
                    raise ScheduleError(f"rank {r}: {step} is a full backward; this schedule splits I and W")
                if split_weight is False and ht in (T.BWD_INPUT, T.BWD_WEIGHT):
                    raise ScheduleError(f"rank {r}: {step} splits the backward; this schedule runs full B")
                key = (ht.value, m, s)
                if key in where:
                    raise ScheduleError(f"rank {r}: {half} appears twice")
                where[key] = (r, (i, half_no))
                if ht is T.FWD:
                    if last_fwd.get(s, -1) > m:
                        raise ScheduleError(f"rank {r}: {half} after F{last_fwd[s]}s{s}: forwards of a stage "
                                            "must run in micro-batch order")
                    last_fwd[s] = m

    def pos(kind, m, s):
        return where.get((kind, m, s), (None, None))[1]

    def need(kind, m, s, what):
        if (kind, m, s) not in where:
            raise ScheduleError(f"{kind}{m}s{s} is missing (rank {layout.rank_of(s)}): {what}")
        return where[(kind, m, s)][1]

    def before(a, b, a_name, b_name, s):
        if a >= b:
            raise ScheduleError(f"rank {layout.rank_of(s)}: {b_name} comes before {a_name}")

    for s in range(last + 1):
        r = layout.rank_of(s)
        up_remote = s > 0 and layout.rank_of(s - 1) != r
        down_remote = s < last and layout.rank_of(s + 1) != r
        for m in range(micro):
            f = need("F", m, s, "every micro-batch runs forward through every stage")
            if s > 0:
                src = need("RF", m, s, f"the input of F{m}s{s} from rank {layout.rank_of(s - 1)}") if up_remote \
                    else need("F", m, s - 1, f"the input of F{m}s{s}")
                before(src, f, f"{'RF' if up_remote else 'F'}{m}s{s if up_remote else s - 1}", f"F{m}s{s}", s)
            if down_remote:
                before(f, need("SF", m, s, f"F{m}s{s}'s output to rank {layout.rank_of(s + 1)}"),
                       f"F{m}s{s}", f"SF{m}s{s}", s)
            if forward_only:
                continue
            if pos("B", m, s) is not None and (pos("I", m, s) or pos("W", m, s)) is not None:
                raise ScheduleError(f"rank {r}: micro-batch {m} stage {s} has both B and I/W")
            kind = "B" if pos("B", m, s) is not None else "I"
            b = need(kind, m, s, "every micro-batch runs backward through every stage")
            before(f, b, f"F{m}s{s}", f"{kind}{m}s{s}", s)
            if kind == "I":
                before(b, need("W", m, s, f"the weight gradient of I{m}s{s}"), f"I{m}s{s}", f"W{m}s{s}", s)
            if s < last:
                if down_remote:
                    g, g_name = need("RB", m, s, f"the gradient of {kind}{m}s{s} from rank "
                                                 f"{layout.rank_of(s + 1)}"), f"RB{m}s{s}"
                else:
                    k2 = "B" if pos("B", m, s + 1) is not None else "I"
                    g, g_name = need(k2, m, s + 1, f"the gradient of {kind}{m}s{s}"), f"{k2}{m}s{s + 1}"
                before(g, b, g_name, f"{kind}{m}s{s}", s)
            if up_remote:
                before(b, need("SB", m, s, f"{kind}{m}s{s}'s input gradient to rank {layout.rank_of(s - 1)}"),
                       f"{kind}{m}s{s}", f"SB{m}s{s}", s)


def comm_units(steps):
    """Split a rank's list into units: a compute step, or a batch (list of positions of adjacent comm actions)."""
    units, unit_of = [], {}
    for i, step in enumerate(steps):
        if step.step_type.is_comm:
            if not units or not isinstance(units[-1], list):
                units.append([])
            units[-1].append(i)
            unit_of[i] = len(units) - 1
        else:
            units.append(i)
    return units, unit_of


def match_fifo(lists, layout) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair every send with its receive, FIFO per ordered rank pair; (rank, pos) -> (peer rank, peer pos)."""
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for r, steps in enumerate(lists):
        for i, step in enumerate(steps):
            if step.step_type.is_comm:
                peer = peer_of(step, layout)
                (sends.setdefault((r, peer), []) if is_send(step) else recvs.setdefault((peer, r), [])).append(i)
    partner = {}
    for a, b in sorted(set(sends) | set(recvs)):
        out, inn = sends.get((a, b), []), recvs.get((a, b), [])
        for k, (i, j) in enumerate(zip(out, inn)):
            if transfer_of(lists[a][i]) != transfer_of(lists[b][j]):
                raise ScheduleError(
                    f"crossed order between rank {a} and rank {b}: send #{k} of rank {a} to rank {b} is "
                    f"{lists[a][i]} but receive #{k} of rank {b} from rank {a} is {lists[b][j]}")
            partner[(a, i)], partner[(b, j)] = (b, j), (a, i)
        if len(out) != len(inn):
            more, (r, idx) = ("send", (a, out[len(inn)])) if len(out) > len(inn) else ("receive", (b, inn[len(out)]))
            raise ScheduleError(f"rank {a} sends {len(out)} and rank {b} receives {len(inn)} messages on "
                                f"the pair {a}->{b}: {lists[r][idx]} on rank {r} has no matching {more}")
    return partner


def check_comm(lists, layout) -> None:
    """FIFO matching then the deadlock simulation (checks 4 and 5)."""
    partner = match_fifo(lists, layout)
    split = [comm_units(steps) for steps in lists]
    cur = [0] * len(lists)

    def done(r, i):
        pr, pi = partner[(r, i)]
        return cur[pr] >= split[pr][1][pi]

    moved = True
    while moved:
        moved = False
        for r, (units, _) in enumerate(split):
            while cur[r] < len(units):
                u = units[cur[r]]
                if isinstance(u, list) and not all(done(r, i) for i in u):
                    break
                cur[r] += 1
                moved = True
    blocked = [r for r, (units, _) in enumerate(split) if cur[r] < len(units)]
    if blocked:
        def waiting(r):
            return next(i for i in split[r][0][cur[r]] if not done(r, i))
        parts = []
        for r in blocked:
            i = waiting(r)
            pr, _ = partner[(r, i)]
            at = f"at {lists[pr][waiting(pr)]}" if pr in blocked else "finished"
            parts.append(f"rank {r} waits at {lists[r][i]} for rank {pr} ({at})")
        raise ScheduleError("deadlock: " + "; ".join(parts))


__all__ = ["ScheduleError", "validate", "check_steps", "check_comm", "match_fifo", "comm_units"]
