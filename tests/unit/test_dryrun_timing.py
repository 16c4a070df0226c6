"""The dry-run's step-time model (hyper_adaptor/dryrun/timing.py) and its calibration cache
(hyper_adaptor/dryrun/calibrate.py): FLOPs of a hand-computed shape, the pipeline bubble through the
simulator, the direction of each split, the communication formulas against the benches' own theory
functions, the cache's round trip, and the accuracy bench's rank correlation (bench/dry_run.py). No real
micro-benchmark beyond the quick one (< 2 s)."""

import argparse
import dataclasses
import json
import socket

import pytest

from hyper_adaptor.dryrun import calibrate, step_fit, timing, workload
from hyper_adaptor.dryrun.shape import ModelShape
from hyper_adaptor.dryrun.workload import Dims


def fake_calibration(**changes) -> calibrate.Calibration:
    """A machine of fixed, round figures: 1 TFLOP/s at every size, 100 GB/s, a 10 us link of 10 GB/s."""
    import torch

    cal = calibrate.Calibration(
        device="cpu", host=socket.gethostname(), machine=calibrate.machine_id("cpu"),
        torch_version=torch.__version__, threads=1, cores=1024,
        matmul={"float32": [[1.0, 1e12], [4096.0, 1e12]]}, memory_bytes_per_s=1e11, layer_overhead_s=0.0,
        collectives={op: {"latency_s": 1e-5, "bytes_per_s": 1e10} for op in calibrate.COLLECTIVES})
    return dataclasses.replace(cal, **changes)


def namespace(**flags) -> argparse.Namespace:
    """The attributes of megatron's namespace the dry-run reads: hidden 64, 4 heads of 16, FFN 256, 4 layers,
    32 tokens x micro-batch 2, global batch 8, vocab 128, one rank, no biases, tied embeddings."""
    base = dict(hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, kv_channels=16, num_layers=4,
                seq_length=32, max_position_embeddings=32, micro_batch_size=2, global_batch_size=8,
                padded_vocab_size=128, world_size=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                context_parallel_size=1, expert_model_parallel_size=1, expert_tensor_parallel_size=None,
                virtual_pipeline_model_parallel_size=None, group_query_attention=False, num_query_groups=None,
                num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None,
                moe_shared_expert_intermediate_size=None, moe_grouped_gemm=False, swiglu=False,
                normalization="LayerNorm", untie_embeddings_and_output_weights=False,
                position_embedding_type="learned_absolute", add_bias_linear=False, add_qkv_bias=False,
                qk_layernorm=False, bf16=False, fp16=False, sequence_parallel=False)
    base.update(flags)
    base["data_parallel_size"] = base["world_size"] // (base["tensor_model_parallel_size"]
                                                        * base["pipeline_model_parallel_size"]
                                                        * base["context_parallel_size"])
    return argparse.Namespace(**base)


def dims(**flags) -> Dims:
    """The cost model's view of ``namespace(**flags)``."""
    return Dims.from_shape(ModelShape.from_args(namespace(**flags)))


def test_dims_is_the_model_shape_plus_gradient_bytes():
    # one source of truth: every figure the cost model reads is ModelShape's, nothing restated beside it
    shape_fields = {f.name for f in dataclasses.fields(ModelShape)}
    assert {f.name for f in dataclasses.fields(Dims)} - shape_fields == {"grad_bytes"}
    shape = ModelShape.from_args(namespace(bf16=True, world_size=2, pipeline_model_parallel_size=2,
                                           virtual_pipeline_model_parallel_size=2))
    d = Dims.from_shape(shape)
    assert all(getattr(d, name) == getattr(shape, name) for name in shape_fields)
    assert (d.elem, d.matmul_dtype, d.grad_bytes, d.chunks) == (2, "bfloat16", 2, 2)
    fp32_reduced = Dims.from_shape(shape, argparse.Namespace(accumulate_allreduce_grads_in_fp32=True))
    assert fp32_reduced.grad_bytes == 4
    assert dims(num_experts=8, moe_ffn_hidden_size=64).is_moe(3) and not dims().is_moe(0)


