"""SwapManager: activations saved for backward, moved to host per group (a layer, or any tag) and brought
back, one group ahead, while the backward of the group after it runs.

How a group lives (``GroupState``)::

    OPEN ─close─> CLOSED ─next group opens: launch_offload─> OFFLOADING ─copy done─> OFFLOADED
                    │                                          │ needed before its copy   │ launch_load
                    │ (the last group is never moved)          │ finished: copy dropped   v (prefetch)
                    │                                          └─────────> LOADED <─wait_load── LOADING
                    └─ (any state) its backward ran and autograd dropped every handle ─> FREED

* Saved tensors reach a group through ``torch.autograd.graph.saved_tensors_hooks`` (``group()``): the pack
  hook hands autograd a small handle instead of the tensor, so once the host copy exists the group drops
  its reference and the device storage is freed ("drop" entries). Tensors that something other than
  autograd's saved-tensor machinery holds (outputs cached by selective checkpointing, a checkpoint's
  inputs, ``swap_tensor_wrapper``) cannot be freed by dropping a reference; their storage is emptied in
  place (``untyped_storage().resize_(0)``) and refilled before it is read again ("resize" entries).
* A group is offloaded when the next group opens, not when it closes: the copy then runs beside the next
  layer's forward, and the last group of a forward is never moved (its backward comes first, there is
  nothing to hide its load behind).
* Storages, not tensors, are moved: views and aliases of one storage share one entry, one copy and one
  host buffer, and are rebuilt as views of the reloaded storage (``Tensor.set_``), bit for bit.
* Backward of group i starts (a multi-grad hook on the group's outputs, or the first unpack of one of its
  tensors): the load of group i−1 (up to ``prefetch`` groups) is launched on the copy stream, then group i's
  own load is waited for. ``trace`` records every launch and wait in order.
* Parameters (and views of them) are never moved; tensors under ``min_bytes`` stay on the device.

On cpu the "device" is host memory: copies are synchronous (there is no second queue to overlap them
with), but the bookkeeping is the same — the host-tier copy is a separate buffer and the device-tier
storage is released — so storage sizes can be checked.
"""

from __future__ import annotations

import enum
import itertools
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hyper_adaptor import platform
from hyper_adaptor.memory._pool import SwapBufferPool


class SwapError(RuntimeError):
    """Misuse of the swap engine (a wait without a launch, MUST_SWAP outside any group, ...)."""


class GroupState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"
    OFFLOADING = "offloading"
    OFFLOADED = "offloaded"
    LOADING = "loading"
    LOADED = "loaded"
    FREED = "freed"


