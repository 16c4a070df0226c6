"""Step time of a Megatron command line, predicted from the model's shape and a machine's calibration.

The model, per pipeline stage and micro-batch:

- compute: each layer's matmuls (QKV, attention scores and values, projection, MLP or routed experts, the
  logits on the last stage) timed at the calibrated throughput *for their size*, plus elementwise traffic
  (norms, residuals, dropout, softmax, activation) at the calibrated memory bandwidth, plus the calibrated
  fixed cost of a megatron layer, micro-batch and step (operator dispatch, bookkeeping); backward costs twice
  the forward matmuls (input and weight gradients), and a recomputed layer runs its forward once more in
  backward. TP divides heads, MLP and vocab,
  CP the sequence, EP x ETP the experts (tokens per expert from top-k).
- communication inside the step, per feature, with the volume of the engines' own theory (the benches' theory
  columns; tests/unit/test_dryrun_timing.py checks each against the bench's function): TP reductions
  (bench/_tp_contenders.py ``theory_tp_bytes``, ``theory_megatron_sp_regather_bytes``), CP per algorithm
  (bench/_cp_analysis.py ``theory``), EP dispatch and combine (bench/expert_parallel.py
  ``engine_theory_bytes``) — restated in :mod:`hyper_adaptor.dryrun.comm_theory` — each collective timed as
  latency per ring step + bytes sent / calibrated rate.
- the pipeline: F / B (I / W for the zero-bubble schedules) costs of the slowest stage on the schedule's own
  action lists (``schedules.build``) through the timeline simulator (``timeline.simulate``), with the activation
  send as the cost between ranks: its makespan is compute plus bubble plus exposed point-to-point time.
- after the last micro-batch: the data-parallel gradient reduction (all-reduce for DDP; reduce-scatter and
  all-gather for the distributed optimizer and HSDP, parameters gathered twice more per micro-batch at HSDP
  level 3: bench/_tp_contenders.py ``theory_dp_bytes``, bench/_hsdp_contenders.py ``theory_comm_bytes``), less
  the part hidden behind the last backward with ``--overlap-grad-reduce`` / ``--hsdp-comm-async``, and the
  optimizer step (Adam: memory-bound over the local shard; Muon: its Newton-Schulz matmuls).

On a CPU all ranks share the machine's cores: every figure is stretched by ranks / cores where that is > 1.

The micro-benchmarks time each matmul alone, operands hot in cache, and the elementwise passes a layer needs; a
real step runs slower (the framework's copies, mask fills and zeroing; operands out of cache; collectives that
wait for a partner still computing). Where the calibration ran real megatron-core steps (a CPU), its fitted
scales (``step_fit.fit_compute_scales``, ``fit_comm_scale``: calibration ``framework``) stretch the matmuls, the
elementwise work and the collectives inside the step accordingly; 16-bit elementwise work runs at its measured
speed against fp32 (``elementwise_speed``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from hyper_adaptor.dryrun.comm_theory import (
    TimingError,
    cp_sent_bytes,
    dp_sent_bytes,
    ep_sent_bytes,
    tp_sent_bytes,
)
from hyper_adaptor.dryrun.shape import ModelShape
from hyper_adaptor.dryrun.workload import (
    Dims,
    elementwise_bytes,
    flops,
    layer_flops,
    layer_matmuls,
    logits_matmul,
    loss_bytes,
    raw_matmul_time,
)

PARTS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "bubble", "dp_comm", "optimizer",
         "swap", "framework")
DDP_BUCKET_ELEMENTS = 40_000_000  # megatron's default bucket with --overlap-grad-reduce
ADAM_BYTES_PER_PARAM = 28          # fp32: read param, grad, m, v; write param, m, v
NEWTON_SCHULZ_STEPS = 5


# ------------------------------------------------------------------------------------------- the step
@dataclasses.dataclass
class StepTime:
    """Predicted seconds of one training step on the slowest rank. ``parts`` (keys PARTS) sum to ``total``:
    compute (matmuls, elementwise, per-layer dispatch), recompute (the forward run again in backward),
    tp/cp/ep/pp communication inside the step, the pipeline bubble, the data-parallel reduction left exposed,
    the optimizer step, swap copies, and megatron's fixed cost per step (framework). ``costs``: seconds per
    micro-batch of the F / B / I / W steps the pipeline simulation used."""

    total: float
    parts: dict[str, float]
    micro_batches: int
    schedule: str
    bubble_fraction: float
    flops_per_rank: float
    comm_bytes: dict[str, float]
    costs: dict[str, float]
    notes: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        shown = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in self.parts.items() if v > 0)
        return (f"step {self.total * 1e3:.1f} ms ({shown} ms); {self.micro_batches} micro-batches, "
                f"{self.schedule}, bubble {self.bubble_fraction:.1%}")


@dataclasses.dataclass
class _Options:
    """What the cost model reads from the flags beyond the shape."""

    schedule: str
    cp_algo: str
    ulysses_degree: int
    dispatcher: str
    dp_mode: str
    dp_shard: int
    overlap_dp: bool
    optimizer: str
    offload_fraction: float
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    recompute_modules: tuple
    recompute_activation: int | None
    recompute_norm: int | None
    swap_modules: tuple
    swap_layers: int | None

    @classmethod
    def from_args(cls, args, d: Dims) -> _Options:
        def get(name, default=None):
            value = getattr(args, name, None)
            return default if value is None else value

        schedule = get("pipeline_schedule") or ("interleaved" if d.chunks > 1 else "1f1b")
        algo, degree = "ring", 1
        if d.cp > 1:
            from hyper_adaptor.features.context_parallel import ContextParallel, ulysses_degree

            algo = ContextParallel().algorithm(args)
            degree = ulysses_degree(args, algo) or 1
        engine = get("moe_dispatcher_engine", "megatron") == "hyper"
        dispatcher = "alltoall" if engine else get("moe_token_dispatcher_type", "allgather")
        if get("use_hsdp", False):
            dp_mode = "hsdp-" + get("hsdp_optimizer_level", "level2")
        else:
            dp_mode = "distopt" if get("use_distributed_optimizer", False) else "ddp"
        granularity = get("recompute_granularity")
        modules = tuple(get("recompute_modules") or (("core_attn",) if granularity == "selective" else ()))
        swap = tuple(get("swap_modules") or ())
        if get("swap_attention", False):
            swap += ("attention",)
        if get("fine_grained_activation_offloading", False):
            swap += tuple(get("offload_modules") or ("attention",))
        activation = get("recompute_activation_function", False)
        norm = get("recompute_norm", False)
        return cls(
            schedule=schedule, cp_algo=algo, ulysses_degree=int(degree), dispatcher=dispatcher, dp_mode=dp_mode,
            dp_shard=int(get("hsdp_shard_size", -1)),
            overlap_dp=bool(get("overlap_grad_reduce", False) or get("hsdp_comm_async", False)),
            optimizer=str(get("optimizer", "adam")),
            offload_fraction=float(get("optimizer_offload_fraction", 1.0)) if get("optimizer_cpu_offload", False)
            else 0.0,
            recompute_granularity=granularity, recompute_method=get("recompute_method"),
            recompute_num_layers=get("recompute_num_layers"), recompute_modules=modules,
            recompute_activation=(get("recompute_activation_function_num_layers") or d.layers) if activation else None,
            recompute_norm=(get("recompute_norm_num_layers") or d.layers) if norm else None,
            swap_modules=swap, swap_layers=get("cpu_offloading_num_layers"))


def _times(cal, d: Dims, mm: dict) -> float:
    """Seconds of the matmuls ``mm`` inside a training step: the micro-benchmark's rate for their size, times
    the slowdown a real step showed on this machine (``matmul_scale``, 1 where not measured)."""
    return raw_matmul_time(cal, d, mm) * cal.framework.get("matmul_scale", 1.0)


def _recomputed(d: Dims, o: _Options, layers: list[int], position: int) -> bool:
    """Whether the layer at ``position`` within its stage (chunk) runs its forward again in backward."""
    if o.recompute_granularity != "full":
        return False
    if o.recompute_method == "block":
        return position < int(o.recompute_num_layers or 0)
    return True  # uniform: every layer, in groups of recompute_num_layers


def _stage_cost(cal, d: Dims, o: _Options, layers: list[int], first: bool, last: bool) -> dict:
    """Seconds per micro-batch of one stage's forward (F), input gradient (I), weight gradient (W) and
    the parts they are made of."""
    f = {"compute": 0.0, "recompute": 0.0, "tp_comm": 0.0, "cp_comm": 0.0, "ep_comm": 0.0, "swap": 0.0}
    i = dict(f)
    w = dict(f)
    flop = 0.0
    # elementwise work at the calibrated bandwidth, slowed as a real step showed (elementwise_scale); swap's
    # copies are plain copies, at the bandwidth itself
    bw = cal.memory_bytes_per_s / cal.framework.get("elementwise_scale", 1.0)
    fp32_bw = bw  # the loss runs in fp32 whatever the model's dtype
    if d.elem != 4 and d.matmul_dtype in cal.elementwise_speed:
        # the layer's bytes at d.elem per element, at the rate the dtype's elements were measured to run
        bw *= cal.elementwise_speed[d.matmul_dtype] * d.elem / 4
    # the collectives inside the step, slowed as a real tensor-parallel step showed (comm_scale)
    comm = cal.framework.get("comm_scale", 1.0)
    attention_core = ("scores", "values")
    for position, layer in enumerate(layers):
        moe = d.is_moe(layer)
        mm = layer_matmuls(d, moe)
        core = _times(cal, d, {k: mm[k] for k in attention_core})
        linear = _times(cal, d, {k: v for k, v in mm.items() if k not in attention_core})
        elem = elementwise_bytes(d, moe) / bw
        overhead = cal.framework.get("layer_s", cal.layer_overhead_s)
        if moe:  # the router, permutation and per-expert loop's operators (calibrated beside a dense layer)
            overhead += cal.framework.get("moe_layer_s", 0.0)
        flop += 3 * sum(flops(mm).values())
        f["compute"] += core + linear + elem + overhead / 3
        i["compute"] += 2 * core + linear + 2 * elem + overhead / 3
        w["compute"] += linear + overhead / 3
        if _recomputed(d, o, layers, position):
            i["recompute"] += core + linear + elem + overhead / 3
            flop += sum(flops(mm).values())
        else:
            extra = 0.0
            modules = set(o.recompute_modules)
            if "core_attn" in modules:
                extra += core + 7 * d.elem * d.micro_batch * d.heads / d.tp * (d.seq / d.cp) * d.seq / bw
            if "mlp" in modules and not moe:
                extra += _times(cal, d, {k: mm[k] for k in ("fc1", "fc2")})
            if "moe" in modules and moe:
                extra += _times(cal, d, {k: v for k, v in mm.items() if k.startswith(("expert", "shared", "router"))})
            rows = d.micro_batch * d.seq / d.cp / (d.tp if d.sp else 1)
            if "layernorm" in modules or (o.recompute_norm and layer < o.recompute_norm):
                extra += 4 * rows * d.hidden * d.elem / bw
            if {"moe_act", "mlp"} & modules or (o.recompute_activation and layer < o.recompute_activation):
                width = (d.topk * d.moe_ffn + d.shared_ffn) if moe else d.ffn
                extra += 2 * rows * width / d.tp * d.elem / bw
            i["recompute"] += extra
        swapped = _swapped_bytes(d, o, layer)
        if swapped and cal.device == "cpu":
            # a copy to host memory and back, each a read and a write of the same memory
            f["swap"] += 2 * swapped / cal.memory_bytes_per_s
            i["swap"] += 2 * swapped / cal.memory_bytes_per_s
        elif swapped:
            # on an accelerator the copy runs on its own stream over the host link, beside the layer's compute
            # (the swap-out after the layer's forward, the prefetch during the next layer's backward): what
            # the link needs beyond that compute shows in the step
            link = swapped / cal.host_link()
            f["swap"] += max(0.0, link - (core + linear + elem))
            i["swap"] += max(0.0, link - (2 * core + linear + 2 * elem))
        if moe:
            sent, calls = ep_sent_bytes(d, o.dispatcher)
            op = "all_gather" if o.dispatcher == "allgather" else "all_to_all"
            f["ep_comm"] += comm * cal.collective_time(op, d.ep, sent / 2, calls // 2)
            i["ep_comm"] += comm * cal.collective_time(op, d.ep, sent / 2, calls - calls // 2)
        if d.cp > 1:
            cp = cp_sent_bytes(o.cp_algo, d, o.ulysses_degree)
            op, group = {"ulysses": ("all_to_all", d.cp), "allgather": ("all_gather", d.cp)}.get(
                o.cp_algo, ("send_recv", 2))
            f["cp_comm"] += comm * cal.collective_time(op, group, cp["forward"], cp["calls_forward"])
            i["cp_comm"] += comm * cal.collective_time(op, group, cp["backward"], cp["calls_backward"])
    tp = tp_sent_bytes(d, len(layers), first, last)
    op = "all_gather" if d.sp else "all_reduce"
    f["tp_comm"] += comm * cal.collective_time(op, d.tp, tp["forward"], tp["calls_forward"])
    i["tp_comm"] += comm * cal.collective_time(op, d.tp, tp["backward"], tp["calls_backward"])
    if last:
        mm = {"logits": logits_matmul(d)}
        logits = _times(cal, d, mm)
        loss = loss_bytes(d) / fp32_bw
        f["compute"] += logits + loss
        i["compute"] += logits + loss + cal.framework.get("micro_batch_s", 0.0) / 2
        w["compute"] += logits
        flop += 3 * sum(flops(mm).values())
    if first:
        f["compute"] += cal.framework.get("micro_batch_s", 0.0) / 2  # embedding, the schedule's bookkeeping
        w["compute"] += 2 * d.micro_batch * d.seq / d.cp * d.hidden * d.elem / bw
    return {"F": f, "I": i, "W": w, "flops": flop,
            "tp_bytes": tp["forward"] + tp["backward"]}


def _swapped_bytes(d: Dims, o: _Options, layer: int) -> float:
    """Activation bytes a layer sends to host: the attention part (about 5.5 + 2.5 a s / h elements per
    token and hidden unit, the usual per-layer count) for attention swaps, the whole layer (17 + 2.5 a s / h)
    when a whole layer is offloaded."""
    tokens = d.micro_batch * d.seq / d.cp
    scores = 2.5 * d.heads * d.seq / d.hidden
    per = tokens * d.hidden * d.elem / d.tp
    if o.swap_layers and layer < int(o.swap_layers):
        return per * (17 + scores)
    if o.swap_modules:
        return per * (5.5 + scores)
    return 0.0


@functools.lru_cache(maxsize=64)
def _schedule(name: str, pp: int, micro: int, chunks: int):
    from hyper_adaptor.parallel.pipeline.schedules import build

    return build(name, pp, micro, chunks if name in ("interleaved", "zbv") else None)


def _pipeline(name: str, d: Dims, costs: dict, comm: float) -> tuple[float, float, float]:
    """(makespan, makespan without the point-to-point time, bubble fraction) of ``name`` on the simulator.

    Past 3 x PP micro-batches the lists are simulated at a count with the same remainder modulo PP and one
    PP more, and the makespan extended by their difference per PP micro-batches: the steady phase adds the
    same time per micro-batch, and a planner's thousand micro-batches need no thousand-step lists."""
    from hyper_adaptor.parallel.pipeline.timeline import simulate

    m, p = d.num_micro_batches, d.pp
    per_micro = d.chunks * (costs["F"] + (costs["I"] + costs["W"] if "I" in costs else costs["B"]))
    if p == 1:
        return m * per_micro, m * per_micro, 0.0

    def spans(micro: int) -> tuple[float, float]:
        layout, lists = _schedule(name, p, micro, d.chunks)
        return simulate(lists, layout, costs, comm).makespan, simulate(lists, layout, costs, 0.0).makespan

    if m <= 3 * p:
        with_comm, ideal = spans(m)
    else:
        base = 2 * p + (m - 2 * p) % p
        (c0, i0), (c1, i1) = spans(base), spans(base + p)
        steps = (m - base) / p
        with_comm, ideal = c0 + steps * (c1 - c0), i0 + steps * (i1 - i0)
    return with_comm, ideal, max(1.0 - m * per_micro / ideal, 0.0) if ideal else 0.0