# ------------------------------------------------------------------------------------------------- FLOPs
def test_layer_flops_hand_computed():
    d = dims()
    # t = 64 tokens: QKV 2*64*64*192, scores and values 2 x 2*32*16*32 per (batch x head) = 8,
    # projection 2*64*64*64, MLP 2 x 2*64*64*256
    hand = 2 * 64 * 64 * 192 + 2 * (2 * 32 * 16 * 32 * 8) + 2 * 64 * 64 * 64 + 2 * (2 * 64 * 64 * 256)
    assert hand == 6_815_744
    assert workload.layer_flops(d) == hand
    b, s, h = 2, 32, 64  # the textbook count for FFN = 4h: 24 b s h^2 + 4 b s^2 h
    assert workload.layer_flops(d) == 24 * b * s * h * h + 4 * b * s * s * h
    # TP splits heads and FFN, CP the sequence (attention: own queries against all keys): both halve it
    assert workload.layer_flops(dims(tensor_model_parallel_size=2, world_size=2)) == hand / 2
    assert workload.layer_flops(dims(context_parallel_size=2, world_size=2)) == hand / 2


def test_moe_flops_follow_topk_not_experts():
    moe = dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64)
    d = dims(**moe)
    mm = workload.flops(workload.layer_matmuls(d, moe=True))
    t = 64
    assert mm["router"] == 2 * t * 64 * 8
    assert mm["expert_fc1"] + mm["expert_fc2"] == 2 * (2 * t * 2 * 64 * 64)  # t x topk rows through FFN 64
    # EP spreads the same rows over more ranks' experts: the work per rank stays, fewer experts hold it
    d_ep = dims(**moe, expert_model_parallel_size=4, world_size=4)
    mm_ep = workload.flops(workload.layer_matmuls(d_ep, moe=True))
    assert mm_ep["expert_fc1"] == mm["expert_fc1"]
    assert workload.layer_matmuls(d_ep, moe=True)["expert_fc1"][3] == 2  # 8 experts / EP 4


def test_step_flops_count_forward_backward_and_recompute():
    cal = fake_calibration()
    step = timing.predict_time(namespace(), cal)
    m = 4  # 8 / (2 x 1)
    logits = 2 * 64 * 64 * 128
    assert step.micro_batches == m
    assert step.flops_per_rank == m * 3 * (4 * 6_815_744 + logits)
    recompute = timing.predict_time(namespace(recompute_granularity="full", recompute_method="uniform",
                                              recompute_num_layers=1), cal)
    assert recompute.flops_per_rank == step.flops_per_rank + m * 4 * 6_815_744
    assert recompute.parts["recompute"] > 0 and step.parts["recompute"] == 0
    block = timing.predict_time(namespace(recompute_granularity="full", recompute_method="block",
                                          recompute_num_layers=1), cal)
    assert block.flops_per_rank == step.flops_per_rank + m * 6_815_744
    assert sum(step.parts.values()) == pytest.approx(step.total)


def test_framework_fixed_costs_per_layer_micro_batch_and_step():
    plain = timing.predict_time(namespace(), fake_calibration())
    fixed = timing.predict_time(namespace(), fake_calibration(
        framework={"layer_s": 1e-3, "micro_batch_s": 2e-3, "step_s": 5e-3}))
    m, layers = 4, 4
    assert fixed.total - plain.total == pytest.approx(m * layers * 1e-3 + m * 2e-3 + 5e-3)
    assert fixed.parts["framework"] == 5e-3


