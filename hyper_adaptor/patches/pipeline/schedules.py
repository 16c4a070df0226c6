"""Megatron's ``get_forward_backward_func`` seam: the schedule picked by ``--pipeline-schedule`` runs on the
engine in ``hyper_adaptor/parallel/pipeline``, with megatron's own per-micro-batch helpers.

megatron.training binds ``get_forward_backward_func`` by name (training.py imports it; so does
``megatron.core.pipeline_parallel``); one wrap of the function in ``schedules`` is rebound in all of them by
the patch manager. The returned function keeps megatron's keyword signature and contract:

- each forward is megatron's ``forward_step`` (``set_input_tensor``, the user's ``forward_step_func`` with
  that chunk's data iterator, ``forward_step_calc_loss``: loss / num-micro-batches or per-token, CP and MoE
  aux-loss scaling, the ``forward_data_store`` it returns); each backward is megatron's ``backward_step``
  (grad scaler on the last stage, pseudo-freed outputs);
- input-gradient steps (ZB-H1) run megatron's linear backward without the weight product
  (:mod:`.wgrad`), the weight-gradient step computes it;
- gradient reduction: every chunk under its DDP wrapper's ``no_sync`` until that chunk's last backward
  step, then megatron's ``finalize_model_grads_func`` with the token count;
- ``forward_only`` (evaluation) runs the forward-only list: no backward, no gradient hooks.
Schedules whose micro-batch count the engine cannot serve raise an error naming ``--pipeline-schedule``.
"""

from __future__ import annotations

import functools

import torch

from hyper_adaptor.parallel.pipeline import SCHEDULES, MetaStepType, build, execute
from hyper_adaptor.patch_manager import Patch
from hyper_adaptor.patches.pipeline import wgrad

FEATURE = "pipeline"
TARGET = "megatron.core.pipeline_parallel.schedules.get_forward_backward_func"
T = MetaStepType


@functools.lru_cache(maxsize=64)
def action_lists(name: str, ranks: int, micro: int, chunks: int, forward_only: bool, overlap_b_f: bool = False):
    """The engine's validated (layout, per-rank lists) of ``name`` for megatron's run shape, errors
    phrased in megatron's flags; cached because every training step asks for the same ones."""
    try:
        return build(name, ranks, micro, chunks, forward_only=forward_only, overlap_b_f=overlap_b_f)
    except ValueError as err:
        raise ValueError(f"--pipeline-schedule {name} with --pipeline-model-parallel-size {ranks}, "
                         f"{chunks} model chunk(s) per rank and {micro} micro-batches: {err}") from err


class MegatronStage:
    """The engine's StageRunner over one megatron model chunk."""

    def __init__(self, run: _Run, chunk: int, stage_index: int, is_last: bool):
        self.run, self.chunk, self.stage_index, self.is_last = run, chunk, stage_index, is_last
        self.saved: dict[int, tuple] = {}
        self.deferred: dict[int, list] = {}

    def recv_meta(self, kind, micro):
        return self.run.shape, self.run.config.pipeline_dtype

    def forward(self, micro, inp):
        from megatron.core.pipeline_parallel import schedules as mcore

        run = self.run  # (validate proved the lists run each stage's forwards in micro-batch order:
        # megatron's data iterators are read in order)
        if inp is not None:
            inp.requires_grad_(not run.forward_only)
        if run.param_sync is not None and micro == 0:
            run.param_sync[self.chunk](run.models[self.chunk].parameters())
        out, num_tokens = mcore.forward_step(
            run.forward_step_func, run.iterators[self.chunk], run.models[self.chunk], run.num_microbatches,
            inp, run.store, run.config, run.cp_size, collect_non_loss_data=run.collect_non_loss_data,
            is_first_microbatch=mcore.check_first_val_step(run.first_val_step, run.forward_only, micro == 0),
            current_microbatch=micro, vp_stage=self.chunk if run.chunks > 1 else None, is_last_stage=self.is_last)
        run.total_num_tokens += num_tokens
        if not run.forward_only:
            self.saved[micro] = (inp, out)
        return None if self.is_last else out

    def backward(self, micro, grad, split_weight):
        from megatron.core.pipeline_parallel import schedules as mcore

        run = self.run
        inp, out = self.saved.pop(micro)
        run.before_backward(self.chunk, micro)
        if not self.is_last:  # megatron pseudo-frees sent outputs; what was sent is a separate reference
            mcore.deallocate_output_tensor(out, run.config.deallocate_pipeline_outputs)
        if split_weight:
            with wgrad.deferring(self.deferred.setdefault(micro, [])):
                return mcore.backward_step(inp, out, grad, run.config)
        return mcore.backward_step(inp, out, grad, run.config)

    def backward_weight(self, micro):
        wgrad.run_deferred(self.deferred.pop(micro, []))


