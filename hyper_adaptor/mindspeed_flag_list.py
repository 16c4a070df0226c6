"""What MindSpeed's feature documentation names, as read from its repository: the data
:mod:`hyper_adaptor.mindspeed_flags` answers, row for row (a test holds the table to this list).

Read from ``docs/zh/features/`` (the features list and every feature page) at :data:`MINDSPEED_COMMIT`:
every ``--flag`` a page names, each filed under one page (the page naming it most often, a page whose
name shares the flag's words first). Two spellings with underscores (``--use_legacy_models``,
``--nproc_per_node``) are filed under their dashed names.
"""

from __future__ import annotations

MINDSPEED_REPOSITORY = "Ascend/MindSpeed"
MINDSPEED_COMMIT = "028de58ca629d035185b00ff7d1eb7eff4f7fd48"

# feature page (under docs/zh/features/, without .md) -> the flags filed under it
FEATURE_PAGE_FLAGS: dict[str, tuple[str, ...]] = {
    "Automatic_Parallelism": (
        "--adam-beta1", "--adam-beta2", "--attention-dropout", "--attention-softmax-in-fp32", "--auto-parallel",
        "--clip-grad", "--disable-bias-linear", "--distributed-backend", "--eval-interval", "--eval-iters",
        "--ffn-hidden-size", "--fp16", "--global-batch-size", "--hidden-dropout", "--hidden-size",
        "--init-method-std", "--initial-loss-scale", "--load", "--log-interval", "--lr", "--lr-decay-style",
        "--lr-warmup-fraction", "--make-vocab-size-divisible-by", "--master-addr", "--master-port",
        "--max-position-embeddings", "--micro-batch-size", "--min-lr", "--nnodes", "--no-load-optim", "--no-load-rng",
        "--no-masked-softmax-fusion", "--node-rank", "--nproc-per-node", "--save-interval", "--split",
        "--tokenizer-model", "--tokenizer-type", "--train-iters", "--untie-embeddings-and-output-weights",
        "--weight-decay",
    ),
    "LayerZeRO": ("--layerzero", "--layerzero-config",),
    "activation-function-recompute": (
        "--recompute-activation-function", "--recompute-activation-function-num-layers", "--recompute-method",
    ),
    "aiqos": ("--aiqos", "--aiqos-mode", "--aiqos-schedule",),
    "alibi": ("--alibi-fusion-attn-type",),
    "async-ddp-param-gather": ("--overlap-param-gather",),
    "async-log-allreduce": ("--async-log-allreduce",),
    "auto_settings": (
        "--auto-settings", "--auto-settings-log-level", "--auto-settings-ranks", "--auto-settings-type",
        "--auto-settings-work-dir", "--target-nnodes",
    ),
    "automated-pipeline": ("--automated-pipeline", "--automated-pipeline-perf",),
    "balanced_moe": (
        "--balanced-moe-experts", "--balanced-moe-hot-expert-num", "--moe-hierarchical-alltoallv",
        "--trans-hot-expert-group-num",
    ),
    "communication-over-computation": ("--coc-fused-kernel", "--coc-parallel-num", "--use-ascend-coc",),
    "compress-tensor": ("--compress-activation", "--compress-dense", "--compress-optimizer",),
    "context_parallelism_kv_cache": (
        "--context-parallel-algo", "--context-parallel-cache-interval", "--context-parallel-kv-cache-policy",
        "--group-query-attention", "--use-ulysses-allgather-kv",
    ),
    "custom_fsdp": ("--data-parallel-sharding-strategy", "--use-custom-fsdp",),
    "dist_ckpt": ("--auto-detect-ckpt-format", "--ckpt-format", "--save",),
    "distributed-optimizer": ("--use-distributed-optimizer",),
    "double-ring": ("--cp-window-size",),
    "dualpipev": ("--dualpipev-dw-detach", "--schedules-method",),
    "eod-reset": ("--reset-attention-mask", "--reset-position-ids",),
    "flash-attention": ("--use-flash-attn",),
    "fsdp2": ("--fsdp2-config-path", "--use-torch-fsdp2",),
    "fused_ema_adamw_optimizer": ("--ema-decay",),
    "fusion-attn-v2": ("--use-fusion-attn-v2",),
    "generate-mask": ("--no-create-attention-mask-in-dataloader", "--sparse-mode",),
    "hccl-group-buffer-set": (
        "--hccl-ep-group-buffer-adaptive-factor", "--hccl-group-buffer", "--hccl-group-buffer-adaptive",
    ),
    "hccl-replace-gloo": ("--disable-gloo-group", "--hccl-slice-size",),
    "hybrid-context-parallel": ("--context-parallel-size", "--ulysses-degree-in-cp",),
    "kvallgather-context-parallel": ("--seq-length",),
    "low-precision-optimizer": (
        "--gemm-gradient-accumulation-fusion", "--no-gradient-accumulation-fusion", "--quant-grads", "--quant-states",
    ),
    "megatron_moe/megatron-moe-allgather-dispatcher": ("--moe-token-dispatcher-type",),
    "megatron_moe/megatron-moe-allgather-overlap-comm": (
        "--moe-allgather-overlap-comm", "--moe-permutation-async-comm",
    ),
    "megatron_moe/megatron-moe-alltoall-overlap-comm": ("--moe-alltoall-overlap-comm", "--moe-shared-expert-overlap",),
    "megatron_moe/megatron-moe-fb-overlap": ("--moe-fb-overlap", "--overlap-grad-reduce",),
    "megatron_moe/megatron-moe-gmm": ("--moe-grouped-gemm",),
    "megatron_moe/megatron-moe-tp-extend-ep": ("--moe-tp-extend-ep", "--num-experts",),
    "megatron_moe/megatron-moe-zero-memory": ("--moe-zero-memory", "--moe-zero-memory-num-layers",),
    "moe-token-permute-and-unpermute": (
        "--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity", "--moe-permute-fusion",
        "--use-fused-moe-token-permute-and-unpermute",
    ),
    "multi-head-latent-attention": (
        "--kv-lora-rank", "--multi-latent-attention", "--q-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
        "--rotary-scaling-factor", "--v-head-dim",
    ),
    "multi_parameter_pipeline": ("--use-multiparameter-pipeline-model-parallel",),
    "multi_parameter_pipeline_and_variable_seq_lengths": ("--variable-seq-lengths",),
    "muon-optimizer": (
        "--apply-wd-to-qk-layernorm", "--bf16", "--muon-coefficient-type", "--muon-extra-scale-factor",
        "--muon-fp32-matmul-prec", "--muon-momentum", "--muon-nesterov", "--muon-no-split-qkv", "--muon-num-ns-steps",
        "--muon-scalar-optimizer", "--muon-scale-mode", "--muon-tp-mode", "--optimizer",
        "--overlap-param-gather-with-optimizer-step",
    ),
    "noop-layers": ("--noop-layers", "--num-layers",),
    "norm-recompute": ("--recompute-norm", "--recompute-norm-num-layers", "--use-mcore-models",),
    "npu_datadump": ("--npu-datadump",),
    "npu_deterministic": ("--npu-deterministic",),
    "ops_flops_cal": ("--op-cal-tflops",),
    "pipeline-model-parallel-layout": (
        "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--mtp-num-layers",
        "--num-virtual-stages-per-pipeline-rank", "--optimize-send-recv-comm", "--pipeline-model-parallel-layout",
        "--pipeline-model-parallel-size",
    ),
    "preprocess-eod-data": (
        "--append-eod", "--data-path", "--handler-name", "--input", "--json-keys", "--output-prefix",
        "--pad-to-multiple-of", "--tokenizer-name-or-path", "--workers",
    ),
    "qad": ("--kl-loss-reduction", "--kl-loss-weight", "--kl-temperature", "--qad-enable", "--qad-teacher-load",),
    "qat_quant": ("--qat-scheme",),
    "recomputation": (
        "--enable-recompute-layers-per-pp-rank", "--recompute-activations", "--recompute-granularity",
        "--recompute-num-layers",
    ),
    "recompute_independent_pipelining": (
        "--moe-adaptive-recompute-activation", "--moe-layer-recompute", "--recompute-in-advance",
        "--recompute-in-bubble",
    ),
    "reset-bucket-group-order": ("--reset-bucket-group-order",),
    "reuse-fp32-param": ("--reuse-fp32-param",),
    "ring-attention-context-parallel": (
        "--attention-mask-type", "--megatron-cp-in-bnsd", "--use-cp-send-recv-overlap",
    ),
    "rms_norm": ("--normalization", "--use-fused-rmsnorm",),
    "rotary-embedding": ("--position-embedding-type", "--use-fused-rotary-pos-emb",),
    "sequence-parallel": ("--sequence-parallel",),
    "shared-experts": ("--moe-model-type", "--n-shared-experts", "--use-legacy-models",),
    "smart_swap": ("--smart-swap",),
    "swap-optimizer": ("--optimizer-selection", "--swap-optimizer", "--swap-optimizer-times",),
    "swap_attention": ("--swap-attention", "--swap-modules",),
    "swiglu": ("--swiglu", "--use-fused-swiglu",),
    "te-comparison-online": ("--te-comparison-with-bf16", "--te-comparison-with-cpu",),
    "tensor-parallel": ("--tensor-model-parallel-size",),
    "tensor-parallel-2d": (
        "--enable-backward-overlap-ag-with-matmul", "--enable-overlap-ag-with-matmul",
        "--enable-overlap-matmul-with-rs", "--tp-2d", "--tp-x", "--tp-y",
    ),
    "transformer_engine": (
        "--fp8-format", "--fp8-recipe", "--no-use-gmm-fp8", "--transformer-impl", "--use-ascend-mc2",
    ),
    "ulysses-context-parallel": ("--num-attention-heads",),
    "unaligned-pipeline": ("--pipeline-num-transformer-layers",),
    "unaligned_linear": ("--unaligned-linear",),
    "virtual-optimizer": ("--virtual-optimizer",),
    "virtual-pipeline-parallel": ("--num-layers-per-virtual-pipeline-stage",),
}

# Named by the pages but read by another program than the training script: MindSpeed's pages show the
# data preprocessing command and torchrun's launch next to the training flags.
NOT_TRAINING_FLAGS = {
    "--input": "tools/preprocess_data.py",
    "--json-keys": "tools/preprocess_data.py",
    "--output-prefix": "tools/preprocess_data.py",
    "--workers": "tools/preprocess_data.py",
    "--handler-name": "tools/preprocess_data.py (MindSpeed-LLM)",
    "--append-eod": "tools/preprocess_data.py",
    "--pad-to-multiple-of": "tools/preprocess_data.py (MindSpeed-LLM)",
}


def feature_doc_flags() -> dict[str, str]:
    """{flag: the feature page it is filed under}, every flag the pages name."""
    return {flag: page for page, flags in FEATURE_PAGE_FLAGS.items() for flag in flags}