# ----------------------------------------------------------------------------------------------- bubble
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8)])
def test_1f1b_bubble_is_textbook_through_the_simulator(p, m):
    d = dims(num_layers=p, global_batch_size=2 * m, pipeline_model_parallel_size=p, world_size=p)
    makespan, ideal, bubble = timing._pipeline("1f1b", d, {"F": 1.0, "B": 2.0}, 0.0)
    assert bubble == pytest.approx((p - 1) / (m + p - 1))
    assert ideal == pytest.approx((m + p - 1) * 3.0) and makespan == ideal
    # a run's step: the slowest stage's F + B paced over (m + p - 1) slots, the rest of it bubble
    step = timing.predict_time(namespace(pipeline_model_parallel_size=p, num_layers=p, world_size=p,
                                         global_batch_size=2 * m), fake_calibration(layer_overhead_s=1e-3))
    assert step.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert step.schedule == "1f1b"
    slot = step.costs["F"] + step.costs["B"]
    assert step.total - step.parts["optimizer"] - step.parts["dp_comm"] == pytest.approx((m + p - 1) * slot
                                                                                          + step.parts["pp_comm"])


@pytest.mark.parametrize("name,chunks", [("1f1b", 1), ("zbh1", 1), ("interleaved", 2), ("zbv", 2)])
def test_many_micro_batches_extend_the_steady_state(name, chunks):
    from hyper_adaptor.parallel.pipeline.schedules import build
    from hyper_adaptor.parallel.pipeline.timeline import simulate

    p, m = 4, 22  # past 3 x PP: simulated at 10 and 14 micro-batches, extended to 22
    d = dims(num_layers=8, global_batch_size=2 * m, pipeline_model_parallel_size=p, world_size=p,
             virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None)
    assert d.chunks == chunks
    costs = {"F": 1.0, "B": 2.5} if name in ("1f1b", "interleaved") else {"F": 1.0, "B": 2.5, "I": 1.5, "W": 1.0}
    makespan, ideal, bubble = timing._pipeline(name, d, costs, 0.25)
    layout, lists = build(name, p, m, chunks if chunks > 1 else None)
    assert makespan == pytest.approx(simulate(lists, layout, costs, 0.25).makespan, rel=0.01)
    direct = simulate(lists, layout, costs, 0.0)
    assert ideal == pytest.approx(direct.makespan, rel=0.01) and bubble == pytest.approx(direct.bubble, abs=0.01)


def test_zero_bubble_schedule_beats_1f1b():
    flags = dict(pipeline_model_parallel_size=4, world_size=4, global_batch_size=16)
    cal = fake_calibration(layer_overhead_s=1e-3)
    one = timing.predict_time(namespace(**flags), cal)
    zb = timing.predict_time(namespace(pipeline_schedule="zbh1", **flags), cal)
    assert zb.parts["bubble"] < one.parts["bubble"]
    assert zb.total < one.total


# ------------------------------------------------------------------------------------------ monotonicity
def test_more_tp_less_compute_more_communication():
    cal = fake_calibration()
    steps = [timing.predict_time(namespace(tensor_model_parallel_size=t, world_size=t), cal) for t in (1, 2, 4)]
    compute = [s.parts["compute"] for s in steps]
    comm = [s.parts["tp_comm"] for s in steps]
    assert compute[0] > compute[1] > compute[2]
    assert comm[0] == 0 < comm[1] < comm[2]
    assert [s.flops_per_rank for s in steps] == pytest.approx([steps[0].flops_per_rank / t for t in (1, 2, 4)])


def test_more_data_parallel_fewer_micro_batches_more_reduction():
    cal = fake_calibration()
    one, four = (timing.predict_time(namespace(world_size=w), cal) for w in (1, 4))
    assert (one.micro_batches, four.micro_batches) == (4, 1)
    assert four.parts["compute"] < one.parts["compute"]
    assert one.parts["dp_comm"] == 0 < four.parts["dp_comm"]


def test_cpu_ranks_beyond_cores_stretch_the_step():
    flags = dict(tensor_model_parallel_size=4, world_size=4)
    roomy = timing.predict_time(namespace(**flags), fake_calibration(cores=8))
    crowded = timing.predict_time(namespace(**flags), fake_calibration(cores=2))
    assert crowded.total == pytest.approx(2 * roomy.total)


