"""Per-wrapped-module state and the hooks that drive HSDP through forward and backward.

Forward: the pre-hook gathers this module's parameters (if freed or stale) and registers the full
copies on their modules; the post-hook puts the shards back (what ``parameters()`` and the
optimizer see), frees the full copies at level 3, and hooks the outputs so that the gradient
arriving at them — the start of this module's backward — gathers the parameters again. A forward
rerun inside backward (activation recompute: ``in_a_backward``) starts no forward prefetch and keeps its
parameters for the backward that follows.

Backward: each full parameter's post-accumulate-grad hook marks it ready in its bucket; buckets are
reduced in a fixed order (so every rank issues the same collectives in the same order) as soon as
they and all buckets before them are ready, synchronously or overlapped with the rest of backward
(``comm_async``). A callback queued on the autograd engine runs when the whole backward is done: it
reduces what is left (parameters that got no gradient contribute zeros), waits for every pending
reduction and frees level-3 parameters.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_flatten, tree_map

from hyper_adaptor.parallel.hsdp._bucket import Bucket, gather_fused, make_buckets, reduce_fused
from hyper_adaptor.parallel.hsdp._config import HSDPConfig
from hyper_adaptor.parallel.hsdp._mesh import HSDPMesh
from hyper_adaptor.parallel.hsdp._param import HSDPParam
from hyper_adaptor.parallel.hsdp._pool import HostBufferPool

# The states taking part in the backward pass now running (one list per process: autograd runs one
# backward at a time on the thread that started it).
_BACKWARD: dict = {"queued": False, "states": [], "in_flight": None, "rebuilt": []}
ALL_STATES: weakref.WeakSet[HSDPState] = weakref.WeakSet()


def in_a_backward() -> bool:
    """True while a backward that has reached an HSDP unit runs in this process, so that a forward now
    is a recomputation (activation checkpointing) inside it.

    Why this signal: a unit's own ``_in_backward`` is not enough. A reentrant checkpoint (torch's
    ``checkpoint(use_reentrant=True)``, megatron's ``CheckpointFunction`` behind ``--recompute-granularity
    full``) ran the unit's forward under no_grad, so no pre-backward hook sits on its outputs: it reruns
    that forward from its autograd node's backward *before* the unit joins backward (it joins through the
    hooks on the recomputed outputs). Non-reentrant checkpointing (torch's default, hyper_adaptor.memory's
    ``checkpoint``, megatron's ``CheckpointWithoutOutput``) recomputes when a saved tensor is unpacked,
    after the unit's pre-backward hook, but a region spanning several units reruns the earlier ones
    before they join too. In every case the backward has already reached an HSDP unit (the root's
    pre-backward hook on its output, at the latest the unit whose saved tensor is unpacked): this flag
    is set from that first hook (``_join_backward``) to the end-of-backward callback, which autograd runs
    after every node, recomputations included. torch's only "inside backward" query is private (the
    autograd engine's current graph-task id), and grad mode says nothing: a recomputation runs with grad
    enabled, as a training forward does."""
    return bool(_BACKWARD["states"])


def mark_stale(params) -> None:
    """Mark HSDP shards among ``params`` as changed: levels 1/2 re-gather them at the next forward.
    For code that writes shards in place outside a torch optimizer step (other parameters are skipped)."""
    for param in params:
        hp = getattr(param, "_hsdp_param", None)
        if hp is not None:
            hp.stale = True


def _mark_stale(optimizer, args, kwargs) -> None:
    mark_stale(p for group in optimizer.param_groups for p in group["params"])


# How levels 1/2 learn that an optimizer step changed a shard. Not from a version counter: measured on
# torch 2.13, a foreach or fused step (the default on accelerators) of DTensor parameters moves the
# version of neither the DTensor nor its local tensor, and a single-tensor step only the DTensor's.
# Not from a hook on each optimizer either: HSDP never sees the optimizer, which is built after
# wrapping, by user code or inside Megatron's optimizer wrappers (which step a torch one). So torch's
# process-wide step post-hook marks the HSDP parameters an optimizer holds, but it is held only
# while an HSDPState exists: registered by the first, removed when the last is garbage collected
# (with its module). Importing HSDP registers nothing; with no module wrapped, optimizers pay nothing.
_STEP_HOOK: dict = {"states": 0, "handle": None}


def _hold_step_hook() -> None:
    # counted before the handle is looked at: a finalizer that the garbage collector runs in
    # between then sees this state as live and does not remove the hook under it
    _STEP_HOOK["states"] += 1
    if _STEP_HOOK["handle"] is None:
        _STEP_HOOK["handle"] = register_optimizer_step_post_hook(_mark_stale)


def _release_step_hook() -> None:
    _STEP_HOOK["states"] -= 1
    if _STEP_HOOK["states"] == 0 and _STEP_HOOK["handle"] is not None:
        handle, _STEP_HOOK["handle"] = _STEP_HOOK["handle"], None
        handle.remove()


def _weakly(method):
    """``method`` called through a weak reference to its object. Torch keeps a tensor's
    post-accumulate-grad hooks on its C++ side, where the garbage collector does not look: a hook
    bound to the state would keep the state, its module and every full parameter alive for ever."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _managed_registrations(module: nn.Module) -> list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]]:
    """Every parameter under ``module`` not already managed by a nested wrap, with all the
    (module, name) places it is registered (tied weights are registered more than once)."""
    found: dict[int, tuple[nn.Parameter, list]] = {}
    for _, sub in module.named_modules(remove_duplicate=False):
        for name, param in sub._parameters.items():
            if param is None or hasattr(param, "_hsdp_param"):
                continue
            entry = found.setdefault(id(param), (param, []))
            if (sub, name) not in [(m, n) for m, n in entry[1]]:
                entry[1].append((sub, name))
    return list(found.values())


class HSDPState:
    def __init__(self, module: nn.Module, config: HSDPConfig, mesh: HSDPMesh, device: torch.device,
                 pool: HostBufferPool, tp=None):
        self.module = module
        self.config = config
        self.mesh = mesh
        self.pool = pool
        self.params: list[HSDPParam] = []
        for param, owners in _managed_registrations(module):
            hp = HSDPParam(param, owners, config, mesh, device, tp)
            hp.register_sharded()
            self.params.append(hp)
        self.buckets: list[Bucket] = make_buckets(self.params, mesh, config, pool)
        self._bucket_of: dict[int, Bucket] = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p.full)] = bucket
        self._param_of = {id(p.full): p for p in self.params}
        self.requires_grad_sync = True
        self.forward_prefetch: list[HSDPState] = []
        self.backward_prefetch: list[HSDPState] = []
        self.is_root = False
        # Level 3: free the full parameters after this unit's forward (True), or keep them until its
        # backward is done (False); None: the default rule of ``_default_keep``.
        self.reshard_after_forward: bool | None = None
        self._nested: list | None = None
        self._in_backward = False
        self._next_launch = 0
        self._pending_gather: list[Bucket] = []
        self._pending_reduce: list[Bucket] = []
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            module.register_forward_hook(self._post_forward),
        ]
        for p in self.params:
            if p.full.requires_grad:
                self._handles.append(p.full.register_post_accumulate_grad_hook(_weakly(self._after_accumulate)))
        self._handles.append(module.register_load_state_dict_post_hook(self._after_load))
        ALL_STATES.add(self)
        _hold_step_hook()
        weakref.finalize(self, _release_step_hook)

    # -- gathering -------------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Gather the full parameters (a no-op where they are present and current)."""
        if not self._pending_gather:
            stale = [b for b in self.buckets if any(p.needs_gather() for p in b.params)]
            for bucket in stale:
                bucket.start_gather(async_op=async_op)
            self._pending_gather = stale
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        for bucket in self._pending_gather:
            bucket.finish_gather()
        self._pending_gather = []

    def reshard(self) -> None:
        """Free the full parameters (level 3)."""
        self.wait_gather()
        for p in self.params:
            p.free_full()

    # -- forward ---------------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        recomputing = in_a_backward()
        if recomputing:
            _release_rebuilt(keep_latest=True)
        if self.is_root:
            self._nested_states()  # (the first forward also sets the default prefetch)
        if self.is_root and not self._in_backward and not self.config.reshard_after_forward:
            # Levels 1 and 2 keep the full parameters, so after an optimizer step every unit is
            # stale at once: the root submits all the gathers together (async, in forward order, as
            # collectives of at most a bucket each, one in flight at a time: _bucket._GatherQueue)
            # rather than each unit blocking on its own in turn when its forward begins.
            launch = []
            for state in (self, *self._nested_states()):
                if not state._pending_gather:
                    state._pending_gather = [b for b in state.buckets if any(p.needs_gather() for p in b.params)]
                    launch += state._pending_gather
            gather_fused(launch, async_op=True)
        self.unshard()
        for p in self.params:
            p.register_full()
        if not recomputing:
            # Not inside backward: there the next unit in module order has had its backward already (a
            # reentrant checkpoint reruns the layers last to first) or has it gathered for it, and this
            # prefetch gathered it again for nothing, kept to the end of backward (its unit was still
            # in backward). The backward prefetch gathers what the backward needs next.
            for other in self.forward_prefetch:
                other.unshard(async_op=True)
        dtype = self.config.param_dtype
        if self.is_root and self.config.cast_forward_inputs and dtype is not None:
            cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
            return tree_map(cast, args), tree_map(cast, kwargs)
        return None

    def _post_forward(self, module, args, output):
        for p in self.params:
            p.register_sharded()
        if self._in_backward:
            return None  # recomputed inside this unit's own backward: its pre-backward hook already ran
        if in_a_backward():
            # Rerun before this unit joined backward (a reentrant checkpoint: megatron's full recompute):
            # its backward follows, so the parameters are kept (freeing them here made its pre-backward
            # hook gather them again at once) until then, or until two more units' rerun forwards begin
            # (_release_rebuilt). The hooks below still join it to backward and start its backward prefetch.
            if self.config.reshard_after_forward:
                _BACKWARD["rebuilt"].append(self)
        elif self.config.reshard_after_forward and (self.reshard_after_forward is not False
                                                    or not torch.is_grad_enabled()):
            self.reshard()  # (no backward will follow a forward without grad: nothing to keep for)
        if torch.is_grad_enabled():
            tensors, _ = tree_flatten(output)
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return None

    @property
    def defers_reduce(self) -> bool:
        return self.config.keeps_full_grads and not self.config.comm_async

    def _nested_states(self) -> list[HSDPState]:
        if self._nested is None:
            self._nested = [sub._hsdp_state for sub in self.module.modules()
                            if sub is not self.module and getattr(sub, "_hsdp_state", None) is not None]
            self._default_prefetch()
            self._default_keep()
        return self._nested

    def _default_keep(self) -> None:
        """Level 3, where ``set_reshard_after_forward`` was not called: the root and the unit whose
        backward begins first (the last one in module order; where units nest, the last outermost
        one: ``_backward_order``) stay gathered from their forward until their backward is done.
        Backward begins with exactly these two (the root's output layer, then that unit), so freeing
        them after forward only to gather them again a moment later costs two blocking all-gathers
        and saves no peak memory: the backward prefetch would hold the same two units at that point.
        FSDP2 keeps its root the same way; torchtitan also keeps the last block."""
        first = self._backward_order()[:1]
        for state in (self, *self._nested):
            if state.reshard_after_forward is None:
                state.reshard_after_forward = state is not self and state not in first

    def _default_prefetch(self) -> None:
        """Level 3, when no prefetch was set: each unit starts the next one's all-gather (module
        order, the execution order of a layer stack) when its forward begins, and the all-gather of
        the unit whose backward comes next (``_backward_order``) when its backward begins, so a
        gather runs while the unit before it computes.
        ``set_forward_prefetch_cells`` / ``set_backward_prefetch_cells`` override this."""
        order = [self, *self._nested]
        if not self.config.reshard_after_forward or any(s.forward_prefetch or s.backward_prefetch for s in order):
            return
        for before, after in zip(order, order[1:]):
            before.forward_prefetch = [after]
        backward = [self, *self._backward_order()]
        for now, after in zip(backward, backward[1:]):
            now.backward_prefetch = [after]

    def _backward_order(self) -> list[HSDPState]:
        """The nested units in the order their backward begins: siblings in reverse module order,
        each before the units nested in it (their outputs feed its own, so the gradient reaches it
        first). Without nesting, reverse module order (the root's backward begins with the last unit);
        with a unit nested in each layer (experts wrapped over another group) it is layer n, its
        nested unit, layer n - 1, ..."""
        names = {id(sub): name for name, sub in self.module.named_modules()}
        units = {names[id(state.module)]: state for state in self._nested_states()}
        children: dict[str, list[str]] = {"": []}
        for name in units:  # module order
            parent = max((p for p in units if name.startswith(p + ".")), key=len, default="")
            children.setdefault(parent, []).append(name)
            children.setdefault(name, [])

        def walk(name):
            for child in reversed(children[name]):
                yield units[child]
                yield from walk(child)

        return list(walk(""))

    # -- backward --------------------------------------------------------------------------------
    def _join_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        _BACKWARD["states"].append(self)
        if not _BACKWARD["queued"]:
            _BACKWARD["queued"] = True
            torch.autograd.Variable._execution_engine.queue_callback(_end_of_backward)

    def _pre_backward(self, grad):
        if not self._in_backward:
            self._join_backward()
            self.unshard()
            # Code that re-runs part of this unit's forward inside its backward (megatron's norm recompute,
            # selective checkpointing) reads the module's attributes: the full parameters until this unit's
            # backward is done (finish_backward puts the shards back for the optimizer).
            for p in self.params:
                p.register_full()
            for other in self.backward_prefetch:
                other.unshard(async_op=True)
        return grad

    def _after_accumulate(self, full: torch.Tensor) -> None:
        self._join_backward()
        p = self._param_of[id(full)]
        if not self.requires_grad_sync:
            p.grad_state = "local"
            return
        self._bucket_of[id(full)].ready.add(id(full))
        if not self.defers_reduce:
            self._launch_ready(flush=False)

    def _launch_ready(self, flush: bool) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            wanted = {id(p.full) for p in bucket.params if p.full.requires_grad}
            if not flush and not wanted <= bucket.ready:
                return
            self._next_launch += 1
            if not wanted or not bucket.sharded:
                continue  # whole (below-threshold) parameters: all-reduced together at the end
            if not self.config.comm_async:
                # At most one reduction in flight: the previous one (of any unit) is finished, and its
                # buffers released, before this one is packed. It ran while this bucket's gradients
                # were computed; waiting on it in place instead made every unit's backward a barrier
                # of all ranks. comm_async=True keeps every reduction in flight until the end of
                # backward (more overlap, and the send buffers of all of them alive at once).
                _wait_in_flight()
                _BACKWARD["in_flight"] = self
            bucket.start_reduce(async_op=True)
            self._pending_reduce.append(bucket)

    def wait_reduce(self) -> None:
        for bucket in self._pending_reduce:
            bucket.finish_reduce()
        self._pending_reduce = []

    def finish_backward(self) -> None:
        if self.requires_grad_sync:
            self._launch_ready(flush=True)
        self.wait_reduce()
        for p in self.params:
            p.register_sharded()
        if self.config.reshard_after_forward:
            self.reshard()
        for bucket in self.buckets:
            bucket.ready.clear()
        self._next_launch = 0
        self._in_backward = False

    def _after_load(self, module, incompatible_keys) -> None:
        for p in self.params:
            p.stale = True

    # -- misc ------------------------------------------------------------------------------------
    def zero_grads(self) -> None:
        for p in self.params:
            p.zero_grad()

    def comm_bytes(self) -> int:
        return sum(b.comm_bytes for b in self.buckets)


