"""The device's profiler for one window: torch_npu.profiler on NPU, torch.profiler on CUDA and CPU.

``--profile-level`` is MindSpeed's, and on NPU it is torch_npu's own ``ProfilerLevel``; torch.profiler
has no levels, so each level switches on what torch can add at a comparable cost (the table is in
docs/features/profiling.md):

=========  ==========================================  ===============================================
level      torch_npu.profiler (NPU, not run here)       torch.profiler (CUDA, CPU)
=========  ==========================================  ===============================================
level0     ProfilerLevel.Level0, AiCMetrics.AiCoreNone  operators (CPU) / kernels (CUDA) + step markers
level1     Level1, AiCMetrics.PipeUtilization           + ``with_flops``; CUDA: + synchronization events
level2     Level2, AiCMetrics.PipeUtilization           + every host thread, Python GC events, overload names
=========  ==========================================  ===============================================
"""

from __future__ import annotations

import os

import torch

from hyper_adaptor import platform

# torch's own name for a step: TensorBoard's profiler view and Perfetto's step track read it
STEP_MARKER = "ProfilerStep#{}"


class TorchRecorder:
    """torch.profiler driven by hand: warm up one step early (Kineto's start-up cost falls outside the
    window), record between ``start`` and ``stop``, one ``ProfilerStep#<iteration>`` range per step.
    No torch.profiler schedule: its step markers count from the profiler's creation, not megatron's
    iteration, and a resumed run would mislabel them."""

    kind = "torch.profiler"

    def __init__(self, config, device: str):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] if device == "cpu" or config.with_cpu else []
        if device == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.device_time = device != "cpu" and ProfilerActivity.CPU not in activities
        experimental = None
        if config.level == "level1" and device == "cuda":
            experimental = torch._C._profiler._ExperimentalConfig(enable_cuda_sync_events=True)
        elif config.level == "level2":
            experimental = torch._C._profiler._ExperimentalConfig(
                enable_cuda_sync_events=device == "cuda", profile_all_threads=True,
                record_python_gc_info=True, capture_overload_names=True)
        self.profiler = profile(
            activities=activities,
            record_shapes=config.record_shapes,
            profile_memory=config.with_memory,
            with_stack=config.with_stack,
            with_flops=config.level != "level0",
            experimental_config=experimental,
        )
        self.warm = False

    def warm_up(self) -> None:
        self.profiler.prepare_trace()
        self.warm = True

    def start(self) -> None:
        if not self.warm:
            self.warm_up()
        self.profiler.start_trace()

    def marker(self, iteration: int):
        return torch.profiler.record_function(STEP_MARKER.format(iteration))

    def stop(self) -> None:
        self.profiler.stop_trace()

    def save(self, directory: str, stem: str) -> str:
        # *.pt.trace.json: the name TensorBoard's profiler plugin looks for; Chrome / Perfetto JSON
        path = os.path.join(directory, f"{stem}.pt.trace.json")
        self.profiler.export_chrome_trace(path)
        return path

    def averages(self):
        return self.profiler.key_averages()

    def communication_intervals(self) -> list[tuple[int, int]]:
        """(start, end) ns of every collective range or kernel, on every thread and stream."""
        from hyper_adaptor.patches.profiling.summary import COMMUNICATION

        return [(e.start_ns(), e.start_ns() + e.duration_ns())
                for e in self.profiler.profiler.kineto_results.events() if COMMUNICATION.search(e.name())]


class NpuRecorder:
    """torch_npu.profiler (written against its documented API; not run here): its levels and
    experimental config, its ``tensorboard_trace_handler`` writing ``<save>/<stem>_<time>_ascend_pt``."""

    kind = "torch_npu.profiler"
    device_time = True

    def __init__(self, config, device: str):
        import torch_npu

        npu_prof = torch_npu.profiler
        level = {"level0": npu_prof.ProfilerLevel.Level0, "level1": npu_prof.ProfilerLevel.Level1,
                 "level2": npu_prof.ProfilerLevel.Level2}[config.level]
        metrics = npu_prof.AiCMetrics.AiCoreNone if config.level == "level0" else npu_prof.AiCMetrics.PipeUtilization
        activities = [npu_prof.ProfilerActivity.NPU]
        if config.with_cpu:
            activities.append(npu_prof.ProfilerActivity.CPU)
        self.directory, self.stem, self.path = config.save_path, None, None
        self.profiler = npu_prof.profile(
            activities=activities,
            record_shapes=config.record_shapes,
            profile_memory=config.with_memory,
            with_stack=config.with_stack,
            experimental_config=npu_prof._ExperimentalConfig(profiler_level=level, aic_metrics=metrics,
                                                             l2_cache=False),
            on_trace_ready=self._ready,
        )

    def _ready(self, prof) -> None:
        import torch_npu

        os.makedirs(self.directory, exist_ok=True)
        torch_npu.profiler.tensorboard_trace_handler(self.directory, worker_name=self.stem)(prof)

    def warm_up(self) -> None:
        pass  # torch_npu.profiler starts collecting at start(); no separate warm-up is documented

    def start(self) -> None:
        self.profiler.start()

    def marker(self, iteration: int):
        return torch.profiler.record_function(STEP_MARKER.format(iteration))

    def stop(self) -> None:
        self.profiler.stop()

    def save(self, directory: str, stem: str) -> str:
        # the trace was written by stop() through on_trace_ready; name it by the steps it holds
        return os.path.join(directory, f"{stem}_*_ascend_pt")

    def averages(self):
        return None  # the summary reads torch_npu's own analysis files; not parsed here

    def communication_intervals(self) -> list[tuple[int, int]]:
        return []


def recorder(config):
    device = platform.device_type()
    return NpuRecorder(config, device) if device == "npu" else TorchRecorder(config, device)


# ---- memory snapshots: the caching allocator's history, where the device keeps one ----

def snapshot_supported() -> bool:
    return platform.device_type() in ("cuda", "npu")


def start_memory_history() -> None:
    platform.device_module().memory._record_memory_history(max_entries=100_000)


def dump_memory_history(path: str) -> None:
    memory = platform.device_module().memory
    memory._dump_snapshot(path)
    memory._record_memory_history(enabled=None)
