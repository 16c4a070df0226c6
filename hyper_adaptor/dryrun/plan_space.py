"""The planner's search space (``python -m hyper_adaptor plan``, :mod:`hyper_adaptor.dryrun.plan`): layouts,
configurations and their flags, and the arithmetic that drops what does not divide before anything is parsed.

A layout is TP (with sequence parallel when > 1), PP with its schedule and model chunks, CP with its algorithm,
EP; a configuration adds the micro-batch size, the data-parallel engine and recompute / swap. The bounds below
keep a cluster's space to what a run would use: TP inside one node (8), CP up to 8, up to 4 model chunks,
micro-batches of 1, 2 or 4.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

MAX_TP = 8            # tensor parallel inside one node
MAX_CP = 8
MAX_VPP = 4
MICRO_BATCHES = (1, 2, 4)
DP_MODES = ("ddp", "distopt", "hsdp-level1", "hsdp-level2", "hsdp-level3")
RECOMPUTE = ("none", "swap", "selective", "full")


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int = 1
    schedule: str = ""        # "" = megatron's own (1F1B, or interleaved with vpp > 1); gpipe / zbh1 / zbv
    cp: int = 1
    algo: str = ""            # ring / ulysses / allgather / hybrid (cp > 1)
    ulysses: int = 0          # hybrid: the Ulysses degree
    ep: int = 1

    def flags(self) -> list[str]:
        out = []
        if self.tp > 1:
            out += ["--tensor-model-parallel-size", str(self.tp), "--sequence-parallel"]
        if self.pp > 1:
            out += ["--pipeline-model-parallel-size", str(self.pp)]
        if self.vpp > 1:
            out += ["--num-virtual-stages-per-pipeline-rank", str(self.vpp)]
        if self.schedule:
            out += ["--pipeline-schedule", self.schedule]
        if self.cp > 1:
            out += ["--context-parallel-size", str(self.cp), "--context-parallel-algo", self.algo]
            if self.algo == "hybrid":
                out += ["--ulysses-degree-in-cp", str(self.ulysses)]
        if self.ep > 1:
            out += ["--expert-model-parallel-size", str(self.ep)]
        return out

    def name(self) -> str:
        sched = self.schedule or ("interleaved" if self.vpp > 1 else "1f1b")
        text = f"TP{self.tp} PP{self.pp}" + (f"x{self.vpp}" if self.vpp > 1 else "")
        text += f" ({sched})" if self.pp > 1 else ""
        text += f" CP{self.cp}" + (f" {self.algo}" + (str(self.ulysses) if self.ulysses else "") if self.cp > 1 else "")
        return text + (f" EP{self.ep}" if self.ep > 1 else "")


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: Layout
    micro_batch: int
    dp_mode: str = "ddp"
    recompute: str = "none"

    def flags(self) -> list[str]:
        out = self.layout.flags() + ["--micro-batch-size", str(self.micro_batch)]
        if self.dp_mode == "distopt":
            out.append("--use-distributed-optimizer")
        elif self.dp_mode.startswith("hsdp"):
            out += ["--use-hsdp", "--hsdp-optimizer-level", self.dp_mode.split("-")[1]]
        out += {"none": [], "swap": ["--swap-attention"], "selective": ["--recompute-granularity", "selective"],
                "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                         "--recompute-num-layers", "1"]}[self.recompute]
        return out


@dataclasses.dataclass
class Model:
    """The figures of the model flags the arithmetic pruning reads."""
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    global_batch: int
    experts: int
    moe_ffn: int
    untied: bool

    @classmethod
    def from_args(cls, args) -> Model:
        kv = args.num_query_groups if args.group_query_attention and args.num_query_groups else \
            args.num_attention_heads
        return cls(layers=args.num_layers, heads=args.num_attention_heads, kv_heads=kv, ffn=args.ffn_hidden_size,
                   seq=args.seq_length, global_batch=args.global_batch_size, experts=args.num_experts or 0,
                   moe_ffn=args.moe_ffn_hidden_size or args.ffn_hidden_size,
                   untied=bool(args.untie_embeddings_and_output_weights))


def divisors(n: int, most: int | None = None) -> list[int]:
    return [d for d in range(1, (most or n) + 1) if n % d == 0 and d <= n]


def layouts(model: Model, world: int, pruned: Counter) -> list[Layout]:
    """Every layout of ``world`` ranks the arithmetic allows; what it does not allow is counted in ``pruned``
    (one per layout branch cut, by the rule that cut it: "does not divide: heads 32 % TP 3")."""
    out = []
    for tp in divisors(world, MAX_TP):
        bad = [f"heads {model.heads} % TP {tp}" if model.heads % tp else "",
               f"query groups {model.kv_heads} % TP {tp}" if model.kv_heads % tp else "",
               f"ffn {model.ffn} % TP {tp}" if model.ffn % tp else "",
               f"moe ffn {model.moe_ffn} % TP {tp}" if model.experts and model.moe_ffn % tp else ""]
        if any(bad):
            pruned["does not divide: " + next(b for b in bad if b)] += 1
            continue
        for pp in divisors(world // tp):
            if pp > model.layers:
                break
            if model.layers % pp:
                pruned[f"does not divide: layers {model.layers} % PP {pp}"] += 1
                continue
            for vpp, schedule in _schedules(model, pp, pruned):
                for cp, algo, degree in _context(model, world // (tp * pp), tp, pruned):
                    for ep in expert_sizes(model, world // pp, tp, pruned):
                        out.append(Layout(tp, pp, vpp, schedule, cp, algo, degree, ep))
    return out


def _schedules(model: Model, pp: int, pruned: Counter) -> list[tuple[int, str]]:
    if pp == 1:
        return [(1, "")]
    out = [(1, ""), (1, "gpipe"), (1, "zbh1")]
    for vpp in range(2, MAX_VPP + 1):
        if model.layers % (pp * vpp):
            pruned[f"does not divide: layers {model.layers} % (PP {pp} x VPP {vpp})"] += 1
            continue
        out.append((vpp, ""))
        if vpp == 2:
            if model.untied:
                out.append((2, "zbv"))
            else:
                pruned["zbv needs --untie-embeddings-and-output-weights (tied weights across its V)"] += 1
    return out


def _context(model: Model, ranks: int, tp: int, pruned: Counter) -> list[tuple[int, str, int]]:
    out = [(1, "", 0)]
    for cp in divisors(ranks, MAX_CP)[1:]:
        if model.seq % (2 * cp):
            pruned[f"does not divide: seq {model.seq} % (2 x CP {cp})"] += 1
            continue
        out += [(cp, "ring", 0), (cp, "allgather", 0)]
        if (model.heads // tp) % cp:
            pruned[f"does not divide: heads/TP {model.heads // tp} % CP {cp} (ulysses)"] += 1
        else:
            out.append((cp, "ulysses", 0))
        for degree in divisors(cp)[1:-1]:
            if (model.heads // tp) % degree:
                pruned[f"does not divide: heads/TP {model.heads // tp} % {degree} (hybrid's Ulysses degree)"] += 1
            else:
                out.append((cp, "hybrid", degree))
    return out


def expert_sizes(model: Model, stage_ranks: int, tp: int, pruned: Counter) -> list[int]:
    """EP: it divides the experts, and ETP (= TP) x EP divides the ranks of a pipeline stage. megatron's
    ``validate_args`` does not check the second (EP 4 at TP 2 on 4 ranks passes it); its process groups need it
    (ETP x EP x PP divides the world), so the planner checks it here."""
    if not model.experts:
        return [1]
    out = []
    for ep in sorted(set(divisors(model.experts)) | set(divisors(stage_ranks // tp if stage_ranks % tp == 0 else 1))):
        if model.experts % ep:
            pruned[f"does not divide: experts {model.experts} % EP {ep}"] += 1
        elif stage_ranks % (tp * ep):
            pruned[f"does not divide: ranks per stage {stage_ranks} % (ETP {tp} x EP {ep})"] += 1
        else:
            out.append(ep)
    return out


def micro_batches(model: Model, layout: Layout, world: int, pruned: Counter | None = None) -> list[int]:
    dp = world // (layout.tp * layout.pp * layout.cp)
    out = []
    for b in MICRO_BATCHES:
        if model.global_batch % (b * dp):
            if pruned is not None:
                pruned[f"does not divide: global batch {model.global_batch} % (micro-batch {b} x DP {dp})"] += 1
        else:
            out.append(b)
    return out


def dp_modes(layout: Layout, world: int) -> list[str]:
    """DDP alone where no rank shares the model (DP x CP = 1); HSDP is refused under the split-weight schedules."""
    if world // (layout.tp * layout.pp) == 1:
        return ["ddp"]
    if layout.schedule in ("zbh1", "zbv"):
        return ["ddp", "distopt"]
    return list(DP_MODES)
