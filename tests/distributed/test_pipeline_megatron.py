"""``--pipeline-schedule`` on megatron-core's GPT (features/pipeline.py, patches/pipeline/): each schedule
against megatron's own 1F1B / interleaved schedule of the same layout, 2 Adam steps and one evaluation pass
(``forward_only``) on CPU/gloo, all in one world of 4 ranks.

Every run goes through the feature's validate and patches exactly as the adaptor applies them, with the
patches registered in a PatchManager of the run's own, so the reference runs on unpatched megatron. Losses,
grad norms, gradients and parameters are compared (1e-5: the schedules run the same micro-batch computations
in another order and accumulate each parameter's micro-batches in the same order, so they come out bitwise
equal in practice, bf16 included; ZBV in bf16: see TOL_V_BF16).

Memory (MEMORY_RUNS): what each training call of a zero-bubble schedule leaves alive must not grow from one
call to the next. The deferred weight gradients once kept every micro-batch's graph on the loss stage in a
reference cycle (tests/unit/pipeline/test_megatron_wgrad.py), so that megatron.training's memory rose each
iteration until Python's cyclic collector ran; the runs below keep the collector off to see any such cycle.
"""

import types

import pytest

from hyper_adaptor.testing import run_world
from tests.distributed.gpt_parity import Layout, compare

pytestmark = pytest.mark.distributed

TARGET = "tests.distributed.test_pipeline_megatron:train_schedules"
TOL = dict(loss_rtol=1e-5, grad_atol=1e-5, param_atol=1e-5)
# two steps: the second's gradients and update follow the first's (Adam's first update is the sign of the
# gradient, its second depends on both steps' gradients), and every step runs the whole schedule
STEPS = 2
# ZBV in bf16: each rank holds other parameters than under the loop placement, so megatron's grad norm adds
# its per-rank partial sums in another order (1e-7 relative, seen in fp32 too); the clipped update then rounds
# some bf16 parameter one unit (2^-8 relative) the other way after the second step. Its effect on the next
# grad norm and evaluation depends on which parameter flips, which depends on the CPU's bf16 GEMMs: under 1e-4
# relative on an AMD EPYC VM, 1.1e-4 on an Intel Xeon with AMX-bf16
TOL_V_BF16 = dict(loss_rtol=1e-5, grad_rtol=1e-2, param_atol=1e-3)
V_BF16_NORM_RTOL = 3e-4

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_token_dispatcher_type="allgather",
           moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
# (case, schedule) runs whose engine calls are watched by the benches' StorageTracker (the loss stage on the
# last and, in the V, on the first pipeline rank; fp32, where the output layer's grad_output is the logits
# tensor itself: in bf16 the cast to fp32 before the cross entropy breaks that cycle), and the growth allowed
# from the first training call's leftovers to the second's: the storages the call returns (its loss tensors)
MEMORY_RUNS = {("DP2xPP2", "zbh1"), ("PP4-VPP2-untied", "zbv")}
LEFT_GROWTH_BYTES = 1024
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
# name -> (layout, our schedules): megatron's own schedule runs the layout first, as the reference
CASES = {
    "PP4": (dict(pp=4), ["1f1b", "gpipe", "zbh1"]),
    "DP2xPP2": (dict(pp=2), ["1f1b", "gpipe", "zbh1"]),
    # model chunks: ZBV (chunk 1 back up the ranks) against megatron's interleaved run of the same model
    # (untied output layer), started from the same full parameters
    "PP4-VPP2-untied": (dict(pp=4, vpp=2, extra={"num_layers": 8},
                             model={"share_embeddings_and_output_weights": False}), ["interleaved", "zbv"]),
    "DP2xPP2-VPP2-untied-bf16": (dict(pp=2, vpp=2, bf16=True,
                                      model={"share_embeddings_and_output_weights": False}), ["interleaved", "zbv"]),
    "TP2xPP2-SP": (dict(tp=2, pp=2, sequence_parallel=True), ["zbh1"]),
    # bf16 with megatron's full recompute: each layer's forward re-runs inside the I step, the products still wait
    "PP4-bf16-recompute": (dict(pp=4, bf16=True, extra=RECOMPUTE), ["zbh1"]),
    "DP2xPP2-overlap-grad-reduce": (dict(pp=2, ddp_overlap=True), ["1f1b"]),
    # MoE: megatron's aux-loss scaling in forward_step_calc_loss; SequentialMLP experts' linears deferred
    # (without linear biases: megatron 0.19.2's SequentialMLP with biases fails at TP 1 under its own DDP)
    "DP2xPP2-MoE": (dict(pp=2, extra=dict(MOE, add_bias_linear=False), spec={"num_experts": 4}), ["zbh1"]),
    # context parallel (hyper_adaptor's ring attention, applied to this process for the rest of the world: last)
    "CP2xPP2": (dict(pp=2, cp=2, cp_comm_type="p2p", features=dict(
        optimization_level=2, context_parallel_size=2, context_parallel_algo="ring", num_attention_heads=4,
        tensor_model_parallel_size=1, seq_length=32, attention_dropout=0.0)), ["zbh1"]),
}


