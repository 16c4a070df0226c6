"""Ascend NPU: level 0 uses torch_npu's own "cuda" -> "npu" mapping.

torch_npu ships ``torch_npu.contrib.transfer_to_npu``, which rebinds ``torch.cuda`` calls, tensor
factories and ``device="cuda"`` arguments to the NPU and sets hccl as the backend for ``nccl``
requests. We use it rather than a mapping of our own, as its maintainers keep it in step with
torch_npu. Imported lazily: this module is importable without torch_npu.

Verified: written against torch_npu's documented API; no NPU was reachable where this was written.
"""

from __future__ import annotations

import importlib


def enable_transfer_to_npu() -> None:
    importlib.import_module("torch_npu")
    importlib.import_module("torch_npu.contrib.transfer_to_npu")
