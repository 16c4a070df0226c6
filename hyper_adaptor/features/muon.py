"""Level 0 — megatron's ``--optimizer muon`` on every device and Python >= 3.11.

megatron-core 0.19.2 builds Muon only through the ``emerging_optimizers`` package (Python >= 3.12,
imports triton). Where it imports, megatron's own Muon runs (``--muon-engine auto``), except under
``--use-hsdp``: there each rank holds row shards of the matrices and megatron's Muon would
orthogonalise every shard as if it were a matrix; hyper_adaptor's Muon gathers each matrix on one
owner rank of the shard group instead (hyper_adaptor/optim/sharded.py). Elsewhere hyper_adaptor's Muon
serves the flag with megatron's update rule and every ``--muon-*`` flag; megatron's parameter split,
bf16 wrapper, layer-wise distributed optimizer and checkpoints stay megatron's.
Seam: hyper_adaptor/patches/optim/muon.py.
"""

from __future__ import annotations

import functools
import importlib

from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag, asked
from hyper_adaptor.notice import notice

# megatron 0.19.2's --optimizer choices that go through its emerging-optimizer factory
EMERGING = ("muon", "dist_muon", "adaptive_muon", "lion", "soap")
ENGINES = ("auto", "hyper", "megatron")


@functools.lru_cache(maxsize=1)
def emerging_optimizers_problem() -> str | None:
    """None when ``emerging_optimizers`` imports here, else why not (one line). Asked by validation, the
    engine choice, the patches and the notice; a failed import is not cached by Python, so the answer is."""
    try:
        importlib.import_module("emerging_optimizers.orthogonalized_optimizers")
        importlib.import_module("emerging_optimizers.scalar_optimizers")
    except Exception as exc:  # any import failure means megatron's path is unavailable
        return f"{type(exc).__name__}: {exc}"
    return None


def muon_engine(args) -> str:
    """'hyper' or 'megatron': who builds the torch optimizer for ``--optimizer muon``."""
    choice = getattr(args, "muon_engine", "auto")
    if choice != "auto":
        return choice
    if getattr(args, "use_hsdp", False) or emerging_optimizers_problem() is not None:
        return "hyper"
    return "megatron"


class Muon(Feature):
    name = "muon"
    level = 0
    summary = "megatron's --optimizer muon without emerging-optimizers, and under --use-hsdp"
    flags = (
        Flag("--optimizer", "megatron's; muon / dist_muon served here where megatron's cannot run", owner="megatron"),
        Flag("--muon-engine", "who builds --optimizer muon: auto (megatron's own where emerging-optimizers "
             "imports and --use-hsdp is off, hyper_adaptor's otherwise), hyper, megatron",
             {"choices": ENGINES, "default": "auto"}),
        Flag("--muon-layer-wise-balance", "with --use-distributed-optimizer (megatron's layer-wise optimizer): deal "
             "each bucket's matrices to the ranks that run their Newton-Schulz by its flops (flops) or keep "
             "megatron's deal by element count (elements: the smallest buffer)",
             {"choices": ("flops", "elements"), "default": "flops"}),
    )

    def requested(self, args) -> bool:
        return getattr(args, "optimizer", "adam") in EMERGING

    def validate(self, args) -> None:
        name = args.optimizer
        problem = emerging_optimizers_problem()
        if name not in ("muon", "dist_muon"):
            if problem is not None:
                raise FeatureConfigError(f"--optimizer {name} needs megatron's emerging-optimizers package, which does "
                                         f"not import here ({problem}); hyper_adaptor serves --optimizer muon only")
            return
        engine = getattr(args, "muon_engine", "auto")
        if engine == "megatron" and problem is not None:
            raise FeatureConfigError(f"--muon-engine megatron needs the emerging-optimizers package, which does not "
                                     f"import here ({problem}); use --muon-engine hyper (or auto)")
        if getattr(args, "use_hsdp", False) and engine == "megatron":
            raise FeatureConfigError("--muon-engine megatron cannot be combined with --use-hsdp: megatron's Muon would "
                                     "orthogonalise each rank's row shard as a matrix of its own; use --muon-engine "
                                     "hyper (or auto), which gathers each matrix on one owner rank")
        if getattr(args, "fp16", False):
            raise FeatureConfigError(f"--optimizer {name} cannot be combined with --fp16 (megatron's "
                                     "emerging-optimizer path has no loss-scaled Muon); use --bf16")
        if asked(args, "optimizer_cpu_offload"):
            raise FeatureConfigError(f"--optimizer {name} cannot be combined with --optimizer-cpu-offload (the host "
                                     "optimizer serves adam and sgd)")
        layer_wise = name == "dist_muon" or getattr(args, "use_distributed_optimizer", False)
        saves = getattr(args, "save", None) or getattr(args, "load", None)
        if layer_wise and saves and not getattr(args, "bf16", False):
            # megatron-core 0.19.2's layer-wise optimizer cannot write an fp32 run's checkpoint: its
            # sharded_state_dict looks for the 'optimizer' entry megatron's bf16 wrapper makes and fp32's
            # FP32Optimizer does not (KeyError: 'optimizer', megatron's own Muon alike)
            how = "--optimizer dist_muon" if name == "dist_muon" else f"--optimizer {name} --use-distributed-optimizer"
            raise FeatureConfigError(f"{how} (megatron's layer-wise distributed optimizer) without --bf16 cannot be "
                                     "combined with --save / --load: megatron-core's layer-wise checkpoint has no "
                                     "fp32 path; add --bf16, or use --use-hsdp (Muon checkpoints in fp32 and bf16)")
        if muon_engine(args) == "hyper":
            from hyper_adaptor.optim.muon import COEFFICIENT_SETS

            coefficients = getattr(args, "muon_coefficient_type", "quintic")
            if coefficients not in COEFFICIENT_SETS:
                raise FeatureConfigError(f"--muon-coefficient-type {coefficients} is not one of "
                                         f"{', '.join(COEFFICIENT_SETS)}")
            steps = getattr(args, "muon_num_ns_steps", 5)
            if not isinstance(steps, int) or steps < 1:
                raise FeatureConfigError(f"--muon-num-ns-steps must be >= 1; got {steps}")

    def patches(self, args):
        from hyper_adaptor.patches.optim import muon

        return muon.patches(serve=args.optimizer in ("muon", "dist_muon") and muon_engine(args) == "hyper",
                            balance_flops=getattr(args, "muon_layer_wise_balance", "flops") == "flops")

    def on_applied(self, args) -> None:
        if args.optimizer not in ("muon", "dist_muon"):
            return
        if muon_engine(args) == "megatron":
            notice(f"--optimizer {args.optimizer}: megatron's own Muon (emerging-optimizers)")
            return
        why = ("--use-hsdp" if getattr(args, "use_hsdp", False)
               else f"emerging-optimizers does not import here: {emerging_optimizers_problem()}")
        if getattr(args, "muon_engine", "auto") == "hyper":
            why = "--muon-engine hyper"
        notice(f"--optimizer {args.optimizer}: served by hyper_adaptor's Muon ({why})")
