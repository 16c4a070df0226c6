"""HyperParallel's memory API: ``swap``, ``swap_wrapper``, ``swap_tensor_wrapper``, ``checkpoint``,
``checkpoint_wrapper`` and ``CheckpointPolicy`` (with ``MUST_SWAP``).

``checkpoint`` is PyTorch's non-reentrant ``torch.utils.checkpoint.checkpoint`` with a selective
checkpointing context from ``torch.utils.checkpoint.create_selective_checkpoint_contexts``: the policy
function sees every op of the region and says save or recompute. ``MUST_SWAP`` is served on top of that:
torch is told ``MUST_SAVE`` (the output stays in the selective checkpoint cache), and the cached output's
storage joins a swap group (``SwapManager.add_tensor``) — emptied after the copy to host, refilled before
the region is recomputed. ``swap`` runs a function under the swap group's saved-tensor hooks: nothing is
recomputed, the saved tensors themselves move.

Both take ``group_swap``: False (default) — the call is its own swap group (one group per call, in
forward order); True — the call's tensors join the group that is open around it (``swap_wrapper`` on the
enclosing layer, or ``SwapManager.group``), so a layer's pieces move and are prefetched together.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import threading

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_adaptor.memory.swap_manager import SwapError, SwapGroup, SwapManager, default_swap_manager, flatten_tensors


class CheckpointPolicy(enum.Enum):
    """What a checkpointed region does with one op's output (torch's four, and MUST_SWAP).

    Values 0..4 as HyperParallel numbers them. ``CheckpointPolicy("must_save")`` (the lower-case name, the
    spelling of configuration strings) looks a member up by name.
    """

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_SWAP = 4   # saved (not recomputed), but kept on the host between forward and backward

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str):
            member = cls.__members__.get(value.upper())
            if member is not None:
                return member
        return None


_TORCH = torch_checkpoint.CheckpointPolicy
_TO_TORCH = {
    CheckpointPolicy.MUST_SAVE: _TORCH.MUST_SAVE,
    CheckpointPolicy.PREFER_SAVE: _TORCH.PREFER_SAVE,
    CheckpointPolicy.MUST_RECOMPUTE: _TORCH.MUST_RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE: _TORCH.PREFER_RECOMPUTE,
    CheckpointPolicy.MUST_SWAP: _TORCH.MUST_SAVE,
}
# torch's own {MUST,PREFER}_CPU_OFFLOAD act only under torch.compile; eagerly this engine serves them.
_TORCH_OFFLOAD = {getattr(_TORCH, n) for n in ("MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD") if hasattr(_TORCH, n)}


def _resolve(decision, op) -> tuple[object, bool]:
    """(torch's policy, swap the output?) for what a policy function returned."""
    if isinstance(decision, bool):  # torch's convention: True saves, False recomputes
        return (_TORCH.MUST_SAVE if decision else _TORCH.PREFER_RECOMPUTE), False
    if isinstance(decision, CheckpointPolicy):
        return _TO_TORCH[decision], decision is CheckpointPolicy.MUST_SWAP
    if decision in _TORCH_OFFLOAD:
        return _TORCH.MUST_SAVE, True
    if isinstance(decision, _TORCH):
        return decision, False
    raise TypeError(f"checkpoint policy_fn returned {decision!r} for {op}; expected a CheckpointPolicy "
                    "(hyper_adaptor.memory or torch.utils.checkpoint) or a bool")


def _manager(manager: SwapManager | None) -> SwapManager:
    return manager if manager is not None else default_swap_manager()


# ------------------------------------------------------------------------------------------- swap
def swap(function, *args, policy_fn=None, group_swap: bool = False, manager: SwapManager | None = None,
         tag=None, **kwargs):
    """``function(*args, **kwargs)`` with the tensors it saves for backward moved to host between its
    forward and its backward (nothing is recomputed: results are bitwise those of ``function``).

    ``policy_fn(tensor) -> bool``: which saved tensors may move (default: every one of at least the
    manager's ``min_bytes``; parameters never). ``group_swap``: join the open group instead of forming one.
    """
    return _swap(function, args, kwargs, policy_fn, group_swap, _manager(manager), tag, None)


def _swap(fn, args, kwargs, policy_fn, group_swap, mgr: SwapManager, tag, module):
    if group_swap:
        g = mgr.current_group
        if g is None:
            raise SwapError("swap(..., group_swap=True) needs an open swap group around it (swap_wrapper on "
                            "the enclosing layer, or SwapManager.group()); none is open")
        with mgr.saved_tensors_hooks(g, policy_fn):
            return fn(*args, **kwargs)
    g = mgr.open_group(tag, module=module)
    out = None
    try:
        with mgr.saved_tensors_hooks(g, policy_fn):
            out = fn(*args, **kwargs)
    finally:
        mgr.close_group(g, out)
    return out


def _wrap_forward(module: torch.nn.Module, kind: str, make_forward) -> torch.nn.Module:
    original = module.forward
    forward = functools.wraps(original)(make_forward(original))
    forward.__hyper_memory_original__ = original
    forward.__hyper_memory_kind__ = kind
    module.forward = forward  # an instance attribute: state_dict keys and module hooks are unchanged
    return module


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Undo ``swap_wrapper`` / ``checkpoint_wrapper`` (the outermost one first)."""
    forward = module.__dict__.get("forward")
    if forward is None or not hasattr(forward, "__hyper_memory_original__"):
        raise ValueError(f"{type(module).__name__} is not wrapped by swap_wrapper/checkpoint_wrapper")
    original = forward.__hyper_memory_original__
    if getattr(original, "__self__", None) is module and getattr(original, "__func__", None) is type(module).forward:
        del module.forward
    else:
        module.forward = original
    return module


def swap_wrapper(module: torch.nn.Module, policy_fn=None, *, group_swap: bool = False,
                 manager: SwapManager | None = None, tag=None) -> torch.nn.Module:
    """Make every forward of ``module`` a ``swap`` call (one swap group per call, tagged ``tag`` or the
    module's class name). Wraps in place and returns ``module``; ``unwrap`` undoes it."""
    mgr = _manager(manager)
    label = tag if tag is not None else type(module).__name__

    def make(original):
        def forward(*args, **kwargs):
            # the module's parameter storages are read at each call: HSDP's unsharded ones change
            return _swap(original, args, kwargs, policy_fn, group_swap, mgr, label, module)
        return forward

    return _wrap_forward(module, "swap", make)


def swap_tensor_wrapper(target: torch.Tensor, tag=None, *, manager: SwapManager | None = None) -> torch.Tensor:
    """Move ``target``'s storage with swap group ``tag``: the live, not yet moved group of that tag if there
    is one (it moves and is prefetched with it), else a group of its own, placed in forward order now
    (``tag=None``: a group of its own, numbered like untagged ones). Returns ``target``. Its storage is
    empty while the group is on the host: do not read it until the group is loaded again (its backward, a
    prefetch, ``manager.set_forward_prefetch_layer`` or ``manager.ensure_loaded(tag)``)."""
    tensor = target
    mgr = _manager(manager)
    group = None if tag is None else next(
        (g for g in reversed(mgr.groups()) if g.tag == tag and g.state.value in ("open", "closed")), None)
    if group is None:
        group = mgr.open_group(tag)
        mgr.add_tensor(group, tensor, force=True)
        mgr.close_group(group, None)
        mgr.watch(group, [tensor])
    else:
        mgr.add_tensor(group, tensor, force=True)
    return tensor


# ------------------------------------------------------------------------------------------- checkpoint
class _LoadBeforeRecompute:
    """torch's recompute context, entered only once the region's swapped storages are back."""

    def __init__(self, inner, mgr: SwapManager, group: SwapGroup | None) -> None:
        self.inner, self.mgr, self.group = inner, mgr, group

    def __enter__(self):
        if self.group is not None:
            self.mgr.begin_backward(self.group)
            self.mgr.ensure_loaded(self.group)
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def checkpoint(function, *args, swap_inputs: bool = False, policy_fn=None, context_fn=None,
               group_swap: bool = False, early_stop: bool = True, manager: SwapManager | None = None, tag=None,
               **kwargs):
    """Activation checkpointing of ``function(*args, **kwargs)`` (torch's non-reentrant checkpoint).

    ``policy_fn(ctx, op, *op_args, **op_kwargs) -> CheckpointPolicy`` (torch's selective checkpointing
    signature; ``ctx.is_recompute``, ``ctx.op_output``): MUST/PREFER_SAVE keep the op's output,
    MUST/PREFER_RECOMPUTE recompute it, MUST_SWAP keeps it on the host until the backward. None: every op
    is recomputed (full recompute). ``swap_inputs``: the region's inputs (which checkpoint keeps for the
    recompute) move to the host too. ``context_fn``: torch's, for a context of your own (not together
    with ``policy_fn`` or ``swap_inputs``). ``group_swap``: swapped tensors join the open group.
    ``early_stop``: torch's, the recompute stops once the tensors the backward needs are back.
    Modules wrapped by ``checkpoint_exclude_wrapper`` inside ``function`` are saved, not recomputed.
    """
    if not isinstance(early_stop, bool):
        raise TypeError(f"checkpoint: early_stop must be a bool, got {early_stop!r}")
    with _early_stop(early_stop):
        return _checkpoint_call(function, args, kwargs, swap_inputs, policy_fn, context_fn, group_swap, manager,
                                tag)


def _early_stop(early_stop: bool):
    return contextlib.nullcontext() if early_stop else torch_checkpoint.set_checkpoint_early_stop(False)


def _checkpoint_call(fn, args, kwargs, swap_inputs, policy_fn, context_fn, group_swap, manager, tag):
    if context_fn is not None and (policy_fn is not None or swap_inputs):
        raise ValueError("checkpoint: context_fn cannot be combined with policy_fn or swap_inputs (both need "
                         "the selective checkpoint context); put your policy into policy_fn")
    # full recompute, or a context of the caller's own (checkpoint_exclude_wrapper does not reach into it)
    if context_fn is not None or (policy_fn is None and not swap_inputs and not _EXCLUDE_WRAPPED[0]):
        extra = {} if context_fn is None else {"context_fn": context_fn}
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)
    return _checkpoint(fn, args, kwargs, swap_inputs, policy_fn, group_swap, _manager(manager), tag, None)


# torch 2.13 runs the op first and hands its output to the selective-checkpoint policy (ctx.op_output);
# earlier releases (2.11, seen on the CUDA image of our GPU machine) ask the policy before the op runs.
# There a dispatch mode of ours, entered above torch's caching mode, sees each op's output right after the
# caching mode stored it (same storage) and hands a MUST_SWAP output to the swap group.
POLICY_SEES_OUTPUT = "op_output" in inspect.signature(torch_checkpoint.SelectiveCheckpointContext).parameters


class _OutputAfterPolicy(TorchDispatchMode):
    """Calls ``on_output(out, op_args, op_kwargs)`` for the op whose policy call set ``pending``."""

    def __init__(self, on_output) -> None:
        super().__init__()
        self.on_output, self.pending = on_output, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.pending = None
        out = func(*args, **kwargs)   # torch's caching mode below: the policy, then the op
        pending, self.pending = self.pending, None
        if pending is not None:
            self.on_output(out, *pending)
        return out


def _is_parameter(t) -> bool:
    return isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad)