def _matrices(d: Dims, layers: list[int]) -> list[tuple[float, float, float]]:
    """(rows, columns, count) of the weight matrices of ``layers`` on one rank (what Muon orthogonalises)."""
    up = 2 if d.swiglu else 1
    out = []
    for layer in layers:
        out += [(d.hidden, (d.q_dim + 2 * d.kv_dim) / d.tp, 1), (d.q_dim / d.tp, d.hidden, 1)]
        if d.is_moe(layer):
            out += [(d.hidden, up * d.moe_ffn / d.etp, d.num_experts / d.ep),
                    (d.moe_ffn / d.etp, d.hidden, d.num_experts / d.ep)]
        else:
            out += [(d.hidden, up * d.ffn / d.tp, 1), (d.ffn / d.tp, d.hidden, 1)]
    return out


def _optimizer_time(cal, d: Dims, o: _Options, dense: float, expert: float, matrices: list,
                    shards: tuple[int, int]) -> float:
    """Adam: memory-bound over the parameters this rank updates (its shard with the distributed optimizer
    or HSDP); the offloaded fraction runs on the host. Muon adds Newton-Schulz on each weight matrix."""
    dense_shard, expert_shard = shards
    local = dense / dense_shard + expert / expert_shard
    seconds = local * ADAM_BYTES_PER_PARAM / cal.memory_bytes_per_s
    if o.offload_fraction and cal.device != "cpu":
        # the offloaded share's gradients go down and its parameters come back over the host link
        seconds += o.offload_fraction * local * (d.grad_bytes + d.elem) / cal.collectives["send_recv"]["bytes_per_s"]
    if "muon" in o.optimizer:
        ns = 0.0
        for rows, cols, count in matrices:
            small, big = min(rows, cols), max(rows, cols)
            # per iteration X X^T (small^2 big), (X X^T)^2 (small^3) and its product with X (small^2 big)
            ns += count * NEWTON_SCHULZ_STEPS * (cal.matmul_time(small, big, small, "float32", 2)
                                                 + cal.matmul_time(small, small, small, "float32"))
        seconds += ns / (dense_shard if o.optimizer.startswith("dist") else 1)
    return seconds