class _Run:
    """One call of the returned forward-backward function."""

    def __init__(self, name, kwargs):
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import schedules as mcore
        from megatron.core.utils import get_model_config

        model, iters = kwargs["model"], kwargs["data_iterator"]
        self.models = list(model) if isinstance(model, list) else [model]
        self.iterators = list(iters) if isinstance(iters, list) else [iters] * len(self.models)
        self.chunks = len(self.models)
        self.config = config = get_model_config(self.models[0])
        self.forward_step_func = kwargs["forward_step_func"]
        self.num_microbatches = int(kwargs["num_microbatches"])
        self.forward_only = bool(kwargs.get("forward_only", False))
        self.collect_non_loss_data = bool(kwargs.get("collect_non_loss_data", False))
        self.first_val_step = kwargs.get("first_val_step")
        self.force_all_reduce = bool(kwargs.get("force_all_reduce", False))
        pg = kwargs.get("pg_collection") or mcore._build_default_pg_collection()
        self.pg_collection = pg
        self.pp_group = getattr(pg, "pp", None) or parallel_state.get_pipeline_model_parallel_group()
        self.cp_size = pg.cp.size()
        if config.variable_seq_lengths:
            raise ValueError(f"--pipeline-schedule {name}: variable sequence lengths (shapes exchanged per "
                             "micro-batch) are not served; megatron's own schedules handle them")
        if kwargs.get("adjust_tensor_shapes_fn") is not None:
            raise ValueError(f"--pipeline-schedule {name}: adjust_tensor_shapes_fn is not served")
        seq = kwargs.get("decoder_seq_length") or kwargs["seq_length"]
        seq //= self.cp_size
        if config.sequence_parallel:
            seq //= pg.tp.size()
        self.shape = (seq, int(kwargs["micro_batch_size"]), config.hidden_size)
        device = next(self.models[0].parameters()).device
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=device)
        self.store: list = []
        self.param_sync = None
        if config.param_sync_func is not None and not self.forward_only:
            fns = config.param_sync_func
            self.param_sync = list(fns) if isinstance(fns, list) else [fns] * self.chunks
        self.no_sync: list = [None] * self.chunks

    # gradient synchronisation: every chunk's no_sync until its last backward step
    def _no_sync_funcs(self):
        funcs = self.config.no_sync_func
        if funcs is None:
            return [None] * self.chunks
        if isinstance(funcs, list):
            return list(funcs)
        # one function for several chunks: HSDP's wrapper sets its own; use each chunk's
        return [getattr(m, "no_sync", funcs) for m in self.models] if self.chunks > 1 else [funcs]

    def enter_no_sync(self, last_backward: dict):
        self.last_backward = last_backward
        for c, fn in enumerate(self._no_sync_funcs()):
            if fn is not None:
                ctx = fn()
                ctx.__enter__()
                self.no_sync[c] = ctx

    def before_backward(self, chunk, micro):
        # without a grad_sync_func the DDP hooks of the chunk's last backward start its reduction; with
        # one (megatron's overlap_grad_reduce + align), the reduction is started after the step
        if self.config.grad_sync_func is None and self.last_backward.get(chunk) == micro:
            self.exit_no_sync(chunk)

    def exit_no_sync(self, chunk):
        ctx, self.no_sync[chunk] = self.no_sync[chunk], None
        if ctx is not None:
            ctx.__exit__(None, None, None)