def test_compute_scales_slow_the_matmuls_and_the_elementwise_work_only():
    args = namespace(world_size=2, tensor_model_parallel_size=2)
    base = timing.predict_time(args, fake_calibration())
    slow_mm = timing.predict_time(args, fake_calibration(framework={"matmul_scale": 2.0}))
    slow_el = timing.predict_time(args, fake_calibration(framework={"elementwise_scale": 3.0}))
    d = Dims.from_shape(ModelShape.from_args(args), args)
    # per micro-batch, 3 x the forward matmuls (forward, input and weight gradients) and the logits';
    # elementwise: 3 x the layers' forward passes, the loss each way, the embedding's weight gradient (W) —
    # the work the calibration's fit divides the measured steps by (workload.unscaled_work)
    matmuls, elementwise = workload.unscaled_work(fake_calibration(), d, d.layers, d.num_micro_batches)
    assert slow_mm.parts["compute"] - base.parts["compute"] == pytest.approx(matmuls, rel=1e-9)
    assert slow_el.parts["compute"] - base.parts["compute"] == pytest.approx(2 * elementwise, rel=1e-9)
    for step in (slow_mm, slow_el):  # communication and the rest are not compute
        assert {k: v for k, v in step.parts.items() if k != "compute"} == \
            {k: v for k, v in base.parts.items() if k != "compute"}


def test_compute_scales_are_fitted_back_from_two_steps():
    from hyper_adaptor.dryrun.calibrate_worlds import COMPUTE_SHAPES

    fixed = {"layer_s": 1e-3, "micro_batch_s": 2e-3, "step_s": 3e-3}
    cal = fake_calibration(framework=dict(fixed))

    def seconds(shape, a, b):
        d = workload.plain_gpt(shape["hidden"], shape["heads"], shape["seq"], shape["layers"], shape["micro_batch"],
                               shape["vocab"])
        mm, el = workload.unscaled_work(cal, d, shape["layers"], shape["micro"])
        return (fixed["layer_s"] * shape["layers"] * shape["micro"] + fixed["micro_batch_s"] * shape["micro"]
                + fixed["step_s"] + a * mm + b * el)

    steps = [{**shape, "seconds": seconds(shape, 1.5, 3.5)} for shape in COMPUTE_SHAPES]
    fitted = step_fit.fit_compute_scales(cal, steps)
    assert fitted["matmul_scale"] == pytest.approx(1.5) and fitted["elementwise_scale"] == pytest.approx(3.5)
    # the fit refuses what does not make sense: one step, or factors outside [0.5, 20]
    assert step_fit.fit_compute_scales(cal, steps[:1]) == {}
    assert step_fit.fit_compute_scales(cal, [{**shape, "seconds": seconds(shape, 0.1, 1.0)}
                                           for shape in COMPUTE_SHAPES]) == {}


def test_sixteen_bit_elementwise_runs_at_its_measured_speed():
    args = namespace(bf16=True)
    d = Dims.from_shape(ModelShape.from_args(args), args)
    assert d.elem == 2
    by_bytes = timing.predict_time(args, fake_calibration())                      # half fp32's bytes: 2x faster
    measured = timing.predict_time(args, fake_calibration(elementwise_speed={"bfloat16": 1.0}))  # as fp32
    m = d.num_micro_batches
    layer_and_embedding = m * (3 * d.layers * workload.elementwise_bytes(d, False)
                               + 2 * d.micro_batch * d.seq * d.hidden * d.elem) / 1e11
    # at speed 1.0 the bf16 elements take fp32's time: twice the bytes-based figure; the fp32 loss is unchanged
    assert measured.parts["compute"] - by_bytes.parts["compute"] == pytest.approx(layer_and_embedding, rel=1e-9)


