"""Communication hidden under compute: the dispatch / combine all-to-alls of one chunk of tokens in flight
while the experts compute another, and one micro-batch's forward computing while another's backward
communicates.

Chunked overlap (``overlapped_moe_forward``). The tokens are cut into ``chunks`` contiguous pieces; each
is permuted, exchanged, run through the experts and exchanged back on its own. With ``overlap=True``
the schedule on every rank is::

    launch dispatch 0; shared expert; for i: wait dispatch i, launch dispatch i+1, experts i,
                                             launch combine i, wait combine i-1, un-permute i-1

so while the experts compute chunk i the dispatch of chunk i+1 and the combine of chunk i-1 are in
flight, and the shared expert runs under the first dispatch. Every exchange is one autograd pair
(``_Launch`` then ``_Wait``): the wait's backward starts the reverse exchange of the gradient and the
launch's backward waits for it. CPU autograd runs nodes in decreasing creation order, so whatever the
forward computed between a launch and its wait runs, mirrored, between the backward's start and wait:
the backward overlaps as the forward did, and every rank issues its exchanges in one order (the same
code builds the same graph everywhere), which is what keeps uneven collectives matched.

Results: ``chunks=1`` does the arithmetic of the plain path in another order of launches and waits, so
output and gradients are bitwise equal to ``overlap=False``. With more chunks the routed outputs are the
same sums per token, but the experts' GEMMs run on fewer rows (a BLAS may block them differently) and each
expert weight's gradient is summed chunk by chunk instead of over all rows at once: equal within float
rounding, not bitwise. ``moe_forward_overlapped(moe, x, chunks=...)`` runs the engine's ``MoE`` block this
way; ``OverlapStats`` / ``measure_exposed_comm`` give the time left blocked on communication.

Micro-batch overlap (``CommComputeOverlap``, ``HookCoordinator``, ``HookRole`` — HyperParallel's names).
``run(fwd_fn, bwd_fn)`` runs one micro-batch's forward on the calling thread and another's backward on a
persistent worker thread. ``wrap_dispatch`` / ``wrap_combine`` put identity hooks around the dispatch and
combine (A before and B after the dispatch, C before and D after the combine); a hook makes its thread
meet the other thread's matching hook, declaring whether its next segment communicates (``COMM``) or
computes (``COMPUTE``)::

    forward:  A comm, B compute, C comm, D compute      backward: D comm, C compute, B comm, A compute

(the last layer's D hook is skipped: nothing follows it in the forward, and in the backward its
combine starts the window). So the forward's dispatch runs under the backward's expert compute, the
backward's dispatch under the forward's experts, and so on. The meeting points are what make it safe
with real collectives: between two meetings at most one thread communicates on the expert group, so each
rank issues its exchanges in the same order; two ``COMM`` segments meeting each other are run one after
the other, the forward's first. A ``COMPUTE`` side does not wait for its partner's communication to
start: on the host only the order among collectives matters, and a compute segment issues none.
A thread whose function ended departs; the other then runs its remaining hooks alone. A hook on a
tensor that needs no gradient has no backward half: later pairs shift by one, still safe (the roles, not
the pairing, order the exchanges) but hiding less.

No megatron import here.
"""

from __future__ import annotations

import enum
import queue
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hyper_adaptor.parallel.expert._comm import (
    _comm_device,
    _exchange,
    expert_order,
    experts_per_rank,
    inverse,
    reorder,
    send_splits,
)
from hyper_adaptor.parallel.expert._permute import capacity, capacity_mask, permute, unpermute


# ------------------------------------------------------------------------------------ statistics
@dataclass
class OverlapStats:
    """Where a rank waited on communication: ``forward_wait_s`` / ``backward_wait_s`` are the seconds
    blocked on exchanges (the token-count exchange included: it is synchronous), i.e. the communication
    that compute did not hide; ``launches`` counts the all-to-alls started (forward and backward)."""

    forward_wait_s: float = 0.0
    backward_wait_s: float = 0.0
    launches: int = 0

    @property
    def wait_s(self) -> float:
        return self.forward_wait_s + self.backward_wait_s

    def add(self, seconds: float, backward: bool) -> None:
        if backward:
            self.backward_wait_s += seconds
        else:
            self.forward_wait_s += seconds