def forward_backward(name: str, **kwargs):
    """Megatron's forward-backward contract over the engine's ``name`` schedule."""
    run = _Run(name, kwargs)
    config = run.config
    ranks = run.pp_group.size()
    me = run.pp_group.rank()
    # --overlap-moe-expert-parallel-comm (the pipeline feature lets it through with the engine's dispatcher):
    # each steady (F, B) pair runs the forward and the backward concurrently, meeting at the hooks the
    # engine's dispatcher puts around its dispatch and combine
    overlap = None
    if getattr(config, "overlap_moe_expert_parallel_comm", False) and not run.forward_only:
        from hyper_adaptor.patches.expert.dispatcher import pair_overlap

        overlap = pair_overlap(create=False)
    layout, lists = action_lists(name, ranks, run.num_microbatches, run.chunks, run.forward_only,
                                 overlap is not None)
    actions = lists[me]
    stages = layout.stages_of(me)
    last_stage = layout.num_stages - 1
    runners = {s: MegatronStage(run, c, s, s == last_stage) for c, s in enumerate(stages)}
    if layout.style == "v":
        _check_v_build(run.models, runners, me)
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
    if run.forward_only:
        grad_sync, param_sync = config.grad_sync_func, config.param_sync_func
        config.grad_sync_func = config.param_sync_func = None
        try:
            execute(actions, runners, layout, run.pp_group, overlap_p2p=bool(config.overlap_p2p_comm))
        finally:
            config.grad_sync_func, config.param_sync_func = grad_sync, param_sync
    else:
        last_backward = {}
        for a in actions:
            for half in a.halves():
                if half.step_type in (T.BWD, T.BWD_INPUT):
                    last_backward[stages.index(half.stage_index)] = half.micro_index
        run.enter_no_sync(last_backward)
        try:
            execute(actions, runners, layout, run.pp_group, overlap_p2p=bool(config.overlap_p2p_comm),
                    comm_compute_overlap=overlap)
        finally:
            for c in range(run.chunks):
                run.exit_no_sync(c)
        if layout.style == "v":
            # the loss stage is chunk 1 of pipeline rank 0; megatron's finalize broadcasts the token count
            # from the last pipeline rank
            torch.distributed.broadcast(run.total_num_tokens, src=_global_rank(run.pp_group, 0), group=run.pp_group)
        if config.grad_sync_func is not None:
            fns = config.grad_sync_func if isinstance(config.grad_sync_func, list) else \
                [config.grad_sync_func] * run.chunks
            for c, fn in enumerate(fns):
                fn(run.models[c].parameters())
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func(
                run.models, run.total_num_tokens if config.calculate_per_token_loss else None,
                pg_collection=run.pg_collection, force_all_reduce=run.force_all_reduce)
    if config.timers is not None:
        config.timers("forward-backward").stop()
    if layout.style == "v":
        # megatron.training reduces and logs the losses on the last pipeline rank; ZBV computes them on rank 0
        box = [run.store]
        torch.distributed.broadcast_object_list(box, src=_global_rank(run.pp_group, 0), group=run.pp_group)
        return box[0] if me == ranks - 1 else []
    return run.store


def _check_v_build(models, runners, me: int) -> None:
    """A chunk built for megatron's loop placement would compute the loss in the wrong place: refuse it."""
    from megatron.core.utils import get_attr_wrapped_model

    for runner in runners.values():
        try:
            built_last = bool(get_attr_wrapped_model(models[runner.chunk], "post_process"))
        except RuntimeError:
            continue  # a model without megatron's post_process attribute: nothing to check
        if built_last != runner.is_last:
            raise ValueError(
                f"--pipeline-schedule zbv: model chunk {runner.chunk} of pipeline rank {me} was built with "
                f"post_process={built_last}, but in the V it is stage {runner.stage_index} "
                f"({'the last' if runner.is_last else 'not the last'}); build the chunks through "
                "megatron.training's get_model or parallel_state.is_pipeline_last_stage(ignore_virtual=False, "
                "vp_stage=...) with the pipeline feature applied")


def _global_rank(group, rank: int) -> int:
    return torch.distributed.get_global_rank(group, rank)


def _wrap_get(name: str, original):
    """megatron's ``get_forward_backward_func`` handing out the engine's ``name`` schedule (bound here,
    so that undoing the patch leaves nothing selected)."""
    def get_forward_backward_func(*args, **kwargs):
        chosen = original(*args, **kwargs)
        if chosen.__name__ == "forward_backward_no_pipelining":
            return chosen  # one pipeline rank: nothing to schedule
        if kwargs.get("schedule_pg_collection") is not None:
            return chosen  # megatron's multi-module bridge schedule
        return functools.partial(forward_backward, name)

    return get_forward_backward_func


def patches(name: str) -> list[Patch]:
    """The patches that run schedule ``name``; a process that runs several schedules registers each
    one's patches in a PatchManager of its own and applies one at a time."""
    from hyper_adaptor.patches.pipeline import vlayout

    if name not in SCHEDULES:
        raise ValueError(f"--pipeline-schedule: unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    return [Patch(TARGET, functools.partial(_wrap_get, name), "wrap", FEATURE), *wgrad.patches(),
            *(vlayout.patches() if name == "zbv" else [])]


__all__ = ["action_lists", "forward_backward", "patches", "MegatronStage"]
