"""megatron's --optimizer-cpu-offload served by hyper_adaptor's OffloadOptimizer
(hyper_adaptor/patches/memory/), 2 gloo ranks, one world for every check
(tests/distributed/optimizer_offload_checks.py).

gpt_parity's tiny GPT, 3 Adam steps at DP2, with megatron's own optimizer and with the offload seam:
megatron's DDP with FP32Optimizer, the distributed optimizer, bf16 and fp16
(Float16OptimizerWithFloat16Params, whose fp32 main copies the offload releases), bf16 with the
distributed optimizer, and HSDP (levels 2 and 3, fp32 and bf16: megatron's optimizer over DTensor
shards); and megatron's precision-aware path (bf16 + distributed optimizer +
--use-precision-aware-optimizer, OffloadedHybridOptimizer) against the plain bf16 distributed optimizer.
Tolerance: none — losses and every parameter after every step bitwise equal (the offloaded step is
torch's AdamW on an fp32 copy of the same fp32 tensor). The optimizer state is counted by
the engine's own accounting (``state_bytes``): on this CPU machine host and device are the same
memory, so what is checked is which tier the engine keeps each tensor on.
"""

import pytest

from hyper_adaptor.testing import run_world

pytestmark = pytest.mark.distributed

RUNS = ["ddp", "distopt", "bf16", "fp16", "bf16-distopt", "hsdp", "hsdp-bf16", "hsdp-level3", "hsdp-level3-bf16"]
PRECISION_AWARE = ["bf16-distopt-pa", "bf16-distopt-pa-half", "fp16-distopt-pa"]
RESUMED = ["ddp", "distopt", "bf16", "hsdp", "hsdp-bf16"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # daemon=False: megatron's checkpoint writer starts processes of its own
    ranks = run_world(2, "tests.distributed.optimizer_offload_checks:all_checks", timeout=420, daemon=False,
                      tmpdir=str(tmp_path_factory.mktemp("optimizer_offload")))
    return ranks[0]


def _differences(want: list, got: list) -> list[str]:
    import torch

    if len(want) != len(got) or not want:
        return [f"{len(got)} steps logged against {len(want)}"]
    problems = []
    for step, (a, b) in enumerate(zip(want, got)):
        if a["loss"] != b["loss"]:
            problems.append(f"step {step}: loss {b['loss']!r} vs {a['loss']!r}")
        if set(a["params"]) != set(b["params"]):
            problems.append(f"step {step}: parameter names differ")
            continue
        problems += [f"step {step}: {name} differs by {(a['params'][name] - b['params'][name]).abs().max().item():.3g}"
                     for name in a["params"] if not torch.equal(a["params"][name], b["params"][name])]
    return problems


@pytest.mark.parametrize("name", RUNS)
def test_offload_equals_megatrons_optimizer_bitwise(results, name):
    run = results["runs"][name]
    reference, offload = run["reference"], run["offload"]
    assert reference["inner"] != "OffloadedTorchOptimizer"  # the reference is megatron's own
    assert offload["inner"] == "OffloadedTorchOptimizer"
    assert offload["wrapper"] == reference["wrapper"]  # megatron's wrapper for the config, unchanged
    assert _differences(reference["history"], offload["history"]) == []


def test_the_runs_cover_megatrons_three_optimizer_wrappers(results):
    wrappers = {name: results["runs"][name]["reference"]["wrapper"] for name in RUNS}
    assert wrappers == {"ddp": "FP32Optimizer", "distopt": "DistributedOptimizer",
                        "bf16": "Float16OptimizerWithFloat16Params", "fp16": "Float16OptimizerWithFloat16Params",
                        "bf16-distopt": "DistributedOptimizer",
                        "hsdp": "FP32Optimizer", "hsdp-bf16": "Float16OptimizerWithFloat16Params",
                        "hsdp-level3": "FP32Optimizer", "hsdp-level3-bf16": "Float16OptimizerWithFloat16Params"}


@pytest.mark.parametrize("name", RUNS)
def test_state_and_masters_live_on_the_host_tier(results, name):
    offload = results["runs"][name]["offload"]
    assert offload["offloaded"] == offload["total"] > 0  # fraction 1: every element this rank steps
    # Adam's two fp32 moments, the fp32 master and its gradient buffer: 16 bytes per element, none on the device
    assert offload["state_bytes"] == {"device": 0, "host": 16 * offload["total"]}
    assert offload["host_state_devices"] == ["cpu"]
    # megatron's wrapper sees every parameter's state through the view (its checkpoints read it there)
    assert offload["params_with_state"] == offload["params"]
    assert offload["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]


def test_shards_are_what_is_offloaded(results):
    # the distributed optimizer and HSDP step this rank's half of the elements
    runs = results["runs"]
    assert runs["distopt"]["offload"]["total"] * 2 == runs["ddp"]["offload"]["total"]
    assert runs["hsdp"]["offload"]["total"] * 2 == runs["ddp"]["offload"]["total"]
    assert runs["hsdp-level3"]["offload"]["total"] * 2 == runs["ddp"]["offload"]["total"]


def test_fraction_one_half_offloads_half(results):
    half = results["runs"]["half"]["offload"]
    total, offloaded = half["total"], half["offloaded"]
    # parameters in order while the offloaded elements are below half: at most one parameter over
    assert total / 2 <= offloaded < total / 2 + half["largest"]
    assert half["state_bytes"] == {"device": 8 * (total - offloaded), "host": 16 * offloaded}
    assert _differences(results["runs"]["ddp"]["reference"]["history"], half["history"]) == []


@pytest.mark.parametrize("name", ["bf16", "fp16", "hsdp-bf16", "hsdp-level3-bf16"])
def test_bf16_optimizers_fp32_main_copies_live_on_the_host_only(results, name):
    # megatron's Float16OptimizerWithFloat16Params keeps an fp32 copy of every bf16 parameter (its shard
    # under HSDP) beside it: 4 bytes per element; with the offload the engine's host master takes its
    # place and the copy's storage is released
    reference, offload = results["runs"][name]["reference"], results["runs"][name]["offload"]
    elements = reference["half_elements"]
    assert elements > 0 and offload["half_elements"] == elements
    assert reference["fp32_main_bytes"] == 4 * elements
    assert offload["fp32_main_bytes"] == 0
    # --log-params-norm reads a parameter's main_param: the host master in place of the released copy
    assert offload["main_param_is_host_master"] == offload["params"] > 0
    assert reference["main_param_is_host_master"] == 0


@pytest.mark.parametrize("name", ["bf16", "fp16", "hsdp-bf16", "hsdp-level3-bf16"])
def test_bf16_optimizers_fp32_main_copies_never_exist_all_at_once(results, name):
    # counted as megatron makes each copy: without the flag they pile up to 4 bytes per element; with it
    # each is released as it is made, so at most one copy (the largest) holds memory at a time
    reference, offload = results["runs"][name]["reference"], results["runs"][name]["offload"]
    assert reference["copies_peak_bytes"] == 4 * reference["half_elements"]
    assert 0 < offload["largest_copy_bytes"] < 4 * offload["half_elements"]
    assert offload["copies_peak_bytes"] == offload["largest_copy_bytes"]


def test_bf16_at_fraction_one_half_releases_the_offloaded_shares_copies(results):
    half, reference = results["runs"]["bf16-half"]["offload"], results["runs"]["bf16"]["reference"]
    total, offloaded = half["total"], half["offloaded"]
    assert 0 < offloaded < total
    # every element this optimizer steps is a bf16 parameter's: the device share keeps its fp32 copies
    assert half["half_elements"] == total
    assert half["fp32_main_bytes"] == 4 * (total - offloaded)
    assert half["state_bytes"] == {"device": 8 * (total - offloaded), "host": 16 * offloaded}
    assert _differences(reference["history"], half["history"]) == []


def test_bf16_reload_model_params_reaches_the_host_masters(results):
    # megatron's reload_model_params copies the model parameters into its fp32 main copies (after a
    # checkpoint's weights were loaded without the optimizer); released copies: into the host masters
    reload = results["reload"]
    assert _differences(reload["reference"]["history"], reload["offload"]["history"]) == []


@pytest.mark.parametrize("name", RESUMED)
def test_save_and_resume_through_megatrons_checkpoint(results, name):
    # 2 steps, megatron torch_dist checkpoint (model + optimizer), a new model and optimizer loaded
    # from it, the 3rd step: equal to the 3rd step of the run without interruption (and without offload)
    resumed = results["resume"][name]
    assert _differences(results["runs"][name]["reference"]["history"][-1:], resumed["history"]) == []
    after_load = resumed["after_load"]
    assert after_load["state_bytes"]["device"] == 0 and after_load["host_state_devices"] == ["cpu"]
    assert after_load.get("fp32_main_bytes", 0) == 0  # bf16: loaded into the host masters


def test_state_dict_is_torchs_format_and_loads_weights_only(results):
    # plain dicts of tensors (no hyper_adaptor class), so torch.load(weights_only=True) reads it
    assert results["weights_only"] == {"keys": ["exp_avg", "exp_avg_sq", "step"], "entries": 52}


@pytest.mark.parametrize("name", PRECISION_AWARE)
def test_precision_aware_path_equals_megatrons_bf16_distributed_optimizer_bitwise(results, name):
    # --use-precision-aware-optimizer: megatron's own CPU-offload path, its optimizer class replaced; the
    # reference is megatron's plain bf16 / fp16 distributed optimizer (fp32 main shards, torch AdamW; fp16
    # with a static loss scale, so megatron unscales the decoupled gradients before the step)
    run = results["runs"][name]
    assert run["offload"]["wrapper"] == run["reference"]["wrapper"] == "DistributedOptimizer"
    assert run["offload"]["inner"] == "OffloadedHybridOptimizer"
    assert _differences(run["reference"]["history"], run["offload"]["history"]) == []


def test_precision_aware_path_keeps_no_fp32_main_copies_beside_the_parameters(results):
    plain, aware = results["runs"]["bf16-distopt"]["offload"], results["runs"]["bf16-distopt-pa"]["offload"]
    elements = aware["half_shard_elements"]
    assert elements > 0 and plain["half_shard_elements"] == elements
    # the plain path: megatron's fp32 main shards, 4 bytes per element of this rank's bf16 shards
    assert plain["fp32_main_bytes"] == 4 * elements
    # the precision-aware path: none; the fp32 masters are the engine's, on the host, with the state
    assert aware["fp32_main_bytes"] == 0
    assert aware["offloaded"] == aware["total"] > 0 and aware["device_master_elements"] == 0
    assert aware["state_bytes"] == {"device": 0, "host": 16 * aware["total"]}
    assert aware["host_state_devices"] == ["cpu"]
    # what megatron's checkpoint code reads: every parameter's state with its fp32 master
    assert aware["params_with_state"] == aware["params"]
    assert aware["state_keys"] == ["exp_avg", "exp_avg_sq", "master_param", "step"]


def test_precision_aware_half_keeps_fp32_masters_of_the_device_share_on_the_device(results):
    half = results["runs"]["bf16-distopt-pa-half"]["offload"]
    total, offloaded, on_device = half["total"], half["offloaded"], half["device_master_elements"]
    assert 0 < offloaded < total and 0 < on_device <= total - offloaded
    # device tier: Adam's moments and the fp32 master (its gradient is megatron's fp32 buffer, not a copy)
    assert half["state_bytes"]["device"] == 8 * (total - offloaded) + 4 * on_device
    assert half["state_bytes"]["host"] == 16 * offloaded
    assert half["fp32_main_bytes"] == 0


def test_precision_aware_save_and_resume_through_megatrons_checkpoint(results):
    resumed = results["resume"]["bf16-distopt-pa"]
    reference = results["runs"]["bf16-distopt"]["reference"]["history"]
    assert _differences(reference[-1:], resumed["history"]) == []
    assert resumed["after_load"]["state_bytes"]["device"] == 0 and resumed["after_load"]["fp32_main_bytes"] == 0