def _checkpoint(fn, args, kwargs, swap_inputs, policy_fn, group_swap, mgr: SwapManager, tag, module):
    if group_swap:
        group, own = mgr.current_group, False
        if group is None and swap_inputs:
            raise SwapError("checkpoint(..., swap_inputs=True, group_swap=True) needs an open swap group "
                            "around it (swap_wrapper on the enclosing layer, or SwapManager.group()); none is open")
    else:
        group, own = mgr.open_group(tag, module=module), True
    # A MUST_SWAP output that shares storage with the region's inputs (a view of one) would empty the
    # caller's tensor: those stay, unless swap_inputs moves the inputs anyway.
    protected = set() if swap_inputs else {t.untyped_storage().data_ptr() for t in flatten_tensors((args, kwargs))}

    def swap_outputs(output, op_args, op_kwargs):
        # Below autograd a view of a parameter is a plain tensor: recognise it by the op's arguments.
        params = {a.untyped_storage().data_ptr() for a in flatten_tensors((op_args, op_kwargs)) if _is_parameter(a)}
        for t in flatten_tensors(output):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in protected:
                mgr.add_tensor(group, t, force=True)

    capture = None if POLICY_SEES_OUTPUT else _OutputAfterPolicy(swap_outputs)

    def sac_policy(ctx, op, *op_args, **op_kwargs):
        if _EXCLUDE.depth > 0:  # inside a checkpoint_exclude_wrapper'd module: kept, not recomputed
            return _TORCH.MUST_SAVE
        decision = CheckpointPolicy.PREFER_RECOMPUTE if policy_fn is None else policy_fn(ctx, op, *op_args,
                                                                                         **op_kwargs)
        torch_policy, swap_output = _resolve(decision, op)
        if swap_output and not ctx.is_recompute:
            if group is None:
                raise SwapError(f"CheckpointPolicy.MUST_SWAP for {op} outside any swap group: with "
                                "group_swap=True the checkpoint must run inside swap_wrapper / "
                                "SwapManager.group(), or use group_swap=False")
            if POLICY_SEES_OUTPUT:
                swap_outputs(ctx.op_output, op_args, op_kwargs)
            else:
                capture.pending = (op_args, op_kwargs)
        return torch_policy

    def context():
        forward_ctx, recompute_ctx = torch_checkpoint.create_selective_checkpoint_contexts(sac_policy)
        if capture is not None:
            forward_ctx = _stacked(forward_ctx, capture)
        return forward_ctx, _LoadBeforeRecompute(recompute_ctx, mgr, group)

    out = None
    try:
        out = torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context, **kwargs)
        if swap_inputs:
            for t in flatten_tensors((args, kwargs)):
                mgr.add_tensor(group, t, force=True)
    finally:
        if own:
            mgr.close_group(group, out)
    return out


