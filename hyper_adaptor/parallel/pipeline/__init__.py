"""Pipeline parallelism as data: validated per-rank action lists (:mod:`.actions`, :mod:`.schedules`,
:mod:`.validate`), one runtime that runs any of them (:mod:`.runtime`), and the library API over plain
``nn.Module`` chunks (:mod:`.stage`, :mod:`.api`; zero-bubble weight-gradient deferral in :mod:`.wgrad`).

    from hyper_adaptor.parallel.pipeline import PipelineStage, Schedule1F1B
    stage = PipelineStage(chunk, stage_index=rank, stage_num=world)
    Schedule1F1B(stage, micro_batch_num=8, loss_fn=loss).step(x, target=y, losses=losses)

Only :mod:`.actions` (plain data, no torch) loads with the package; every other name is imported on first
use, so ``import hyper_adaptor.megatron_adaptor`` (whose patches name action types) stays light.
``validate_schedule`` is :func:`.validate.validate` (the bare name ``validate`` is the submodule).
``SCHEDULES`` names the schedules :func:`build` knows; ``SPLIT_WEIGHT_SCHEDULES`` those that split each
backward into input and weight gradients, ``CHUNKED_SCHEDULES`` those that run several chunks per rank.
"""

import importlib

from hyper_adaptor.parallel.pipeline.actions import MetaStep, MetaStepType, StageLayout

_LAZY = {
    "BatchDimSpec": "api", "PipelineSchedule": "api", "ScheduleGPipe": "api", "Schedule1F1B": "api",
    "ScheduleInterleaved1F1B": "api", "ScheduleZBH1": "api", "ScheduleZBV": "api", "schedule_from_actions": "api",
    "PipelineStage": "stage",
    "execute": "runtime", "PipelineRuntimeError": "runtime",
    "build": "schedules", "SCHEDULES": "schedules", "SPLIT_WEIGHT_SCHEDULES": "schedules",
    "CHUNKED_SCHEDULES": "schedules",
    "render": "timeline",
    "ScheduleError": "validate", "validate_schedule": ("validate", "validate"),
    "WeightGradQueue": "wgrad", "defer_weight_grads": "wgrad",
}

__all__ = ["MetaStep", "MetaStepType", "StageLayout", *_LAZY]


def __getattr__(name):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value
    return value
