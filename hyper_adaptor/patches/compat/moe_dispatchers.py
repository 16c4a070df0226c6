"""Level 0: megatron's ``flex`` MoE token dispatcher without its backend, said at argument validation.

``--moe-token-dispatcher-type flex`` hands dispatch and combine to a fused CUDA communication library
chosen by ``--moe-flex-dispatcher-backend`` (``--moe-enable-deepep`` is the older spelling of
``deepep``): DeepEP (``deep_ep.Buffer``), HybridEP (``deep_ep.HybridEPBuffer``) or TransformerEngine's
NCCL EP (``transformer_engine.pytorch.ep``). megatron-core imports each of them optionally and finds
one missing only when the model's first MoE layer builds its dispatcher, after start-up and data set
building, as a traceback. The libraries are CUDA kernels, so off CUDA there is nothing to install.
Said here instead, before megatron's own argument checks, naming the flag, the backend and the two
dispatchers that run everywhere (``alltoall`` and ``allgather``, megatron's own collectives).

No patch: this module only answers :func:`flex_backend_problem` for the compat feature's ``validate``.
"""

from __future__ import annotations

import importlib

# backend -> (its name, the module megatron imports it from, the name megatron takes from there)
BACKENDS = {
    "deepep": ("DeepEP", "deep_ep", "Buffer"),
    "hybridep": ("HybridEP", "deep_ep", "HybridEPBuffer"),
    "ncclep": ("TransformerEngine NCCL EP", "transformer_engine.pytorch.ep", None),
}
INSTEAD = "use --moe-token-dispatcher-type alltoall or allgather (megatron's own, every device)"


def importable(module: str, name: str | None) -> bool:
    try:
        loaded = importlib.import_module(module)
    except Exception:  # an ImportError, or a CUDA library that fails while importing: not usable
        return False
    return name is None or hasattr(loaded, name)


def flex_backend_problem(args, device_type: str, can_import=importable) -> str | None:
    """None unless ``--moe-token-dispatcher-type flex`` is asked for a backend this process cannot
    run; then the error, naming the flags and the backend."""
    if getattr(args, "moe_token_dispatcher_type", None) != "flex":
        return None
    backend = "deepep" if getattr(args, "moe_enable_deepep", False) else getattr(
        args, "moe_flex_dispatcher_backend", "deepep")
    if backend not in BACKENDS:  # megatron names an unknown backend itself
        return None
    label, module, name = BACKENDS[backend]
    where = module if name is None else f"{module}.{name}"
    asked = f"--moe-token-dispatcher-type flex with --moe-flex-dispatcher-backend {backend} needs {label} ({where})"
    if device_type != "cuda":
        return f"{asked}, CUDA kernels that do not run on {device_type}; {INSTEAD}"
    if not can_import(module, name):
        return f"{asked}, which this Python cannot import; install it, or {INSTEAD}"
    return None
