"""Registry that applies, and exactly undoes, monkey-patches on Megatron (or any importable code).

Targets are resolved at registration so a patch written for another Megatron release fails early,
naming the installed version, instead of silently patching nothing. Two features may only touch the
same attribute when both wrap it and one declares the other in ``after``. Stdlib only, so importing
this module never pulls in Megatron or torch.

Kinds: ``replace`` (set a new value), ``wrap`` (a factory ``original -> new``) and ``provide`` (set an
attribute the installed code looks up at call time but lacks, e.g. a module global left unbound
because an optional import failed; its parent must exist and it must be absent, and undo deletes it).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import operator
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterable

__all__ = ["Patch", "PatchError", "PatchTargetError", "PatchConflictError", "PatchManager"]
logger = logging.getLogger("hyper_adaptor.patch")

_KINDS = ("replace", "wrap", "provide")
_EXCLUSIVE = ("replace", "provide")  # kinds that share their target with no other patch
_MISSING = object()

# Identity of these says nothing about where a global came from (None, small ints and interned
# strings are shared everywhere), so rebinding them would clobber unrelated module constants.
_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, tuple, frozenset,
                type(Ellipsis), type(NotImplemented))


class PatchError(Exception):
    """Base class of every error the patch manager raises."""


class PatchTargetError(PatchError):
    """The dotted target does not exist in the installed code."""


class PatchConflictError(PatchError):
    """Two patches would modify the same attribute without a declared order."""


@dataclass(frozen=True)
class Patch:
    target: str
    replacement: Any
    kind: str
    feature: str
    after: tuple[str, ...] = ()
    rebind_in: tuple[str, ...] = ("megatron",)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"feature {self.feature!r}: patch kind must be one of {_KINDS}, "
                             f"got {self.kind!r} for {self.target!r}")
        if self.kind == "wrap" and not callable(self.replacement):
            raise TypeError(f"feature {self.feature!r}: 'wrap' patch on {self.target!r} needs a "
                            f"callable factory original -> new, got {self.replacement!r}")
        # A bare string would otherwise be split into characters by tuple().
        for name in ("after", "rebind_in"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))


@dataclass
class _Slot:
    """One patched location, shared by every spelling of the same (owner, attr)."""
    owner: Any
    attr: str
    target: str  # first spelling seen, for messages
    patches: list[Patch] = field(default_factory=list)


@dataclass
class _Applied:
    """What undo needs to put one applied patch back."""
    patch: Patch
    slot: _Slot
    had_own: bool  # False: the attribute was inherited/lazy, so undo deletes it
    before: Any
    new: Any
    rebound: list[tuple[dict, str, Any, Any]]  # (namespace, name, old value, new value)


def _installed_megatron_version() -> str:
    try:
        return f"megatron-core {importlib.metadata.version('megatron-core')}"
    except importlib.metadata.PackageNotFoundError:
        return "megatron-core not installed"


def _lookup_raw(owner: Any, attr: str) -> tuple[bool, Any]:
    """Return (defined on owner itself, raw value); raw keeps staticmethod/classmethod wrappers."""
    own = getattr(owner, "__dict__", None)
    if own is not None and attr in own:
        return True, own[attr]
    if isinstance(owner, type):
        for klass in owner.__mro__[1:]:
            if attr in vars(klass):
                return False, vars(klass)[attr]
    try:
        # Objects without a __dict__ can only be restored by setattr, so count them as own.
        return own is None, getattr(owner, attr)
    except AttributeError:
        return False, _MISSING


def _plain(raw: Any) -> Any:
    """What other modules bind by value: the function, never the staticmethod wrapper."""
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


def _build(patch: Patch, current: Any) -> Any:
    if patch.kind in _EXCLUSIVE:
        return patch.replacement
    if isinstance(current, (staticmethod, classmethod)):
        return type(current)(patch.replacement(current.__func__))
    return patch.replacement(current)


def _in_scope(module_name: str, prefixes: tuple[str, ...]) -> bool:
    return any(module_name == p or module_name.startswith(p + ".") for p in prefixes)


def _must_precede(first: Patch, second: Patch) -> bool:
    return first.feature in second.after


class PatchManager:
    def __init__(self, version_info: Callable[[], str] | None = None) -> None:
        self._version_info = version_info or _installed_megatron_version
        self._patches: list[Patch] = []
        self._slot_of: dict[int, _Slot] = {}  # by id(patch); _patches keeps the ids valid
        self._slots: dict[tuple[int, str], _Slot] = {}  # by (id(owner), attr); slot keeps owner
        self._applied: dict[int, _Applied] = {}
        self._stack: list[_Applied] = []

    @property
    def patches(self) -> list[Patch]:
        return list(self._patches)

    def register(self, patch: Patch) -> None:
        if not isinstance(patch, Patch):
            raise TypeError(f"expected a Patch, got {patch!r}")
        if any(p is patch for p in self._patches):
            return
        owner, attr = self._resolve(patch.target, patch.feature, need_attr=patch.kind != "provide")
        slot = self._slots.get((id(owner), attr))
        # A provided attribute must be absent from the code as installed; with patches already on
        # this slot, the registered patches (not the present value) decide, so _order reports them.
        if patch.kind == "provide" and slot is None and _lookup_raw(owner, attr)[1] is not _MISSING:
            raise self._present(patch)
        slot = slot or _Slot(owner, attr, patch.target)
        self._order(slot.patches + [patch], slot)  # raises on conflict before anything is stored
        slot.patches.append(patch)
        self._slots[(id(owner), attr)] = slot
        self._slot_of[id(patch)] = slot
        self._patches.append(patch)
        logger.debug("registered %s on %s for %r", patch.kind, patch.target, patch.feature)

    def register_all(self, patches: Iterable[Patch]) -> None:
        for patch in patches:
            self.register(patch)

    def _present(self, patch: Patch) -> PatchTargetError:
        return PatchTargetError(
            f"feature {patch.feature!r}: 'provide' target {patch.target!r} already exists in the "
            f"installed {self._version_info()}; the real one is present, so it must not be replaced "
            f"by a stand-in (drop the patch when the real one is available)")

    def _resolve(self, target: str, feature: str, need_attr: bool = True) -> tuple[Any, str]:
        def missing(reason: str) -> PatchTargetError:
            return PatchTargetError(f"feature {feature!r}: patch target {target!r} does not exist "
                                    f"in the installed {self._version_info()} ({reason})")

        parts = target.split(".")
        if len(parts) < 2 or not all(parts):
            raise missing("not a dotted 'module.attribute' path")
        module, depth = None, 0
        # The last component is always an attribute, so never try to import the full path.
        for depth_try in range(1, len(parts)):
            name = ".".join(parts[:depth_try])
            try:
                module, depth = importlib.import_module(name), depth_try
            except ModuleNotFoundError as exc:
                if exc.name != name:  # the module exists but one of its own imports is missing
                    raise missing(f"importing {name!r} failed: {exc}") from exc
                break
            except Exception as exc:  # a broken module must not masquerade as a missing attribute
                raise missing(f"importing {name!r} failed: {exc!r}") from exc
        if module is None:
            raise missing(f"no module named {parts[0]!r}")

        owner, path = module, ".".join(parts[:depth])
        for part in parts[depth:-1]:
            try:
                owner = getattr(owner, part)
            except AttributeError:
                raise missing(f"no attribute {part!r} on {path}") from None
            path = f"{path}.{part}"
        if need_attr and _lookup_raw(owner, parts[-1])[1] is _MISSING:
            raise missing(f"no attribute {parts[-1]!r} on {path}")
        return owner, parts[-1]

    def _order(self, patches: list[Patch], slot: _Slot) -> list[Patch]:
        """Order patches on one slot, raising PatchConflictError unless every pair is ordered."""
        for i, first in enumerate(patches):
            for second in patches[i + 1:]:
                forward, backward = _must_precede(first, second), _must_precede(second, first)
                exclusive = [k for k in (first.kind, second.kind) if k in _EXCLUSIVE]
                if exclusive:
                    reason = f"a {exclusive[0]!r} patch cannot share its target with any other patch"
                elif forward == backward:
                    reason = f"{'each' if forward else 'neither'} declares the other in 'after'"
                else:
                    continue
                raise PatchConflictError(self._conflict(first, second, slot, reason))
        # Every pair is ordered, so without a cycle (a -> b -> c -> a) sorting by predecessor count
        # yields an order that agrees with every declared pair.
        ordered = sorted(patches, key=lambda p: sum(
            _must_precede(o, p) for o in patches if o is not p))
        for i, earlier in enumerate(ordered):
            for later in ordered[i + 1:]:
                if not _must_precede(earlier, later):
                    reason = "cyclic 'after' order"
                    raise PatchConflictError(self._conflict(earlier, later, slot, reason))
        return ordered

    @staticmethod
    def _conflict(first: Patch, second: Patch, slot: _Slot, reason: str) -> str:
        spellings = sorted({first.target, second.target, slot.target})
        where = f" (also spelled {', '.join(map(repr, spellings[1:]))})" if spellings[1:] else ""
        return (f"features {first.feature!r} ({first.kind}) and {second.feature!r} ({second.kind}) "
                f"both patch {spellings[0]!r}{where}: {reason}")

    def _apply_order(self) -> list[Patch]:
        # Registration order across slots, declared 'after' order within a slot.
        order, seen = [], set()
        for patch in self._patches:
            slot = self._slot_of[id(patch)]
            if id(slot) not in seen:
                seen.add(id(slot))
                order.extend(self._order(slot.patches, slot))
        return order

    def apply(self) -> None:
        order = self._apply_order()
        if self._needs_rebuild(order):
            # A late patch must sit below an applied wrapper; only a full rebuild keeps undo exact.
            logger.debug("re-applying all patches to insert a patch below an applied one")
            self.undo()
        depth = len(self._stack)
        try:
            for patch in order:
                if id(patch) not in self._applied:
                    self._apply_one(patch)
        except BaseException:
            # Leave no half-applied state behind when a factory fails.
            self._undo_to(depth)
            raise

    def _needs_rebuild(self, order: list[Patch]) -> bool:
        pending_slots = set()  # slots with a not-yet-applied patch earlier in the order
        for patch in order:
            slot_id = id(self._slot_of[id(patch)])
            if id(patch) not in self._applied:
                pending_slots.add(slot_id)
            elif slot_id in pending_slots:
                return True
        return False

    def _apply_one(self, patch: Patch) -> None:
        slot = self._slot_of[id(patch)]
        had_own, before = _lookup_raw(slot.owner, slot.attr)
        if patch.kind == "provide" and before is not _MISSING:
            raise self._present(patch)  # it appeared after registration: never overwrite the real one
        new = _build(patch, before)
        setattr(slot.owner, slot.attr, new)
        entry = _Applied(patch, slot, had_own, before, new, [])
        self._applied[id(patch)] = entry
        self._stack.append(entry)
        entry.rebound = self._rebind(patch, slot, before, new)
        logger.debug("applied %s on %s for %r, rebound %d globals", patch.kind, patch.target,
                     patch.feature, len(entry.rebound))

    def _rebind(self, patch: Patch, slot: _Slot, before: Any, new: Any) -> list:
        """Point globals that imported the original by value (``from x import f``) at ``new``."""
        old_value, new_value = _plain(before), _plain(new)
        if before is _MISSING or old_value is new_value or isinstance(old_value, _VALUE_TYPES):
            return []
        owner_ns = vars(slot.owner) if isinstance(slot.owner, ModuleType) else None
        rebound, seen = [], set()
        for module in list(sys.modules.values()):
            name, namespace = getattr(module, "__name__", None), getattr(module, "__dict__", None)
            # Entries may be None or non-module objects; only plain module namespaces are rebound.
            if not (isinstance(name, str) and isinstance(namespace, dict)) \
                    or id(namespace) in seen or not _in_scope(name, patch.rebind_in):
                continue
            seen.add(id(namespace))
            for key, value in list(namespace.items()):
                # The owner's attribute was set above; names already holding `new` stay unrecorded.
                if value is old_value and not (namespace is owner_ns and key == slot.attr):
                    namespace[key] = new_value
                    rebound.append((namespace, key, old_value, new_value))
        return rebound

    def undo(self) -> None:
        self._undo_to(0)

    def _undo_to(self, depth: int) -> None:
        first_error = None
        while len(self._stack) > depth:
            entry = self._stack.pop()
            del self._applied[id(entry.patch)]
            try:
                self._restore(entry)
            except Exception as exc:  # keep restoring the rest; a partial undo is worse
                logger.debug("failed to undo patch on %s: %r", entry.patch.target, exc)
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    @staticmethod
    def _restore(entry: _Applied) -> None:
        for namespace, key, old_value, new_value in reversed(entry.rebound):
            # Someone may have rebound the name since; only take back what is still ours.
            if namespace.get(key, _MISSING) is new_value:
                namespace[key] = old_value
        slot, patch = entry.slot, entry.patch
        if entry.had_own:
            setattr(slot.owner, slot.attr, entry.before)
        else:
            delattr(slot.owner, slot.attr)
        logger.debug("undid %s on %s for %r", patch.kind, patch.target, patch.feature)

    @contextlib.contextmanager
    def applied(self):
        """Apply for the duration of a with-block, then undo what the block applied."""
        outer = list(self._stack)
        self.apply()
        try:
            yield self
        finally:
            # apply() may have rebuilt the whole stack; then only a full undo is exact.
            kept = len(self._stack) >= len(outer) and all(map(operator.is_, self._stack, outer))
            self._undo_to(len(outer) if kept else 0)

    def describe(self) -> list[dict]:
        return [{"target": p.target, "kind": p.kind, "feature": p.feature,
                 "applied": id(p) in self._applied} for p in self._patches]

    def original(self, target: str) -> Any:
        """The unpatched raw object at a registered ``target``: what undo would restore.

        A target only ``provide``-d has none: AttributeError, as the unpatched lookup would raise."""
        owner, attr = self._resolve(target, "<original lookup>", need_attr=False)
        slot = self._slots.get((id(owner), attr))
        if slot is None:
            raise KeyError(f"no patch is registered for {target!r}")
        value = _lookup_raw(owner, attr)[1]
        for entry in self._stack:
            if entry.slot is slot:
                value = entry.before
                break
        if value is _MISSING:
            raise AttributeError(f"{target!r} does not exist unpatched (it is provided by a patch)")
        return value
