"""Feature registry: one module per feature, listed here in the order they are applied."""

from __future__ import annotations

from hyper_adaptor.features.base import DEFAULT_LEVEL, LEVEL_NAMES, Feature, FeatureConfigError, Flag
from hyper_adaptor.features.checkpoint import Checkpoint
from hyper_adaptor.features.compat import Compat
from hyper_adaptor.features.context_parallel import ContextParallel
from hyper_adaptor.features.determinism import Determinism
from hyper_adaptor.features.expert_parallel import ExpertParallel
from hyper_adaptor.features.flash_attn import FlashAttention
from hyper_adaptor.features.fused_backend import FusedBackend
from hyper_adaptor.features.fused_rmsnorm import FusedRMSNorm
from hyper_adaptor.features.fused_rope import FusedRoPE
from hyper_adaptor.features.fused_swiglu import FusedSwiGLU
from hyper_adaptor.features.grad_accum_fusion import GradAccumFusion
from hyper_adaptor.features.hsdp import HSDP
from hyper_adaptor.features.moe_grouped_gemm import MoEGroupedGEMM
from hyper_adaptor.features.muon import Muon
from hyper_adaptor.features.optimizer_offload import OptimizerOffload
from hyper_adaptor.features.pipeline import Pipeline
from hyper_adaptor.features.profiling import Profiling
from hyper_adaptor.features.recompute import Recompute
from hyper_adaptor.features.swap import Swap

# Fixed, documented application order: compatibility first, then kernels, then parallel algorithms,
# then memory (swap before recompute: recompute's checks read what is swapped, and its wrap of the
# block constructor is declared after swap's), optimizer offload, then the optimizer itself (Muon).
FEATURES: tuple[Feature, ...] = (
    Compat(),
    Determinism(),
    Checkpoint(),
    Profiling(),
    FusedBackend(),
    FusedRMSNorm(),
    FusedSwiGLU(),
    FusedRoPE(),
    FlashAttention(),
    GradAccumFusion(),
    MoEGroupedGEMM(),
    ContextParallel(),
    ExpertParallel(),
    HSDP(),
    Pipeline(),
    Swap(),
    Recompute(),
    OptimizerOffload(),
    Muon(),
)


def get(name: str) -> Feature:
    for feature in FEATURES:
        if feature.name == name:
            return feature
    raise KeyError(f"no feature named {name!r}; known: {', '.join(f.name for f in FEATURES)}")


__all__ = ["DEFAULT_LEVEL", "FEATURES", "Feature", "FeatureConfigError", "Flag", "LEVEL_NAMES", "get"]