def test_comm_scale_is_fitted_back_from_a_tensor_parallel_step():
    import types

    from hyper_adaptor.dryrun.calibrate_worlds import COMM_SHAPE

    cal = fake_calibration(framework={"layer_s": 1e-3, "micro_batch_s": 2e-3, "step_s": 3e-3, "matmul_scale": 1.5})
    d = dataclasses.replace(workload.plain_gpt(COMM_SHAPE["hidden"], COMM_SHAPE["heads"], COMM_SHAPE["seq"],
                                             COMM_SHAPE["layers"], COMM_SHAPE["micro_batch"], COMM_SHAPE["vocab"]),
                            tp=2, sp=True, world=2, global_batch=COMM_SHAPE["micro_batch"] * COMM_SHAPE["micro"])
    step = timing.predict_time(types.SimpleNamespace(), cal, d)
    assert step.parts["tp_comm"] > 0 and step.micro_batches == COMM_SHAPE["micro"]
    measured = step.total + 2.0 * step.parts["tp_comm"]      # the collectives took 3 x the model's
    fitted = step_fit.fit_comm_scale(cal, {**COMM_SHAPE, "tp": 2, "seconds": measured})
    assert fitted["comm_scale"] == pytest.approx(3.0)
    # applied: the TP, CP and EP collectives inside the step, nothing else
    scaled = timing.predict_time(types.SimpleNamespace(), dataclasses.replace(
        cal, framework={**cal.framework, **fitted}), d)
    assert scaled.parts["tp_comm"] == pytest.approx(3.0 * step.parts["tp_comm"])
    assert scaled.parts["compute"] == pytest.approx(step.parts["compute"])
    assert step_fit.fit_comm_scale(cal, {**COMM_SHAPE, "tp": 2, "seconds": step.total * 1e3}) == {}


def test_accelerator_swap_costs_what_the_host_link_cannot_hide():
    # 4 layers x 4 micro-batches, the attention's activations to host and back; on an accelerator each copy
    # overlaps its layer's compute, so a fast link costs nothing and a slow one its transfer time less that
    # compute (the compute is microseconds here, the transfer at 1 MB/s seconds)
    args = namespace(swap_attention=True)
    d = Dims.from_shape(ModelShape.from_args(args))
    per_layer = timing._swapped_bytes(d, timing._Options.from_args(args, d), 0)
    assert per_layer > 0
    fast = timing.predict_time(args, fake_calibration(device="cuda", host_link_bytes_per_s=1e15))
    slow = timing.predict_time(args, fake_calibration(device="cuda", host_link_bytes_per_s=1e6))
    assert fast.parts["swap"] == 0
    assert slow.parts["swap"] == pytest.approx(4 * 4 * 2 * per_layer / 1e6, rel=1e-3)
    # an accelerator calibration without a measured link takes the assumed one
    assert fake_calibration(device="npu").host_link() == calibrate.HOST_LINK["npu"]


def test_bad_layout_is_an_error_naming_the_flag():
    with pytest.raises(timing.TimingError, match="--global-batch-size 6"):
        timing.predict_time(namespace(global_batch_size=6, world_size=2), fake_calibration())
    with pytest.raises(timing.TimingError, match="--world-size 3"):
        timing.predict_time(namespace(world_size=3, tensor_model_parallel_size=2), fake_calibration())
    shape = ModelShape.from_args(namespace(world_size=4))
    with pytest.raises(timing.TimingError, match="data-parallel size 4 x TP 2 x PP 1 x CP 1 is not --world-size 4"):
        timing.predict_time(namespace(world_size=4), fake_calibration(), dataclasses.replace(shape, tp=2))
    fixed = dataclasses.replace(shape, tp=2, dp=2)   # a candidate with its DP size changed too is priced
    assert timing.predict_time(namespace(world_size=4), fake_calibration(), fixed).parts["tp_comm"] > 0


# ------------------------------------------------------- the engines' theory, as the benches state it
def _bench_dims(d: Dims) -> dict:
    return {"seq": d.seq, "dim": d.hidden, "vocab": d.vocab, "layers": d.layers}


