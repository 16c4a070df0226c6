"""``python -m hyper_adaptor plan``: the enumeration and its arithmetic pruning on hand-checkable cases, every
printed flag line parsed back and predicted again, bad input (one line naming it, exit 2), the refusal of
layout flags, a model whose only fitting layouts need PP or recompute, the shortened schedule lists the search
builds, and the reused parser. The step times use a fixed calibration, never a measurement."""

import io
import re
import socket
from collections import Counter

import pytest

import hyper_adaptor.megatron_adaptor  # noqa: F401  (level 0 first: megatron imports on CPU)
from hyper_adaptor.dryrun import calibrate, memory, parse, plan, timing
from hyper_adaptor.dryrun.plan import Candidate, Layout, Model
from hyper_adaptor.dryrun.shape import parser as shape_parser

MODEL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 32 "
         "--max-position-embeddings 32 --global-batch-size 8 --lr 3e-3 --tokenizer-type NullTokenizer "
         "--vocab-size 257").split()


def fixed_calibration() -> calibrate.Calibration:
    """Round figures: 1 TFLOP/s at every size, 100 GB/s, a 10 us link of 10 GB/s, 1 ms per layer."""
    import torch

    return calibrate.Calibration(
        device="cpu", host=socket.gethostname(), machine="fixed (test)", torch_version=torch.__version__, threads=1,
        cores=1024, matmul={"float32": [[1.0, 1e12], [4096.0, 1e12]]}, memory_bytes_per_s=1e11,
        layer_overhead_s=1e-3, collectives={op: {"latency_s": 1e-5, "bytes_per_s": 1e10}
                                            for op in calibrate.COLLECTIVES})


def small(**changes) -> Model:
    base = dict(layers=4, heads=4, kv_heads=4, ffn=256, seq=32, global_batch=8, experts=0, moe_ffn=256, untied=False)
    return Model(**{**base, **changes})


# ------------------------------------------------------------------------------------------- enumeration
def test_layouts_of_four_ranks_by_hand():
    pruned = Counter()
    found = plan.layouts(small(heads=6, kv_heads=6, ffn=252, layers=6, seq=20), 4, pruned)
    # TP 4 cannot split 6 heads; PP 4 cannot split 6 layers; CP 4 cannot split 20 tokens into 8 chunks;
    # VPP 2 at PP 2 would need 6 % 4; VPP 3 at PP 2 is fine (6 layers = 2 stages x 3 chunks)
    assert pruned["does not divide: heads 6 % TP 4"] == 1
    assert pruned["does not divide: layers 6 % PP 4"] == 1
    assert pruned["does not divide: seq 20 % (2 x CP 4)"] == 1
    assert pruned["does not divide: layers 6 % (PP 2 x VPP 2)"] == 2   # at TP 1 and TP 2
    # TP 2: 6 / 2 = 3 heads per rank, not a multiple of CP 2 for Ulysses
    assert pruned["does not divide: heads/TP 3 % CP 2 (ulysses)"] == 1
    assert {lay.tp for lay in found} == {1, 2} and {lay.pp for lay in found} == {1, 2}
    assert {(lay.vpp, lay.schedule) for lay in found if lay.pp == 2} == {(1, ""), (1, "gpipe"), (1, "zbh1"), (3, "")}
    tp1_pp1 = sorted((lay.cp, lay.algo) for lay in found if lay.tp == 1 and lay.pp == 1)
    assert tp1_pp1 == [(1, ""), (2, "allgather"), (2, "ring"), (2, "ulysses")]
    # every layout's ranks: TP x PP x CP divides the world
    assert all(4 % (lay.tp * lay.pp * lay.cp) == 0 for lay in found)


def test_zbv_needs_untied_weights_and_experts_need_ep_to_divide():
    pruned = Counter()
    tied = plan.layouts(small(), 2, pruned)
    assert not any(lay.schedule == "zbv" for lay in tied) and pruned[next(k for k in pruned if "zbv" in k)] == 1
    untied = plan.layouts(small(untied=True), 2, Counter())
    assert any(lay.schedule == "zbv" and lay.vpp == 2 for lay in untied)
    pruned = Counter()
    # 6 experts on a stage of 4 ranks at TP 1: EP 1 and 2; 4 does not divide 6 experts, 3 and 6 not 4 ranks
    assert plan.expert_sizes(small(experts=6, moe_ffn=64), 4, 1, pruned) == [1, 2]
    assert pruned == Counter({"does not divide: experts 6 % EP 4": 1,
                              "does not divide: ranks per stage 4 % (ETP 1 x EP 3)": 1,
                              "does not divide: ranks per stage 4 % (ETP 1 x EP 6)": 1})
    # at TP 2 the experts' tensor-parallel size is 2: EP 2 needs 4 ranks, EP 3 would need 6
    assert plan.expert_sizes(small(experts=6, moe_ffn=64), 4, 2, Counter()) == [1, 2]
    moe = plan.layouts(small(experts=6, moe_ffn=64), 4, Counter())
    assert {lay.ep for lay in moe if lay.tp == 1 and lay.pp == 1 and lay.cp == 1} == {1, 2}


