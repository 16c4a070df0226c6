"""--use-hsdp with expert parallelism against megatron's DDP + distributed optimizer at the same layout.

A megatron-core GPT whose every layer is an MoE (4 experts, top-2, aux-loss router, all-to-all
dispatcher, no linear biases; tests/distributed/hsdp_expert_checks.py), 3 Adam steps with gradient
clipping, fp32, every parameter sharded (threshold 0):

* 2 ranks, EP 2 (the expert-DP group is one rank: experts whole, dense parameters over 2), levels 1-3,
  and level 3 with megatron's allgather dispatcher;
* 4 ranks, EP 2 x DP 2 (experts sharded over their 2-rank expert-DP group, dense over 4) at levels 1
  and 3 and level 2 with hybrid sharding of the dense parameters (2 x 2) and --hsdp-comm-async, and
  TP 2 x EP 2 with expert TP 1 at level 3.

Each step's loss and gradient norm within 1e-5 relative of megatron's (the e2e HSDP runs' loss
tolerance; the norms megatron logs to 4 digits), every parameter after the last step within 1e-5;
clipping at 0.5 acts in the first steps only. megatron builds a dense and an expert optimizer (a
ChainedOptimizer) on both sides; under fp16 an inf in one rank's dense or expert gradient shard
makes every rank skip the step.
A run whose expert gradients are averaged over the expert-DP group only (megatron divides by the
data-parallel size) fails that. The model checkpoint moves both ways between HSDP and megatron's DDP
at EP 2 x DP 2 (expert rows at their global offsets under megatron's expert keys), exactly. Before
expert parallelism was served, every HSDP run here was refused (FeatureConfigError).
"""

import pytest

from hyper_adaptor.testing import run_world

pytestmark = pytest.mark.distributed

TARGET = "tests.distributed.hsdp_expert_checks:parity"
RTOL = PARAM_ATOL = 1e-5
EP2 = dict(ep=2)
TP2_ETP1 = dict(ep=2, tp=2, etp=1)
WORLD2 = {"ddp": EP2, **{f"hsdp-{level}": dict(EP2, hsdp=level) for level in ("level1", "level2", "level3")},
          # megatron's other dispatcher (the same tokens reach the same experts; compared with all-to-all's DDP run)
          "hsdp-level3-allgather": dict(EP2, hsdp="level3", dispatcher="allgather")}


def _world4(tmpdir: str) -> dict:
    return {
        "ddp": dict(EP2, save=f"{tmpdir}/ddp"),
        "ddp-tp2-etp1": TP2_ETP1,
        "hsdp-level1": dict(EP2, hsdp="level1"),
        "hsdp-level3": dict(EP2, hsdp="level3", save=f"{tmpdir}/hsdp"),
        "hsdp-level2-hybrid-async": dict(EP2, hsdp="level2", shard=2, comm_async=True),
        "hsdp-level3-tp2-etp1": dict(TP2_ETP1, hsdp="level3"),
        "wrong-expert-scale": dict(EP2, hsdp="level3", wrong_expert_scale=True, steps=1),
        # fp16: an inf in one gradient shard of rank 0 (no step taken)
        "overflow-in-a-dense-shard": dict(EP2, hsdp="level3", fp16=65536.0, overflow_in="dense"),
        "overflow-in-an-expert-shard": dict(EP2, hsdp="level3", fp16=65536.0, overflow_in="expert"),
        # a checkpoint of one loaded by the other, no step taken: the parameters must be the saver's
        "hsdp-checkpoint-into-ddp": dict(EP2, load=f"{tmpdir}/hsdp", steps=0),
        "ddp-checkpoint-into-hsdp": dict(EP2, hsdp="level2", shard=2, load=f"{tmpdir}/ddp", steps=0),
    }


BASELINE = {"hsdp-level3-tp2-etp1": "ddp-tp2-etp1", "wrong-expert-scale": "ddp"}
WORLD4_PARITY = ["hsdp-level1", "hsdp-level3", "hsdp-level2-hybrid-async", "hsdp-level3-tp2-etp1"]


