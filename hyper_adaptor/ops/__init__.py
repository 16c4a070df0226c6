"""Fused kernels, one module per op, each with its backends (npu, fast, eager) chosen by ``backend``;
plain torch, no megatron import (docs/design.md, docs/features/fused-kernels.md)."""
