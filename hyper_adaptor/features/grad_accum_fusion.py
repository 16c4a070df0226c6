"""Level 1 — Megatron's gradient-accumulation fusion (wgrad GEMM accumulated into ``main_grad``)
on any device: hyper_adaptor provides the kernel apex would (hyper_adaptor/ops/wgrad_accum.py).

The flag is Megatron's own, on by default (``--no-gradient-accumulation-fusion`` turns it off). At
level 0 without apex, level 0 switches it off with a notice; from level 1 it stays on and is served here.
"""

from __future__ import annotations

from hyper_adaptor.features.base import Feature, Flag


class GradAccumFusion(Feature):
    name = "grad_accum_fusion"
    level = 1
    summary = "weight-gradient GEMM accumulated in fp32 into main_grad (apex's semantics, any device)"
    flags = (
        # Megatron's own flag, on by default there; a namespace without it (adapt()) counts as off.
        Flag("--gradient-accumulation-fusion", "megatron's flag (--no-gradient-accumulation-fusion)", owner="megatron"),
    )

    def requested(self, args) -> bool:
        return bool(getattr(args, "gradient_accumulation_fusion", False))

    def asked_explicitly(self, args) -> bool:
        return False  # on by default in Megatron: below level 1, level 0's notice covers it

    def patches(self, args):
        from hyper_adaptor.patches.fused import grad_accum

        return grad_accum.patches(args)
