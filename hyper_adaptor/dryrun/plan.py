"""``python -m hyper_adaptor plan --world-size N --device-memory GiB [--device D] [--top K] <model flags>``.

Picks the parallel layout for a cluster from the dry-run's own predictions: it enumerates TP (with sequence
parallel), PP with its schedule (megatron's 1F1B, GPipe, ZB-H1; with model chunks megatron's interleaved 1F1B
or ZBV), CP with its algorithm, EP (MoE), DP = the rest, the data-parallel engine (megatron DDP, its distributed
optimizer, HSDP level 1 / 2 / 3), recompute (none, --swap-attention, selective, full) and the micro-batch size.

Why it is staged: a configuration costs about 8 ms (megatron's parser and checks, then the memory and time
models), and a cluster of 1,024 devices has tens of thousands of them. So:

1. arithmetic first: what does not divide (heads by TP, layers by PP x VPP, the sequence by 2 x CP, experts and
   the ranks of a stage by EP, the global batch by micro-batch x DP) is dropped without a parse;
2. one probe per layout (TP, PP, schedule, CP, EP): micro-batch 1, the distributed optimizer (HSDP level 3 where
   that does not fit), full recompute — about the least memory the layout can take. A layout whose probe is
   refused or does not fit is dropped whole;
3. the layouts that fit are searched in the order of their probe's step time less its recompute (an estimate,
   not a bound: a larger micro-batch can be faster), each micro-batch size x data-parallel engine without
   recompute first; recompute and swap only add time, so they are tried only where that does not fit.

Every configuration evaluated goes through :func:`hyper_adaptor.dryrun.parse` (the checks of a training run),
:func:`hyper_adaptor.dryrun.memory.predict` and :func:`hyper_adaptor.dryrun.timing.predict_time`; ``bound``
caps how many (the output says how many were left out). The best ``top`` are printed as flag lines to append
to the model flags, then why the others lost, grouped by the binding constraint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import sys
import time
from collections import Counter

from hyper_adaptor import usage
from hyper_adaptor.dryrun import memory, timing
from hyper_adaptor.dryrun.plan_space import (  # noqa: F401  (the space's names, for the planner's users)
    DP_MODES,
    RECOMPUTE,
    Candidate,
    Layout,
    Model,
    dp_modes,
    expert_sizes,
    layouts,
    micro_batches,
)
from hyper_adaptor.dryrun.shape import DEVICES
from hyper_adaptor.dryrun.shape import parse as _parse
from hyper_adaptor.dryrun.shape import parser as _parser
from hyper_adaptor.parallel.pipeline import schedules

PROG = "hyper_adaptor plan"
GIB = 1024 ** 3
DEFAULT_BOUND = 3000  # configurations evaluated (parse + memory + time), probes included
# the headroom kept under --device-memory: the memory model's accuracy. Over the accuracy matrix
# (bench/dry_run.py) predicted / measured peaks ran 0.92-1.03, and the planner's validation (bench/plan_validate.py)
# ran configurations predicted a few percent under the limit a few percent over it (0.96-0.98) before the margin
DEFAULT_MARGIN = 0.1
# flags that choose what the planner chooses: refused in the model flags
LAYOUT_FLAGS = (
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank",
    "--num-layers-per-virtual-pipeline-stage", "--virtual-pipeline-model-parallel-size", "--context-parallel-size",
    "--context-parallel-algo", "--cp-comm-type", "--ulysses-degree-in-cp", "--hierarchical-context-parallel-sizes",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--pipeline-schedule", "--sequence-parallel",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-modules",
    "--swap-attention", "--swap-modules", "--cpu-offloading-num-layers", "--use-hsdp", "--hsdp-optimizer-level",
    "--hsdp-shard-size", "--use-distributed-optimizer", "--micro-batch-size", "--world-size",
    "--num-layers-in-first-pipeline-stage", "--num-layers-in-last-pipeline-stage",
)


class PlanError(ValueError):
    """Bad input to the planner (exit status 2), naming the flag or value."""


# ------------------------------------------------------------------------------------------- evaluation
def dominated(model: Model, candidate: Candidate, world: int) -> str:
    """A configuration never better than another of the space, without evaluating it (or "")."""
    layout = candidate.layout
    m = model.global_batch // (candidate.micro_batch * (world // (layout.tp * layout.pp * layout.cp)))
    if layout.schedule == "gpipe" and m > schedules.STEADY * layout.pp:
        return "slower or equal: gpipe (1F1B's step with every micro-batch in flight)"
    return ""


@dataclasses.dataclass
class Outcome:
    candidate: Candidate
    verdict: str                    # fits | oom | refused
    peak: int = 0                   # bytes, the largest rank
    part: str = ""                  # oom: the largest part of the largest rank
    step: timing.StepTime | None = None
    message: str = ""               # refused: the check's message

    @property
    def seconds(self) -> float:
        return self.step.total if self.step else math.inf


class Evaluator:
    """Parses, predicts and times configurations of ``model_flags`` on ``world`` ranks (one parser, reused)."""

    def __init__(self, model_flags, world, device, limit_bytes, calibration, parser=None):
        self.model_flags, self.world, self.device = list(model_flags), world, device
        self.limit, self.calibration = limit_bytes, calibration
        self.parser = parser or _parser(PROG)
        self.count = 0
        self.seconds = 0.0
        self.cache = {}
        self._model = None

    @property
    def model(self) -> Model:
        """The model flags alone on one rank (unknown flags and a missing shape end here, naming the flag)."""
        if self._model is None:
            self._model = Model.from_args(_parse([*self.model_flags, "--micro-batch-size", "1"], 1, self.device,
                                                 PROG, self.parser))
        return self._model

    def parse(self, candidate: Candidate):
        return _parse(self.model_flags + candidate.flags(), self.world, self.device, PROG, self.parser)

    def __call__(self, candidate: Candidate, timed: bool = True) -> Outcome:
        """The outcome of ``candidate``; each configuration is evaluated once (a probe is met again later)."""
        key = (candidate, timed)
        if key not in self.cache:
            self.cache[key] = self._evaluate(candidate, timed)
        return self.cache[key]

    def _evaluate(self, candidate: Candidate, timed: bool) -> Outcome:
        start = time.perf_counter()
        self.count += 1
        try:
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    args = self.parse(candidate)
            except SystemExit:
                lines = err.getvalue().strip().splitlines() or ["refused"]
                return Outcome(candidate, "refused", message=lines[-1].split("error: ", 1)[-1])
            prediction = memory.predict(args)
            worst = max(prediction.ranks, key=lambda r: r.peak)
            part = max(memory.PARTS, key=lambda p: worst.parts[p])
            if worst.peak > self.limit:
                return Outcome(candidate, "oom", worst.peak, part)
            step = None
            if timed:
                try:
                    step = timing.predict_time(args, self.calibration, prediction.shape)
                except timing.TimingError as error:
                    return Outcome(candidate, "refused", worst.peak, part, message=str(error))
            return Outcome(candidate, "fits", worst.peak, part, step)
        finally:
            self.seconds += time.perf_counter() - start


@dataclasses.dataclass
class Plan:
    ranked: list[Outcome]            # every fitting configuration evaluated, fastest first
    pruned: Counter                  # arithmetic (layout branches)
    lost: Counter                    # configurations, by the binding constraint
    layouts: int
    configurations: int              # the whole space after the arithmetic
    evaluated: int
    seconds: float
    bound: int
    smallest: Outcome | None = None  # the smallest peak seen, when nothing fits


def size(nbytes: int) -> str:
    return f"{nbytes / GIB:.3f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:.1f} MiB"


def _oom(outcome: Outcome) -> str:
    return f"out of memory: largest part {outcome.part}"


def search(model_flags, world: int, device_memory: float, device: str, calibration, bound: int = DEFAULT_BOUND,
           evaluator: Evaluator | None = None, margin: float = DEFAULT_MARGIN) -> Plan:
    """The feasible configurations ranked by predicted step time, and why the others lost."""
    start = time.perf_counter()
    evaluator = evaluator or Evaluator(model_flags, world, device, device_memory * (1 - margin) * GIB, calibration)
    model = evaluator.model
    pruned, lost = Counter(), Counter()
    space = layouts(model, world, pruned)
    sizes = {}
    for layout in space:
        mbs = micro_batches(model, layout, world, pruned)
        sizes[layout] = (mbs, dp_modes(layout, world))
    total = sum(len(m) * len(d) * len(RECOMPUTE) for m, d in sizes.values())
    space = [layout for layout in space if sizes[layout][0]]
    # one probe per layout (its smallest micro-batch, sharded optimizer state, full recompute: its leanest
    # configuration), breadth first: one layout of each (TP, PP, CP, EP) with the least model parallelism
    # first, then the other layouts of those the probes found fastest (their schedules, chunks and CP
    # algorithms), so that a bound well under the space still reaches every degree of parallelism
    space.sort(key=lambda lay: (lay.tp * lay.pp * lay.cp, lay.vpp, bool(lay.schedule), lay.algo, -lay.ep))
    groups: dict[tuple, list[Layout]] = {}
    for layout in space:
        groups.setdefault((layout.tp, layout.pp, layout.cp, layout.ep), []).append(layout)
    fits, smallest = [], None
    promising, scores = [], {}
    probe_budget = max(bound // 2, 1)

    def probe(layout: Layout) -> None:
        nonlocal smallest
        mbs, modes = sizes[layout]
        n = len(mbs) * len(modes) * len(RECOMPUTE)
        sharded = [m for m in ("distopt", "hsdp-level3") if m in modes] or ["ddp"]
        reason = dominated(model, Candidate(layout, mbs[-1]), world)
        if reason:
            lost[reason] += n
            return
        outcome = None
        smallest_mbs = next(b for b in mbs if not dominated(model, Candidate(layout, b), world))
        for mode in sharded:
            outcome = evaluator(Candidate(layout, smallest_mbs, mode, "full"))
            if smallest is None or (outcome.peak and outcome.peak < smallest.peak):
                smallest = outcome if outcome.peak else smallest
            if outcome.verdict != "oom":
                break
        if outcome.verdict == "refused":
            lost[f"refused: {outcome.message}"] += n
        elif outcome.verdict == "oom":
            lost[_oom(outcome)] += n
        else:
            seconds = outcome.seconds - outcome.step.parts.get("recompute", 0.0)
            promising.append((seconds, layout))
            key = (layout.tp, layout.pp, layout.cp, layout.ep)
            scores[key] = min(scores.get(key, math.inf), seconds)

    first = [members[0] for members in groups.values()]
    rest = [layout for members in groups.values() for layout in members[1:]]
    unprobed = []
    for index, layout in enumerate(first):
        if evaluator.count >= probe_budget:
            unprobed = first[index:] + rest
            break
        probe(layout)
    else:
        rest.sort(key=lambda lay: scores.get((lay.tp, lay.pp, lay.cp, lay.ep), math.inf))
        for index, layout in enumerate(rest):
            if evaluator.count >= probe_budget:
                unprobed = rest[index:]
                break
            probe(layout)
    if unprobed:
        lost[f"not evaluated (search bound {bound})"] += sum(
            len(sizes[lay][0]) * len(sizes[lay][1]) * len(RECOMPUTE) for lay in unprobed)
    promising.sort(key=lambda x: x[0])
    queue = [Candidate(layout, b, mode) for _, layout in promising for b in sizes[layout][0]
             for mode in sizes[layout][1]]
    for index, candidate in enumerate(queue):
        if evaluator.count >= bound:
            lost[f"not evaluated (search bound {bound})"] += len(RECOMPUTE) * (len(queue) - index)
            break
        reason = dominated(model, candidate, world)
        if reason:
            lost[reason] += len(RECOMPUTE)
        else:
            _variants(evaluator, candidate, fits, lost)
    fits.sort(key=lambda o: (o.seconds, o.peak, len(o.candidate.flags())))
    return Plan(fits, pruned, lost, len(space), total, evaluator.count, time.perf_counter() - start, bound,
                None if fits else smallest)


def _variants(evaluator: Evaluator, base: Candidate, fits: list, lost: Counter) -> None:
    """No recompute first; where it fits, recompute and swap can only add time: counted, not evaluated."""
    outcome = evaluator(base)
    if outcome.verdict == "fits":
        fits.append(outcome)
        lost["slower: recompute / swap not needed (fits without)"] += len(RECOMPUTE) - 1
        return
    _count(outcome, lost)
    for recompute in RECOMPUTE[1:]:
        outcome = evaluator(dataclasses.replace(base, recompute=recompute))
        if outcome.verdict == "fits":
            fits.append(outcome)
        else:
            _count(outcome, lost)


def _count(outcome: Outcome, lost: Counter) -> None:
    lost[_oom(outcome) if outcome.verdict == "oom" else f"refused: {outcome.message}"] += 1


TIE = "equal step time, more memory"


def gap(loser: Outcome, best: Outcome) -> str:
    """The part of the step time that makes most of ``loser``'s gap to ``best`` (TIE when there is none: the
    ranking put it after the best for its memory)."""
    if loser.seconds <= best.seconds * (1 + 1e-9):
        return TIE
    parts = loser.step.parts
    return max(parts, key=lambda p: parts[p] - best.step.parts.get(p, 0.0))


# ------------------------------------------------------------------------------------------------ output
def report(plan: Plan, top: int, world: int, device_memory: float, device: str, calibration, out,
           margin: float = DEFAULT_MARGIN) -> None:
    rate = plan.evaluated / plan.seconds if plan.seconds else 0.0
    headroom = (f", peaks kept under {size(int(device_memory * (1 - margin) * GIB))} (--memory-margin {margin:g})"
                if margin else "")
    print(f"plan for {world} ranks of {device_memory:g} GiB on {device}{headroom} "
          f"({'assumed nominal figures' if 'nominal' in calibration.machine else 'calibrated on ' + calibration.host})"
          f": {plan.layouts} layouts, {plan.configurations} configurations after the arithmetic; "
          f"{plan.evaluated} evaluated (bound {plan.bound}) in {plan.seconds:.1f} s ({rate:.0f}/s)", file=out)
    if not plan.ranked:
        return
    best = plan.ranked[0]
    print(f"\nbest {min(top, len(plan.ranked))} (append to the model flags; peak = the largest rank):", file=out)
    for i, o in enumerate(plan.ranked[:top], 1):
        s = o.step
        print(f"{i}. step {s.total * 1e3:.1f} ms, peak {size(o.peak)} — {o.candidate.layout.name()}, "
              f"DP {world // (o.candidate.layout.tp * o.candidate.layout.pp * o.candidate.layout.cp)}, "
              f"{o.candidate.dp_mode}, recompute {o.candidate.recompute}, micro-batch {o.candidate.micro_batch}",
              file=out)
        print(f"   {' '.join(o.candidate.flags())}", file=out)
    lost = Counter(plan.lost)
    for o in plan.ranked[top:]:
        part = gap(o, best)
        lost[part if part == TIE else f"slower: {part}"] += 1
    print("\nwhy the others lost (configurations, by the binding constraint):", file=out)
    for reason, n in sorted(lost.items(), key=lambda kv: -kv[1]):
        print(f"  {n:7d}  {reason}", file=out)
    if plan.pruned:
        print("dropped by the arithmetic (layout branches):", file=out)
        for reason, n in sorted(plan.pruned.items(), key=lambda kv: -kv[1]):
            print(f"  {n:7d}  {reason}", file=out)


def refuse_layout_flags(flags: list[str]) -> None:
    for flag in flags:
        name = flag.split("=", 1)[0]
        if name in LAYOUT_FLAGS:
            raise PlanError(f"{name}: plan chooses it; leave it out of the model flags")


USAGE = ("usage: python -m hyper_adaptor plan --world-size N --device-memory GiB [--device npu|cuda|cpu] "
         "[--top K] [--bound N] [--memory-margin F] [--all] <model flags>")


def _options(argv: list[str]) -> tuple[dict, list[str]]:
    """The planner's own options, the rest the model flags."""
    spec = {"--world-size": int, "--device-memory": float, "--device": str, "--top": int, "--bound": int,
            "--memory-margin": float}
    opts, rest, i = {"--top": 5, "--bound": DEFAULT_BOUND, "--device": "cpu", "--all": False,
                     "--memory-margin": DEFAULT_MARGIN}, [], 0
    while i < len(argv):
        name, _, inline = argv[i].partition("=")
        if name == "--all":
            opts["--all"] = True
        elif name in spec:
            value = inline or (argv[i + 1] if i + 1 < len(argv) else None)
            i += 0 if inline else 1
            if value is None:
                raise PlanError(f"argument {name}: expected a value")
            try:
                opts[name] = spec[name](value)
            except ValueError:
                raise PlanError(f"argument {name}: invalid value {value!r}") from None
        else:
            rest.append(argv[i])
        i += 1
    for name in ("--world-size", "--device-memory"):
        if name not in opts:
            raise PlanError(f"argument {name}: required")
    if opts["--world-size"] < 1:
        raise PlanError(f"argument --world-size: must be >= 1; got {opts['--world-size']}")
    memory_gib = opts["--device-memory"]
    if not (math.isfinite(memory_gib) and memory_gib > 0):
        raise PlanError(f"argument --device-memory: must be a finite number of GiB > 0; got {memory_gib}")
    if opts["--device"] not in DEVICES:
        raise PlanError(f"argument --device: unknown device {opts['--device']!r}; choose from {', '.join(DEVICES)}")
    if opts["--top"] < 1 or opts["--bound"] < 1:
        raise PlanError("argument --top / --bound: must be >= 1")
    margin = opts["--memory-margin"]
    if not (math.isfinite(margin) and 0 <= margin < 1):
        raise PlanError(f"argument --memory-margin: must be a fraction in [0, 1) of --device-memory kept free; "
                        f"got {margin}")
    return opts, rest