@pytest.fixture(scope="module")
def world2():
    return run_world(2, TARGET, timeout=300, runs=WORLD2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    tmpdir = str(tmp_path_factory.mktemp("hsdp_experts"))
    return run_world(4, TARGET, timeout=420, daemon=False, runs=_world4(tmpdir))


def differences(got: dict, want: dict) -> list[str]:
    """Where an HSDP run differs from megatron's beyond the tolerances (empty: it matches)."""
    if isinstance(got, str):
        return [got[:600]]
    bad = []
    for what in ("loss", "grad_norm"):
        if len(got[what]) != len(want[what]) or not want[what]:
            bad.append(f"{what}: {got[what]} vs {want[what]}")
        bad += [f"step {i} {what}: {g!r} vs {w!r}" for i, (g, w) in enumerate(zip(got[what], want[what]))
                if not abs(g - w) <= RTOL * abs(w)]
    if set(got["params"]) != set(want["params"]):
        bad.append(f"parameter names differ: {sorted(set(got['params']) ^ set(want['params']))[:4]}")
    for name, value in want["params"].items():
        diff = (got["params"][name] - value).abs().max().item() if name in got["params"] else float("nan")
        if not diff <= PARAM_ATOL:
            bad.append(f"{name}: max |diff| {diff:.3g}")
    return bad


@pytest.mark.parametrize("name", [n for n in WORLD2 if n != "ddp"])
def test_ep2_on_two_ranks_matches_megatron_ddp(world2, name):
    for rank, results in enumerate(world2):
        assert differences(results[name], results["ddp"]) == [], (rank, name)
        # one rank per expert-DP group: experts whole there, dense parameters over both ranks
        assert results[name]["layout"] == {"dense": [(2, True)], "expert": [(1, False)]}
        assert results[name]["optimizers"] == results["ddp"]["optimizers"] == 2  # dense + expert


@pytest.mark.parametrize("name", WORLD4_PARITY)
def test_ep2_dp2_on_four_ranks_matches_megatron_ddp(world4, name):
    for rank, results in enumerate(world4):
        assert differences(results[name], results[BASELINE.get(name, "ddp")]) == [], (rank, name)
        assert results[name]["optimizers"] == 2


def test_experts_are_sharded_over_the_expert_data_parallel_group(world4):
    for results in world4:
        assert results["hsdp-level3"]["layout"] == {"dense": [(4, True)], "expert": [(2, True)]}
        # hybrid: the dense parameters on a 2 x 2 mesh; the shard size (2) is the whole expert-DP group
        assert results["hsdp-level2-hybrid-async"]["layout"] == {"dense": [(4, True)], "expert": [(2, True)]}
        # TP 2: data parallel is 2 ranks; expert TP 1 x EP 2 leaves 2 for expert data parallel
        assert results["hsdp-level3-tp2-etp1"]["layout"] == {"dense": [(2, True)], "expert": [(2, True)]}


def test_expert_gradients_averaged_over_their_own_group_only_are_caught(world4):
    for results in world4:
        wrong = results["wrong-expert-scale"]
        assert not isinstance(wrong, str), wrong[:600]
        assert not abs(wrong["grad_norm"][0] - results["ddp"]["grad_norm"][0]) <= RTOL * results["ddp"]["grad_norm"][0]


@pytest.mark.parametrize("name", ["overflow-in-a-dense-shard", "overflow-in-an-expert-shard"])
def test_an_overflow_in_one_shard_skips_the_step_on_every_rank(world4, name):
    assert [results[name]["planted"] for results in world4] == [True, False, False, False]
    assert [results[name]["found_inf"] for results in world4] == [True] * 4


@pytest.mark.parametrize("saved, loaded", [("hsdp-level3", "hsdp-checkpoint-into-ddp"),
                                           ("ddp", "ddp-checkpoint-into-hsdp")])
def test_model_checkpoints_move_between_hsdp_and_megatron_ddp(world4, saved, loaded):
    for rank, results in enumerate(world4):
        got, want = results[loaded], results[saved]
        assert not isinstance(got, str), got[:600]
        assert got["loss"] == []  # loaded, no step taken
        for name, value in want["params"].items():
            assert got["params"][name].equal(value), (rank, name)