def _await(handle, stats: OverlapStats | None, backward: bool) -> None:
    """Block on one exchange (each gloo work is waited for exactly once)."""
    if handle is None:
        return
    start = time.perf_counter()
    handle.wait()
    if stats is not None:
        stats.add(time.perf_counter() - start, backward)


# ------------------------------------------------------------------------------ async exchange pair
class _Flight:
    """One exchange and its reverse: what the launch and the wait (and their backward halves) share."""

    def __init__(self, out_splits, in_splits, group, stats):
        self.out_splits, self.in_splits, self.group, self.stats = out_splits, in_splits, group, stats
        self.handle = None
        self.grad = None
        self.grad_handle = None


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, flight):
        ctx.flight = flight
        out, flight.handle = _exchange(x, flight.out_splits, flight.in_splits, flight.group, async_op=True)
        if flight.stats is not None:
            flight.stats.launches += 1
        return out

    @staticmethod
    def backward(ctx, grad):
        flight = ctx.flight
        if flight.grad is None:  # the wait's backward did not start the reverse exchange: do it now
            flight.grad, flight.grad_handle = _exchange(grad, flight.in_splits, flight.out_splits, flight.group,
                                                        async_op=True)
            if flight.stats is not None:
                flight.stats.launches += 1
        _await(flight.grad_handle, flight.stats, backward=True)
        result = flight.grad
        flight.grad = flight.grad_handle = None
        return result, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, flight):
        ctx.flight = flight
        _await(flight.handle, flight.stats, backward=False)
        flight.handle = None
        return buffer

    @staticmethod
    def backward(ctx, grad):
        flight = ctx.flight
        flight.grad, flight.grad_handle = _exchange(grad.contiguous(), flight.in_splits, flight.out_splits,
                                                    flight.group, async_op=True)
        if flight.stats is not None:
            flight.stats.launches += 1
        return grad, None


class _Pending:
    def __init__(self, buffer, flight):
        self._buffer, self._flight = buffer, flight

    def wait(self) -> torch.Tensor:
        return _Wait.apply(self._buffer, self._flight)


def _launch(x, out_splits, in_splits, group, stats) -> _Pending:
    flight = _Flight(list(out_splits), list(in_splits), group, stats)
    return _Pending(_Launch.apply(x, flight), flight)