_ON_HOST = (GroupState.OFFLOADING, GroupState.OFFLOADED)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over every byte of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def flatten_tensors(obj) -> list[torch.Tensor]:
    """Tensors inside nested tuples / lists / dicts (a module's output), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in flatten_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in flatten_tensors(item)]
    return []


def _storage_ptrs(module: torch.nn.Module):
    # a DTensor parameter (tensor parallel) is a wrapper without storage of its own: its local tensor has it
    return (getattr(t, "_local_tensor", t).untyped_storage().data_ptr()
            for t in itertools.chain(module.parameters(), module.buffers()))


class _Entry:
    """One storage of a group: where its bytes are (device, host or both) and how it is released."""

    __slots__ = ("group", "key", "nbytes", "mode", "device", "storage", "weak", "host", "loaded", "on_device")

    def __init__(self, group, storage: torch.UntypedStorage, mode: str) -> None:
        self.group = group
        self.key = storage.data_ptr()
        self.nbytes = storage.nbytes()
        self.mode = mode                    # "drop", "resize", "keep" (counted, never moved) or
        #                                     "released" (emptied by its owner before the copy: left to it)
        self.device = storage.device
        self.storage = storage if mode != "keep" else None
        self.weak = StorageWeakRef(storage)  # to check that a released storage was really freed
        self.host: torch.Tensor | None = None
        self.loaded: torch.Tensor | None = None  # drop entries: the reloaded bytes
        self.on_device = True

    def current_storage(self) -> torch.UntypedStorage:
        if self.mode in ("drop", "released") and self.storage is None:
            if self.loaded is None:
                raise SwapError(f"swap group {self.group.tag!r}: a tensor was read while its storage is on "
                                "the host (internal error: unpack must load the group first)")
            return self.loaded.untyped_storage()
        return self.storage


class _Packed:
    """What autograd holds instead of a saved tensor: the entry of its storage and the view into it."""

    __slots__ = ("entry", "tensor", "dtype", "size", "stride", "offset", "__weakref__")

    def __init__(self, entry: _Entry, t: torch.Tensor, keep: bool) -> None:
        self.entry = entry
        self.tensor = t if keep else None   # "keep" handles hold the tensor itself
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        entry.group.handles += 1

    def unpack(self) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor
        storage = self.entry.current_storage()
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.offset, self.size, self.stride)

    def __del__(self) -> None:
        try:
            self.entry.group.handle_dropped()
        except Exception:  # interpreter shutdown
            pass


class SwapGroup:
    """The saved activations of one layer (or tag) of one forward."""

    def __init__(self, manager: SwapManager, tag, index: int) -> None:
        self.manager = manager
        self.tag = tag
        self.index = index
        self.state = GroupState.OPEN
        self.entries: dict[int, _Entry] = {}
        self.handles = 0
        self.prev: SwapGroup | None = None
        self.backward_started = False
        self.param_ptrs: frozenset[int] = frozenset()  # storages of the wrapped module's parameters, now
        self.offload_event = None
        self.load_event = None

    def __repr__(self) -> str:
        return f"SwapGroup(tag={self.tag!r}, state={self.state.value}, storages={len(self.entries)})"

    @property
    def moved_entries(self) -> list[_Entry]:
        return [e for e in self.entries.values() if e.mode not in ("keep", "released")]

    def handle_dropped(self) -> None:
        self.handles -= 1
        self.manager._maybe_free(self)


class SwapManager:
    """Moves saved activations to host memory per group and prefetches them back in backward.

    ``min_bytes``: storages smaller than this stay on the device. ``prefetch``: how many groups ahead (in
    backward order) to load when a group's backward starts; 0 loads each group only when it is needed.
    ``pool``: the host buffer pool (reused across steps; one per manager by default).
    ``offloads_in_flight``: how many groups' copies to host may run before the host waits for the oldest
    (1: the previous layer's copy overlaps this layer's forward; None: never wait — then a host that runs
    ahead of the device frees nothing until the backward, tests/gpu shows it).
    """

    def __init__(self, *, min_bytes: int = 1 << 16, prefetch: int = 1, pool: SwapBufferPool | None = None,
                 device_type: str | None = None, offloads_in_flight: int | None = 1) -> None:
        if min_bytes < 0:
            raise ValueError(f"SwapManager: min_bytes must be >= 0, got {min_bytes}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"SwapManager: prefetch must be an int >= 0 (groups loaded ahead), got {prefetch!r}")
        if offloads_in_flight is not None and (not isinstance(offloads_in_flight, int) or offloads_in_flight < 1):
            raise ValueError(f"SwapManager: offloads_in_flight must be an int >= 1 or None, got {offloads_in_flight!r}")
        self.offloads_in_flight = offloads_in_flight
        self.device_type = device_type or platform.device_type()
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.pool = pool or SwapBufferPool(pin=platform.pin_memory_available(self.device_type))
        self.trace: list[tuple[str, object]] = []
        self._open: list[SwapGroup] = []      # nested open groups, innermost last
        self._chain: list[SwapGroup] = []     # groups of the forward in flight, in forward order
        self._live: list[SwapGroup] = []      # every group not yet freed
        self._param_ptrs: set[int] = set()
        self._counter = itertools.count()
        self.moved_bytes = 0                   # cumulative bytes copied device -> host
        self.loaded_bytes = 0                  # cumulative bytes copied host -> device
        self._device_bytes = 0                 # saved-activation bytes the engine holds on the device
        self.peak_device_bytes = 0
        self._forward_prefetch: dict = {}      # tag -> tag loaded when the first one's group opens

    # ---------------------------------------------------------------- groups and saved-tensor hooks
    @property
    def current_group(self) -> SwapGroup | None:
        return self._open[-1] if self._open else None

    def ignore_parameters(self, module: torch.nn.Module) -> None:
        """Never move the storages ``module``'s parameters and buffers have now (a saved parameter or view
        of one is recognised without this; groups opened with ``module=`` look at its storages afresh, which
        suits parameters whose storage changes, such as HSDP's unsharded ones)."""
        self._param_ptrs.update(_storage_ptrs(module))

    def open_group(self, tag=None, *, module: torch.nn.Module | None = None) -> SwapGroup:
        self._poll()
        # Groups of an earlier forward whose backward has begun start a new chain.
        self._chain = [g for g in self._chain if not g.backward_started and g.state is not GroupState.FREED]
        # Bounded offloads in flight: the host waits here for the oldest copies. The caching allocator
        # hands a block out again only once the host has dropped it, and the host may drop it only once
        # the copy has read it; a host that runs ahead of the device (the usual case on cuda / npu) and
        # never waits would free nothing during the forward (seen on an H100, tests/gpu).
        if self.offloads_in_flight is not None:
            flying = [g for g in self._chain if g.state is GroupState.OFFLOADING]
            for g in flying[:max(0, len(flying) - self.offloads_in_flight + 1)]:
                self._finish_offload(g)
        for g in self._chain:  # deferred offload: the previous group moves while this one computes
            if g.state is GroupState.CLOSED:
                self.launch_offload(g)
        self._prefetch_for_forward(tag)
        g = SwapGroup(self, next(self._counter) if tag is None else tag, len(self._live))
        if module is not None:
            g.param_ptrs = frozenset(_storage_ptrs(module))
        g.prev = self._chain[-1] if self._chain else None
        self._chain.append(g)
        self._live.append(g)
        self._open.append(g)
        return g

    def set_forward_prefetch_layer(self, first_layer, second_layer) -> None:
        """When a group tagged ``first_layer`` opens (its forward starts), load the live group tagged
        ``second_layer`` if it is on the host, so that it is back on the device by the time the forward
        reaches it (for tensors swapped out by ``swap_tensor_wrapper`` and read again in a later forward).
        ``second_layer=None`` removes the pair."""
        if second_layer is None:
            self._forward_prefetch.pop(first_layer, None)
        else:
            self._forward_prefetch[first_layer] = second_layer

    def _prefetch_for_forward(self, tag) -> None:
        target = self._forward_prefetch.get(tag) if tag is not None else None
        if target is None:
            return
        for g in reversed(self._live):
            if g.tag == target:
                if g.state in _ON_HOST:
                    self.launch_load(g)
                return

    def close_group(self, g: SwapGroup, outputs=None) -> None:
        """End ``g``'s forward. Storages that alias ``outputs`` leave its resize entries: the next layer
        still reads them. Tensors of ``outputs`` that require grad get the backward-start hook."""
        if not self._open or self._open[-1] is not g:
            raise SwapError(f"swap group {g.tag!r} closed out of order (open: {[x.tag for x in self._open]})")
        self._open.pop()
        tensors = flatten_tensors(outputs)
        live_out = {t.untyped_storage().data_ptr() for t in tensors}
        for key in [k for k, e in g.entries.items() if e.mode == "resize" and k in live_out]:
            self._account(g.entries.pop(key), -1)
        g.state = GroupState.CLOSED
        self.watch(g, tensors)
        self._maybe_free(g)

    @contextmanager
    def group(self, tag=None, *, predicate=None, module: torch.nn.Module | None = None):
        """Saved activations created inside go to a new group. ``predicate(tensor) -> bool``: which saved
        tensors may move (default: all eligible ones). Yields the group; call ``manager.watch(group,
        outputs)`` (``swap``/``swap_wrapper`` do) so that its backward start is seen before it computes.
        ``module``: its parameters' and buffers' storages are never moved."""
        g = self.open_group(tag, module=module)
        try:
            with self.saved_tensors_hooks(g, predicate):
                yield g
        finally:
            if self._open and self._open[-1] is g:
                self.close_group(g)

    def saved_tensors_hooks(self, g: SwapGroup, predicate=None):
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(g, t, predicate), self._unpack)

    def watch(self, g: SwapGroup, tensors) -> None:
        """Call ``begin_backward(g)`` as soon as a gradient reaches any of ``tensors`` (before g computes)."""
        tensors = [t for t in flatten_tensors(tensors) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _grad: self.begin_backward(g),
                                                          mode="any")

    def _is_parameter_storage(self, t: torch.Tensor, g: SwapGroup | None = None) -> bool:
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            return True
        base = t._base
        if base is not None and (isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)):
            return True
        ptr = t.untyped_storage().data_ptr()
        return ptr in self._param_ptrs or (g is not None and ptr in g.param_ptrs)

    def _movable(self, t: torch.Tensor) -> bool:
        # Tensor subclasses (DTensor, ...) and non-strided layouts keep their own storage logic: left alone.
        return (type(t) is torch.Tensor and t.layout is torch.strided and t.device.type == self.device_type
                and not t.is_conj() and not t.is_neg())

    def _pack(self, g: SwapGroup, t: torch.Tensor, predicate):
        if not self._movable(t) or self._is_parameter_storage(t, g):
            return t
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return t
        move = storage.nbytes() >= self.min_bytes and (predicate is None or predicate(t))
        entry = g.entries.get(storage.data_ptr())
        if entry is None:
            entry = _Entry(g, storage, "drop" if move else "keep")
            g.entries[entry.key] = entry
            self._account(entry, +1)
        elif move and entry.mode == "keep":
            entry.mode, entry.storage = "drop", storage
        return _Packed(entry, t, keep=entry.mode == "keep")

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        g = packed.entry.group
        self.begin_backward(g)
        self.ensure_loaded(g)
        return packed.unpack()

    def add_tensor(self, g: SwapGroup | None, t: torch.Tensor, *, force: bool = False) -> bool:
        """Move ``t``'s storage with group ``g`` although something other than autograd's saved tensors holds
        it: the storage is emptied in place after the copy and refilled before ``g``'s backward. Returns
        whether it was added (parameters, small and non-device tensors are not)."""
        if g is None:
            raise SwapError("a tensor marked for swap (MUST_SWAP / swap_inputs / swap_tensor_wrapper) has no "
                            "swap group: run it inside swap(...)/checkpoint(...)/swap_wrapper or SwapManager.group()")
        if g.state is not GroupState.OPEN and g.state is not GroupState.CLOSED:
            raise SwapError(f"swap group {g.tag!r} is {g.state.value}: tensors can join it only before it moves")
        if not self._movable(t) or self._is_parameter_storage(t, g):
            return False
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or (storage.nbytes() < self.min_bytes and not force):
            return False
        entry = g.entries.get(storage.data_ptr())
        if entry is None:
            entry = _Entry(g, storage, "resize")
            g.entries[entry.key] = entry
            self._account(entry, +1)
        else:  # saved through the hooks too: the storage must be emptied in place, not just dropped
            entry.mode, entry.storage = "resize", storage
        return True

    # ---------------------------------------------------------------- offload and load
    def _find(self, group_or_tag) -> SwapGroup:
        if isinstance(group_or_tag, SwapGroup):
            return group_or_tag
        for g in reversed(self._live):
            if g.tag == group_or_tag:
                return g
        raise SwapError(f"no live swap group with tag {group_or_tag!r}")

    def launch_offload(self, group_name, copy_stream=None) -> SwapGroup:
        """Start copying the group (a ``SwapGroup`` or its tag) to host buffers on ``copy_stream`` (default:
        the platform's copy stream)."""
        g = self._find(group_name)
        if g.state is GroupState.OPEN:
            raise SwapError(f"launch_offload({g.tag!r}): the group is still open (its forward is running)")
        if g.state is not GroupState.CLOSED:
            return g
        for e in g.moved_entries:
            if e.storage.nbytes() != e.nbytes:
                # Its owner emptied it after autograd saved it (megatron's CheckpointWithoutOutput discards a
                # norm's output and refills the same storage in backward, before it is read): nothing to copy,
                # and the owner brings the bytes back. The entry keeps the storage for unpack.
                e.mode = "released"
                self._set_on_device(e, False)
        entries = g.moved_entries
        if not entries:
            g.state = GroupState.OFFLOADED
            return g
        stream = copy_stream if copy_stream is not None else platform.copy_stream(self.device_type)
        stream.wait_stream(platform.current_stream(self.device_type))  # the tensors are written
        with platform.use_stream(stream):
            for e in entries:
                e.host = self.pool.acquire(e.nbytes)
                e.host.copy_(_bytes_of(e.storage), non_blocking=True)
            g.offload_event = platform.new_event(self.device_type)
            g.offload_event.record(stream)
        g.state = GroupState.OFFLOADING
        self.trace.append(("offload", g.tag))
        if not platform.copies_are_async(self.device_type):
            self._finish_offload(g)
        return g

    def wait_offload(self, group_name) -> SwapGroup:
        g = self._find(group_name)
        if g.state is GroupState.OFFLOADING:
            self._finish_offload(g)
        elif g.state is not GroupState.OFFLOADED:
            raise SwapError(f"wait_offload({g.tag!r}): no offload was launched for this group "
                            f"(it is {g.state.value}); call launch_offload first")
        return g

    def _finish_offload(self, g: SwapGroup) -> None:
        # The device storage may go only once the copy has read it.
        g.offload_event.synchronize()
        for e in g.moved_entries:
            if e.mode == "resize":
                e.storage.resize_(0)
            else:
                e.storage = None
            self.moved_bytes += e.nbytes
            self._set_on_device(e, False)
        g.state = GroupState.OFFLOADED
        self.trace.append(("offload_done", g.tag))

    def _poll(self) -> None:
        for g in self._live:
            if g.state is GroupState.OFFLOADING and g.offload_event.query():
                self._finish_offload(g)

    def _cancel_offload(self, g: SwapGroup) -> None:
        """Needed before its copy finished: keep the device storage, give the host buffers back."""
        g.offload_event.synchronize()
        for e in g.moved_entries:
            self.pool.release(e.host)
            e.host = None
        g.state = GroupState.LOADED
        self.trace.append(("offload_cancelled", g.tag))

    def launch_load(self, group_name, copy_stream=None) -> SwapGroup:
        """Start copying the group back to the device on ``copy_stream`` (default: the platform's copy
        stream); a no-op unless it is on the host."""
        g = self._find(group_name)
        if g.state is GroupState.OFFLOADING:
            self._cancel_offload(g)
            return g
        if g.state is not GroupState.OFFLOADED:
            return g
        entries = g.moved_entries
        # Allocate on the compute stream, which will read and free these blocks; the copy stream waits.
        for e in entries:
            if e.mode == "resize":
                e.storage.resize_(e.nbytes)
            else:
                e.loaded = torch.empty(e.nbytes, dtype=torch.uint8, device=e.device)
        stream = copy_stream if copy_stream is not None else platform.copy_stream(self.device_type)
        stream.wait_stream(platform.current_stream(self.device_type))
        with platform.use_stream(stream):
            for e in entries:
                target = _bytes_of(e.storage) if e.mode == "resize" else e.loaded
                target.copy_(e.host, non_blocking=True)
            g.load_event = platform.new_event(self.device_type)
            g.load_event.record(stream)
        for e in entries:
            self.loaded_bytes += e.nbytes
            self._set_on_device(e, True)
        g.state = GroupState.LOADING
        self.trace.append(("load", g.tag))
        return g

    def wait_load(self, group_name) -> SwapGroup:
        g = self._find(group_name)
        if g.state is GroupState.LOADED:
            return g
        if g.state is not GroupState.LOADING:
            raise SwapError(f"wait_load({g.tag!r}): no load was launched for this group (it is "
                            f"{g.state.value}); call launch_load first")
        platform.current_stream(self.device_type).wait_event(g.load_event)
        for e in g.moved_entries:
            # Its next user is an offload copy on the same copy stream, which runs after this load.
            self.pool.release(e.host)
            e.host = None
        g.state = GroupState.LOADED
        self.trace.append(("wait", g.tag))
        return g

    def ensure_loaded(self, group_or_tag) -> SwapGroup:
        g = self._find(group_or_tag)
        if g.state is GroupState.OFFLOADING:
            self._cancel_offload(g)
        elif g.state is GroupState.OFFLOADED:
            self.launch_load(g)
            self.wait_load(g)
        elif g.state is GroupState.LOADING:
            self.wait_load(g)
        return g

    def begin_backward(self, g: SwapGroup) -> None:
        """Group g's backward is about to compute: prefetch the groups before it, then have g on device."""
        if g.backward_started or g.state is GroupState.FREED:
            return
        g.backward_started = True
        self.trace.append(("backward", g.tag))
        self._poll()
        if g.state is GroupState.OFFLOADED:
            self.launch_load(g)  # its own load first (not prefetched: prefetch=0 or the first one)
        prev, ahead = g.prev, self.prefetch
        while prev is not None and ahead > 0:
            if prev.state in _ON_HOST:
                self.launch_load(prev)
            prev, ahead = prev.prev, ahead - 1
        self.ensure_loaded(g)
        self._maybe_free(g)

    # ---------------------------------------------------------------- lifetime and accounting
    def _maybe_free(self, g: SwapGroup) -> None:
        if g.state in (GroupState.OPEN, GroupState.FREED) or g.handles > 0:
            return
        has_resize = any(e.mode == "resize" for e in g.entries.values())
        if has_resize and not g.backward_started:
            return  # its tensors are held elsewhere (a checkpoint): wait for its backward
        if g.state in _ON_HOST or g.state is GroupState.LOADING:
            if g.state is GroupState.OFFLOADING:
                g.offload_event.synchronize()
            if g.state is GroupState.LOADING:
                g.load_event.synchronize()
        for e in g.entries.values():
            if e.host is not None:
                self.pool.release(e.host)
                e.host = None
            self._account(e, -1)
            e.storage = e.loaded = None
        g.state = GroupState.FREED
        self.trace.append(("free", g.tag))
        self._live = [x for x in self._live if x is not g]
        self._chain = [x for x in self._chain if x is not g]

    def _account(self, e: _Entry, sign: int) -> None:
        if sign > 0:
            self._set_on_device(e, True, force=True)
        else:
            self._set_on_device(e, False)

    def _set_on_device(self, e: _Entry, on: bool, force: bool = False) -> None:
        if on and (force or not e.on_device):
            self._device_bytes += e.nbytes
            e.on_device = True
        elif not on and e.on_device:
            self._device_bytes -= e.nbytes
            e.on_device = False
        self.peak_device_bytes = max(self.peak_device_bytes, self._device_bytes)

    def reset_peak(self) -> None:
        self.peak_device_bytes = self._device_bytes

    def stats(self) -> dict:
        """Where the saved activations of live groups are, in bytes (unique storages).

        ``device_bytes``: held on the device tier by the engine (kept, not yet moved, or loaded back);
        ``host_bytes``: in host buffers; ``released_but_alive_bytes``: storages the engine released that
        something else still holds (so the device memory was not freed)."""
        entries = [e for g in self._live for e in g.entries.values()]
        released_alive = sum(e.nbytes for e in entries if not e.on_device and e.mode == "drop"
                             and not e.weak.expired())
        released_alive += sum(e.nbytes for e in entries if not e.on_device and e.mode == "resize"
                              and e.storage is not None and e.storage.nbytes() != 0)
        return {
            "groups": len(self._live),
            "saved_bytes": sum(e.nbytes for e in entries),
            "device_bytes": self._device_bytes,
            "host_bytes": sum(e.host.numel() for e in entries if e.host is not None),
            "released_but_alive_bytes": released_alive,
            "moved_bytes": self.moved_bytes,
            "loaded_bytes": self.loaded_bytes,
            "peak_device_bytes": self.peak_device_bytes,
            "pool_bytes": self.pool.total_bytes,
        }

    def groups(self) -> list[SwapGroup]:
        return list(self._live)


_default: SwapManager | None = None


def default_swap_manager() -> SwapManager:
    """The process-wide manager ``swap``/``checkpoint`` use when they are given none."""
    global _default
    if _default is None:
        _default = SwapManager()
    return _default


def set_default_swap_manager(manager: SwapManager | None) -> None:
    global _default
    _default = manager
