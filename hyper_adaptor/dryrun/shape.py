"""A Megatron command line as numbers: the model's shape, its parallel layout, and each rank's parameters.

``parse`` checks the flags exactly as ``python -m hyper_adaptor describe`` does (megatron's parser, the
adaptor's features, megatron's ``validate_args``) and fills in what a training run derives from them: the
data-parallel size and the padded vocabulary. ``ModelShape`` reads the namespace once; everything else in the
dry-run works from it.

Parameter counts follow megatron-core's GPT on the local layer spec (the spec this project runs without
TransformerEngine): a separate norm before the attention and before the MLP, ``linear_qkv`` (column parallel,
``heads + 2 x query groups`` heads of ``kv_channels``), ``linear_proj`` (row parallel: its bias is whole on
every tensor-parallel rank), ``linear_fc1`` (column parallel, twice the width under a gated activation),
``linear_fc2`` (row parallel); MoE layers with a router (fp32-built, then cast to the parameters' dtype),
``num_experts / EP`` local experts split over the expert tensor-parallel size, and shared experts split over TP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hyper_adaptor import usage

PROG = "hyper_adaptor dry-run"
DEVICES = ("cpu", "cuda", "npu")


def _dry_run_arguments(group) -> None:
    group.add_argument("--device-memory", type=float, default=None, metavar="GiB",
                       help="the memory of one device, in GiB: the prediction says whether each rank fits")
    group.add_argument("--device", default=None, metavar="{npu,cuda,cpu}",
                       help="the device the prediction is for (default: cpu)")
    group.add_argument("--moe-token-imbalance", type=float, default=None, metavar="F",
                       help="MoE: each expert-parallel rank's experts are predicted to get F x the tokens balanced "
                            "routing gives them, the busiest rank's share (F >= 1; default 1: balanced). Under "
                            "--moe-expert-capacity-factor the capacity caps it")
    group.add_argument("--no-time", action="store_true",
                       help="memory only: no step-time prediction (nor the one-time calibration of this machine "
                            "it needs)")


def parser(prog: str = PROG):
    """The parser :func:`parse` builds on every call, built once (for a caller that parses many lines)."""
    from hyper_adaptor import cli, megatron_adaptor  # noqa: F401  (level 0 first: megatron imports on CPU)

    return cli.megatron_parser(prog, _dry_run_arguments)


def parse(flags: list[str], world_size: int | None = None, device: str | None = None, prog: str = PROG,
          parser=None):
    """The namespace a training run of ``flags`` on ``world_size`` processes would have, checked as a training
    run checks it. Bad input (an unknown flag, a world the layout does not divide, an unknown device, a missing
    model flag) ends as argparse ends: one line naming it (``prog: error: ...``), SystemExit(2). ``parser``:
    one from :func:`parser`, reused (building one is most of a parse's 0.3 s)."""
    from hyper_adaptor import cli, megatron_adaptor  # noqa: F401  (level 0 first: megatron imports on CPU)

    flags = list(flags)
    if world_size is not None:
        flags += ["--world-size", str(world_size)]
    args = cli._parse_megatron_flags(flags, prog, _dry_run_arguments, parser)
    device = device or args.device or "cpu"
    if device not in DEVICES:
        usage.fail(f"argument --device: unknown device {device!r}; choose from {', '.join(DEVICES)}", prog)
    args.device = device
    memory = args.device_memory
    if memory is not None and not (math.isfinite(memory) and memory > 0):
        usage.fail(f"argument --device-memory: must be a finite number of GiB > 0; got {memory}", prog)
    imbalance = args.moe_token_imbalance
    if imbalance is not None:
        if not (math.isfinite(imbalance) and imbalance >= 1):
            usage.fail(f"argument --moe-token-imbalance: must be a number >= 1 (the busiest expert-parallel rank's "
                       f"tokens over the balanced count); got {imbalance}", prog)
        if not args.num_experts:
            usage.fail("argument --moe-token-imbalance: only for an MoE model (--num-experts)", prog)
    if args.world_size is None:
        usage.fail("argument --world-size: required (the number of processes the run starts)", prog)
    _, _, adjustments, missing = cli.check(args, prog)
    if args.seq_length is None and "max_position_embeddings" not in missing:
        missing.append("seq_length")
    if missing:
        usage.fail(f"the dry-run needs the model's shape: {', '.join(usage.flag(d) for d in missing)} missing", prog)
    if args.padded_vocab_size is None:
        if not args.vocab_size:
            usage.fail(f"the dry-run needs {usage.flag('vocab_size')} (it reads no tokenizer files)", prog)
        args.padded_vocab_size = padded_vocab(args.vocab_size, args.make_vocab_size_divisible_by,
                                              args.tensor_model_parallel_size)
    args.dryrun_adjustments = adjustments
    return args


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """megatron's tokenizer builder: the vocabulary rounded up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def _dtype(args) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    seq: int
    micro_batch: int
    global_batch: int
    vocab: int                    # padded
    swiglu: bool
    normalization: str            # LayerNorm | RMSNorm
    untied: bool
    position_embedding: str       # learned_absolute | rope | ...
    max_positions: int
    bias: bool                    # --add-bias-linear (megatron's default) / --disable-bias-linear
    qkv_bias: bool
    qk_layernorm: bool
    num_experts: int              # 0: dense
    topk: int
    moe_ffn: int
    shared_ffn: int               # 0: no shared experts
    shared_gate: bool
    moe_pattern: tuple            # 1 for an MoE layer, per global layer
    grouped_gemm: bool
    dtype: str                    # fp32 | bf16 | fp16
    tp: int = 1
    pp: int = 1
    vpp: int = 1                  # model chunks per pipeline rank
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    sp: bool = False
    world: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    schedule: str = ""            # the adaptor's --pipeline-schedule, "" for megatron's own

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def edp(self) -> int:
        """megatron's expert data-parallel size: the ranks of one pipeline stage over ETP x EP."""
        return self.world // (self.pp * self.etp * self.ep)

    @classmethod
    def from_args(cls, args) -> ModelShape:
        heads = args.num_attention_heads
        kv = args.num_query_groups if args.group_query_attention and args.num_query_groups else heads
        experts = args.num_experts or 0
        freq = getattr(args, "moe_layer_freq", 1)
        if not experts:
            pattern = (0,) * args.num_layers
        elif isinstance(freq, int):
            pattern = tuple(int(i % freq == 0) for i in range(args.num_layers))
        else:
            pattern = tuple(int(x) for x in freq)
        vpp = 1
        if args.virtual_pipeline_model_parallel_size:
            vpp = args.virtual_pipeline_model_parallel_size
        return cls(
            hidden=args.hidden_size, ffn=args.ffn_hidden_size, heads=heads, kv_heads=kv,
            head_dim=args.kv_channels or args.hidden_size // heads, layers=args.num_layers,
            seq=args.seq_length, micro_batch=args.micro_batch_size, global_batch=args.global_batch_size,
            vocab=args.padded_vocab_size, swiglu=bool(args.swiglu), normalization=args.normalization,
            untied=bool(args.untie_embeddings_and_output_weights),
            position_embedding=args.position_embedding_type, max_positions=args.max_position_embeddings,
            bias=bool(args.add_bias_linear), qkv_bias=bool(args.add_bias_linear or args.add_qkv_bias),
            qk_layernorm=bool(args.qk_layernorm), num_experts=experts, topk=args.moe_router_topk if experts else 0,
            moe_ffn=(args.moe_ffn_hidden_size or args.ffn_hidden_size) if experts else 0,
            shared_ffn=(args.moe_shared_expert_intermediate_size or 0) if experts else 0,
            shared_gate=bool(getattr(args, "moe_shared_expert_gate", False)), moe_pattern=pattern,
            grouped_gemm=bool(args.moe_grouped_gemm), dtype=_dtype(args),
            tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size, vpp=vpp,
            cp=args.context_parallel_size, ep=args.expert_model_parallel_size,
            etp=args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
            dp=args.data_parallel_size, sp=bool(args.sequence_parallel), world=args.world_size,
            first_stage_layers=getattr(args, "num_layers_in_first_pipeline_stage", None),
            last_stage_layers=getattr(args, "num_layers_in_last_pipeline_stage", None),
            schedule=getattr(args, "pipeline_schedule", None) or "",
        )

    # -- layout ---------------------------------------------------------------------------------------------

    def rank_coords(self, rank: int) -> dict:
        """megatron's default rank order: tp fastest, then cp, dp, pp for the dense part ("tp-cp-ep-dp-pp" with
        EP folded into DP); the experts' part decomposes the same rank as etp, ep, edp, pp."""
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        in_stage = rank % (self.world // self.pp)
        etp, rest = in_stage % self.etp, in_stage // self.etp
        ep, edp = rest % self.ep, rest // self.ep
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "etp": etp, "ep": ep, "edp": edp}

    def stage_layers(self, pp_rank: int) -> int:
        """Layers on pipeline rank ``pp_rank`` (all its chunks): an even split, or megatron's uneven first/last."""
        first, last = self.first_stage_layers, self.last_stage_layers
        if first is None and last is None:
            return self.layers // self.pp
        middle_stages = self.pp - (first is not None) - (last is not None)
        rest = self.layers - (first or 0) - (last or 0)
        if pp_rank == 0 and first is not None:
            return first
        if pp_rank == self.pp - 1 and last is not None:
            return last
        return rest // middle_stages if middle_stages else 0

    def chunks_on(self, rank: int) -> list[list[int]]:
        """Global layer indices per model chunk of ``rank`` (one chunk without VPP). With VPP megatron deals
        the layers round-robin: chunk c of pipeline rank r holds block c x PP + r of L / (PP x VPP) layers."""
        r = self.rank_coords(rank)["pp"]
        if self.schedule == "zbv":  # a V: chunk 0 is stage r, chunk 1 is stage 2 PP - 1 - r
            per = self.layers // (2 * self.pp)
            return [list(range(stage * per, (stage + 1) * per)) for stage in (r, 2 * self.pp - 1 - r)]
        if self.vpp > 1:
            per = self.layers // (self.pp * self.vpp)
            return [list(range((c * self.pp + r) * per, (c * self.pp + r + 1) * per)) for c in range(self.vpp)]
        start = sum(self.stage_layers(s) for s in range(r))
        return [list(range(start, start + self.stage_layers(r)))]

    def layers_on(self, rank: int) -> list[int]:
        """Global layer indices on ``rank``, all chunks together (see chunks_on for the split)."""
        return [i for chunk in self.chunks_on(rank) for i in chunk]

    def is_first_stage(self, rank: int) -> bool:
        return self.rank_coords(rank)["pp"] == 0

    def is_last_stage(self, rank: int) -> bool:
        """Holds the output layer and the loss: the last pipeline rank, or the first under a V (zbv)."""
        return self.rank_coords(rank)["pp"] == (0 if self.schedule == "zbv" else self.pp - 1)

    # -- parameters -----------------------------------------------------------------------------------------

    def norm_tensors(self, width: int) -> list[int]:
        """LayerNorm: weight and bias; RMSNorm: weight."""
        return [width, width] if self.normalization == "LayerNorm" else [width]

    def norm_params(self, width: int) -> int:
        return sum(self.norm_tensors(width))

    def _linear(self, rows: int, cols: int, bias: int) -> list[int]:
        return [rows * cols] + ([bias] if bias else [])

    def attention_tensors(self) -> list[int]:
        """One layer's linear_qkv, linear_proj (whole bias on every TP rank) and q/k layernorms on one TP rank."""
        h, d, tp = self.hidden, self.head_dim, self.tp
        qkv_out = (self.heads + 2 * self.kv_heads) * d // tp
        tensors = self._linear(qkv_out, h, qkv_out if self.qkv_bias else 0)
        tensors += self._linear(h, self.heads * d // tp, h if self.bias else 0)
        if self.qk_layernorm:
            tensors += self.norm_tensors(d) + self.norm_tensors(d)
        return tensors

    def attention_params(self) -> int:
        return sum(self.attention_tensors())

    def mlp_tensors(self, ffn: int, split: int, bias: bool | None = None) -> list[int]:
        """One MLP (fc1 twice as wide with swiglu, then fc2) with ``ffn`` columns over ``split`` ranks."""
        bias = self.bias if bias is None else bias
        h, width = self.hidden, ffn // split
        fc1_out = width * (2 if self.swiglu else 1)
        return self._linear(fc1_out, h, fc1_out if bias else 0) + self._linear(h, width, h if bias else 0)

    def mlp_params(self, ffn: int, split: int) -> int:
        return sum(self.mlp_tensors(ffn, split))

    def layer_tensors(self, index: int) -> list[tuple[str, int]]:
        """(part, numel) of every parameter of global layer ``index`` on one rank."""
        out = [("norms", n) for n in self.norm_tensors(self.hidden) * 2]
        out += [("attention", n) for n in self.attention_tensors()]
        if self.moe_pattern[index]:
            local = self.num_experts // self.ep
            out += [("router", n) for n in self._linear(self.num_experts, self.hidden,
                                                         self.num_experts if self.bias else 0)]
            if self.grouped_gemm:  # megatron's grouped experts: one fc1 and one fc2 weight, no biases
                width = self.moe_ffn // self.etp
                out += [("experts", self.hidden * local * width * (2 if self.swiglu else 1)),
                        ("experts", self.hidden * local * width)]
            else:
                out += [("experts", n) for _ in range(local) for n in self.mlp_tensors(self.moe_ffn, self.etp)]
            if self.shared_ffn:
                out += [("shared_experts", n) for n in self.mlp_tensors(self.shared_ffn, self.tp)]
                if self.shared_gate:
                    out.append(("shared_experts", self.hidden))
        else:
            out += [("mlp", n) for n in self.mlp_tensors(self.ffn, self.tp)]
        return out

    def layer_params(self, index: int) -> dict:
        """Parameter counts of global layer ``index`` on one rank, by part."""
        counts = {}
        for part, n in self.layer_tensors(index):
            counts[part] = counts.get(part, 0) + n
        return counts

    def tensors_on(self, rank: int) -> list[tuple[str, int]]:
        """(part, numel) of every parameter on ``rank``, in the model's order."""
        out = []
        first, last = self.is_first_stage(rank), self.is_last_stage(rank)
        table = self.vocab // self.tp * self.hidden
        if first:
            out.append(("embedding", table))
            if self.position_embedding == "learned_absolute":
                out.append(("position_embedding", self.max_positions * self.hidden))
        for index in self.layers_on(rank):
            out += self.layer_tensors(index)
        if last:
            out += [("norms", n) for n in self.norm_tensors(self.hidden)]
            if self.untied or not first:
                out.append(("output_layer", table))
        return out

    def params_on(self, rank: int) -> dict:
        """Parameter counts on ``rank`` by part: embedding (first stage: vocab / TP x hidden), position_embedding
        (learned absolute: max positions x hidden), norms, attention, mlp, router, experts, shared_experts,
        output_layer (last stage: untied, or the embedding's copy when tied and PP > 1)."""
        counts = {}
        for part, n in self.tensors_on(rank):
            counts[part] = counts.get(part, 0) + n
        return counts
