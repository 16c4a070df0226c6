"""MindSpeed's flags, each answered: the one table behind parsing, ``describe`` and
docs/migrating-from-mindspeed.md (hyper_adaptor/mindspeed_guide.py writes it from the table).

Every flag MindSpeed's feature pages name (hyper_adaptor/mindspeed_flag_list.py) is one row here, or one
row per value where the answer depends on the value, with exactly one disposition:

* ``same``: megatron or hyper_adaptor defines the flag with MindSpeed's meaning; nothing to do;
* ``mapped``: parsing sets hyper_adaptor's or megatron's own flag(s) instead, with one notice naming both;
* ``noop``: the flag only tunes a path of Ascend's (or of MindSpeed's own implementation) that does not
  run here, and training computes the same without it: accepted, one notice saying why;
* ``refused``: no equivalent here; an error naming the flag and what to use instead (exit status 2,
  like every other bad flag: hyper_adaptor/usage.py).

The adaptor's wrap of ``add_megatron_arguments`` registers each row's flag with MindSpeed's argparse shape
(:func:`add_arguments`), and ``Adaptor.prepare`` answers the flags given (:func:`apply`) before any feature
adjusts or validates, so a training run and ``describe`` answer alike. A flag left at MindSpeed's default
asked for nothing and is answered with silence.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

from hyper_adaptor.features.base import FeatureConfigError
from hyper_adaptor.mindspeed_flag_list import feature_doc_flags

SAME, MAPPED, NOOP, REFUSED = "same", "mapped", "noop", "refused"
DISPOSITIONS = (SAME, MAPPED, NOOP, REFUSED)
DOC = "docs/migrating-from-mindspeed.md"
SWITCH = {"action": "store_true"}


def _value(type_=str, default=None, **more) -> dict:
    return {"type": type_, "default": default, **more}


@dataclass(frozen=True)
class Row:
    flag: str
    disposition: str
    note: str = ""  # mapped: why they match; noop: why nothing is lost; refused: what to use instead
    # argparse keyword arguments as MindSpeed declares the flag; None: megatron's or hyper_adaptor's flag
    shape: dict | None = None
    value: str | None = None  # the one value this row answers (None: every value the other rows leave)
    apply: Callable | None = field(default=None, compare=False)  # mapped: (args, value) -> the flags set
    matches: Callable | None = field(default=None, compare=False)  # instead of ``value``: which values
    example: str | None = None  # a value tests give a value flag (default: ``value``)
    target: str = ""  # mapped: the flags it becomes ({names}: the value in hyper_adaptor's names)

    @property
    def dest(self) -> str:
        if self.shape and "dest" in self.shape:
            return self.shape["dest"]
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def default(self):
        """What the flag holds when it is not given (MindSpeed's default for MindSpeed's own flags)."""
        shape = self.shape or {}
        action = shape.get("action")
        if action in ("store_true", "store_false"):
            return action == "store_false"
        return shape.get("default")

    def answers(self, value) -> bool:
        if self.matches is not None:
            return self.matches(value)
        return self.value is None or self.value == _text(value)

    def shown(self, value) -> str:
        return self.flag if isinstance(value, bool) else f"{self.flag} {_text(value)}"

    def notice(self, value) -> str:
        flag = self.shown(value)
        if self.disposition == MAPPED:
            target = self.target.replace("{names}", " ".join(_swap_names(value))) if "{names}" in self.target \
                else self.target
            return f"{flag} (MindSpeed's) -> {target}: {self.note}"
        if self.disposition == NOOP:
            return f"{flag} (MindSpeed's): accepted, nothing to do here: {self.note}"
        if self.disposition == REFUSED:
            return f"{flag} (MindSpeed's) cannot run here: {self.note} (see {DOC})"
        return f"{flag}: hyper_adaptor's flag, with MindSpeed's meaning"


def _text(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


# ---------------------------------------------------------------- mappings: (args, value) -> None, set the flags


def _setting(**values) -> Callable:
    def apply(args, value) -> None:
        for dest, new in values.items():
            setattr(args, dest, new)

    return apply


def _tp_extend_ep(args, value) -> None:
    args.expert_model_parallel_size = getattr(args, "expert_model_parallel_size", 1) * \
        getattr(args, "tensor_model_parallel_size", 1)
    args.expert_tensor_parallel_size = 1
    args.moe_tp_extend_ep = False  # answered: a namespace prepared twice (adapt) must not multiply twice


def _shared_experts(args, value) -> None:
    ffn = getattr(args, "moe_ffn_hidden_size", None) or getattr(args, "ffn_hidden_size", None)
    if ffn is None:
        raise FeatureConfigError(
            f"--n-shared-experts {value} (MindSpeed's) needs --moe-ffn-hidden-size or --ffn-hidden-size to size "
            "the shared experts; or give megatron's --moe-shared-expert-intermediate-size instead")
    size = value * ffn
    given = getattr(args, "moe_shared_expert_intermediate_size", None)
    if given not in (None, size):
        raise FeatureConfigError(
            f"--n-shared-experts {value} (MindSpeed's: {value} x {ffn} = {size}) disagrees with "
            f"--moe-shared-expert-intermediate-size {given}; give one of them")
    args.moe_shared_expert_intermediate_size = size


def _balanced_moe(args, value) -> None:
    args.moe_dispatcher_engine = "hyper"
    if not getattr(args, "moe_hot_expert_replicas", 0):
        args.moe_hot_expert_replicas = getattr(args, "balanced_moe_hot_expert_num", 3)


def _tokenizer_path(args, value) -> None:
    if getattr(args, "tokenizer_model", None) not in (None, value):
        raise FeatureConfigError(f"--tokenizer-name-or-path {value} (MindSpeed's; --tokenizer-model here) disagrees "
                                 f"with --tokenizer-model {args.tokenizer_model}; give one of them")
    args.tokenizer_model = value


def _replicas(args, value) -> None:
    args.moe_hot_expert_replicas = value


def _dualpipev(args, value) -> None:
    schedule = getattr(args, "pipeline_schedule", None)
    if schedule not in (None, "zbv"):
        raise FeatureConfigError(f"--schedules-method dualpipev (MindSpeed's; --pipeline-schedule zbv here) cannot "
                                 f"be combined with --pipeline-schedule {schedule}")
    args.pipeline_schedule = "zbv"
    if getattr(args, "num_virtual_stages_per_pipeline_rank", None) is None and \
            getattr(args, "num_layers_per_virtual_pipeline_stage", None) is None:
        args.num_virtual_stages_per_pipeline_rank = 2


# MindSpeed's --swap-modules: one comma-separated string of a layer's submodule names
SWAP_MODULE_NAMES = {"input_norm": "layernorm", "input_layernorm": "layernorm", "post_attention_norm": "layernorm",
                     "pre_mlp_layernorm": "layernorm", "self_attention": "self_attn", "core_attention": "core_attn",
                     "mlp": "mlp"}


def _mindspeed_swap_list(value) -> bool:
    items = value if isinstance(value, (list, tuple)) else [value]
    return any("," in item or item in SWAP_MODULE_NAMES and item != "mlp" for item in items)


def _swap_names(value) -> list[str]:
    names = []
    for item in value if isinstance(value, (list, tuple)) else [value]:
        for name in item.split(","):
            name = SWAP_MODULE_NAMES.get(name.strip(), name.strip())
            if name and name not in names:
                names.append(name)
    return names


def _swap_modules(args, value) -> None:
    args.swap_modules = _swap_names(value)


class _AlsoMindSpeedSwapLists(tuple):
    """hyper_adaptor's --swap-modules choices, which also let MindSpeed's comma lists through to the table
    (argparse tests membership; help and errors list hyper_adaptor's names)."""

    def __contains__(self, item) -> bool:
        if tuple.__contains__(self, item):
            return True
        names = [n.strip() for n in str(item).split(",")]
        return all(n in SWAP_MODULE_NAMES or tuple.__contains__(self, n) for n in names if n) and \
            _mindspeed_swap_list(item)


# ---------------------------------------------------------------- the table

_USE_HOST = "use --optimizer-cpu-offload [--optimizer-offload-fraction F] (optimizer state on the host)"
_TUNES_TP = "an Ascend kernel that fuses tensor-parallel matmuls with their HCCL collectives; here megatron's " \
            "own tensor-parallel layers communicate (the same results)"
_AUTO = "MindSpeed's search for parallel settings, launching trial runs; choose the sizes on the command line " \
        "(python -m hyper_adaptor describe checks a line before a run)"
_HCCL = "sizes HCCL's communication buffers per group (torch_npu's HCCL_BUFFSIZE sets them process-wide); " \
        "results do not depend on it"

ROWS: tuple[Row, ...] = (
    # -- kernels and attention
    Row("--use-fused-rmsnorm", SAME), Row("--use-fused-swiglu", SAME), Row("--use-fused-rotary-pos-emb", SAME),
    Row("--use-fusion-attn-v2", MAPPED, target="--use-flash-attn",
        note="MindSpeed's second fused-attention kernel; hyper_adaptor's fused core attention (level 1) picks the "
             "kernel per backend", shape=SWITCH, apply=_setting(use_flash_attn=True)),
    Row("--alibi-fusion-attn-type", REFUSED, "ALiBi position bias is not served; use --position-embedding-type "
        "rope (or learned_absolute)", _value(int), example="2"),
    Row("--sparse-mode", NOOP, "a causal mask layout of Ascend's fused-attention kernel; here the causal mask "
        "is megatron's", _value(int, 0, choices=tuple(range(9))), value="2"),
    Row("--sparse-mode", NOOP, "a causal mask layout of Ascend's fused-attention kernel; here the causal mask "
        "is megatron's", _value(int, 0, choices=tuple(range(9))), value="3"),
    Row("--sparse-mode", REFUSED, "band and prefix masks of Ascend's fused-attention kernel are not served; "
        "leave it at 0 (megatron's mask)", _value(int, 0, choices=tuple(range(9))), example="4"),
    Row("--attention-mask-type", NOOP, "MindSpeed computes the same attention with a full mask; here megatron's "
        "causal mask (and --reset-attention-mask) decide", _value(str, "causal", choices=("causal", "general")),
        value="general"),
    Row("--use-fused-moe-token-permute-and-unpermute", NOOP, "torch_npu's fused token permute kernels; here "
        "megatron's permutation (or --moe-dispatcher-engine hyper's) runs, with the same result", SWITCH),
    Row("--gemm-gradient-accumulation-fusion", MAPPED, target="--gradient-accumulation-fusion",
        note="the grouped experts of --moe-grouped-gemm accumulate weight gradients into main_grad under megatron's "
             "flag (on by default from level 1)", shape=SWITCH, apply=_setting(gradient_accumulation_fusion=True)),
    Row("--no-use-gmm-fp8", NOOP, "turns off fp8 grouped GEMMs, which this backend's grouped GEMM does not have",
        {"action": "store_false", "dest": "use_gmm_fp8"}),
    # -- tensor parallel
    Row("--use-ascend-mc2", NOOP, _TUNES_TP, SWITCH),
    Row("--use-ascend-coc", NOOP, _TUNES_TP, SWITCH),
    Row("--coc-fused-kernel", NOOP, _TUNES_TP, SWITCH),
    Row("--coc-parallel-num", NOOP, _TUNES_TP, _value(int, 1), example="2"),
    Row("--tp-2d", REFUSED, "2-D tensor parallel is not served; use --tensor-model-parallel-size (with "
        "--sequence-parallel)", SWITCH),
    Row("--tp-x", REFUSED, "a --tp-2d size; use --tensor-model-parallel-size", _value(int, 1), example="2"),
    Row("--tp-y", REFUSED, "a --tp-2d size; use --tensor-model-parallel-size", _value(int, 1), example="2"),
    Row("--enable-overlap-ag-with-matmul", REFUSED, "a --tp-2d option; use --tensor-model-parallel-size", SWITCH),
    Row("--enable-overlap-matmul-with-rs", REFUSED, "a --tp-2d option; use --tensor-model-parallel-size", SWITCH),
    Row("--enable-backward-overlap-ag-with-matmul", REFUSED, "a --tp-2d option; use --tensor-model-parallel-size",
        SWITCH),
    Row("--unaligned-linear", REFUSED, "hidden, FFN and head counts must divide --tensor-model-parallel-size "
        "here; choose sizes that do", SWITCH),
    # -- context parallel
    Row("--context-parallel-algo", SAME, value="megatron_cp_algo"),
    Row("--context-parallel-algo", SAME, value="ulysses_cp_algo"),
    Row("--context-parallel-algo", SAME, value="hybrid_cp_algo"),
    Row("--context-parallel-algo", MAPPED, target="--context-parallel-algo allgather",
        note="both gather the whole sequence's keys and values on every context-parallel rank",
        value="kvallgather_cp_algo", apply=_setting(context_parallel_algo="allgather")),
    Row("--context-parallel-algo", REFUSED, "adaptive context parallel is not served; use megatron_cp_algo "
        "(ring), ulysses_cp_algo, hybrid_cp_algo or allgather", value="adaptive_cp_algo"),
    Row("--context-parallel-algo", REFUSED, "adaptive context parallel is not served; use hybrid_cp_algo with "
        "--ulysses-degree-in-cp", value="hybrid_adaptive_cp_algo"),
    Row("--ulysses-degree-in-cp", SAME, example="2"),
    Row("--cp-window-size", REFUSED, "double ring attention is not served; for two levels use "
        "--context-parallel-algo hybrid_cp_algo --ulysses-degree-in-cp K", _value(int, 1), example="2"),
    Row("--use-cp-send-recv-overlap", NOOP, "hyper_adaptor's ring always sends the next block while it computes "
        "the current one", SWITCH),
    Row("--megatron-cp-in-bnsd", NOOP, "a tensor layout for Ascend's fused-attention kernel in ring attention",
        SWITCH),
    Row("--context-parallel-kv-cache-policy", REFUSED, "caching keys and values across the ring for backward is "
        "not served; drop it (use --recompute-* or --swap-attention for memory)",
        _value(str, None, choices=("full", "half")), example="full"),
    Row("--context-parallel-cache-interval", REFUSED, "a --context-parallel-kv-cache-policy option, not served",
        _value(int, 0), example="2"),
    Row("--use-ulysses-allgather-kv", REFUSED, "Ulysses with all-gathered keys and values is not served; "
        "use --context-parallel-algo ulysses_cp_algo or allgather", SWITCH),
    # -- pipeline
    Row("--schedules-method", MAPPED,
        target="--pipeline-schedule zbv (--num-virtual-stages-per-pipeline-rank 2 unless given)",
        note="both place two model chunks per rank in a V and split weight gradients to fill the bubble",
        shape=_value(str, None, choices=("dualpipev",)), value="dualpipev", apply=_dualpipev),
    Row("--dualpipev-dw-detach", NOOP, "--pipeline-schedule zbv (what --schedules-method dualpipev becomes) "
        "always computes weight gradients apart", SWITCH),
    Row("--noop-layers", REFUSED, "empty layers are not served; give --num-layers the real count, uneven stages "
        "with megatron's --pipeline-model-parallel-layout", _value(str), example="1,3"),
    Row("--pipeline-num-transformer-layers", REFUSED, "use megatron's --pipeline-model-parallel-layout (or "
        "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)", _value(str),
        example="[[1,2],[2,1]]"),
    Row("--optimize-send-recv-comm", NOOP, "reorders MindSpeed's own pipeline sends and receives; megatron's (or "
        "--pipeline-schedule's) run here", SWITCH),
    Row("--automated-pipeline", REFUSED, _AUTO, SWITCH),
    Row("--automated-pipeline-perf", REFUSED, _AUTO, SWITCH),
    Row("--variable-seq-lengths", REFUSED, "pipeline stages exchange --seq-length sequences here; pad the data "
        "to it", SWITCH),
    Row("--use-multiparameter-pipeline-model-parallel", REFUSED, "pipeline stages pass megatron's one hidden "
        "state here", SWITCH),
    Row("--recompute-in-bubble", REFUSED, "use --pipeline-schedule zbh1 / zbv, which fill the bubble with weight "
        "gradients", SWITCH),
    Row("--recompute-in-advance", REFUSED, "use --pipeline-schedule zbh1 / zbv, which fill the bubble with weight "
        "gradients", SWITCH),
    # -- memory
    Row("--swap-attention", SAME),
    Row("--swap-modules", MAPPED, target="--swap-modules {names}",
        note="MindSpeed's comma list of a layer's submodules becomes hyper_adaptor's names (norms: layernorm, "
             "self_attention: self_attn)",
        matches=_mindspeed_swap_list, apply=_swap_modules, example="input_norm,self_attention,post_attention_norm"),
    Row("--smart-swap", REFUSED, "the automatic swap policy is not served; name what to swap: --swap-attention "
        "or --swap-modules", SWITCH),
    Row("--recompute-activation-function", SAME), Row("--recompute-norm", SAME),
    Row("--recompute-activation-function-num-layers", REFUSED, "--recompute-activation-function recomputes in "
        "every layer here; drop it", _value(int), example="2"),
    Row("--recompute-norm-num-layers", REFUSED, "--recompute-norm recomputes in every layer here; drop it",
        _value(int), example="2"),
    Row("--enable-recompute-layers-per-pp-rank", REFUSED, "megatron's --recompute-num-layers counts per model "
        "chunk; give it that count", SWITCH),
    Row("--moe-adaptive-recompute-activation", REFUSED, "use --recompute-activation-function", SWITCH),
    Row("--moe-zero-memory", REFUSED, "use --recompute-activation-function, or megatron's --recompute-granularity "
        "selective --recompute-modules moe_act", _value(str, "disable", choices=("disable", "level0", "level1")),
        example="level0"),
    Row("--moe-zero-memory-num-layers", REFUSED, "a --moe-zero-memory option, not served", _value(int),
        example="2"),
    Row("--reuse-fp32-param", REFUSED, "sharing the fp32 master weights' memory with the bf16 weights is not "
        "served; for less optimizer memory per device use --use-distributed-optimizer, --use-hsdp or "
        "--optimizer-cpu-offload", SWITCH),
    Row("--swap-optimizer", MAPPED, target="--optimizer-cpu-offload",
        note="both keep the optimizer state on the host (here the step runs there too)",
        shape=SWITCH, apply=_setting(optimizer_cpu_offload=True)),
    Row("--swap-optimizer-times", NOOP, "the number of --swap-optimizer round trips; --optimizer-cpu-offload "
        "makes none", _value(int, 16), example="8"),
    Row("--virtual-optimizer", REFUSED, _USE_HOST, {"type": str, "nargs": "+", "default": None}, example="2"),
    Row("--hccl-group-buffer", NOOP, _HCCL, _value(str), example="dp:200"),
    Row("--hccl-group-buffer-adaptive", NOOP, _HCCL, SWITCH),
    Row("--hccl-ep-group-buffer-adaptive-factor", NOOP, _HCCL, _value(float, -1.0), example="1.0"),
    # -- data parallel, sharding, checkpoints
    Row("--layerzero", MAPPED, target="--use-hsdp --hsdp-optimizer-level level3",
        note="both shard parameters, gradients and optimizer state over data-parallel groups",
        shape=SWITCH, apply=_setting(use_hsdp=True, hsdp_optimizer_level="level3")),
    Row("--layerzero-config", REFUSED, "its settings are flags here: zero3_size -> --hsdp-shard-size, the rest "
        "--hsdp-*", _value(str), example="config.yml"),
    Row("--use-custom-fsdp", MAPPED, target="--use-megatron-fsdp",
        note="megatron's earlier name of the same flag", shape=SWITCH, apply=_setting(use_megatron_fsdp=True)),
    Row("--fsdp2-config-path", REFUSED, "megatron's --use-torch-fsdp2 takes megatron's flags; or use --use-hsdp "
        "--hsdp-*", _value(str), example="fsdp2.yaml"),
    Row("--reset-bucket-group-order", NOOP, "reorders MindSpeed's parameter all-gather buckets; megatron's "
        "distributed optimizer gathers the same parameters", SWITCH),
    Row("--async-log-allreduce", NOOP, "makes MindSpeed's all-reduce of the logged loss asynchronous; megatron "
        "reduces it in the step, and logs the same loss", SWITCH),
    Row("--disable-gloo-group", MAPPED, target="--disable-gloo-process-groups",
        note="neither creates gloo groups; checkpoints gather over the device's backend",
        shape=SWITCH, apply=_setting(use_gloo_process_groups=False)),
    Row("--hccl-slice-size", NOOP, "the slice size of --disable-gloo-group's HCCL transfers in MindSpeed's "
        "checkpoint gather", _value(int, 10 * 1024 * 1024), example="1048576"),
    # -- optimizers and numerics
    Row("--optimizer-selection", NOOP, "which fused AdamW kernel runs (torch's); megatron's --optimizer adam "
        "builds its own, with the same update", _value(str, "fused_adamw", choices=(
            "fused_adamw", "fused_torch_adamw", "fused_ema_adamw")), value="fused_torch_adamw"),
    Row("--optimizer-selection", REFUSED, "AdamW with an EMA of the weights is not served; use --optimizer adam",
        _value(str, "fused_adamw", choices=("fused_adamw", "fused_torch_adamw", "fused_ema_adamw")),
        value="fused_ema_adamw"),
    Row("--ema-decay", REFUSED, "an --optimizer-selection fused_ema_adamw option, not served", _value(float, 0.9999),
        example="0.999"),
    Row("--quant-states", REFUSED, "fp8 optimizer states are not served; megatron's --use-precision-aware-optimizer "
        "--exp-avg-dtype / --exp-avg-sq-dtype where TransformerEngine is installed",
        _value(str, None, choices=("fp8", "hif8", "mxfp8")), example="fp8"),
    Row("--quant-grads", REFUSED, "low-precision gradients are not served; megatron's "
        "--use-precision-aware-optimizer --main-grads-dtype where TransformerEngine is installed", SWITCH),
    Row("--compress-activation", REFUSED, "activation compression is not served; use --swap-attention / "
        "--recompute-*", _value(str, ""), example="level0"),
    Row("--compress-dense", REFUSED, "activation compression is not served; use --swap-attention / --recompute-*",
        _value(str, "disable", choices=("disable", "level0", "level1")), example="level0"),
    Row("--compress-optimizer", REFUSED, "optimizer state compression is not served; use --optimizer-cpu-offload",
        SWITCH),
    Row("--qat-scheme", REFUSED, "quantization-aware training is not served", _value(str, None, choices=(
        "w4a16-mxfp4", "w4a16-mxfp4-moe-only", "w8a16-mxfp8", "w8a16-mxfp8-moe-only", "w4a4-mxfp4",
        "w4a8-moe-only")), example="w8a16-mxfp8"),
    Row("--qad-enable", REFUSED, "quantization-aware distillation is not served", SWITCH),
    Row("--qad-teacher-load", REFUSED, "quantization-aware distillation is not served", _value(str, ""),
        example="teacher"),
    Row("--kl-loss-weight", REFUSED, "a quantization-aware distillation option, not served", _value(float, 1.0),
        example="0.5"),
    Row("--kl-temperature", REFUSED, "a quantization-aware distillation option, not served", _value(float, 1.0),
        example="2.0"),
    Row("--kl-loss-reduction", REFUSED, "a quantization-aware distillation option, not served",
        _value(str, "mean", choices=("mean", "sum")), example="sum"),
    Row("--npu-deterministic", MAPPED, target="--deterministic-mode",
        note="bitwise-reproducible runs, served on every device",
        shape=SWITCH, apply=_setting(deterministic_mode=True)),
    # -- mixture of experts
    Row("--moe-alltoall-overlap-comm", SAME),
    Row("--moe-allgather-overlap-comm", NOOP, "hides MindSpeed's all-gather dispatcher communication; megatron's "
        "dispatcher computes the same (for overlap: --moe-token-dispatcher-type alltoall --moe-dispatcher-engine "
        "hyper --moe-alltoall-overlap-comm)", SWITCH),
    Row("--moe-permutation-async-comm", NOOP, "makes MindSpeed's dispatcher communication asynchronous; megatron's "
        "dispatcher (or --moe-dispatcher-engine hyper) computes the same", SWITCH),
    Row("--moe-hierarchical-alltoallv", NOOP, "splits MindSpeed's expert all-to-all into intra- and inter-node "
        "steps; the tokens delivered are the same", SWITCH),
    Row("--moe-tp-extend-ep", MAPPED, target="--expert-model-parallel-size EP x TP --expert-tensor-parallel-size 1",
        note="experts spread over the tensor-parallel ranks too, unsplit", shape=SWITCH, apply=_tp_extend_ep),
    Row("--moe-fb-overlap", MAPPED, target="--overlap-moe-expert-parallel-comm",
        note="both overlap one micro-batch's expert all-to-all with another's compute in 1F1B",
        shape=SWITCH, apply=_setting(overlap_moe_expert_parallel_comm=True)),
    Row("--n-shared-experts", MAPPED, target="--moe-shared-expert-intermediate-size N x the expert FFN size",
        note="megatron sizes shared experts by their total FFN width",
        shape=_value(int), apply=_shared_experts, example="2"),
    Row("--moe-model-type", REFUSED, "DeepSpeed-style MoE is not served; megatron's MoE (megatron_moe) is",
        _value(str, "megatron_moe", choices=("deepspeed_moe", "megatron_moe")), value="deepspeed_moe"),
    Row("--balanced-moe-experts", MAPPED, target="--moe-dispatcher-engine hyper --moe-hot-expert-replicas N",
        note="both give the most loaded experts extra copies on lightly loaded ranks, replanned from the measured load",
        shape=SWITCH, apply=_balanced_moe),
    Row("--balanced-moe-hot-expert-num", MAPPED, target="--moe-hot-expert-replicas N",
        note="the number of hot experts given a copy",
        shape=_value(int, 3), apply=_replicas, example="2"),
    Row("--trans-hot-expert-group-num", NOOP, "groups MindSpeed's transfers of hot experts' weights; "
        "--moe-hot-expert-replicas moves them in one exchange", _value(int, 3), example="2"),
    # -- tools, debugging, auto-tuning
    Row("--op-cal-tflops", MAPPED, target="--log-throughput",
        note="both log the achieved TFLOP/s", shape=SWITCH, apply=_setting(log_throughput=True)),
    Row("--npu-datadump", REFUSED, "tensor dumps are msprobe's tool on Ascend; call msprobe (or torch hooks) from "
        "the script", SWITCH),
    Row("--te-comparison-with-cpu", REFUSED, "online comparison of TransformerEngine against a reference is not "
        "served", SWITCH),
    Row("--te-comparison-with-bf16", REFUSED, "online comparison of TransformerEngine against a reference is not "
        "served", SWITCH),
    Row("--aiqos", NOOP, "sets traffic priorities of Ascend's network", SWITCH),
    Row("--aiqos-mode", NOOP, "sets traffic priorities of Ascend's network", _value(str, "auto"), example="manual"),
    Row("--aiqos-schedule", NOOP, "sets traffic priorities of Ascend's network", _value(str), example="dp"),
    Row("--auto-settings", REFUSED, _AUTO, SWITCH),
    Row("--auto-settings-type", REFUSED, _AUTO, _value(str, "white"), example="mixed"),
    Row("--auto-settings-ranks", REFUSED, _AUTO, _value(int, 8), example="16"),
    Row("--auto-settings-log-level", REFUSED, _AUTO, _value(str, "info"), example="debug"),
    Row("--auto-settings-work-dir", REFUSED, _AUTO, _value(str), example="work"),
    Row("--auto-parallel", REFUSED, _AUTO, SWITCH),
    Row("--target-nnodes", REFUSED, _AUTO, _value(int, 1), example="2"),
    Row("--nnodes", REFUSED, "read on the training line only by MindSpeed's parallel-settings search; "
        "torchrun's --nnodes sets the nodes", _value(int, 1), example="2"),
    Row("--nproc-per-node", REFUSED, "read on the training line only by MindSpeed's parallel-settings search; "
        "torchrun's --nproc-per-node sets the processes", _value(int, 1), example="8"),
    Row("--node-rank", REFUSED, "read on the training line only by MindSpeed's parallel-settings search; "
        "torchrun's --node-rank sets it", _value(int, 0), example="1"),
    Row("--master-addr", REFUSED, "read on the training line only by MindSpeed's parallel-settings search; "
        "torchrun's --master-addr sets it", _value(str, "127.0.0.1"), example="10.0.0.1"),
    Row("--master-port", REFUSED, "read on the training line only by MindSpeed's parallel-settings search; "
        "torchrun's --master-port sets it", _value(int, 29500), example="6000"),
    Row("--use-legacy-models", REFUSED, "megatron-core 0.19 has only its core models; drop it", SWITCH),
    Row("--tokenizer-type", MAPPED, target="--tokenizer-type HuggingFaceTokenizer",
        note="both load a Hugging Face tokenizer from a name or directory", value="PretrainedFromHF",
        apply=_setting(tokenizer_type="HuggingFaceTokenizer")),
    Row("--tokenizer-name-or-path", MAPPED, target="--tokenizer-model",
        note="megatron's HuggingFaceTokenizer loads the name or directory given to --tokenizer-model",
        shape=_value(str), apply=_tokenizer_path, example="./tokenizer"),
)

# Megatron's own flags the pages name: megatron defines each with MindSpeed's meaning (MindSpeed passes them
# through to megatron), and hyper_adaptor serves them as megatron defines them.
MEGATRON_FLAGS = (
    "--adam-beta1", "--adam-beta2", "--apply-wd-to-qk-layernorm", "--attention-dropout",
    "--attention-softmax-in-fp32", "--auto-detect-ckpt-format", "--bf16", "--ckpt-format", "--clip-grad",
    "--context-parallel-size", "--data-parallel-sharding-strategy", "--data-path", "--disable-bias-linear",
    "--distributed-backend", "--eval-interval", "--eval-iters", "--expert-model-parallel-size",
    "--expert-tensor-parallel-size", "--ffn-hidden-size", "--fp16", "--fp8-format", "--fp8-recipe",
    "--global-batch-size", "--group-query-attention", "--hidden-dropout", "--hidden-size", "--init-method-std",
    "--initial-loss-scale", "--kv-lora-rank", "--load", "--log-interval", "--lr", "--lr-decay-style",
    "--lr-warmup-fraction", "--make-vocab-size-divisible-by", "--max-position-embeddings", "--micro-batch-size",
    "--min-lr", "--moe-expert-capacity-factor", "--moe-grouped-gemm", "--moe-layer-recompute",
    "--moe-pad-expert-input-to-capacity", "--moe-permute-fusion", "--moe-shared-expert-overlap",
    "--moe-token-dispatcher-type", "--mtp-num-layers", "--multi-latent-attention", "--muon-coefficient-type",
    "--muon-extra-scale-factor", "--muon-fp32-matmul-prec", "--muon-momentum", "--muon-nesterov",
    "--muon-no-split-qkv", "--muon-num-ns-steps", "--muon-scalar-optimizer", "--muon-scale-mode",
    "--muon-tp-mode", "--no-create-attention-mask-in-dataloader", "--no-gradient-accumulation-fusion",
    "--no-load-optim", "--no-load-rng", "--no-masked-softmax-fusion", "--normalization",
    "--num-attention-heads", "--num-experts", "--num-layers", "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank", "--optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--overlap-param-gather-with-optimizer-step", "--pipeline-model-parallel-layout",
    "--pipeline-model-parallel-size", "--position-embedding-type", "--q-lora-rank", "--qk-head-dim",
    "--qk-pos-emb-head-dim", "--recompute-activations", "--recompute-granularity", "--recompute-method",
    "--recompute-num-layers", "--reset-attention-mask", "--reset-position-ids", "--rotary-scaling-factor",
    "--save", "--save-interval", "--seq-length", "--sequence-parallel", "--split", "--swiglu",
    "--tensor-model-parallel-size", "--tokenizer-model", "--train-iters",
    "--transformer-impl", "--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
    "--use-flash-attn", "--use-mcore-models", "--use-torch-fsdp2", "--v-head-dim", "--weight-decay",
)


def rows_of(flag: str) -> list[Row]:
    return [row for row in ROWS if row.flag == flag]


def page_of(flag: str) -> str:
    return feature_doc_flags()[flag]


# ---------------------------------------------------------------- parsing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register MindSpeed's flags that neither megatron nor hyper_adaptor defines, with MindSpeed's shape;
    let the values MindSpeed gives a flag defined here through its choices, to be answered by the table."""
    known = parser._option_string_actions  # argparse keeps no public map of its options
    group = None
    for flag in dict.fromkeys(row.flag for row in ROWS):
        rows = rows_of(flag)
        action = known.get(flag)
        if action is not None:
            if action.choices is not None:
                extra = tuple(r.value for r in rows if r.value is not None and r.value not in action.choices)
                if any(r.matches is _mindspeed_swap_list for r in rows):
                    action.choices = _AlsoMindSpeedSwapLists(action.choices)
                elif extra:
                    action.choices = tuple(action.choices) + extra
            continue
        if group is None:
            group = parser.add_argument_group(f"MindSpeed's flags (each answered: {DOC})")
        shape = dict(rows[0].shape)
        group.add_argument(flag, help=_help(rows), **shape)


def _help(rows: list[Row]) -> str:
    if len(rows) == 1:
        row = rows[0]
        becomes = f" to {row.target.replace('{names}', 'NAME...')}" if row.disposition == MAPPED else ""
        return f"MindSpeed's; {row.disposition}{becomes} here: {row.note}".replace("%", "%%")
    answers = ", ".join(f"{row.value or 'other values'}: {row.disposition}" for row in rows)
    return f"MindSpeed's; {answers}".replace("%", "%%")


def given(args) -> list[tuple[Row, object]]:
    """The rows the flags on ``args`` ask for (a flag at MindSpeed's default asks for nothing), in table
    order: (row, the value given)."""
    found = []
    for flag in dict.fromkeys(row.flag for row in ROWS):
        rows = rows_of(flag)
        value = getattr(args, rows[0].dest, None)
        if value is None or value is False and rows[0].default is not True or value == rows[0].default:
            continue
        for row in rows:
            if row.answers(value):
                found.append((row, value))
                break
    return found


def apply(args) -> list[str]:
    """Answer the MindSpeed flags on ``args``: a refused one raises FeatureConfigError naming it (before
    anything is changed), a mapped one sets its equivalent; returns the notices, one per flag."""
    answered = given(args)
    for row, value in answered:
        if row.disposition == REFUSED:
            raise FeatureConfigError(row.notice(value))
    notices = []
    for row, value in answered:
        if row.disposition == MAPPED:
            row.apply(args, value)
            notices.append(row.notice(value))
        elif row.disposition == NOOP:
            notices.append(row.notice(value))
    return notices


def describe(answered: list[tuple[Row, object]], out) -> None:
    """``describe``'s section: every MindSpeed flag on the line (``given`` before the checks ran) with its
    disposition and notice."""
    if answered:
        print(f"\nMindSpeed's flags ({DOC}):", file=out)
    for row, value in answered:
        print(f"    {row.disposition:7s} {row.notice(value)}", file=out)
