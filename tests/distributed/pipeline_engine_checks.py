"""Pipeline engine checks (hyper_adaptor.parallel.pipeline), run inside one gloo world per size.

Every rank builds the same seeded MLP (LAYERS x (Linear + GELU), hidden HIDDEN), cuts it into the stages
of the case's layout, and runs the library schedule on the same seeded micro-batches; the single-process
reference is the whole model on the same micro-batches with the same loss, ``sum(losses).backward()`` (the
library's convention). Each case returns max-abs errors of the losses (last stage's rank), the merged output
and every parameter gradient of this rank's stages; the test asserts them (fp32, 1e-6). Hand-broken lists
must raise ScheduleError on every rank before any communication: the time to the error comes back too.

    PYTHONPATH=. python tests/distributed/pipeline_engine_checks.py   # both worlds, prints the results
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HIDDEN, LAYERS, ROWS = 16, 8, 2  # ROWS per micro-batch
TOL = 1e-6

# (name, micro-batches, options); names: schedule[-variant]-m<m>
CASES = {
    "gpipe": [(1, {}), (3, {}), (8, {})],
    "1f1b": [(1, {}), (2, {}), (5, {}), (8, {}), (5, {"overlap_p2p": True})],
    "interleaved": [(1, {}), (3, {}), (4, {}), (6, {}), (8, {}), (6, {"overlap_p2p": True}),
                    (4, {"overlap_b_f": True}), (6, {"overlap_b_f": True}),
                    (8, {"overlap_b_f": True, "overlap_p2p": True})],
    "zbh1": [(1, {}), (3, {}), (8, {}), (8, {"overlap_p2p": True})],
    "zbv": [(1, {}), (3, {}), (5, {}), (8, {}), (8, {"overlap_p2p": True})],
}


def case_id(name: str, m: int, opts: dict) -> str:
    extra = "".join(f"-{k.removeprefix('overlap_')}" for k in sorted(opts))
    return f"{name}{extra}-m{m}"


CASE_IDS = [case_id(n, m, o) for n, cases in CASES.items() for m, o in cases]


def loss_fn(out, target):
    return F.mse_loss(out, target)


def full_model() -> nn.Sequential:
    torch.manual_seed(1234)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.GELU()]
    return nn.Sequential(*layers)


def data(m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m * ROWS, HIDDEN, generator=g), torch.randn(m * ROWS, HIDDEN, generator=g)


def stage_slice(model: nn.Sequential, s: int, num_stages: int) -> nn.Sequential:
    per = 2 * LAYERS // num_stages
    return nn.Sequential(*list(model)[per * s: per * (s + 1)])


def reference(m: int, x, target, steps: int = 1):
    model = full_model()
    losses, outs = [], []
    for _ in range(steps):
        micro = list(zip(torch.tensor_split(x, m), torch.tensor_split(target, m)))
        step_losses = [loss_fn(model(xm), tm) for xm, tm in micro]
        sum(step_losses).backward()
        losses += [loss.detach() for loss in step_losses]
        with torch.no_grad():
            outs = [model(xm) for xm, _ in micro]
    return model, losses, torch.cat(outs)


def _layout(name: str, p: int):
    from hyper_adaptor.parallel.pipeline import StageLayout

    if name == "zbv":
        return StageLayout(p, 2, "v")
    return StageLayout(p, 2 if name == "interleaved" else 1)


def _schedule_class(name: str):
    from hyper_adaptor.parallel import pipeline as pp

    return {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B, "interleaved": pp.ScheduleInterleaved1F1B,
            "zbh1": pp.ScheduleZBH1, "zbv": pp.ScheduleZBV}[name]


def make_stages(name: str, p: int, rank: int):
    from hyper_adaptor.parallel.pipeline import PipelineStage

    layout = _layout(name, p)
    model = full_model()
    return layout, [PipelineStage(copy.deepcopy(stage_slice(model, s, layout.num_stages)), s, layout.num_stages)
                    for s in layout.stages_of(rank)]


def _max_err(got, want) -> float:
    return (got - want).abs().max().item()


def run_case(rank: int, p: int, name: str, m: int, opts: dict, *, steps: int = 1) -> dict:
    layout, stages = make_stages(name, p, rank)
    kwargs = {k: v for k, v in opts.items()}
    schedule = _schedule_class(name)(stages if len(stages) > 1 else stages[0], m, loss_fn, **kwargs)
    x, target = data(m, seed=m)
    holds_first, holds_last = 0 in schedule.stages, layout.num_stages - 1 in schedule.stages
    losses = []
    for _ in range(steps):
        out = schedule.step(*((x,) if holds_first else ()), target=target if holds_last else None, losses=losses)
    ref_model, ref_losses, ref_out = reference(m, x, target, steps)
    result = {"grad_err": 0.0, "loss_err": None, "out_err": None, "routed": [], "peak_live": {}}
    for st in stages:
        ref_part = stage_slice(ref_model, st.stage_index, layout.num_stages)
        for a, b in zip(st.module.parameters(), ref_part.parameters()):
            result["grad_err"] = max(result["grad_err"], _max_err(a.grad, b.grad))
        result["routed"].append(any("forward" in mod.__dict__ for mod in st.module.modules()))
        result["peak_live"][st.stage_index] = st.peak_live_micro_batches
    if holds_last:
        result["loss_err"] = _max_err(torch.stack(losses), torch.stack(ref_losses)) if len(losses) == len(
            ref_losses) else float("inf")
        result["out_err"] = _max_err(out, ref_out)
    else:
        result["out_none"] = out is None
    result["grads"] = {st.stage_index: [q.grad.clone() for q in st.module.parameters()] for st in stages}
    return result


def forward_only_case(rank: int, p: int) -> dict:
    """loss_fn=None: an inference schedule; the merged output equals the model's."""
    layout, stages = make_stages("1f1b", p, rank)
    schedule = _schedule_class("1f1b")(stages[0], 4, None)
    x, _ = data(4, seed=7)
    out = schedule.run(*((x,) if 0 in schedule.stages else ()))
    grads_none = all(q.grad is None for st in stages for q in st.module.parameters())
    if layout.num_stages - 1 in schedule.stages:
        with torch.no_grad():
            return {"out_err": _max_err(out, full_model()(x)), "grads_none": grads_none}
    return {"out_err": 0.0 if out is None else float("inf"), "grads_none": grads_none}


