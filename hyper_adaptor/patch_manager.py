"""Registry that applies, and exactly undoes, monkey-patches on Megatron (or any importable code).

Targets are resolved at registration so a patch written for another Megatron release fails early,
naming the installed version, instead of silently patching nothing. Two features may only touch the
same attribute when both wrap it and one declares the other in ``after``. Stdlib only, so importing
this module never pulls in Megatron or torch.

Kinds:

* ``replace`` — set a new value;
* ``wrap`` — a factory ``original -> new``;
* ``provide`` — set an attribute the installed code looks up at call time but lacks (e.g. a module
  global left unbound because an optional import failed); its parent must exist and it must be
  absent, and undo deletes it;
* ``item`` — set one entry of a mapping (``os.environ.NAME``: the last component is the key, the rest
  the dotted path of the mapping); undo restores the old value or removes the key;
* ``module`` — serve a stand-in for a module that exists in the installed tree but cannot be
  imported here (``replacement(module)`` fills the new module object); the target is the module's
  dotted name, found on disk without importing it or its parents, and it must not be imported yet.
  Undo removes the stand-in from ``sys.modules`` and from its parent package.

Undo also restores names that modules imported while a patch was on took by value
(``from x import f`` ran after apply): apply rebinds the modules it finds, undo scans again.
"""

from __future__ import annotations

import collections.abc
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import logging
import operator
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = ["Patch", "PatchError", "PatchTargetError", "PatchConflictError", "PatchManager"]
logger = logging.getLogger("hyper_adaptor.patch")

_KINDS = ("replace", "wrap", "provide", "item", "module")
_EXCLUSIVE = ("replace", "provide", "item", "module")  # kinds that share their target with no other patch
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
    kind: str = "attribute"  # "attribute", "item" (a mapping entry) or "module" (a sys.modules entry)

    def lookup(self) -> tuple[bool, Any]:
        if self.kind == "item":
            return self.attr in self.owner, self.owner.get(self.attr, _MISSING)
        if self.kind == "module":
            return False, sys.modules.get(self.attr, _MISSING)
        return _lookup_raw(self.owner, self.attr)

    def set(self, value: Any) -> None:
        if self.kind == "item":
            self.owner[self.attr] = value
        elif self.kind == "module":
            self.owner.serve(value)
        else:
            setattr(self.owner, self.attr, value)

    def delete(self) -> None:
        if self.kind == "item":
            self.owner.pop(self.attr, None)
        elif self.kind == "module":
            self.owner.withdraw()
        else:
            delattr(self.owner, self.attr)


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
    from hyper_adaptor.megatron_version import detect

    found = detect()
    return str(found) if found is not None else "megatron-core (not found)"


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


def _swap_globals(scope: tuple[str, ...], old_value: Any, new_value: Any, slot: _Slot) -> list:
    """Point module globals in ``scope`` that hold ``old_value`` at ``new_value``; returns what changed
    as (namespace, name, old, new). The patched attribute itself is left to the caller."""
    if old_value is new_value or isinstance(old_value, _VALUE_TYPES):
        return []
    owner_ns = vars(slot.owner) if isinstance(slot.owner, ModuleType) else None
    changed, seen = [], set()
    for module in list(sys.modules.values()):
        name, namespace = getattr(module, "__name__", None), getattr(module, "__dict__", None)
        # Entries may be None or non-module objects; only plain module namespaces are rebound.
        if not (isinstance(name, str) and isinstance(namespace, dict)) \
                or id(namespace) in seen or not _in_scope(name, scope):
            continue
        seen.add(id(namespace))
        for key, value in list(namespace.items()):
            if value is old_value and not (namespace is owner_ns and key == slot.attr):
                namespace[key] = new_value
                changed.append((namespace, key, old_value, new_value))
    return changed


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves one module name from a fill function while a ``module`` patch is applied."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fill: Callable[[ModuleType], None] | None = None
        self.served: ModuleType | None = None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self.fill is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.fill(module)
        self.served = module

    def serve(self, fill: Callable[[ModuleType], None]) -> None:
        self.fill = fill
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def withdraw(self) -> None:
        self.fill = None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        if self.served is not None and sys.modules.get(self.name) is self.served:
            del sys.modules[self.name]
            parent, _, leaf = self.name.rpartition(".")
            if parent in sys.modules and getattr(sys.modules[parent], leaf, None) is self.served:
                delattr(sys.modules[parent], leaf)
        self.served = None


def _in_scope(module_name: str, prefixes: tuple[str, ...]) -> bool:
    return any(module_name == p or module_name.startswith(p + ".") for p in prefixes)


def _must_precede(first: Patch, second: Patch) -> bool:
    return first.feature in second.after