def plan(argv: list[str], calibration=None, out=None) -> tuple[int, Plan | None]:
    """(exit status, the plan) of a command line; ``calibration`` replaces ``calibrate.get`` (tests)."""
    out = out or sys.stdout
    try:
        opts, model_flags = _options(argv)
        refuse_layout_flags(model_flags)
    except PlanError as error:
        usage.fail(str(error), PROG)
    world, device = opts["--world-size"], opts["--device"]
    margin = opts["--memory-margin"]
    evaluator = Evaluator(model_flags, world, device, opts["--device-memory"] * (1 - margin) * GIB, calibration)
    evaluator.model  # noqa: B018  (bad model flags end here, before a calibration is measured)
    if calibration is None:  # dry-run's: the cache, or a measurement announced first, or nominal figures
        from hyper_adaptor.dryrun.report import calibration as machine_calibration

        evaluator.calibration = machine_calibration(device, out)
    result = search(model_flags, world, opts["--device-memory"], device, evaluator.calibration,
                    bound=opts["--bound"], evaluator=evaluator)
    if result.configurations == 0:
        reasons = "; ".join(f"{r}" for r in list(result.pruned)[:4])
        usage.fail(f"argument --world-size: no layout of {world} ranks divides this model ({reasons})", PROG)
    report(result, len(result.ranked) if opts["--all"] else opts["--top"], world, opts["--device-memory"], device,
           evaluator.calibration, out, margin)
    if not result.ranked:
        s = result.smallest
        hint = (f"the smallest peak seen is {size(s.peak)} ({s.candidate.layout.name()}, "
                f"{s.candidate.dp_mode}, recompute {s.candidate.recompute}; largest part {s.part})") if s else ""
        print(f"nothing fits in {opts['--device-memory']:g} GiB less {margin:.0%} headroom: {hint}; use more "
              f"devices or devices with more "
              f"memory, a smaller --global-batch-size or --seq-length, or a smaller model", file=out)
        return 1, result
    return 0, result


def main(argv: list[str], out=None) -> int:
    out = out or sys.stdout
    if any(f in ("-h", "--help") for f in argv):
        print(USAGE + "\n\nSearches TP, PP (schedule, VPP), CP (algorithm), EP, DP, the data-parallel engine, "
              "recompute / swap and the micro-batch size; prints the fastest configurations that fit as flag "
              "lines, and why the others lost. docs/features/dry-run.md (plan).", file=out)
        return 0
    return plan(argv, out=out)[0]
