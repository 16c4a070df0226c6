"""Rank code for test_expert_parallel_megatron.py: megatron's ``MoELayer`` with ``--moe-dispatcher-engine
hyper`` (hyper_adaptor's token-dispatch engine) beside megatron's own all-to-all dispatcher.

The layer, its weights, its data and what each rank returns are tests/distributed/moe_dispatcher_checks.py's
(``layout``); this module only switches the engine on through the adaptor — the feature's own
``prepare`` / ``apply_features``, as megatron.training's ``validate_args`` would — and counts the engine's
calls (plain dispatch, overlapped schedule), so that a run that silently fell back to megatron's
dispatcher, or took the other path, is seen.
"""

from __future__ import annotations

import contextlib
import types

import torch.distributed as dist

from tests.distributed import moe_dispatcher_checks as checks


def engine_on() -> None:
    """What megatron.training does with ``--moe-dispatcher-engine hyper`` (level 2); process-wide."""
    from hyper_adaptor.megatron_adaptor import ADAPTOR

    args = types.SimpleNamespace(transformer_impl="local", optimization_level=2, num_experts=checks.EXPERTS,
                                 moe_token_dispatcher_type="alltoall", moe_dispatcher_engine="hyper",
                                 moe_grouped_gemm=False, gradient_accumulation_fusion=False)
    ADAPTOR.prepare(args)
    ADAPTOR.apply_features(args)


class _Counted:
    """Counts the engine's entry points while a run lasts: ``AllToAllDispatcher.dispatch`` (the plain
    path) and ``overlapped_moe_forward`` (chunks, shared expert during the dispatch)."""

    def __init__(self):
        from hyper_adaptor.parallel import expert

        self.expert, self.calls = expert, {"dispatch": 0, "overlapped": 0}
        self.dispatch, self.overlapped = expert.AllToAllDispatcher.dispatch, expert.overlapped_moe_forward

    def _counting(self, key, original):
        def counted(*args, **kwargs):
            self.calls[key] += 1
            return original(*args, **kwargs)

        return counted

    def __enter__(self):
        self.expert.AllToAllDispatcher.dispatch = self._counting("dispatch", self.dispatch)
        self.expert.overlapped_moe_forward = self._counting("overlapped", self.overlapped)
        return self

    def __exit__(self, *exc):
        self.expert.AllToAllDispatcher.dispatch = self.dispatch
        self.expert.overlapped_moe_forward = self.overlapped


def _chunked(chunks: int):
    """The feature's patches with ``--moe-dispatch-chunks chunks``, for one run (a manager of its own)."""
    from hyper_adaptor.patch_manager import PatchManager
    from hyper_adaptor.patches.expert import dispatcher

    manager = PatchManager()
    manager.register_all(dispatcher.patches(types.SimpleNamespace(moe_dispatch_chunks=chunks)))
    return manager.applied()


def layouts(rank: int, world_size: int, runs: dict) -> dict:
    """Each run in order: ``layout``'s keywords plus ``"engine": bool``, ``"chunks": N`` (the engine's
    patches with that many chunks, for this run only) and ``"level": 1`` (grouped GEMM served at level
    1). The engine and level 1, once on, stay on in the process: runs of megatron's own dispatcher go
    first. A run that raises gives its error text."""
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {}
    for name, run in runs.items():
        run = dict(run)
        engine, level, chunks = run.pop("engine", False), run.pop("level", None), run.pop("chunks", 1)
        if engine:
            engine_on()
        if level is not None:
            run["grouped"] = checks._level(level, run.get("grouped", False))
        try:
            with _chunked(chunks) if chunks > 1 else contextlib.nullcontext(), _Counted() as counted:
                results[name] = checks.layout(rank, world_size, **run)
            results[name]["engine_calls"] = dict(counted.calls)
        except Exception as error:  # the test reads which error
            results[name] = f"{type(error).__name__}: {error}"
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
    return results
