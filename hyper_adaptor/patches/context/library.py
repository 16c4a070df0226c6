"""Context parallel asked by a ``TransformerConfig`` alone (megatron-core library users, no command line).

A framework that uses megatron-core as a library (NeMo, verl, in-house trainers, megatron's own unit tests)
builds ``TransformerConfig(context_parallel_size=N, cp_comm_type=...)`` and calls
``parallel_state.initialize_model_parallel(context_parallel_size=N)`` itself: megatron.training's flags never
request the ``context_parallel`` feature, and megatron's local ``DotProductAttention`` asserts CP == 1.

This level-0 wrap sits on that constructor *below* the feature's own wrap (``attention.py``), which hands the
constructor a copy of the config saying CP 1. So a config with CP > 1 reaches this wrap only while the feature
is not applied, and then:

- at optimization level >= 2 (``HYPER_ADAPTOR_OPTIMIZATION_LEVEL``, or the ``--optimization-level`` of a
  command line the adaptor prepared, as for the fusion switches of such a config) it applies the feature
  through the adaptor and builds the module again through the class's constructor, now the feature's wrap:
  the layer's algorithm is its ``cp_comm_type``, its groups are its ``pg_collection``'s (else parallel_state's);
- below level 2 megatron's ``AssertionError`` stands, its message saying how to get context parallel served.
"""

from __future__ import annotations

import functools
import importlib

from hyper_adaptor.patch_manager import Patch
from hyper_adaptor.patches import adaptor_hooks
from hyper_adaptor.patches.compat import fusion_switches
from hyper_adaptor.patches.context.attention import CLASS
from hyper_adaptor.patches.context.attention import FEATURE as CP_FEATURE

FEATURE = "compat"
INIT = f"{CLASS}.__init__"
LEVEL = 2  # the context_parallel feature's level (features/context_parallel.py; a test holds them equal)
MEGATRON_MESSAGE = "Context parallelism is only supported by TEDotProductAttention!"

_building: set[int] = set()  # modules being built again through the feature's wrap (a loop guard)


def below_level_message(size: int, level: int, from_command_line: bool) -> str:
    how = (f"pass --optimization-level {LEVEL} (it is {level})" if from_command_line
           else f"set {fusion_switches.LEVEL_ENV}={LEVEL} (the level is {level})")
    return (f"{MEGATRON_MESSAGE} TransformerConfig.context_parallel_size={size} on megatron's local spec: "
            f"hyper_adaptor serves context parallel there from optimization level {LEVEL} "
            f"(the algorithm from the config's cp_comm_type): {how}")


def _attention_class():
    module, name = CLASS.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _serving_context_parallel(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        size = getattr(config, "context_parallel_size", 1) or 1
        if size == 1:
            return original(self, config, *args, **kwargs)
        hooks = adaptor_hooks.current()
        level = fusion_switches.optimization_level()
        if level < LEVEL or hooks.apply_feature is None:
            raise AssertionError(below_level_message(size, level, hooks.level() is not None))
        if id(self) in _building:
            raise RuntimeError(f"{INIT}: hyper_adaptor's {CP_FEATURE} wrap did not take the constructor after "
                               "the feature was applied (a patch above it?)")
        hooks.apply_feature(CP_FEATURE, level)
        _building.add(id(self))
        try:
            return _attention_class().__init__(self, config, *args, **kwargs)
        finally:
            _building.discard(id(self))

    return __init__


def patches() -> list[Patch]:
    # above level 0's wrap that accepts MLA's head sizes, below the feature's wrap (which lists "compat")
    return [Patch(INIT, _serving_context_parallel, "wrap", FEATURE, after=(FEATURE,))]
