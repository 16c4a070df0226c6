"""Process groups requested with "nccl" by code written for CUDA use the platform's backend.

Library users of megatron-core (NeMo, verl, in-house trainers) call
``torch.distributed.init_process_group(backend="nccl")`` themselves, and megatron's own group creation
passes "nccl" for some groups (e.g. ``pipeline_model_parallel_comm_backend``). Without NCCL in the
torch build those calls fail ("Distributed package doesn't have NCCL built in"). The rewrite happens
at torch's two entry points, so every caller — the user's, megatron's — is covered by one seam:

* CPU: "nccl" becomes "gloo" (also inside a "cpu:gloo,cuda:nccl" device map);
* NPU: torch_npu's ``transfer_to_npu`` already maps "nccl" to "hccl" at these same entry points
  (enabled at import, see megatron_adaptor.py), so nothing here is registered there;
* CUDA: nccl is the platform's backend; nothing changes.

One notice, the first time a request is rewritten.
"""

from __future__ import annotations

import functools
import inspect

from hyper_adaptor.notice import notice
from hyper_adaptor.patch_manager import Patch

FEATURE = "compat"
REQUESTED = "nccl"
ENTRY_POINTS = ("torch.distributed.init_process_group", "torch.distributed.new_group")


def platform_backend(backend, platform_name: str):
    """``backend`` with "nccl" replaced by ``platform_name``; anything else as given. Handles the
    plain name and torch's per-device form ("cpu:gloo,cuda:nccl")."""
    if not isinstance(backend, str) or REQUESTED not in backend.lower():
        return backend
    if ":" not in backend:
        return platform_name if backend.lower() == REQUESTED else backend
    parts = []
    for item in backend.split(","):
        device, _, name = item.partition(":")
        parts.append(f"{device}:{platform_name if name.strip().lower() == REQUESTED else name}")
    # the host now serves every device; a repeated entry would name one backend twice
    return ",".join(dict.fromkeys(parts))


def _on_platform_backend(platform_name: str):
    def wrap(original):
        # the backend may come positionally (init_process_group's first argument, new_group's third)
        position = list(inspect.signature(original).parameters).index("backend")

        @functools.wraps(original)
        def with_platform_backend(*args, **kwargs):
            if len(args) > position:
                requested = args[position]
                args = args[:position] + (platform_backend(requested, platform_name),) + args[position + 1:]
            else:
                requested = kwargs.get("backend")
                if "backend" in kwargs:
                    kwargs["backend"] = platform_backend(requested, platform_name)
            if platform_backend(requested, platform_name) != requested:
                notice(
                    f'process groups requested with backend "{REQUESTED}" use "{platform_name}" '
                    f"(the platform's collective backend; NCCL needs CUDA)"
                )
            return original(*args, **kwargs)

        return with_platform_backend

    return wrap


def patches(device_type: str) -> list[Patch]:
    """The backend mapping for ``device_type``: CPU only (see the module docstring for NPU and CUDA)."""
    if device_type != "cpu":
        return []
    return [Patch(target, _on_platform_backend("gloo"), "wrap", FEATURE) for target in ENTRY_POINTS]
