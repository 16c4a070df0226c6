"""Megatron argument defaults that cannot work on the detected platform, switched to what does.

Runs on the parsed namespace before megatron.training validates it, so that a Megatron-LM command
line runs unchanged apart from the hardware it lands on. Each switch returns one notice, logged once.
"""

from __future__ import annotations

import importlib.util


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def have_transformer_engine() -> bool:
    return _installed("transformer_engine")


def have_apex_kernel(name: str) -> bool:
    """Apex's compiled CUDA extensions are top-level modules (e.g. ``fused_layer_norm_cuda``); the
    unrelated PyPI package called ``apex`` has none of them, so look for the kernel, not the name."""
    return _installed(name)


def switch(args, dest: str, value, why: str) -> str:
    """Set one of megatron's arguments (an ``adjust`` step); returns its notice, naming the flag."""
    old = getattr(args, dest, None)
    setattr(args, dest, value)
    return f"--{dest.replace('_', '-')}: {old!r} -> {value!r} ({why})"


def switch_unworkable_defaults(args, device_type: str) -> list[str]:
    """Adjust ``args`` in place; returns one notice per switch made."""
    notices = []

    backend = {"cpu": "gloo", "npu": "hccl"}.get(device_type)
    if backend and getattr(args, "distributed_backend", backend) != backend:
        notices.append(switch(args, "distributed_backend", backend, f"the {device_type} platform's collective backend"))

    if getattr(args, "transformer_impl", None) == "transformer_engine" and not have_transformer_engine():
        notices.append(switch(args, "transformer_impl", "local", "transformer_engine is not installed"))

    # The fusion switches megatron-core also reads from a TransformerConfig: one decision table for
    # both (fusion_switches.py). On the command line a level-1 feature serves a switch only when that
    # feature is itself enabled (e.g. --use-fused-rotary-pos-emb for apply_rope_fusion).
    # Whether that feature is enabled is the adaptor's decision, handed down at bootstrap (adaptor_hooks).
    from hyper_adaptor.patches import adaptor_hooks
    from hyper_adaptor.patches.compat import fusion_switches

    feature_enabled = adaptor_hooks.current().feature_enabled
    level = getattr(args, "optimization_level", 0)
    for name, entry in fusion_switches.SWITCHES.items():
        # megatron.training derives persist_layer_norm = not no_persist_layer_norm (on by default).
        dest, on = ("no_persist_layer_norm", False) if name == "persist_layer_norm" else (name, True)
        if getattr(args, dest, not on) != on:
            continue
        available = entry.served_by is not None and feature_enabled(entry.served_by, args)
        decision = fusion_switches.decide(name, device_type, level, feature_available=available)
        if not decision.value:
            notices.append(switch(args, dest, dest == "no_persist_layer_norm", decision.why))

    # megatron.training's validate_args asserts a CUDA compute capability >= 8 for this flag, which no
    # other platform has; the local spec never calls those kernels (it builds SequentialMLP either way).
    # From level 1 on, hyper_adaptor serves the flag itself (features/moe_grouped_gemm.py).
    below_level_1 = getattr(args, "optimization_level", 0) < 1
    if getattr(args, "moe_grouped_gemm", False) and below_level_1 and device_type != "cuda":
        notices.append(switch(
            args,
            "moe_grouped_gemm",
            False,
            "megatron asserts a CUDA compute capability >= 8 for it; megatron's SequentialMLP (per-expert loop) "
            "is used instead; --optimization-level 1 provides a grouped GEMM",
        ))

    return notices