def _release_rebuilt(keep_latest: bool) -> None:
    """Free the units kept gathered after a forward rerun inside backward (``_post_forward``) whose own
    backward has not begun. When another unit's rerun forward begins, all but the latest: a checkpointed
    region of several units then holds at most two of them, as the backward prefetch does (the latest is
    the one whose backward follows the next unit's; an older one is gathered again by the backward
    prefetch, as without recompute, rather than every unit of a long region staying whole). Every one
    when the backward ends (one the backward did not reach)."""
    kept = _BACKWARD["rebuilt"]
    _BACKWARD["rebuilt"] = kept[-1:] if keep_latest else []
    for state in kept[:-1] if keep_latest else kept:
        if not state._in_backward:
            state.reshard()


def _wait_in_flight() -> None:
    state, _BACKWARD["in_flight"] = _BACKWARD["in_flight"], None
    if state is not None:
        state.wait_reduce()


def _end_of_backward() -> None:
    states, _BACKWARD["states"], _BACKWARD["queued"] = _BACKWARD["states"], [], False
    _wait_in_flight()
    # a unit kept after a forward rerun inside this backward that the backward then did not reach
    _release_rebuilt(keep_latest=False)
    # Level 1, synchronous: the full gradients stay anyway and a blocking reduction per bucket would
    # not overlap with anything, so every unit's buckets are reduced here in one collective (per
    # compatible group) where they fit the bucket size, else in runs of at most a bucket one after
    # the other, in the order the units joined backward (the same on every rank).
    # Parameters kept whole (below the threshold) are small by definition: a collective of its own
    # per unit would cost a rendezvous of every rank for a few KB, so at every level they are
    # all-reduced here together, in one collective (per run of at most a bucket).
    deferred = []
    for state in states:
        if not state.requires_grad_sync:
            continue
        if state.defers_reduce:
            deferred += [b for b in state.buckets if b.wants_grad]
            state._next_launch = len(state.buckets)
        else:
            deferred += [b for b in state.buckets if b.wants_grad and not b.sharded]
    if deferred:
        reduce_fused(deferred)
    for state in states:
        state.finish_backward()
    # A unit kept gathered after forward that got no gradient never joined this backward (so
    # finish_backward did not free it): free it too.
    for state in states:
        if state.is_root:
            for sub in state._nested_states():
                if sub.config.reshard_after_forward and sub.reshard_after_forward is False and sub not in states:
                    sub.reshard()


def sync_all() -> None:
    """Wait for every pending gather and reduction of every HSDP module in this process."""
    for state in list(ALL_STATES):
        state.wait_gather()
        state.wait_reduce()