def test_tp_volume_is_the_tp_bench_theory():
    from bench._tp_contenders import theory_megatron_sp_regather_bytes, theory_tp_bytes

    d = dims(tensor_model_parallel_size=2, world_size=2)
    ours = timing.tp_sent_bytes(d, d.layers, first=True, last=True)
    assert ours["forward"] + ours["backward"] == theory_tp_bytes(_bench_dims(d), 2, 2, gathered_logits=False)
    sp = timing.tp_sent_bytes(dims(tensor_model_parallel_size=2, world_size=2, sequence_parallel=True), d.layers,
                              first=True, last=True)
    assert sp["forward"] + sp["backward"] - (ours["forward"] + ours["backward"]) == \
        theory_megatron_sp_regather_bytes(_bench_dims(d), 2, 2)


@pytest.mark.parametrize("algo", ["ring", "ulysses", "allgather", "hybrid"])
def test_cp_volume_is_the_cp_bench_theory(algo):
    from bench._cp_analysis import theory

    d = dims(group_query_attention=True, num_query_groups=2, context_parallel_size=4, world_size=4)
    ours = timing.cp_sent_bytes(algo, d, ulysses_degree=2)
    bench = theory(algo, 4, d.seq, {"batch": 2, "heads": 4, "kv_heads": 2, "head_dim": 16})
    assert (ours["forward"], ours["backward"]) == pytest.approx((bench["forward"], bench["backward"]))


def test_ep_volume_is_the_ep_bench_theory():
    from bench.expert_parallel import engine_theory_bytes

    d = dims(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64, expert_model_parallel_size=4, world_size=4)
    rows = 64 * 2 * 3 / 4  # t x topk, three quarters of them to other ranks
    sent, calls = timing.ep_sent_bytes(d, "alltoall")
    assert sent == pytest.approx(engine_theory_bytes({"sent_rows": rows, "received_rows": rows}, 64, 8, 4))
    assert calls == 5


def test_dp_volume_is_the_dp_bench_theory():
    from bench._hsdp_contenders import theory_comm_bytes
    from bench._tp_contenders import theory_dp_bytes

    psi, n = 1000, 4
    assert timing.dp_sent_bytes("ddp", psi, n, 4, 4) == theory_dp_bytes("ddp", psi, n)
    assert timing.dp_sent_bytes("hsdp-level3", psi, n, 4, 4) == theory_dp_bytes("hsdp-level3", psi, n)
    assert timing.dp_sent_bytes("distopt", psi, n, 4, 4) == theory_comm_bytes("zero2", psi) * (n - 1) / n
    assert timing.dp_sent_bytes("ddp", psi, 1, 4, 4) == 0


def test_dp_volume_counts_the_ranks_parameters():
    # per layer QKV 64 x 192, projection 64 x 64, two norms (weight, bias), MLP 2 x 64 x 256: 49,408;
    # 4 layers + word (128 x 64) and position (32 x 64) embeddings + final norm (the output layer is tied)
    psi = 4 * (64 * 192 + 64 * 64 + 4 * 64 + 2 * 64 * 256) + 128 * 64 + 32 * 64 + 2 * 64
    assert psi == 208_000
    step = timing.predict_time(namespace(world_size=2), fake_calibration())
    assert step.comm_bytes["dp"] == 2 * psi * 4 * (2 - 1) / 2
    distopt = timing.predict_time(namespace(world_size=2, use_distributed_optimizer=True), fake_calibration())
    assert distopt.comm_bytes["dp"] == step.comm_bytes["dp"]  # reduce-scatter + all-gather: the same volume
    assert distopt.parts["optimizer"] == pytest.approx(step.parts["optimizer"] / 2)  # half the state per rank


# ------------------------------------------------------------------------------------------ calibration
def test_calibration_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path))
    cal = fake_calibration()
    path = calibrate.save(cal)
    assert path == tmp_path / f"calibration-cpu-{socket.gethostname()}.json"
    assert calibrate.load("cpu") == cal

    def no_measuring(device, quick=False):
        raise AssertionError("measured although the cache is valid")

    monkeypatch.setattr(calibrate, "measure", no_measuring)
    assert calibrate.get("cpu") == cal
    # another torch, another machine, another host: measured again, not reused
    for change in ({"torch_version": "0.0.1"}, {"machine": "elsewhere"}, {"host": "other-host"}):
        path.write_text(json.dumps(fake_calibration(**change).to_json()))
        assert calibrate.load("cpu") is None
    path.write_text("{not json")
    assert calibrate.load("cpu") is None
    fresh = fake_calibration(memory_bytes_per_s=5e10)
    monkeypatch.setattr(calibrate, "measure", lambda device, quick=False: fresh)
    assert calibrate.get("cpu") == fresh and calibrate.load("cpu") == fresh
    monkeypatch.setattr(calibrate, "measure", lambda device, quick=False: cal)
    assert calibrate.get("cpu", recalibrate=True) == cal  # --recalibrate measures although the cache is valid