def test_micro_batch_sizes_divide_the_global_batch():
    pruned = Counter()
    layout = Layout(tp=1, pp=1)
    assert plan.micro_batches(small(global_batch=12), layout, 4, pruned) == [1]
    assert pruned["does not divide: global batch 12 % (micro-batch 2 x DP 4)"] == 1
    assert plan.micro_batches(small(global_batch=16), layout, 4) == [1, 2, 4]
    assert plan.dp_modes(Layout(tp=2, pp=2), 4) == ["ddp"]
    assert plan.dp_modes(Layout(tp=1, pp=2, schedule="zbh1"), 4) == ["ddp", "distopt"]


def test_candidate_flags_are_megatrons_and_the_adaptors():
    c = Candidate(Layout(tp=2, pp=2, vpp=2, schedule="zbv", cp=4, algo="hybrid", ulysses=2, ep=2), 2,
                  "hsdp-level3", "full")
    assert " ".join(c.flags()) == (
        "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 "
        "--num-virtual-stages-per-pipeline-rank 2 --pipeline-schedule zbv --context-parallel-size 4 "
        "--context-parallel-algo hybrid --ulysses-degree-in-cp 2 --expert-model-parallel-size 2 "
        "--micro-batch-size 2 --use-hsdp --hsdp-optimizer-level level3 --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1")


# ------------------------------------------------------------------------------------------- the output
def run_plan(argv, calibration=None):
    out = io.StringIO()
    code, result = plan.plan(argv, calibration=calibration or fixed_calibration(), out=out)
    return code, result, out.getvalue()


LINE = re.compile(r"^\d+\. step ([\d.]+) ms, peak ([\d.]+) (GiB|MiB)")


def test_every_printed_line_parses_back_and_predicts_what_it_shows():
    cal = fixed_calibration()
    code, result, text = run_plan([*MODEL, "--world-size", "2", "--device-memory", "1", "--top", "5",
                                   "--bound", "40"], cal)
    assert code == 0, text
    lines = text.splitlines()
    shown = [(LINE.match(line), lines[i + 1].split()) for i, line in enumerate(lines) if LINE.match(line)]
    assert len(shown) == 5
    times = []
    for match, flags in shown:
        args = parse(MODEL + flags, 2, "cpu")
        prediction = memory.predict(args)
        peak = max(r.peak for r in prediction.ranks)
        step = timing.predict_time(args, cal)
        assert float(match.group(1)) == pytest.approx(step.total * 1e3, abs=0.051)
        unit = 2 ** 30 if match.group(3) == "GiB" else 2 ** 20
        assert float(match.group(2)) == pytest.approx(peak / unit, abs=0.051 if unit == 2 ** 20 else 0.00051)
        times.append(step.total)
    assert times == sorted(times)                                 # fastest first
    assert "evaluated (bound 40)" in text and "why the others lost" in text
    assert result.evaluated <= 40 + 3                               # the last no-recompute one may add 3
    assert result.lost["not evaluated (search bound 40)"] > 0      # the bound cut this search
    assert len(result.ranked) + sum(result.lost.values()) == result.configurations


def test_the_losers_are_grouped_by_what_bound_them():
    code, result, text = run_plan([*MODEL, "--world-size", "2", "--device-memory", "0.004", "--bound", "400"])
    assert code == 0
    reasons = "\n".join(text.split("why the others lost")[1].splitlines())
    assert "out of memory: largest part" in reasons
    assert re.search(r"slower: (compute|bubble|tp_comm|cp_comm|dp_comm|pp_comm|optimizer|recompute|framework)",
                     reasons)
    best = result.ranked[0]
    assert best.peak <= 0.004 * 2 ** 30
    # every configuration of the space is either ranked or lost for one reason
    assert len(result.ranked) + sum(result.lost.values()) == result.configurations
    # gap(): the part that makes most of a loser's difference
    loser = result.ranked[-1]
    part = plan.gap(loser, best)
    diffs = {p: loser.step.parts[p] - best.step.parts[p] for p in loser.step.parts}
    assert loser.seconds > best.seconds and diffs[part] == max(diffs.values())
    assert plan.gap(best, best) == plan.TIE