# --------------------------------------------------------------------------------- chunked forward
def _exchange_chunk_counts(counts: list[list[int]], placement: list[int], group) -> torch.Tensor:
    """Every chunk's token counts in one all-to-all: ``received`` [chunks, P, L], [c, s, e] = the rows
    source s sends in chunk c for my local expert e."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks, local = len(counts), placement[rank]
    table = torch.tensor(counts, dtype=torch.int64).view(chunks, -1)
    pieces, start = [], 0
    for held in placement:  # destination d's block: its experts' columns, chunk after chunk
        pieces.append(table[:, start:start + held].reshape(-1))
        start += held
    device = _comm_device(group)
    mine = torch.cat(pieces).to(device)
    received = torch.empty(size * chunks * local, dtype=torch.int64, device=device)
    if size == 1:
        received.copy_(mine)
    else:
        dist.all_to_all_single(received, mine, [chunks * local] * size, [chunks * held for held in placement],
                               group=group)
    return received.view(size, chunks, local).transpose(0, 1).cpu()


def _check_args(tokens, routing_map, probs, experts_fn, chunks, shared_fn, placement, ep_group):
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"overlapped_moe_forward: chunks must be an integer >= 1, got {chunks!r}")
    if not callable(experts_fn):
        raise TypeError(f"overlapped_moe_forward: experts_fn must be callable, got {type(experts_fn).__name__}")
    if shared_fn is not None and not callable(shared_fn):
        raise TypeError(f"overlapped_moe_forward: shared_fn must be callable or None, got "
                        f"{type(shared_fn).__name__}")
    if tokens.dim() != 2 or routing_map.dim() != 2 or routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(f"overlapped_moe_forward: tokens [T, H] and routing_map [T, E] expected, got "
                         f"{tuple(tokens.shape)} and {tuple(routing_map.shape)}")
    if routing_map.dtype != torch.bool:
        raise ValueError(f"overlapped_moe_forward: routing_map must be bool, got {routing_map.dtype}")
    if probs is not None and probs.shape != routing_map.shape:
        raise ValueError(f"overlapped_moe_forward: probs {tuple(probs.shape)} must match routing_map "
                         f"{tuple(routing_map.shape)}")
    num_experts, size = routing_map.shape[1], dist.get_world_size(ep_group)
    if placement is None:
        return experts_per_rank(num_experts, size)
    placement = [int(p) for p in placement]
    if len(placement) != size or sum(placement) != num_experts or min(placement) < 0:
        raise ValueError(f"overlapped_moe_forward: placement {placement} must list the experts of each of the "
                         f"{size} ranks of ep_group, {num_experts} in all")
    return placement


def overlapped_moe_forward(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None,
                           experts_fn: Callable, *, ep_group, chunks: int = 1, shared_fn: Callable | None = None,
                           placement: list[int] | None = None, overlap: bool = True,
                           stats: OverlapStats | None = None) -> torch.Tensor:
    """The routed experts' output [T, H_out] (weighted by ``probs``, plus ``shared_fn(tokens)`` when given)
    of a dropless expert-parallel MoE over ``ep_group``, dispatched in ``chunks`` pieces of the tokens.

    ``experts_fn(rows, tokens_per_local_expert)`` computes this rank's experts on rows grouped by local
    expert (``GroupedExperts.forward``'s signature). ``placement`` lists how many experts each rank of the
    group holds (E / P each by default). Drop tokens beforehand (``capacity_mask``) for a capacity
    factor: the mask is then the same whatever ``chunks`` is. ``overlap=False`` is the plain path: each
    exchange waited for as soon as it starts and the shared expert computed last. ``stats`` collects the
    time blocked on communication. Every rank of ``ep_group`` must call with the same ``chunks``,
    ``overlap``, expert count and placement (they shape the collectives)."""
    placement = _check_args(tokens, routing_map, probs, experts_fn, chunks, shared_fn, placement, ep_group)
    num_tokens = tokens.shape[0]
    bounds = [num_tokens * c // chunks for c in range(chunks + 1)]
    pieces = []  # per chunk: rows expert-major and their Permutation
    for c in range(chunks):
        lo, hi = bounds[c], bounds[c + 1]
        pieces.append(permute(tokens[lo:hi], routing_map[lo:hi], None if probs is None else probs[lo:hi]))
    start = time.perf_counter()
    received = _exchange_chunk_counts([perm.tokens_per_expert for _, perm in pieces], placement, ep_group)
    if stats is not None:
        stats.add(time.perf_counter() - start, backward=False)
    plans = []  # per chunk: (send splits, receive splits, index by local expert, rows per local expert)
    for c, (_, perm) in enumerate(pieces):
        index, per_expert = expert_order(received[c])
        plans.append((send_splits(perm.tokens_per_expert, placement), received[c].sum(dim=1).tolist(), index,
                      per_expert))

    def dispatch(c):
        sent, got, _, _ = plans[c]
        return _launch(pieces[c][0], got, sent, ep_group, stats)

    def experts_and_combine(c, arrived):
        sent, got, index, per_expert = plans[c]
        out = experts_fn(reorder(arrived, index), per_expert)
        return _launch(reorder(out, inverse(index)), sent, got, ep_group, stats)

    outputs = [None] * chunks
    if not overlap:
        for c in range(chunks):
            back = experts_and_combine(c, dispatch(c).wait()).wait()
            outputs[c] = unpermute(back, pieces[c][1])
        shared = shared_fn(tokens) if shared_fn is not None else None
    else:
        in_flight = dispatch(0)
        shared = shared_fn(tokens) if shared_fn is not None else None
        combining = None
        for c in range(chunks):
            arrived = in_flight.wait()
            if c + 1 < chunks:
                in_flight = dispatch(c + 1)
            returning = experts_and_combine(c, arrived)
            if combining is not None:
                outputs[c - 1] = unpermute(combining.wait(), pieces[c - 1][1])
            combining = returning
        outputs[-1] = unpermute(combining.wait(), pieces[-1][1])
    routed = outputs[0] if chunks == 1 else torch.cat(outputs)
    return routed if shared is None else routed + shared


def moe_forward_overlapped(moe, x: torch.Tensor, *, chunks: int = 2, return_aux_loss: bool = False,
                           stats: OverlapStats | None = None):
    """``moe(x)`` for a ``MoE`` block sharded by ``ExpertParallel``, through ``overlapped_moe_forward``:
    the same router, capacity decisions (made on all of this rank's tokens, before chunking), experts and
    shared expert, with the exchanges overlapped. Expert tensor parallel and padding to capacity are not
    chunked (their static shapes and extra collectives are per call): those blocks are refused."""
    dispatcher = moe.dispatcher
    if dispatcher.ep_group is None:
        raise ValueError("moe_forward_overlapped: the block has no expert-parallel group; shard it with "
                         "ExpertParallel first")
    if dispatcher.etp_group is not None and dist.get_world_size(dispatcher.etp_group) > 1:
        raise ValueError("moe_forward_overlapped: expert tensor parallel (ExpertTensorParallel) is not chunked; "
                         "use ExpertParallel, or the block's own forward")
    if dispatcher.pad_to_capacity:
        raise ValueError("moe_forward_overlapped: pad_to_capacity=True is not chunked; use the block's own forward")
    if x.shape[-1] != moe.hidden:
        raise ValueError(f"moe_forward_overlapped: input's last dimension is {x.shape[-1]}, expected "
                         f"hidden={moe.hidden}")
    tokens = x.reshape(-1, moe.hidden)
    routing_map, probs, scores = moe.route(tokens)
    moe.aux_loss = moe.load_balancing_loss(routing_map, scores) if moe.aux_loss_coeff > 0 else None
    if dispatcher.capacity_factor is not None:
        topk = dispatcher.topk or max(int(routing_map.sum(dim=1).max().item()) if routing_map.numel() else 1, 1)
        cap = capacity(tokens.shape[0], dispatcher.num_experts, topk, dispatcher.capacity_factor)
        routing_map = capacity_mask(routing_map, probs, cap, dispatcher.drop_policy)
    out = overlapped_moe_forward(tokens, routing_map, probs, moe.experts, ep_group=dispatcher.ep_group,
                                 chunks=chunks, shared_fn=moe.shared_expert, placement=dispatcher.placement,
                                 stats=stats).view(x.shape)
    return (out, moe.aux_loss) if return_aux_loss else out


def measure_exposed_comm(tokens, routing_map, probs, experts_fn, *, ep_group, chunks=(1, 2, 4), shared_fn=None,
                         steps: int = 5, backward: bool = True) -> list[dict]:
    """Time forward (+ backward) steps of ``overlapped_moe_forward`` without overlap (chunks 1) and with
    overlap for each of ``chunks``; per mode: median step seconds and median seconds blocked on
    communication (exposed). The modes take turns step by step (a warm-up round first, then ``steps``
    rounds), so a machine whose load drifts penalises none of them; ranks are aligned by a barrier
    before each step. Gradients accumulate into whatever ``experts_fn`` / ``shared_fn`` hold."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"measure_exposed_comm: steps must be an integer >= 1, got {steps!r}")
    modes = [(False, 1)] + [(True, c) for c in chunks]
    step_times, exposed = {m: [] for m in modes}, {m: [] for m in modes}
    for step in range(steps + 1):
        for overlap, c in modes:
            stats = OverlapStats()
            dist.barrier(group=ep_group)
            start = time.perf_counter()
            out = overlapped_moe_forward(tokens, routing_map, probs, experts_fn, ep_group=ep_group, chunks=c,
                                         shared_fn=shared_fn, overlap=overlap, stats=stats)
            if backward and out.requires_grad:
                out.sum().backward()
            if step:
                step_times[(overlap, c)].append(time.perf_counter() - start)
                exposed[(overlap, c)].append(stats.wait_s)
    rows = []
    for overlap, c in modes:
        step_s, exposed_s = statistics.median(step_times[(overlap, c)]), statistics.median(exposed[(overlap, c)])
        rows.append(dict(mode="overlap" if overlap else "plain", chunks=c, step_s=step_s, exposed_comm_s=exposed_s,
                         exposed_fraction=exposed_s / step_s if step_s else 0.0))
    return rows


# ------------------------------------------------------------------------- micro-batch overlap
class HookRole(enum.Enum):
    """What a thread does between this hook and its next one."""

    COMM = "comm"
    COMPUTE = "compute"


_FWD, _BWD = "forward", "backward"
_ROLES = {  # (hook, in the backward) -> the role of the segment that follows it
    ("A", False): HookRole.COMM, ("B", False): HookRole.COMPUTE,
    ("C", False): HookRole.COMM, ("D", False): HookRole.COMPUTE,
    ("D", True): HookRole.COMM, ("C", True): HookRole.COMPUTE,
    ("B", True): HookRole.COMM, ("A", True): HookRole.COMPUTE,
}
_SIDE = threading.local()


class HookCoordinator:
    """Meeting points for the two threads of ``CommComputeOverlap.run`` (see the module docstring).

    ``rendezvous(role)`` blocks until the other side reaches one too (or has departed, or the coordinator
    is disabled: then it returns at once). When both declare ``COMM`` the backward side waits until the
    forward side's communication is issued: its next rendezvous, ``notify_dispatched(COMM)`` or its
    departure. A partner missing for ``timeout`` seconds is an error, not a hang."""

    def __init__(self, timeout: float = 300.0):
        if timeout <= 0:
            raise ValueError(f"HookCoordinator: timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self._cond = threading.Condition()
        self._enabled = False
        self._reset()

    def _reset(self):
        self._departed = False
        self._waiting = None      # (side, role) of a thread at a rendezvous with no partner yet
        self._generation = 0
        self._held = None         # the side that must let the other side's communication go first
        self.pairs = 0            # rendezvous that met a partner since enable()

    def enable(self) -> None:
        with self._cond:
            self._reset()
            self._enabled = True

    def disable(self) -> None:
        with self._cond:
            self._enabled = False
            self._cond.notify_all()

    def is_enabled(self) -> bool:
        return self._enabled

    def depart(self) -> None:
        """The calling side has no more hooks: the other side runs the rest of its hooks alone."""
        with self._cond:
            self._departed = True
            self._held = None
            self._cond.notify_all()

    def notify_dispatched(self, role: HookRole, side: str | None = None) -> None:
        """The caller's communication is issued: a ``COMM`` partner held behind it may start."""
        if not isinstance(role, HookRole):
            raise TypeError(f"HookCoordinator: role must be a HookRole, got {type(role).__name__}")
        if role is HookRole.COMM:
            with self._cond:
                self._release(side or _side())

    def _release(self, side):
        if self._held is not None and self._held != side:
            self._held = None
            self._cond.notify_all()

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"HookCoordinator: {what} for {self.timeout:.0f}s (the two sides' hooks do not "
                                   "pair up, or the other side is stuck)")
            self._cond.wait(left)

    def rendezvous(self, role: HookRole, side: str | None = None) -> None:
        if not isinstance(role, HookRole):
            raise TypeError(f"HookCoordinator: role must be a HookRole, got {type(role).__name__}")
        side = side or _side()
        with self._cond:
            if not self._enabled or self._departed:
                return
            self._release(side)  # reaching a hook ends this side's previous segment
            if self._waiting is None:
                self._waiting = (side, role)
                generation = self._generation
                try:
                    self._wait_for(lambda: self._generation != generation or not self._enabled or self._departed,
                                   f"the {side} side waited at a {role.value} hook for its partner")
                finally:
                    if self._generation == generation:
                        self._waiting = None
                return self._hold_if_needed(side)
            other_side, other_role = self._waiting
            if other_side == side:
                raise RuntimeError(f"HookCoordinator: two {side} hooks met; each rendezvous pairs the forward with "
                                   "the backward side")
            self._waiting = None
            self._generation += 1
            self.pairs += 1
            if role is HookRole.COMM and other_role is HookRole.COMM:
                self._held = _BWD
            self._cond.notify_all()
            self._hold_if_needed(side)

    def _hold_if_needed(self, side):
        if self._held == side:
            self._wait_for(lambda: self._held != side or not self._enabled or self._departed,
                           f"the {side} side waited for the other side's communication to start")

    def hook(self, tag: str, backward: bool) -> None:
        """The rendezvous of wrap hook ``tag`` ("A".."D") in the forward or the backward."""
        self.rendezvous(_ROLES[(tag, backward)], side=getattr(_SIDE, "side", None) or (_BWD if backward else _FWD))


def _side() -> str:
    return getattr(_SIDE, "side", None) or _FWD


class _SyncHook(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coordinator, tag):
        ctx.coordinator, ctx.tag = coordinator, tag
        coordinator.hook(tag, backward=False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.coordinator.hook(ctx.tag, backward=True)
        return grad, None, None


def _hooked(value, coordinator, tag):
    """``value`` (a tensor, or a tuple / list whose first item is one) through hook ``tag``."""
    if tag is None:
        return value
    if isinstance(value, torch.Tensor):
        return _SyncHook.apply(value, coordinator, tag)
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return type(value)([_SyncHook.apply(value[0], coordinator, tag), *value[1:]])
    raise TypeError(f"CommComputeOverlap: hook {tag} needs a tensor (or a tuple whose first item is one), "
                    f"got {type(value).__name__}")


@dataclass
class _Task:
    fn: Callable
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class CommComputeOverlap:
    """One micro-batch's forward computing while another's backward communicates (module docstring).

    ``wrap_dispatch(fn)`` / ``wrap_combine(fn, is_last_layer=False)`` return ``fn`` with hooks on its first
    positional tensor argument and its (first) tensor result; outside ``run`` they cost one identity op.
    ``run(fwd_fn, bwd_fn)`` returns ``fwd_fn()``'s result; an exception of either side is raised after both
    ended (the other side runs to its end alone, so no rank is left in a half-issued collective).
    Collectives outside the wrapped dispatch and combine must not run on one group from both sides."""

    def __init__(self, timeout: float = 300.0):
        self.coordinator = HookCoordinator(timeout)
        self._tasks: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()

    def wrap_dispatch(self, dispatch_fn: Callable) -> Callable:
        return self._wrap(dispatch_fn, "A", "B")

    def wrap_combine(self, combine_fn: Callable, is_last_layer: bool = False) -> Callable:
        return self._wrap(combine_fn, "C", None if is_last_layer else "D")

    def _wrap(self, fn, before, after):
        if not callable(fn):
            raise TypeError(f"CommComputeOverlap: can only wrap a callable, got {type(fn).__name__}")
        coordinator = self.coordinator

        def wrapped(*args, **kwargs):
            if not args:
                raise TypeError(f"CommComputeOverlap: {getattr(fn, '__name__', fn)} wrapped for overlap takes its "
                                "tensor as the first positional argument")
            result = fn(_hooked(args[0], coordinator, before), *args[1:], **kwargs)
            return _hooked(result, coordinator, after)

        wrapped.__wrapped__ = fn
        return wrapped

    def _work(self):
        _SIDE.side = _BWD
        while True:
            task = self._tasks.get()
            if task is None:
                return
            try:
                task.fn()
            except BaseException as exc:
                task.error = exc
            finally:
                self.coordinator.depart()
                task.done.set()

    def run(self, fwd_fn: Callable, bwd_fn: Callable):
        if not callable(fwd_fn) or not callable(bwd_fn):
            raise TypeError("CommComputeOverlap.run: fwd_fn and bwd_fn must be callables taking no argument")
        if getattr(_SIDE, "side", None) is not None:  # the worker would wait for itself
            raise RuntimeError("CommComputeOverlap.run cannot be called from inside fwd_fn or bwd_fn")
        with self._lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="expert-overlap-backward", daemon=True)
                self._worker.start()
            self.coordinator.enable()
            task = _Task(bwd_fn)
            self._tasks.put(task)
            previous, _SIDE.side = getattr(_SIDE, "side", None), _FWD
            fwd_error, result = None, None
            try:
                result = fwd_fn()
            except BaseException as exc:
                fwd_error = exc
            finally:
                _SIDE.side = previous
                self.coordinator.depart()
                task.done.wait()
                self.coordinator.disable()
            if task.error is not None:
                raise RuntimeError("CommComputeOverlap.run: the backward function raised") from task.error
            if fwd_error is not None:
                raise fwd_error
            return result

    def close(self) -> None:
        """Stop the backward worker thread (a later ``run`` starts a new one)."""
        with self._lock:
            if self._worker is not None and self._worker.is_alive():
                self._tasks.put(None)
                self._worker.join()
            self._worker = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["CommComputeOverlap", "HookCoordinator", "HookRole", "OverlapStats", "measure_exposed_comm",
           "moe_forward_overlapped", "overlapped_moe_forward"]