def test_quick_measurement_and_interpolation():
    cal = calibrate.measure("cpu", quick=True)
    assert cal.seconds < 2 and calibrate.matches_here(cal)
    sizes = [s for s, _ in cal.matmul["float32"]]
    assert sizes == sorted(sizes) and cal.memory_bytes_per_s > 0 and cal.layer_overhead_s > 0
    # between two measured sizes the rate lies between theirs; below the smallest, a matmul costs no less
    lo, hi = cal.matmul["float32"][0], cal.matmul["float32"][1]
    mid = cal.flops_per_s((lo[0] * hi[0]) ** 0.5)
    assert min(lo[1], hi[1]) <= mid <= max(lo[1], hi[1])
    assert cal.matmul_time(4, 4, 4) == pytest.approx(cal.matmul_time(lo[0], lo[0], lo[0]))
    assert calibrate.Calibration.from_json(json.loads(json.dumps(cal.to_json()))) == cal


def test_unknown_or_absent_device_is_an_error():
    import torch

    with pytest.raises(calibrate.CalibrationError, match="--device: invalid choice: 'gpu'"):
        calibrate.get("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(calibrate.CalibrationError, match="--device cuda: this machine has no usable cuda"):
            calibrate.measure("cuda")


def test_nominal_figures_for_an_absent_accelerator():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: cuda is measured, not assumed")
    cal = calibrate.get("cuda", allow_nominal=True)
    assert cal.collective_source.startswith("assumed") and "nominal" in cal.machine
    # a bf16 GPT priced on the nominal GPU
    args = namespace(bf16=True, world_size=2, tensor_model_parallel_size=2)
    assert 0 < timing.predict_time(args, cal).total


# ------------------------------------------------------------------ the accuracy bench's step-time summary
def test_bench_spearman_against_hand_computed_values():
    from bench.dry_run import spearman

    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # no ties: 1 - 6 sum d^2 / (n (n^2 - 1)) = 1 - 6 x 4 / 120
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    # ranks, not values: a monotone but far from linear relation is still 1
    assert spearman([1, 2, 3, 4], [1, 10, 1000, 1e6]) == pytest.approx(1.0)
    # ties share their mean rank: x ranks 1, 2.5, 2.5, 4 against 1..4 -> 4.5 / sqrt(4.5 x 5)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert spearman([1], [2]) is None and spearman([1, 1, 1], [1, 2, 3]) is None
    with pytest.raises(ValueError, match="3 values against 2"):
        spearman([1, 2, 3], [1, 2])


def test_bench_time_summary_uses_the_rows_with_both_times():
    from bench.dry_run import time_summary

    rows = [{"name": "a", "predicted_step_s": 0.2, "step_time_s": 0.1},
            {"name": "b", "predicted_step_s": 0.4, "step_time_s": 0.8},
            {"name": "c", "predicted_step_s": 1.0, "step_time_s": 1.0},
            {"name": "failed", "predicted_step_s": None, "step_time_s": 0.5}]
    summary = time_summary(rows)
    assert summary["rows"] == ["a", "b", "c"]
    assert summary["spearman"] == pytest.approx(1.0)
    assert (summary["ratio_min"], summary["ratio_max"]) == (0.5, 2.0)
    assert summary["ratio_geomean"] == pytest.approx(1.0)
    assert summary["ratio_error_factor"] == pytest.approx(2 ** (2 / 3))
