"""Level 0 — profiling from the launch command: MindSpeed's ``--profile*`` flags and Megatron's, one profiler.

MindSpeed users switch profiling on with ``--profile`` plus ``--profile-level``, ``--profile-with-cpu``,
``--profile-with-stack``, ``--profile-with-memory``, ``--profile-record-shapes``, ``--profile-save-path``
and ``--profile-ranks`` (-1: every rank); Megatron-core spells the same thing ``--profile`` (nsys, CUDA
only), ``--use-pytorch-profiler``, ``--pytorch-profiler-collect-shapes/-callstack`` and ``--profile-ranks``
(empty: every rank). Both spellings are served by one profiler, hyper_adaptor's
(hyper_adaptor/patches/profiling): torch_npu.profiler on NPU, torch.profiler on CUDA and CPU.

So that exactly one profiler runs, ``adjust`` takes megatron's ``--profile`` from it for the run
(``take_from_megatron``: megatron's train loop would otherwise start nsys — ``cudaProfilerStart``, an
error without CUDA — or its own torch.profiler, whose window is one step off the nsys one and whose
trace goes under ``--tensorboard-dir/..``); the flag as asked is still read through ``asked``. The one
exception is megatron's own meaning of ``--profile`` on CUDA under Nsight Systems: there megatron's nsys
path stays and this feature stays off.
"""

from __future__ import annotations

import os

from hyper_adaptor import platform
from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag, asked, switch, take_from_megatron
from hyper_adaptor.patches.profiling.ranks import profiled_ranks

LEVELS = ("level0", "level1", "level2")
DEFAULT_SAVE_PATH = "./profile_dir"
# Nsight Systems sets this in the processes it profiles (the marker NVTX bindings check for "nsys active")
NSYS_ENV = "NSYS_PROFILING_SESSION_ID"


def megatron_nsys(args) -> bool:
    """``--profile`` in megatron's own meaning: nsys on CUDA, when the process runs under Nsight Systems."""
    return (platform.device_type() == "cuda" and not getattr(args, "use_pytorch_profiler", False)
            and NSYS_ENV in os.environ)


def _writable_dir(path: str) -> str | None:
    """Why ``path`` cannot hold traces, or None. Checks only: nothing is created here."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "it exists and is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "it is not writable"
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"it cannot be created ({parent} is not writable)"


class Profiling(Feature):
    name = "profiling"
    level = 0
    summary = ("--profile records steps [start, end) on the chosen ranks: torch_npu.profiler on NPU, "
               "torch.profiler elsewhere")
    flags = (
        Flag("--profile",
             "megatron's flag; served by hyper_adaptor's profiler (megatron's nsys path under nsys on CUDA)",
             owner="megatron"),
        Flag("--profile-level", "what the profiler records (MindSpeed): level0 operators and kernels; level1 + "
             "FLOPs, communication detail (NPU: AscendCL, AI Core metrics); level2 + every host thread "
             "(NPU: runtime, AI CPU); see docs/features/profiling.md",
             {"choices": LEVELS, "default": "level0"}),
        Flag("--profile-with-cpu", "also record host-side (CPU) operators (always on with --device-type cpu)"),
        Flag("--profile-with-stack", "record the Python call stack of each operator (megatron: "
             "--pytorch-profiler-collect-callstack)"),
        Flag("--profile-with-memory", "record memory allocations, and write a memory snapshot where the device "
             "keeps one (CUDA, NPU); needs --profile-with-cpu"),
        Flag("--profile-record-shapes", "record operator input shapes (megatron: --pytorch-profiler-collect-shapes)"),
        Flag("--profile-save-path", "directory of the traces (one per profiled rank; created if absent)",
             {"type": str, "default": DEFAULT_SAVE_PATH}),
        # megatron's, read here; the defaults are what a namespace built without megatron's parser gets
        Flag("--profile-step-start", "megatron's: first recorded step", {"type": int, "default": 10}, owner="megatron"),
        Flag("--profile-step-end", "megatron's: first step not recorded", {"type": int, "default": 12},
             owner="megatron"),
        Flag("--profile-ranks", "megatron's: global ranks ([] or -1: every rank)", {"nargs": "+", "type": int,
             "default": []}, owner="megatron"),
        Flag("--use-pytorch-profiler", "megatron's: with --profile, the torch profiler (served here)",
             owner="megatron"),
        Flag("--pytorch-profiler-collect-shapes", "megatron's: = --profile-record-shapes", owner="megatron"),
        Flag("--pytorch-profiler-collect-callstack", "megatron's: = --profile-with-stack", owner="megatron"),
    )

    def requested(self, args) -> bool:
        return bool(asked(args, "profile")) and not megatron_nsys(args)

    def adjust(self, args) -> list[str]:
        notices = []
        if getattr(args, "profile", False):
            chosen = profiled_ranks(args)
            ranks = ("every rank" if chosen is None
                     else ("rank " if len(chosen) == 1 else "ranks ") + ", ".join(map(str, chosen)))
            notices.append(take_from_megatron(
                args, "profile", False,
                f"hyper_adaptor's profiler records steps [{args.profile_step_start}, {args.profile_step_end}) on "
                f"{ranks}; megatron's nsys / torch.profiler path is off so that one profiler runs"))
        tensorboard = getattr(args, "tensorboard_dir", None)
        if getattr(args, "use_pytorch_profiler", False) and tensorboard and \
                getattr(args, "profile_save_path", DEFAULT_SAVE_PATH) == DEFAULT_SAVE_PATH:
            # megatron's --use-pytorch-profiler writes beside the TensorBoard logs: keep its place
            notices.append(switch(args, "profile_save_path", os.path.join(tensorboard, "..", "torch_profile"),
                                  "--use-pytorch-profiler writes where megatron does: "
                                  "--tensorboard-dir/../torch_profile"))
        return notices

    def validate(self, args) -> None:
        start, end = args.profile_step_start, args.profile_step_end
        if start < 0:
            raise FeatureConfigError(f"--profile-step-start must be >= 0; got {start}")
        if end <= start:
            raise FeatureConfigError(f"--profile-step-end {end} must be greater than --profile-step-start {start} "
                                     "(the steps [start, end) are recorded)")
        train_iters = getattr(args, "train_iters", None)
        if train_iters is not None and end > train_iters:
            raise FeatureConfigError(f"--profile-step-end {end} is past --train-iters {train_iters}: the window "
                                     f"[{start}, {end}) would never close and no trace would be written")
        world = getattr(args, "world_size", None) or 1
        for rank in getattr(args, "profile_ranks", None) or []:
            if rank != -1 and not 0 <= rank < world:
                raise FeatureConfigError(f"--profile-ranks {rank}: outside the world of {world} processes "
                                         f"(global ranks 0..{world - 1}, or -1 for every rank)")
        if args.profile_with_memory and not args.profile_with_cpu:
            raise FeatureConfigError("--profile-with-memory needs --profile-with-cpu (MindSpeed's rule: memory "
                                     "events are recorded by the host-side profiler)")
        if getattr(args, "pytorch_profiler_collect_chakra", False):
            raise FeatureConfigError("--pytorch-profiler-collect-chakra is not served by hyper_adaptor's profiler "
                                     "(no execution trace is written); drop it")
        why = _writable_dir(args.profile_save_path)
        if why:
            raise FeatureConfigError(f"--profile-save-path {args.profile_save_path}: {why}")

    def patches(self, args):
        from hyper_adaptor.patches.profiling import patches

        return patches.patches(args)

    def on_applied(self, args) -> None:
        from hyper_adaptor.patches.profiling import window

        window.configure(window.WindowConfig.from_args(args))