def test_probes_reach_every_degree_of_parallelism_before_a_second_layout_of_one():
    class Spy(plan.Evaluator):
        def _evaluate(self, candidate, timed):
            seen.append(candidate)
            return super()._evaluate(candidate, timed)

    seen = []
    cal = fixed_calibration()
    evaluator = Spy(MODEL, 8, "cpu", 2 ** 40, cal)
    result = plan.search(MODEL, 8, 1024.0, "cpu", cal, bound=40, evaluator=evaluator)
    layouts = plan.layouts(evaluator.model, 8, Counter())
    degrees = {(lay.tp, lay.pp, lay.cp, lay.ep) for lay in layouts}
    assert len(layouts) > 20 > len(degrees) > 4                  # the bound's probes (20) cannot see every layout
    probes = [c.layout for c in seen[:len(degrees)]]
    # the first probes: one layout of each TP x PP x CP x EP, the least model parallelism first
    assert {(lay.tp, lay.pp, lay.cp, lay.ep) for lay in probes} == degrees
    sizes = [lay.tp * lay.pp * lay.cp for lay in probes]
    assert sizes == sorted(sizes)
    assert result.lost["not evaluated (search bound 40)"] > 0


def test_validation_bench_helpers():
    from bench.plan_validate import spearman, spread

    assert spread(100, 30)[0] == 0 and spread(100, 30)[-1] == 99 and len(spread(100, 30)) == 30
    assert spread(3, 30) == [0, 1, 2]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [5, 5, 6]) == pytest.approx(0.8660254)   # ties take the mean rank


def test_only_pipeline_or_recompute_fits():
    # 3 heads: no TP 2; 34 tokens: no CP 2 (34 % 4); long sequence: the attention scores dominate the peak
    model = ("--num-layers 4 --hidden-size 48 --num-attention-heads 3 --ffn-hidden-size 96 --seq-length 34 "
             "--max-position-embeddings 34 --global-batch-size 4 --lr 3e-3 --tokenizer-type NullTokenizer "
             "--vocab-size 64").split()
    evaluator = plan.Evaluator(model, 2, "cpu", 1e18, fixed_calibration())
    flat = [evaluator(Candidate(Layout(1, 1), b, mode), timed=False).peak
            for b in (1, 2) for mode in plan.DP_MODES]
    limit = min(flat) * 0.98 / 2 ** 30                            # every PP 1 configuration without recompute: over
    code, result, text = run_plan([*model, "--world-size", "2", "--device-memory", str(limit), "--bound", "400"])
    assert code == 0, text
    assert result.ranked and all(o.candidate.layout.pp > 1 or o.candidate.recompute != "none"
                                 for o in result.ranked)
    assert {o.candidate.layout.tp for o in result.ranked} == {1}
    assert any(o.candidate.layout.pp > 1 for o in result.ranked)
    assert any(o.candidate.recompute != "none" for o in result.ranked)


def test_the_memory_margin_keeps_headroom_under_the_device_memory():
    cal = fixed_calibration()
    _, roomy, _ = run_plan([*MODEL, "--world-size", "2", "--device-memory", "1", "--bound", "60", "--all"], cal)
    best = roomy.ranked[0]
    limit = best.peak / 0.95 / 2 ** 30          # the best peak is 95 % of this limit: inside it, not 10 % under
    code, tight, text = run_plan([*MODEL, "--world-size", "2", "--device-memory", str(limit), "--bound", "60",
                                  "--all"], cal)
    assert "--memory-margin 0.1" in text.splitlines()[0]
    assert best.candidate not in {o.candidate for o in tight.ranked}
    assert all(o.peak <= 0.9 * limit * 2 ** 30 for o in tight.ranked)
    _, none, _ = run_plan([*MODEL, "--world-size", "2", "--device-memory", str(limit), "--bound", "60", "--all",
                           "--memory-margin", "0"], cal)
    assert best.candidate in {o.candidate for o in none.ranked}


def test_nothing_fits_is_exit_1_with_what_to_change():
    code, result, text = run_plan([*MODEL, "--world-size", "2", "--device-memory", "0.00001", "--bound", "60"])
    assert code == 1 and not result.ranked
    assert "nothing fits in 1e-05 GiB less 10% headroom: the smallest peak seen is" in text and "more devices" in text