@contextlib.contextmanager
def _stacked(outer, inner):
    with outer, inner:
        yield


def _policy_from(policy):
    """checkpoint_wrapper's ``policy``: None or "full", a policy function, {op: CheckpointPolicy}, or ops to save."""
    if policy is None or policy == "full" or callable(policy):
        return None if policy == "full" else policy
    if isinstance(policy, dict):
        table = dict(policy)
        return lambda ctx, op, *a, **k: table.get(op, table.get(getattr(op, "overloadpacket", None),
                                                                  CheckpointPolicy.PREFER_RECOMPUTE))
    if isinstance(policy, (list, tuple, set, frozenset)):
        saved = set(policy)
        return lambda ctx, op, *a, **k: (CheckpointPolicy.MUST_SAVE if op in saved or getattr(
            op, "overloadpacket", None) in saved else CheckpointPolicy.PREFER_RECOMPUTE)
    raise TypeError(f"checkpoint_wrapper: policy must be None, 'full', a policy function, a dict of op -> "
                    f"CheckpointPolicy or a collection of ops to save; got {policy!r}")


_CHECKPOINT_KWARGS = ("swap_inputs", "policy_fn", "context_fn", "group_swap", "early_stop", "manager", "tag")


def checkpoint_wrapper(module: torch.nn.Module, policy=None, **checkpoint_kwargs) -> torch.nn.Module:
    """Make every forward of ``module`` a ``checkpoint`` call with ``checkpoint_kwargs`` (``swap_inputs``,
    ``policy_fn``, ``context_fn``, ``group_swap``, ``early_stop``, ``manager``, ``tag``). ``policy`` (this
    package's shorthand, not together with ``policy_fn``): None or "full" (full recompute), a policy
    function, ``{op: CheckpointPolicy}`` (others recomputed) or a collection of ops to save. Wraps in place
    and returns ``module``; ``unwrap`` undoes it."""
    unknown = sorted(set(checkpoint_kwargs) - set(_CHECKPOINT_KWARGS))
    if unknown:
        raise TypeError(f"checkpoint_wrapper: unknown keyword(s) {unknown}; accepted: policy, "
                        f"{', '.join(_CHECKPOINT_KWARGS)}")
    if policy is not None and checkpoint_kwargs.get("policy_fn") is not None:
        raise TypeError("checkpoint_wrapper: give policy or policy_fn, not both")
    kw = dict(checkpoint_kwargs)
    policy_fn = _policy_from(policy if policy is not None else kw.pop("policy_fn", None))
    kw.pop("policy_fn", None)
    if kw.get("tag") is None:
        kw["tag"] = type(module).__name__
    swap_inputs, group_swap = kw.pop("swap_inputs", False), kw.pop("group_swap", False)
    manager, label = kw.pop("manager", None), kw.pop("tag")

    def make(original):
        def forward(*args, **kwargs):
            if kw.get("context_fn") is not None or (policy_fn is None and not swap_inputs):
                return checkpoint(original, *args, policy_fn=policy_fn, swap_inputs=swap_inputs,
                                  group_swap=group_swap, manager=manager, tag=label, **kw, **kwargs)
            with _early_stop(kw.get("early_stop", True)):
                return _checkpoint(original, args, kwargs, swap_inputs, policy_fn, group_swap, _manager(manager),
                                   label, module)
        return forward

    return _wrap_forward(module, "checkpoint", make)


class _ExcludeState(threading.local):
    depth = 0      # checkpoint_exclude_wrapper forwards running on this thread


_EXCLUDE = _ExcludeState()
_EXCLUDE_WRAPPED = [0]  # modules ever wrapped: from then on checkpoint takes the selective path to see them


def checkpoint_exclude_wrapper(module: torch.nn.Module, *, save_output: bool = True) -> torch.nn.Module:
    """Exclude ``module`` from an enclosing ``checkpoint`` / ``checkpoint_wrapper``: the ops of its forward
    keep their outputs (torch's MUST_SAVE) and are not recomputed in backward; the rest of the region is.
    Outside a checkpoint it changes nothing. ``save_output=False`` (HyperParallel's: the module's own output
    recomputed) is not served here: the region's ops cannot tell the module's last output from the others."""
    if save_output is not True:
        raise ValueError("checkpoint_exclude_wrapper: save_output=False is not served (only True: the module's "
                         "ops, its output included, are saved)")
    _EXCLUDE_WRAPPED[0] += 1

    def make(original):
        def forward(*args, **kwargs):
            _EXCLUDE.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                _EXCLUDE.depth -= 1
        return forward

    return _wrap_forward(module, "checkpoint_exclude", make)