def broken_lists(rank: int, p: int) -> dict:
    """Hand-broken action lists are refused on every rank, before any communication."""
    from hyper_adaptor.parallel.pipeline import MetaStepType as T
    from hyper_adaptor.parallel.pipeline import ScheduleError, build, schedule_from_actions

    out = {}
    layout, stages = make_stages("gpipe", p, rank)

    def attempt(key, lists):
        start = time.perf_counter()
        try:
            schedule_from_actions(stages, lists, layout, 2, loss_fn)
            out[key] = ("accepted", time.perf_counter() - start)
        except ScheduleError as e:
            out[key] = (str(e), time.perf_counter() - start)

    _, lists = build("gpipe", p, 2)
    missing = [list(a) for a in lists]
    missing[1] = [a for a in missing[1] if not (a.step_type is T.RECV_F and a.micro_index == 1)]
    attempt("missing_receive", missing)

    crossed = [list(a) for a in lists]
    r0 = crossed[0]
    first = next(i for i, a in enumerate(r0) if a.step_type is T.SEND_F and a.micro_index == 0)
    send0 = r0.pop(first)
    second = next(i for i, a in enumerate(r0) if a.step_type is T.SEND_F and a.micro_index == 1)
    r0.insert(second + 1, send0)
    attempt("crossed_order", crossed)

    both_receive = [list(a) for a in lists]  # rank 0 waits for a gradient before it sent any activation
    r0 = both_receive[0]
    rb = next(i for i, a in enumerate(r0) if a.step_type is T.RECV_B)
    r0.insert(0, r0.pop(rb))
    attempt("deadlock", both_receive)
    dist.barrier()  # every rank got here: nobody was left waiting in a send or receive
    return out


def wrong_stage_count(rank: int, p: int) -> str:
    layout, stages = make_stages("1f1b", p, rank)
    try:
        _schedule_class("interleaved")(stages, 4, loss_fn)  # interleaved with one chunk: refused somewhere
        _schedule_class("zbv")(stages, 4, loss_fn)
    except ValueError as e:
        return str(e)
    return "accepted"


def engine_checks(rank: int, world_size: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    results, times = {}, {}
    for name, cases in CASES.items():
        for m, opts in cases:
            key = case_id(name, m, opts)
            start = time.perf_counter()
            results[key] = run_case(rank, world_size, name, m, opts)
            times[key] = time.perf_counter() - start
    grads = {k: r.pop("grads") for k, r in results.items()}
    # deferred W (zbh1, split I/W) against immediate B (1f1b): the same micro-batches, the same gradients
    deferred_vs_immediate = max(
        _max_err(a, b) for s in grads["zbh1-m8"] for a, b in zip(grads["zbh1-m8"][s], grads["1f1b-m8"][s]))
    two_steps = run_case(rank, world_size, "1f1b", 4, {}, steps=2)
    two_steps.pop("grads")
    return {
        "cases": results, "times": times, "deferred_vs_immediate": deferred_vs_immediate,
        "two_steps": two_steps, "forward_only": forward_only_case(rank, world_size),
        "broken": broken_lists(rank, world_size), "wrong_stage_count": wrong_stage_count(rank, world_size),
    }


if __name__ == "__main__":
    from hyper_adaptor.testing import run_world

    for n in (2, 4):
        start = time.perf_counter()
        res = run_world(n, "tests.distributed.pipeline_engine_checks:engine_checks", timeout=300)
        print(f"world {n}: {time.perf_counter() - start:.1f}s")
        for rank, r in enumerate(res):
            bad = {k: v for k, v in r["cases"].items()
                   if v["grad_err"] > TOL or (v["loss_err"] or 0) > TOL or (v["out_err"] or 0) > TOL}
            print(rank, "bad:", bad or "none", "| d/i", r["deferred_vs_immediate"], "| two", r["two_steps"]["grad_err"],
                  "| fwd-only", r["forward_only"], "| broken", {k: (v[0][:70], round(v[1], 3)) for k, v in
                                                               r["broken"].items()}, "|", r["wrong_stage_count"][:80])
            print("   slowest", sorted(r["times"].items(), key=lambda kv: -kv[1])[:3])