def _stages(d: Dims) -> list[list[tuple[int, list[int]]]]:
    """Per pipeline rank: (stage index, global layers) of each of its model chunks (ModelShape's placement)."""
    per_stage_rank = d.world // d.pp
    out = []
    for r in range(d.pp):
        chunks = d.chunks_on(r * per_stage_rank)
        if d.schedule == "zbv":
            stages = [r, 2 * d.pp - 1 - r]
        else:
            stages = [c * d.pp + r for c in range(len(chunks))]
        out.append(list(zip(stages, chunks, strict=True)))
    return out


def _dp_time(cal, d: Dims, o: _Options, args, dense: float, expert: float, m: int) -> tuple[float, float]:
    """(seconds, bytes sent) of the data-parallel reduction of one step on one rank: dense parameters over
    DP x CP, expert parameters over the expert data-parallel group; HSDP over its shard groups (and an
    all-reduce across their replicas), level 3 gathering the parameters again for every micro-batch."""
    mode = o.dp_mode if o.dp_mode in ("ddp", "distopt", "hsdp-level3") else "distopt"
    seconds = sent_total = 0.0
    for params, group in ((dense, d.dp * d.cp), (expert, max(d.world // (d.pp * d.ep * d.etp), 1))):
        if not params or group <= 1:
            continue
        shard = group
        if o.dp_mode.startswith("hsdp") and 0 < o.dp_shard < group:
            shard, replicas = o.dp_shard, group // o.dp_shard
            replica = 2 * params / shard * d.grad_bytes * (replicas - 1) / replicas
            sent_total += replica
            seconds += cal.collective_time("all_reduce", replicas, replica)
        sent = dp_sent_bytes(mode, params, shard, d.grad_bytes, d.elem)
        bucket = DDP_BUCKET_ELEMENTS
        if o.dp_mode.startswith("hsdp"):
            bucket = max(int(float(getattr(args, "hsdp_bucket_size_kb", 25600) or 25600) * 1024 / d.grad_bytes), 1)
        calls = max(1, math.ceil(params / bucket))
        if mode == "ddp":
            seconds += cal.collective_time("all_reduce", shard, sent, calls)
        else:
            seconds += cal.collective_time("reduce_scatter", shard, sent / 2, calls)
            seconds += cal.collective_time("all_gather", shard, sent / 2, calls)
        if o.dp_mode == "hsdp-level3" and m > 1:
            gather = 2 * params * d.elem * (shard - 1) / shard
            seconds += (m - 1) * cal.collective_time("all_gather", shard, gather, 2 * calls)
            sent += (m - 1) * gather
        sent_total += sent
    return seconds, sent_total


def predict_time(args, calibration, shape=None) -> StepTime:
    """Predicted step time of the run ``args`` describes (the namespace :func:`hyper_adaptor.dryrun.parse`
    returns) on the machine ``calibration`` measured (:func:`hyper_adaptor.dryrun.calibrate.get`). ``shape``:
    the run's :class:`ModelShape` when the caller has it (else read from ``args``); the flags beyond the shape
    (schedule, CP algorithm, dispatcher, data-parallel mode, recompute, swap, optimizer) are read from ``args``."""
    d = Dims.from_shape(shape or ModelShape.from_args(args), args)
    o = _Options.from_args(args, d)
    if d.world % (d.tp * d.pp * d.cp):
        raise TimingError(f"--world-size {d.world} is not a multiple of TP x PP x CP = {d.tp * d.pp * d.cp}")
    if d.dp * d.tp * d.pp * d.cp != d.world:
        # a shape changed with dataclasses.replace (a planner's candidate) must change its DP size with it
        raise TimingError(f"data-parallel size {d.dp} x TP {d.tp} x PP {d.pp} x CP {d.cp} is not --world-size "
                          f"{d.world}")
    if d.num_micro_batches < 1 or d.global_batch % (d.micro_batch * d.dp):
        raise TimingError(f"--global-batch-size {d.global_batch} is not a multiple of --micro-batch-size "
                          f"{d.micro_batch} x data-parallel size {d.dp}")
    cal, m, notes = calibration, d.num_micro_batches, []
    stretch = 1.0
    if cal.device == "cpu":
        # every rank is a process of this machine with one thread: more ranks than cores share them
        stretch = max(1.0, d.world / max(cal.cores, 1))
        if stretch > 1:
            notes.append(f"{d.world} ranks on {cal.cores} cores: every figure x {stretch:g}")
    ranks = _stages(d)
    last_stage = d.pp * d.chunks - 1
    cost = {stage: _stage_cost(cal, d, o, layers, stage == 0, stage == last_stage)
            for chunks in ranks for stage, layers in chunks}
    # one cost per step type for the simulator, the same on every stage: the busiest pipeline rank's, per
    # model chunk (the simulator knows no stage of its own cost; the busiest rank paces the steady state)
    busy = [sum(sum(cost[s][k].values()) for s, _ in chunks for k in "FIW") for chunks in ranks]
    rank = max(range(d.pp), key=busy.__getitem__)
    step = {k: sum(sum(cost[s][k].values()) for s, _ in ranks[rank]) / d.chunks for k in "FIW"}
    costs = {"F": step["F"], "B": step["I"] + step["W"]}
    if o.schedule in ("zbh1", "zbv"):
        costs.update(I=step["I"], W=step["W"])
    # an activation crossing a stage boundary: [s / CP (/ TP with SP), b, h]
    boundary = d.micro_batch * d.seq / d.cp / (d.tp if d.sp else 1) * d.hidden * d.elem
    p2p = cal.collective_time("send_recv", 2, boundary) if d.pp > 1 else 0.0
    makespan, ideal, bubble_fraction = _pipeline(o.schedule, d, costs, p2p)
    parts = dict.fromkeys(PARTS, 0.0)
    for stage, _ in ranks[rank]:
        for k in "FIW":
            for name, value in cost[stage][k].items():
                parts[name] += m * value
    parts["pp_comm"] = max(makespan - ideal, 0.0)
    parts["bubble"] = max(ideal - m * busy[rank], 0.0)
    flop = m * sum(cost[s]["flops"] for s, _ in ranks[rank])

    first_rank = rank * (d.world // d.pp)
    params = d.params_on(first_rank)
    expert = float(params.get("experts", 0))
    dense = float(sum(params.values())) - expert
    dp_time, dp_bytes = _dp_time(cal, d, o, args, dense, expert, m)
    if o.overlap_dp and dp_time:
        # buckets reduce while the last micro-batch's backward still runs
        hidden = sum(sum(cost[s][k].values()) for s, _ in ranks[rank] for k in "IW")
        exposed = max(dp_time - hidden, 0.0)
        notes.append(f"data-parallel reduction overlapped with the last backward: {exposed / dp_time:.0%} exposed")
        dp_time = exposed
    if d.pp > 1 and not d.untied and (rank == 0 or rank == d.pp - 1):
        # the tied word embedding's gradient, all-reduced between the first and the last stage
        tied = 2 * d.vocab * d.hidden / d.tp * d.grad_bytes / 2
        dp_time += cal.collective_time("all_reduce", 2, tied)
        dp_bytes += tied
    parts["dp_comm"] = dp_time
    shards = (1, 1)
    if o.dp_mode != "ddp":
        shards = (d.dp * d.cp, max(d.world // (d.pp * d.ep * d.etp), 1))
        if o.dp_mode.startswith("hsdp") and o.dp_shard > 0:
            shards = tuple(min(o.dp_shard, n) for n in shards)
    layers = [layer for _, chunk in ranks[rank] for layer in chunk]
    parts["optimizer"] = _optimizer_time(cal, d, o, dense, expert, _matrices(d, layers), shards)
    parts["framework"] = cal.framework.get("step_s", 0.0)

    parts = {k: v * stretch for k, v in parts.items()}
    comm_bytes = {"tp": m * sum(cost[s]["tp_bytes"] for s, _ in ranks[rank]), "dp": dp_bytes}
    if d.cp > 1:
        cp = cp_sent_bytes(o.cp_algo, d, o.ulysses_degree)
        comm_bytes["cp"] = m * len(layers) * (cp["forward"] + cp["backward"])
    if d.ep > 1:
        comm_bytes["ep"] = m * sum(d.is_moe(layer) for layer in layers) * ep_sent_bytes(d, o.dispatcher)[0]
    return StepTime(total=sum(parts.values()), parts=parts, micro_batches=m,
                    schedule=o.schedule if d.pp > 1 else "none (one stage)", bubble_fraction=bubble_fraction,
                    flops_per_rank=flop, comm_bytes=comm_bytes,
                    costs={k: v * stretch for k, v in costs.items()}, notes=notes)


__all__ = ["PARTS", "Dims", "StepTime", "TimingError", "predict_time", "layer_matmuls", "layer_flops",
           "tp_sent_bytes", "cp_sent_bytes", "ep_sent_bytes", "dp_sent_bytes"]