# --------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv, named", [
    (["--device-memory", "8"], "--world-size"),
    (["--world-size", "2"], "--device-memory"),
    (["--world-size", "2", "--device-memory", "8", "--device", "tpu"], "--device"),
    (["--world-size", "2", "--device-memory", "-3"], "--device-memory"),
    (["--world-size", "7", "--device-memory", "8"], "--world-size"),     # 7 ranks: nothing divides
    (["--world-size", "2", "--device-memory", "8", "--no-such-flag"], "--no-such-flag"),
    (["--world-size", "2", "--device-memory", "8", "--tensor-model-parallel-size", "2"],
     "--tensor-model-parallel-size: plan chooses it"),
    (["--world-size", "2", "--device-memory", "8", "--recompute-granularity=full"], "--recompute-granularity"),
    (["--world-size", "2", "--device-memory", "8", "--micro-batch-size", "2"], "--micro-batch-size"),
    (["--world-size", "2", "--device-memory", "8", "--memory-margin", "1.5"], "--memory-margin"),
])
def test_bad_input_is_one_line_naming_it(capsys, argv, named):
    with pytest.raises(SystemExit) as ended:
        run_plan([*MODEL, *argv])
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith("hyper_adaptor plan: error:") and named in err, err
    assert "Traceback" not in err


def test_the_command_line_dispatches(capsys):
    from hyper_adaptor import cli

    assert cli.main(["plan", "--help"]) == 0
    assert "--device-memory" in capsys.readouterr().out
    cli.main(["--help"])
    assert "hyper_adaptor plan" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ what it reuses
@pytest.mark.parametrize("name, chunks", [("zbh1", None), ("zbv", 2), ("1f1b", None), ("interleaved", 2)])
@pytest.mark.parametrize("pp", [2, 4])
def test_shortened_lists_keep_the_in_flight_peaks(name, chunks, pp):
    from hyper_adaptor.parallel.pipeline import schedules, timeline

    for micro in (4 * pp + 1, 5 * pp, 6 * pp + 3):
        short = schedules.steady_micro(name, pp, micro)
        assert short < micro and short % pp == micro % pp
        whole = timeline.inflight_peaks(schedules.build(name, pp, micro, chunks)[1])
        steady = timeline.inflight_peaks(schedules.build(name, pp, short, chunks)[1])
        assert whole == steady


def test_memory_under_the_shortened_lists_is_the_whole_lists(monkeypatch):
    from hyper_adaptor.parallel.pipeline import schedules

    flags = [*MODEL, "--global-batch-size", "40", "--micro-batch-size", "1", "--pipeline-model-parallel-size", "2",
             "--untie-embeddings-and-output-weights", "--num-virtual-stages-per-pipeline-rank", "2",
             "--pipeline-schedule", "zbv"]
    assert schedules.steady_micro("zbv", 2, 40) < 40  # the model builds the shortened lists here
    shortened = [r.peak for r in memory.predict(parse(flags, 2)).ranks]
    monkeypatch.setattr(schedules, "steady_micro", lambda name, ranks, micro: micro)
    memory._steady_lists.cache_clear()
    try:
        assert [r.peak for r in memory.predict(parse(flags, 2)).ranks] == shortened
    finally:
        memory._steady_lists.cache_clear()


def test_a_reused_parser_gives_the_namespace_of_a_fresh_one():
    parser = shape_parser(plan.PROG)
    for extra in (["--micro-batch-size", "1", "--recompute-granularity", "selective"],
                  ["--micro-batch-size", "2", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
                  ["--micro-batch-size", "1"]):
        fresh = vars(parse(MODEL + extra, 2))
        reused = vars(parse(MODEL + extra, 2, parser=parser))
        assert {k: v for k, v in reused.items() if k != "dryrun_adjustments"} == \
            {k: v for k, v in fresh.items() if k != "dryrun_adjustments"}
    # a check that changes a default list in place changes it for its namespace only
    first = parse(MODEL + ["--micro-batch-size", "1"], 2, parser=parser)
    lists = [k for k, v in vars(first).items() if isinstance(v, list)]
    for k in lists:
        getattr(first, k).append("changed")
    second = parse(MODEL + ["--micro-batch-size", "1"], 2, parser=parser)
    assert not any("changed" in getattr(second, k) for k in lists if isinstance(getattr(second, k), list))
