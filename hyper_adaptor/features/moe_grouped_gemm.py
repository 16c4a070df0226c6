"""Level 1 — Megatron's ``--moe-grouped-gemm`` served for the local spec (hyper_adaptor/ops/grouped_gemm.py).

The flag is Megatron's own. With TransformerEngine (``--transformer-impl transformer_engine``)
megatron builds TE's grouped experts itself and this feature stays out of the way (it does not
apply; no error). With the local spec megatron-core 0.19.2 ignores the flag (``SequentialMLP`` runs
one expert after the other) and megatron.training's ``validate_args`` asserts a CUDA compute
capability >= 8 for it, a check of CUDA grouped-GEMM kernels that the local spec never calls and
that fails on CPU and NPU. From level 1 this feature runs the experts' GEMMs as grouped GEMMs
(patches/fused/grouped_gemm.py) and lets that check pass: ``adjust`` hides the flag from megatron's
``validate_args`` (features.base.hide_from_megatron) and the adaptor puts it back right after, before
the model is built, so ``args.moe_grouped_gemm`` (and the model config derived from it) says what was
asked.

Below level 1 the flag gets megatron's behaviour (SequentialMLP); without CUDA, level 0 switches it
off before that assertion, with one notice (patches/compat/arguments.py; docs/features/fused-kernels.md).
"""

from __future__ import annotations

from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag, asked, hide_from_megatron


class MoEGroupedGEMM(Feature):
    name = "moe_grouped_gemm"
    level = 1
    summary = "MoE experts (local spec) as grouped GEMMs: torch_npu npu_grouped_matmul / mm into one buffer / eager"
    flags = (Flag("--moe-grouped-gemm", "megatron's flag; served by hyper_adaptor at level >= 1 for the local spec",
                  owner="megatron"),)

    @staticmethod
    def _local(args) -> bool:
        return getattr(args, "transformer_impl", "local") == "local"

    def requested(self, args) -> bool:
        # with TE, megatron's TE grouped experts serve the flag
        return bool(asked(args, "moe_grouped_gemm")) and self._local(args)

    def status(self, args) -> tuple[bool, str]:
        if getattr(args, "moe_grouped_gemm", False) and not self._local(args):
            return False, f"--transformer-impl {args.transformer_impl}: megatron's own grouped experts"
        return super().status(args)

    def adjust(self, args) -> list[str]:
        if not getattr(args, "moe_grouped_gemm", False):
            return []
        # megatron's validate_args checks CUDA hardware for grouped-GEMM kernels the local spec never calls
        return [hide_from_megatron(args, "moe_grouped_gemm", "served by hyper_adaptor's grouped GEMM (local spec); "
                                   "megatron checks a CUDA compute capability for kernels it does not call")]

    def validate(self, args) -> None:
        experts = getattr(args, "num_experts", None)
        if not experts:
            raise FeatureConfigError("--moe-grouped-gemm needs --num-experts (it groups the MoE experts' GEMMs)")
        if experts < 1:
            raise FeatureConfigError(f"--num-experts must be >= 1 for --moe-grouped-gemm; got {experts}")

    def patches(self, args):
        from hyper_adaptor.patches.fused import grouped_gemm

        return grouped_gemm.patches(args)
