"""Step time of a Megatron command line, predicted from the model's shape and a machine's calibration.

The model, per pipeline stage and micro-batch:

- compute: each layer's matmuls (QKV, attention scores and values, projection, MLP or routed experts, the
  logits on the last stage) timed at the calibrated throughput *for their size*, plus elementwise traffic
  (norms, residuals, dropout, softmax, activation) at the calibrated memory bandwidth, plus the calibrated
  fixed cost of a layer (operator dispatch); backward costs twice the forward matmuls (input and weight
  gradients), and a recomputed layer runs its forward once more in backward. TP divides heads, MLP and vocab,
  CP the sequence, EP x ETP the experts (tokens per expert from top-k).
- communication inside the step, per feature, with the volume of the engines' own theory (the benches' theory
  columns, restated in :mod:`hyper_adaptor.dryrun.timing` because the benches are not part of the installed
  package; tests/unit/test_dryrun_timing.py checks each against the bench's function): TP reductions
  (bench/_tp_contenders.py ``theory_tp_bytes``, ``theory_megatron_sp_regather_bytes``), CP per algorithm
  (bench/_cp_analysis.py ``theory``), EP dispatch and combine (bench/expert_parallel.py
  ``engine_theory_bytes``), each collective timed as latency per ring step + bytes sent / calibrated rate.
- the pipeline: F / B (I / W for the zero-bubble schedules) costs of the slowest stage on the schedule's own
  action lists (``schedules.build``) through the timeline simulator (``timeline.simulate``), with the activation
  send as the cost between ranks: its makespan is compute plus bubble plus exposed point-to-point time.
- after the last micro-batch: the data-parallel gradient reduction (all-reduce for DDP; reduce-scatter and
  all-gather for the distributed optimizer and HSDP, parameters gathered twice more per micro-batch at HSDP
  level 3: bench/_tp_contenders.py ``theory_dp_bytes``, bench/_hsdp_contenders.py ``theory_comm_bytes``), less
  the part hidden behind the last backward with ``--overlap-grad-reduce`` / ``--hsdp-comm-async``, and the
  optimizer step (Adam: memory-bound over the local shard; Muon: its Newton-Schulz matmuls).

On a CPU all ranks share the machine's cores: every figure is stretched by ranks / cores where that is > 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math

PARTS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "bubble", "dp_comm", "optimizer",
         "swap")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DDP_BUCKET_ELEMENTS = 40_000_000  # megatron's default bucket with --overlap-grad-reduce
ADAM_BYTES_PER_PARAM = 28          # fp32: read param, grad, m, v; write param, m, v
NEWTON_SCHULZ_STEPS = 5


class TimingError(ValueError):
    """A layout the step-time model cannot price (the message names the flag)."""


@dataclasses.dataclass
class Dims:
    """The figures of the model and its layout the cost model reads (megatron's argument names in brackets)."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    seq: int
    micro_batch: int
    global_batch: int
    vocab: int
    swiglu: bool = False
    num_experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    moe_layer_freq: object = 1
    dtype: str = "float32"
    grad_bytes: int = 4
    tp: int = 1
    pp: int = 1
    chunks: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sp: bool = False
    world: int = 1

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def is_moe(self, layer: int) -> bool:
        if not self.num_experts:
            return False
        freq = self.moe_layer_freq
        if isinstance(freq, (list, tuple)):
            return bool(freq[layer % len(freq)])
        return layer % int(freq or 1) == 0

    @classmethod
    def from_args(cls, args) -> Dims:
        def get(name, default=None):
            value = getattr(args, name, None)
            return default if value is None else value

        hidden, heads = int(args.hidden_size), int(args.num_attention_heads)
        tp = int(get("tensor_model_parallel_size", 1))
        kv_heads = int(get("num_query_groups", heads)) if get("group_query_attention", False) else heads
        vocab = get("padded_vocab_size")
        if vocab is None:  # megatron fills it when it builds the tokenizer: the same rounding
            multiple = int(get("make_vocab_size_divisible_by", 128)) * tp
            vocab = -(-int(get("vocab_size", 0)) // multiple) * multiple
        dtype = "bfloat16" if get("bf16", False) else "float16" if get("fp16", False) else "float32"
        fp32_grads = dtype == "float32" or get("accumulate_allreduce_grads_in_fp32", False)
        if get("use_hsdp", False) and get("hsdp_reduce_dtype"):
            fp32_grads = get("hsdp_reduce_dtype") in ("fp32", "float32")
        num_experts = int(get("num_experts", 0))
        ffn = int(get("ffn_hidden_size", 4 * hidden))
        chunks = _model_chunks(args)
        world = int(get("world_size", 1))
        return cls(
            hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv_heads,
            head_dim=int(get("kv_channels", hidden // heads)), layers=int(args.num_layers),
            seq=int(args.seq_length), micro_batch=int(args.micro_batch_size),
            global_batch=int(get("global_batch_size", args.micro_batch_size)), vocab=int(vocab),
            swiglu=bool(get("swiglu", False)), num_experts=num_experts,
            topk=int(get("moe_router_topk", 2)) if num_experts else 0,
            moe_ffn=int(get("moe_ffn_hidden_size", ffn)) if num_experts else 0,
            shared_ffn=int(get("moe_shared_expert_intermediate_size", 0)) if num_experts else 0,
            moe_layer_freq=get("moe_layer_freq", 1), dtype=dtype, grad_bytes=4 if fp32_grads else 2,
            tp=tp, pp=int(get("pipeline_model_parallel_size", 1)), chunks=chunks,
            cp=int(get("context_parallel_size", 1)), ep=int(get("expert_model_parallel_size", 1)),
            etp=int(get("expert_tensor_parallel_size", tp)), sp=bool(get("sequence_parallel", False)),
            world=world)


def _model_chunks(args) -> int:
    from hyper_adaptor.patches.pipeline import model_chunks

    return model_chunks(args)


# ------------------------------------------------------------------------------------------------ FLOPs
def layer_matmuls(d: Dims, moe: bool) -> dict[str, tuple[float, float, float, float]]:
    """The forward matmuls of one layer and micro-batch on one rank: name -> (m, k, n, count)."""
    t = d.micro_batch * d.seq / d.cp                  # tokens of this rank (CP splits the sequence)
    mm = {
        "qkv": (t, d.hidden, (d.q_dim + 2 * d.kv_dim) / d.tp, 1),
        # every query of this rank against the whole sequence's keys, then the values; heads split by TP
        "scores": (d.seq / d.cp, d.head_dim, d.seq, d.micro_batch * d.heads / d.tp),
        "values": (d.seq / d.cp, d.seq, d.head_dim, d.micro_batch * d.heads / d.tp),
        "proj": (t, d.q_dim / d.tp, d.hidden, 1),
    }
    up = 2 if d.swiglu else 1
    if not moe:
        mm["fc1"] = (t, d.hidden, up * d.ffn / d.tp, 1)
        mm["fc2"] = (t, d.ffn / d.tp, d.hidden, 1)
        return mm
    # routed rows land evenly on the experts: the expert group's tokens x top-k over its EP x ETP ranks;
    # this rank's share of the rows is t x k / TP (TP ranks hold the same tokens), each expert's FFN / ETP
    local_experts = d.num_experts / d.ep
    rows = t * d.topk * d.etp / d.tp / local_experts
    mm["router"] = (t, d.hidden, d.num_experts, 1)
    mm["expert_fc1"] = (rows, d.hidden, up * d.moe_ffn / d.etp, local_experts)
    mm["expert_fc2"] = (rows, d.moe_ffn / d.etp, d.hidden, local_experts)
    if d.shared_ffn:
        mm["shared_fc1"] = (t, d.hidden, up * d.shared_ffn / d.tp, 1)
        mm["shared_fc2"] = (t, d.shared_ffn / d.tp, d.hidden, 1)
    return mm


def logits_matmul(d: Dims) -> tuple[float, float, float, float]:
    return (d.micro_batch * d.seq / d.cp, d.hidden, d.vocab / d.tp, 1)


def flops(mm: dict) -> dict[str, float]:
    return {name: 2.0 * m * k * n * c for name, (m, k, n, c) in mm.items()}


def layer_flops(d: Dims, moe: bool = False) -> float:
    """Forward FLOPs of one layer and micro-batch on one rank (backward: twice as many)."""
    return sum(flops(layer_matmuls(d, moe)).values())


def elementwise_bytes(d: Dims, moe: bool) -> float:
    """Forward memory traffic of one layer's elementwise work on one rank: two norms (read + write), two
    dropout-and-residual adds (about five passes each), the activation over the FFN width, rotary on Q and K,
    and the attention probabilities' scale, mask, softmax and dropout (about seven passes)."""
    t = d.micro_batch * d.seq / d.cp
    rows = t / d.tp if d.sp else t
    act = (d.topk * d.moe_ffn / d.tp + d.shared_ffn / d.tp) if moe else d.ffn / d.tp
    probs = d.micro_batch * d.heads / d.tp * (d.seq / d.cp) * d.seq
    return d.elem * (14 * rows * d.hidden + 3 * t * act + 4 * t * (d.q_dim + d.kv_dim) / d.tp + 7 * probs)


# ------------------------------------------------------------------------ the engines' communication theory
def tp_sent_bytes(d: Dims, layers: int, first: bool, last: bool) -> dict:
    """Bytes one rank sends for TP in one micro-batch over ``layers`` layers of a stage, forward and backward,
    with the collectives made: bench/_tp_contenders.py ``theory_tp_bytes`` (megatron's vocab-parallel loss: no
    gathered logits) plus ``theory_megatron_sp_regather_bytes`` under sequence parallel."""
    out = {"forward": 0.0, "backward": 0.0, "calls_forward": 0, "calls_backward": 0}
    if d.tp == 1:
        return out
    activation = d.elem * d.micro_batch * (d.seq / d.cp) * d.hidden
    reduction = 2 * (d.tp - 1) * activation / d.tp
    per = 2 if d.sp else 1                      # an all-reduce, or a reduce-scatter and an all-gather
    # per layer two reductions each way (attention's and the MLP's); the embedding's forward and the output
    # layer's backward reduction at the ends
    out["forward"] = (2 * layers + int(first)) * reduction
    out["backward"] = (2 * layers + int(last)) * reduction
    out["calls_forward"] = per * (2 * layers + int(first)) + 3 * int(last)  # + the loss's [b, s] reductions
    out["calls_backward"] = per * (2 * layers + int(last))
    if d.sp:
        out["backward"] += (2 * layers + int(last)) * (d.tp - 1) * activation / d.tp
        out["calls_backward"] += 2 * layers + int(last)
    return out


def cp_sent_bytes(algo: str, d: Dims, ulysses_degree: int = 2) -> dict:
    """Bytes one rank sends per layer and micro-batch for CP ``algo`` (bench/_cp_analysis.py ``theory``, at
    this run's element size; the ring's travelling dK / dV accumulators stay fp32), with the calls made."""
    n = d.cp
    s, b, nh, ng, hn = d.seq / n, d.micro_batch, d.heads / d.tp, max(d.kv_heads / d.tp, 1), d.head_dim
    zero = {"forward": 0.0, "backward": 0.0, "calls_forward": 0, "calls_backward": 0}
    if n == 1:
        return zero
    q = s * b * nh * hn * d.elem
    if algo == "ulysses":
        kv = s * b * _kv_heads_for(ng, n) * hn * d.elem
        each = (n - 1) * (2 * q + 2 * kv) / n
        return {"forward": each, "backward": each, "calls_forward": 4, "calls_backward": 4}
    if algo == "allgather":
        kv = s * b * ng * hn * d.elem
        return {"forward": 2 * (n - 1) * kv, "backward": 2 * (n - 1) * kv, "calls_forward": 2, "calls_backward": 2}
    if algo == "ring":
        u, g, ulysses_each = 1, n, 0.0
        kv = s * b * ng * hn * d.elem
    elif algo == "hybrid":
        u, g = ulysses_degree, n // ulysses_degree
        kv = s * b * _kv_heads_for(ng, u) * hn * d.elem
        ulysses_each = (u - 1) * (2 * q + 2 * kv) / u
    else:
        raise TimingError(f"--context-parallel-algo: no communication model for {algo!r}")
    kv_fp32 = kv * 4 / d.elem
    a2a = 4 if u > 1 else 0
    return {"forward": ulysses_each + (g - 1) * 2 * kv,
            "backward": ulysses_each + (g - 1) * 2 * kv + g * 2 * kv_fp32,
            "calls_forward": a2a + (g - 1), "calls_backward": a2a + 2 * g}


def _kv_heads_for(ng: float, degree: int) -> float:
    """KV heads a Ulysses rank holds before its split: ng repeated degree / gcd(ng, degree) times."""
    ng_int = max(int(round(ng)), 1)
    return ng_int * (degree // math.gcd(ng_int, degree))


def ep_sent_bytes(d: Dims, dispatcher: str) -> tuple[float, int]:
    """(bytes one rank sends per MoE layer and micro-batch, forward and backward, collectives). all-to-all
    (megatron's alltoall dispatcher and hyper_adaptor's engine): bench/expert_parallel.py
    ``engine_theory_bytes`` with evenly routed rows; megatron's allgather dispatcher gathers the tokens of the
    expert group and reduce-scatters them back."""
    if d.ep == 1:
        return 0.0, 0
    t = d.micro_batch * d.seq / d.cp
    if dispatcher == "allgather":
        tokens = t * d.ep * d.etp / d.tp
        return 4 * (d.ep - 1) / d.ep * tokens * d.hidden * d.elem, 4
    rows = t * d.topk * d.etp / d.tp * (d.ep - 1) / d.ep    # sent = received, in expectation
    return 2 * (2 * rows) * d.hidden * d.elem + d.num_experts * 8 * (d.ep - 1) / d.ep, 5


def dp_sent_bytes(mode: str, params: float, n: int, grad_bytes: int, param_bytes: int) -> float:
    """Bytes one rank sends per step to reduce ``params`` gradients over ``n`` data-parallel ranks
    (bench/_tp_contenders.py ``theory_dp_bytes``, at the run's element sizes): DDP all-reduces (2Ψ); the
    distributed optimizer and HSDP reduce-scatter gradients and all-gather parameters (Ψ each; level 3
    gathers parameters twice: 3Ψ, bench/_hsdp_contenders.py ``theory_comm_bytes``)."""
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    if mode == "ddp":
        return 2 * params * grad_bytes * share
    if mode == "hsdp-level3":
        return params * (grad_bytes + 2 * param_bytes) * share
    return params * (grad_bytes + param_bytes) * share


# ------------------------------------------------------------------------------------------ parameters
def layer_params(d: Dims, moe: bool) -> tuple[float, float]:
    """(dense, expert) parameters of one layer on one rank."""
    up = 3 if d.swiglu else 2
    dense = d.hidden * (d.q_dim + 2 * d.kv_dim) / d.tp + d.q_dim * d.hidden / d.tp + 4 * d.hidden
    if not moe:
        return dense + up * d.hidden * d.ffn / d.tp, 0.0
    dense += d.hidden * d.num_experts + up * d.hidden * d.shared_ffn / d.tp
    return dense, d.num_experts / d.ep * up * d.hidden * d.moe_ffn / d.etp


# ------------------------------------------------------------------------------------------- the step
@dataclasses.dataclass
class StepTime:
    """Predicted seconds of one training step on the slowest rank. ``parts`` (keys PARTS) sum to ``total``:
    compute (matmuls, elementwise, per-layer dispatch), recompute (the forward run again in backward),
    tp/cp/ep/pp communication inside the step, the pipeline bubble, the data-parallel reduction left exposed,
    the optimizer step, and swap copies. ``costs``: seconds per micro-batch of the F / B / I / W steps the
    pipeline simulation used."""

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
    first_stage_layers: int | None
    last_stage_layers: int | None
    learned_position: bool
    untied: bool

    @classmethod
    def from_args(cls, args, d: Dims) -> _Options:
        def get(name, default=None):
            value = getattr(args, name, None)
            return default if value is None else value

        schedule = get("pipeline_schedule") or ("interleaved" if d.chunks > 1 else "1f1b")
        algo, degree = "ring", 1
        if d.cp > 1:
            from hyper_adaptor.features.context_parallel import ContextParallel, _ulysses_degree

            algo = ContextParallel().algorithm(args)
            degree = _ulysses_degree(args, algo) or 1
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
            swap_modules=swap, swap_layers=get("cpu_offloading_num_layers"),
            first_stage_layers=get("num_layers_in_first_pipeline_stage"),
            last_stage_layers=get("num_layers_in_last_pipeline_stage"),
            learned_position=get("position_embedding_type", "learned_absolute") == "learned_absolute",
            untied=bool(get("untie_embeddings_and_output_weights", False)))


def stage_layers(d: Dims, o: _Options) -> list[list[int]]:
    """Global layer indices of each pipeline stage (stage = chunk x PP + rank for the loop layouts)."""
    stages = d.pp * d.chunks
    counts = [d.layers // stages] * stages
    if stages > 1 and (o.first_stage_layers or o.last_stage_layers):
        first = o.first_stage_layers if o.first_stage_layers is not None else None
        last = o.last_stage_layers if o.last_stage_layers is not None else None
        middle = stages - (first is not None) - (last is not None)
        rest = d.layers - (first or 0) - (last or 0)
        counts = [rest // middle if middle else 0] * stages
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
    counts[-1] += d.layers - sum(counts)
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def _times(cal, d: Dims, mm: dict) -> float:
    return sum(cal.matmul_time(m, k, n, d.dtype, c) for m, k, n, c in mm.values())


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
    bw = cal.memory_bytes_per_s
    attention_core = ("scores", "values")
    for position, layer in enumerate(layers):
        moe = d.is_moe(layer)
        mm = layer_matmuls(d, moe)
        core = _times(cal, d, {k: mm[k] for k in attention_core})
        linear = _times(cal, d, {k: v for k, v in mm.items() if k not in attention_core})
        elem = elementwise_bytes(d, moe) / bw
        overhead = cal.layer_overhead_s
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
            # a copy to host memory and back, each a read and a write; on an accelerator the prefetch hides it
            f["swap"] += 2 * swapped / bw
            i["swap"] += 2 * swapped / bw
        if moe:
            sent, calls = ep_sent_bytes(d, o.dispatcher)
            op = "all_gather" if o.dispatcher == "allgather" else "all_to_all"
            f["ep_comm"] += cal.collective_time(op, d.ep, sent / 2, calls // 2)
            i["ep_comm"] += cal.collective_time(op, d.ep, sent / 2, calls - calls // 2)
        if d.cp > 1:
            cp = cp_sent_bytes(o.cp_algo, d, o.ulysses_degree)
            op, group = {"ulysses": ("all_to_all", d.cp), "allgather": ("all_gather", d.cp)}.get(
                o.cp_algo, ("send_recv", 2))
            f["cp_comm"] += cal.collective_time(op, group, cp["forward"], cp["calls_forward"])
            i["cp_comm"] += cal.collective_time(op, group, cp["backward"], cp["calls_backward"])
    tp = tp_sent_bytes(d, len(layers), first, last)
    op = "all_gather" if d.sp else "all_reduce"
    f["tp_comm"] += cal.collective_time(op, d.tp, tp["forward"], tp["calls_forward"])
    i["tp_comm"] += cal.collective_time(op, d.tp, tp["backward"], tp["calls_backward"])
    if last:
        mm = {"logits": logits_matmul(d)}
        logits = _times(cal, d, mm)
        # the loss: softmax over the vocabulary shard, read and written a few times each way
        loss = 6 * d.micro_batch * d.seq / d.cp * d.vocab / d.tp * 4 / bw
        f["compute"] += logits + loss
        i["compute"] += logits + loss
        w["compute"] += logits
        flop += 3 * sum(flops(mm).values())
    if first:
        f["compute"] += cal.layer_overhead_s / 6  # the embedding lookup: a few operators
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
    """(makespan, makespan without the point-to-point time, bubble fraction) of ``name`` on the simulator."""
    from hyper_adaptor.parallel.pipeline.timeline import simulate

    m = d.micro_batches
    if d.pp == 1:
        busy = m * (costs["F"] + costs["B"])
        return busy, busy, 0.0
    layout, lists = _schedule(name, d.pp, m, d.chunks)
    with_comm = simulate(lists, layout, costs, comm)
    ideal = simulate(lists, layout, costs, 0.0)
    return with_comm.makespan, ideal.makespan, ideal.bubble


def _params_on_rank(d: Dims, o: _Options, stages: list[list[int]], rank: int) -> tuple[float, float, list]:
    """(dense, expert) parameters on pipeline rank ``rank`` (every chunk of it) and its 2-D weights' shapes
    (for Muon)."""
    from hyper_adaptor.parallel.pipeline.actions import StageLayout

    layout = StageLayout(d.pp, d.chunks, "v" if o.schedule == "zbv" else "loop")
    dense = expert = 0.0
    matrices = []
    for chunk in range(d.chunks):
        stage = layout.stage_of(rank, chunk)
        for layer in stages[stage]:
            moe = d.is_moe(layer)
            a, b = layer_params(d, moe)
            dense, expert = dense + a, expert + b
            matrices += [(d.hidden, (d.q_dim + 2 * d.kv_dim) / d.tp, 1), (d.q_dim / d.tp, d.hidden, 1)]
            up = 2 if d.swiglu else 1
            if moe:
                matrices += [(d.hidden, up * d.moe_ffn / d.etp, d.num_experts / d.ep),
                             (d.moe_ffn / d.etp, d.hidden, d.num_experts / d.ep)]
            else:
                matrices += [(d.hidden, up * d.ffn / d.tp, 1), (d.ffn / d.tp, d.hidden, 1)]
        if stage == 0:
            dense += d.vocab * d.hidden / d.tp + (d.seq * d.hidden if o.learned_position else 0)
        if stage == len(stages) - 1:
            dense += 2 * d.hidden
            if o.untied or d.pp > 1:
                dense += d.vocab * d.hidden / d.tp
    return dense, expert, matrices


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


def predict_time(args, calibration, dims: Dims | None = None) -> StepTime:
    """Predicted step time of the run ``args`` describes (the namespace a training run would have) on the
    machine ``calibration`` measured."""
    d = dims or Dims.from_args(args)
    o = _Options.from_args(args, d)
    if d.world % (d.tp * d.pp * d.cp):
        raise TimingError(f"--world-size {d.world} is not a multiple of TP x PP x CP = {d.tp * d.pp * d.cp}")
    if d.micro_batches < 1 or d.global_batch % (d.micro_batch * d.dp):
        raise TimingError(f"--global-batch-size {d.global_batch} is not a multiple of --micro-batch-size "
                          f"{d.micro_batch} x data-parallel size {d.dp}")
    cal = calibration
    notes = []
    stages = stage_layers(d, o)
    from hyper_adaptor.parallel.pipeline.actions import StageLayout

    layout = StageLayout(d.pp, d.chunks, "v" if o.schedule == "zbv" else "loop")
    per_stage = [_stage_cost(cal, d, o, layers, s == 0, s == len(stages) - 1) for s, layers in enumerate(stages)]
    # one figure per step type for the simulator: the slowest stage's, which paces the steady state
    worst = {}
    for kind in ("F", "I", "W"):
        worst[kind] = max(per_stage, key=lambda c, kind=kind: sum(c[kind].values()))[kind]
    split = o.schedule in ("zbh1", "zbv")
    cost = {k: sum(v.values()) for k, v in worst.items()}
    costs = {"F": cost["F"], "B": cost["I"] + cost["W"], "I": cost["I"], "W": cost["W"]}
    if not split:
        costs = {"F": cost["F"], "B": cost["I"] + cost["W"]}
    # an activation crossing a stage boundary: [s / CP (/ TP with SP), b, h]
    boundary = d.micro_batch * d.seq / d.cp / (d.tp if d.sp else 1) * d.hidden * d.elem
    p2p = cal.collective_time("send_recv", 2, boundary) if d.pp > 1 else 0.0
    makespan, ideal, bubble_fraction = _pipeline(o.schedule, d, costs, p2p)
    m = d.micro_batches
    # a rank runs `chunks` stages: its busy time is m x (its stages' costs); the busiest rank's
    by_rank = []
    for rank in range(d.pp):
        chunks = [per_stage[layout.stage_of(rank, c)] for c in range(d.chunks)]
        by_rank.append(chunks)
    busiest_rank = max(range(d.pp), key=lambda r: sum(sum(c[k].values()) for c in by_rank[r] for k in "FIW"))
    busiest = by_rank[busiest_rank]
    parts = dict.fromkeys(PARTS, 0.0)
    for c in busiest:
        for kind in ("F", "I", "W"):
            for name, value in c[kind].items():
                parts[name] += m * value
    busy = sum(parts.values())
    # stages other than the slowest wait for it: the simulator's makespan with the slowest stage's costs on
    # every stage is the step, what the busiest rank does not fill of it is bubble
    parts["pp_comm"] = max(makespan - ideal, 0.0)
    parts["bubble"] = max(ideal - busy, 0.0)
    flop = sum(c["flops"] for c in busiest) * m

    dense, expert, matrices = _params_on_rank(d, o, stages, busiest_rank)
    dense_group = d.dp * d.cp
    expert_group = max(d.world // (d.pp * d.ep * d.etp), 1)
    mode = o.dp_mode if o.dp_mode in ("ddp", "distopt", "hsdp-level3") else "distopt"
    dp_bytes = 0.0
    dp_time = 0.0
    for params, group, op_group in ((dense, dense_group, "dense"), (expert, expert_group, "expert")):
        if not params or group <= 1:
            continue
        shard = group
        if o.dp_mode.startswith("hsdp") and 0 < o.dp_shard < group:
            shard = o.dp_shard
            replicas = group // shard
            replica = 2 * params / shard * d.grad_bytes * (replicas - 1) / replicas
            dp_bytes += replica
            dp_time += cal.collective_time("all_reduce", replicas, replica)
        sent = dp_sent_bytes(mode, params, shard, d.grad_bytes, d.elem)
        bucket = DDP_BUCKET_ELEMENTS
        if o.dp_mode.startswith("hsdp"):
            bucket = max(int(getattr(args, "hsdp_bucket_size_kb", 25600) * 1024 / d.grad_bytes), 1)
        calls = max(1, math.ceil(params / bucket))
        if mode == "ddp":
            dp_time += cal.collective_time("all_reduce", shard, sent, calls)
        else:
            dp_time += cal.collective_time("reduce_scatter", shard, sent / 2, calls)
            dp_time += cal.collective_time("all_gather", shard, sent / 2, calls)
        if o.dp_mode == "hsdp-level3":
            # parameters gathered again for every micro-batch's forward and backward
            gather = 2 * params * d.elem * (shard - 1) / shard
            dp_time += (m - 1) * cal.collective_time("all_gather", shard, gather, 2 * calls)
            sent += (m - 1) * gather
        dp_bytes += sent
    if o.overlap_dp and dp_time:
        hidden = m and sum(sum(c[k].values()) for c in busiest for k in ("I", "W"))
        exposed = max(dp_time - hidden, 0.0)
        notes.append(f"data-parallel reduction overlapped with the last backward: {exposed / dp_time:.0%} exposed")
        dp_time = exposed
    parts["dp_comm"] = dp_time
    shards = (1, 1)
    if o.dp_mode != "ddp":
        shards = (dense_group, expert_group) if o.dp_shard <= 0 or not o.dp_mode.startswith("hsdp") else (
            min(o.dp_shard, dense_group), min(o.dp_shard, expert_group))
    parts["optimizer"] = _optimizer_time(cal, d, o, dense, expert, matrices, shards)

    stretch = 1.0
    if cal.device == "cpu":
        # every rank is a process of this machine, with one thread each: more ranks than cores share them
        stretch = max(1.0, d.world / max(cal.cores, 1))
        if stretch > 1:
            notes.append(f"{d.world} ranks on {cal.cores} cores: every figure x {stretch:g}")
    parts = {k: v * stretch for k, v in parts.items()}
    comm_bytes = {"tp": m * sum(c["tp_bytes"] for c in busiest), "dp": dp_bytes}
    if d.cp > 1:
        cp = cp_sent_bytes(o.cp_algo, d, o.ulysses_degree)
        comm_bytes["cp"] = m * (cp["forward"] + cp["backward"]) * sum(len(stages[layout.stage_of(r, c)])
                                                                       for r in [0] for c in range(d.chunks))
    if d.ep > 1:
        moe_layers = sum(d.is_moe(layer) for s in stages for layer in s) / d.pp
        comm_bytes["ep"] = m * moe_layers * ep_sent_bytes(d, o.dispatcher)[0]
    return StepTime(total=sum(parts.values()), parts=parts, micro_batches=m,
                    schedule=o.schedule if d.pp > 1 else "none (one stage)", bubble_fraction=bubble_fraction,
                    flops_per_rank=flop, comm_bytes=comm_bytes,
                    costs={k: v * stretch for k, v in costs.items()}, notes=notes)


__all__ = ["PARTS", "Dims", "StepTime", "TimingError", "predict_time", "layer_matmuls", "layer_flops",
           "tp_sent_bytes", "cp_sent_bytes", "ep_sent_bytes", "dp_sent_bytes", "stage_layers"]
