"""HSDP options and their validation.

Every check raises ``ValueError`` naming the argument, what it must be, and the value received, so a
wrong call fails at wrap time rather than as a hang or a silent wrong answer mid-training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OPTIMIZER_LEVELS = ("level1", "level2", "level3")

# The default communication bucket, in KB: torch DDP's default ``bucket_cap_mb`` (25 MB). Megatron's DDP
# default, max(40 M, 1 M x data-parallel size) elements (160 MB of fp32 and more), favours few, very
# large collectives and bounds nothing below that size; torch's is the smaller of the two common
# defaults and already amortises a collective's fixed cost (a rendezvous of every rank, a launch): on
# the CI box (bench/hsdp.py) buckets somewhat smaller than the default cost no step time against one
# whole-model collective and only much smaller ones slow the step (figures in docs/features/hsdp.md,
# "Bucket size: memory against speed"), so the default stays well above where that cost begins while
# bounding every model larger than it. Every transient communication buffer of HSDP is at most one
# bucket (a single parameter larger than it goes alone), so the bucket is also what HSDP adds to the
# peak memory of a step beyond the model state: about two buckets (about three at level 3 in backward,
# see _bucket.py).
DEFAULT_BUCKET_KB = 25 * 1024


def _fail(name: str, must: str, value) -> None:
    raise ValueError(f"hsdp: {name} must be {must}; got {value!r}")


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: dtype of the gathered parameters that forward / backward compute with;
    ``reduce_dtype``: dtype gradients are reduced in (defaults to ``param_dtype``). The sharded
    parameters the optimizer steps keep the module's original dtype (the fp32 master weights)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """Keep the sharded parameters, their gradients (and so the optimizer state built on them) in
    host memory; only the gathered parameters live on the device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """FSDP2's spelling of the host offload of :class:`OffloadPolicy`. ``pin_memory`` is accepted so
    that FSDP2 code runs unchanged; HSDP does not pin the host shards."""

    pin_memory: bool = True


@dataclass(frozen=True)
class HSDPConfig:
    shard_size: int = -1
    threshold: float = 64  # KB: parameters smaller than this stay whole (replicated)
    optimizer_level: str = "level1"
    enable_grad_accumulation: bool = False
    use_eager_hook: bool = True
    grad_scale: float = 1.0
    reduce_dtype: torch.dtype | None = None
    param_dtype: torch.dtype | None = None
    comm_async: bool = False
    comm_fusion: bool = False
    # KB: the most bytes one collective moves (its gathered / reduced buffer): parameters are packed into
    # buckets up to it (with comm_fusion) and the fused collectives across units (the root's early
    # all-gather at levels 1/2, level 1's end-of-backward reduce-scatter) are cut into runs of at most
    # it; -1: no limit (one bucket per wrapped module, one collective for every unit); 0: one parameter.
    bucket_size: float = DEFAULT_BUCKET_KB
    offload: bool = False
    cast_forward_inputs: bool = False
    # On gloo with CPU tensors, do the shard group's reduce-scatter / all-gather as an all-to-all
    # exchange of point-to-point messages (faster there and no extra buffer, measured: see
    # _bucket.reduce_scatter / all_gather); False uses gloo's own.
    # Other backends always use their native collectives.
    gloo_reduce_scatter_as_all_to_all: bool = True
    gloo_all_gather_as_all_to_all: bool = True

    @property
    def reshard_after_forward(self) -> bool:
        return self.optimizer_level == "level3"

    @property
    def keeps_full_grads(self) -> bool:
        # ZeRO-1 keeps the full gradient buffer between steps; level 2/3 release it once reduced.
        return self.optimizer_level == "level1"

    def validate(self, data_parallel_size: int) -> None:
        if self.optimizer_level not in OPTIMIZER_LEVELS:
            _fail("optimizer_level", "one of " + ", ".join(repr(x) for x in OPTIMIZER_LEVELS), self.optimizer_level)
        if isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int):
            _fail("shard_size", "an int (-1 for the whole data-parallel group)", self.shard_size)
        if self.shard_size != -1 and (self.shard_size < 1 or data_parallel_size % self.shard_size):
            _fail(
                "shard_size",
                f"-1 or a positive divisor of the data-parallel size {data_parallel_size}",
                self.shard_size,
            )
        for name in ("threshold", "grad_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                _fail(name, "a number", value)
        if self.threshold < 0:
            _fail("threshold", "a size in KB >= 0", self.threshold)
        if not self.grad_scale > 0:
            _fail("grad_scale", "a number > 0", self.grad_scale)
        if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, (int, float)):
            _fail("bucket_size", "a size in KB (-1: one bucket, 0: one per parameter)", self.bucket_size)
        if self.bucket_size < 0 and self.bucket_size != -1:
            _fail("bucket_size", "-1, 0 or a positive size in KB", self.bucket_size)
        for name in ("enable_grad_accumulation", "use_eager_hook", "comm_async", "comm_fusion", "offload",
                     "gloo_reduce_scatter_as_all_to_all", "gloo_all_gather_as_all_to_all"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, "a bool", getattr(self, name))
        if not self.use_eager_hook:
            # PyTorch runs module hooks eagerly; there is no graph-mode hook to switch to.
            _fail("use_eager_hook", "True (PyTorch has only eager module hooks)", self.use_eager_hook)
        for name in ("reduce_dtype", "param_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                _fail(name, "None or a floating torch.dtype", value)

    def shard_world(self, data_parallel_size: int) -> int:
        return data_parallel_size if self.shard_size == -1 else self.shard_size

    def bucket_bytes(self) -> int | None:
        """Bytes per fused bucket; None: one bucket for the whole module; 0: one per parameter."""
        if not self.comm_fusion:
            return 0
        return self.budget_bytes()

    def budget_bytes(self) -> int | None:
        """The most bytes of one collective's buffer (None: no limit); also bounds the fused collectives
        across units, with or without ``comm_fusion``."""
        return None if self.bucket_size == -1 else int(self.bucket_size * 1024)