def _args(schedule: str, layout: dict):
    from hyper_adaptor import features

    args = types.SimpleNamespace(optimization_level=2, num_layers=layout.get("extra", {}).get("num_layers", 4),
                                 untie_embeddings_and_output_weights=not layout.get("model", {}).get(
                                     "share_embeddings_and_output_weights", True),
                                 pipeline_model_parallel_size=layout.get("pp", 1),
                                 tensor_model_parallel_size=layout.get("tp", 1),
                                 virtual_pipeline_model_parallel_size=layout.get("vpp"),
                                 overlap_grad_reduce=layout.get("ddp_overlap", False))
    for feature in features.FEATURES:
        feature.fill_defaults(args)
    args.pipeline_schedule = schedule
    return args


def train_schedules(rank: int, world_size: int, cases: dict) -> dict:
    import collections
    import gc

    import torch.distributed as dist

    from hyper_adaptor.features import get
    from hyper_adaptor.patch_manager import Patch, PatchManager
    from hyper_adaptor.patches.pipeline import wgrad
    from hyper_adaptor.testing.measure import StorageTracker
    from tests.distributed import gpt_parity

    feature = get("pipeline")
    results = {}
    served = collections.Counter()  # schedule name -> forward-backward calls the engine ran

    watch = {"tracker": None, "left": []}

    def counting(original):
        def forward_backward(name, **kwargs):
            served[name] += 1
            tracker = watch["tracker"]
            if tracker is None or kwargs.get("forward_only"):
                return original(name, **kwargs)
            with tracker:  # bytes made inside the engine's training calls and still alive after them
                out = original(name, **kwargs)
            watch["left"].append(tracker.live)
            return out

        return forward_backward

    for case, (layout, schedules) in cases.items():
        layout = dict(layout, evaluate=True, steps=STEPS)
        results[case] = {"megatron": gpt_parity.train(rank, world_size, Layout(**layout))}
        box = [results[case]["megatron"].get("init")]
        dist.broadcast_object_list(box, src=0)  # the full initial parameters (rank 0 has them)
        init = box[0]
        for schedule in schedules:
            args = _args(schedule, layout)
            feature.adjust(args)
            feature.validate(args)
            manager = PatchManager()
            manager.register_all(feature.patches(args))
            manager.register(Patch("hyper_adaptor.patches.pipeline.schedules.forward_backward", counting, "wrap",
                                   "test"))
            before, deferred = served[schedule], wgrad.DEFERRED_RUNS[0]
            watched = (case, schedule) in MEMORY_RUNS
            watch.update(tracker=StorageTracker("cpu") if watched else None, left=[])
            if watched:
                gc.disable()  # a reference cycle then stays alive, whenever the collector would have run
            try:
                with manager.applied():
                    results[case][schedule] = gpt_parity.train(rank, world_size, Layout(**layout), init)
            finally:
                gc.enable()
            if watched:
                results[case][schedule]["left"] = watch["left"]
            # the engine ran every step and the evaluation (not megatron's schedule)
            results[case][schedule]["served"] = served[schedule] - before
            results[case][schedule]["deferred"] = wgrad.DEFERRED_RUNS[0] - deferred
    return results


def test_every_schedule_matches_megatrons_own():
    ranks = run_world(4, TARGET, timeout=900, cases=CASES)
    for case, (_layout, schedules) in CASES.items():
        reference = ranks[0][case]["megatron"]
        for schedule in schedules:
            got = ranks[0][case][schedule]
            v_bf16 = schedule == "zbv" and "bf16" in case
            diffs = compare(reference, got, **(TOL_V_BF16 if v_bf16 else TOL))
            assert diffs == [], f"{case} {schedule}:\n" + "\n".join(diffs[:20])
            for r, result in enumerate(ranks):
                want, have = result[case]["megatron"], result[case][schedule]
                assert have["grad_norm"] == pytest.approx(want["grad_norm"],
                                                          rel=V_BF16_NORM_RTOL if v_bf16 else 1e-5), \
                    (case, schedule, r)
                assert have["eval"] == pytest.approx(want["eval"], rel=V_BF16_NORM_RTOL if v_bf16 else 1e-5), \
                    (case, schedule, r)
                assert have["loss"] == pytest.approx(want["loss"], rel=1e-5), (case, schedule, r)
                assert have["served"] == len(have["loss"]) + 1, (case, schedule, r)
                # zero-bubble schedules computed megatron's linear weight gradients in W steps
                assert (have["deferred"] > 0) == (schedule in ("zbh1", "zbv")), (case, schedule, r)
                if (case, schedule) in MEMORY_RUNS:
                    left = have["left"]
                    assert len(left) == STEPS and left[1] - left[0] <= LEFT_GROWTH_BYTES, \
                        f"{case} {schedule} rank {r}: bytes left alive after each training call grew: {left}"