class PatchManager:
    def __init__(self, version_info: Callable[[], str] | None = None) -> None:
        self._version_info = version_info or _installed_megatron_version
        self._patches: list[Patch] = []
        self._slot_of: dict[int, _Slot] = {}  # by id(patch); _patches keeps the ids valid
        self._slots: dict[tuple, _Slot] = {}  # by _slot_key: (kind, id(owner), attr); slot keeps owner
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
        slot = self._slot_for(patch)
        # A provided attribute must be absent from the code as installed; with patches already on
        # this slot, the registered patches (not the present value) decide, so _order reports them.
        if patch.kind == "provide" and not slot.patches and slot.lookup()[1] is not _MISSING:
            raise self._present(patch)
        self._order(slot.patches + [patch], slot)  # raises on conflict before anything is stored
        slot.patches.append(patch)
        self._slots[self._slot_key(slot)] = slot
        self._slot_of[id(patch)] = slot
        self._patches.append(patch)
        logger.debug("registered %s on %s for %r", patch.kind, patch.target, patch.feature)

    def register_all(self, patches: Iterable[Patch]) -> None:
        for patch in patches:
            self.register(patch)

    @staticmethod
    def _slot_key(slot: _Slot) -> tuple:
        return (slot.kind, id(slot.owner) if slot.kind != "module" else 0, slot.attr)

    def _slot_for(self, patch: Patch) -> _Slot:
        """The slot ``patch`` modifies (an existing one when another patch already targets it)."""
        if patch.kind == "module":
            self._locate_module(patch.target, patch.feature)
            slot = self._slots.get(("module", 0, patch.target))
            return slot or _Slot(_StandInFinder(patch.target), patch.target, patch.target, kind="module")
        if patch.kind == "item":
            owner, key = self._resolve(patch.target, patch.feature, need_attr=False)
            if not isinstance(owner, collections.abc.MutableMapping):
                raise PatchTargetError(f"feature {patch.feature!r}: 'item' target {patch.target!r}: "
                                       f"{type(owner).__name__} is not a mapping")
            slot = self._slots.get(("item", id(owner), key))
            return slot or _Slot(owner, key, patch.target, kind="item")
        owner, attr = self._resolve(patch.target, patch.feature, need_attr=patch.kind != "provide")
        return self._slots.get(("attribute", id(owner), attr)) or _Slot(owner, attr, patch.target)

    def check(self, patch: Patch) -> str | None:
        """None when ``patch``'s target resolves in the installed code, else why not (for describe)."""
        try:
            self._slot_for(patch)
        except PatchTargetError as error:
            return str(error)
        return None

    def _locate_module(self, name: str, feature: str) -> None:
        """A module's source must exist in the installed tree; found without importing anything."""
        path = None
        for depth in range(1, len(name.split(".")) + 1):
            prefix = ".".join(name.split(".")[:depth])
            spec = importlib.machinery.PathFinder.find_spec(prefix, path)
            if spec is None:
                raise PatchTargetError(f"feature {feature!r}: module {name!r} does not exist in the installed "
                                       f"{self._version_info()} (no {prefix!r} on the import path)")
            path = spec.submodule_search_locations

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
        had_own, before = slot.lookup()
        if patch.kind == "provide" and before is not _MISSING:
            raise self._present(patch)  # it appeared after registration: never overwrite the real one
        if patch.kind == "module" and before is not _MISSING:
            raise PatchError(f"feature {patch.feature!r}: module {patch.target!r} is already imported; its "
                             f"stand-in must be applied before anything imports it")
        new = _build(patch, before)
        slot.set(new)
        entry = _Applied(patch, slot, had_own, before, new, [])
        self._applied[id(patch)] = entry
        self._stack.append(entry)
        entry.rebound = self._rebind(patch, slot, before, new)
        logger.debug("applied %s on %s for %r, rebound %d globals", patch.kind, patch.target,
                     patch.feature, len(entry.rebound))

    def _rebind(self, patch: Patch, slot: _Slot, before: Any, new: Any) -> list:
        """Point globals that imported the original by value (``from x import f``) at ``new``."""
        if slot.kind != "attribute" or before is _MISSING:
            return []
        return _swap_globals(patch.rebind_in, _plain(before), _plain(new), slot)

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
        if slot.kind == "attribute" and entry.before is not _MISSING:
            # modules imported while the patch was on took the patched object by value
            _swap_globals(patch.rebind_in, _plain(entry.new), _plain(entry.before), slot)
        if entry.had_own:
            slot.set(entry.before)
        else:
            slot.delete()
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
        slot = self._slots.get(("attribute", id(owner), attr)) or self._slots.get(("item", id(owner), attr))
        if slot is None:
            raise KeyError(f"no patch is registered for {target!r}")
        value = slot.lookup()[1]
        for entry in self._stack:
            if entry.slot is slot:
                value = entry.before
                break
        if value is _MISSING:
            raise AttributeError(f"{target!r} does not exist unpatched (it is provided by a patch)")
        return value
