"""Unit tests for hyper_adaptor.patch_manager against synthetic packages (no Megatron import)."""

import functools
import importlib
import sys
import textwrap
import uuid

import pytest

from hyper_adaptor.patch_manager import (
    Patch,
    PatchConflictError,
    PatchError,
    PatchManager,
    PatchTargetError,
)

VERSION = "megatron-core 9.9.9"

MODULE_A = '''
def f():
    return 1

def g():
    return f()

class Base:
    def inherited(self):
        return "base"

class C(Base):
    def m(self):
        return "m"

    @staticmethod
    def sm():
        return "sm"

    @classmethod
    def cm(cls):
        return cls.__name__

    @property
    def prop(self):
        return "prop"

FLAG = None
'''

MODULE_B = '''
from {pkg}.a import f, C
alias_none = None

def call_f():
    return f()
'''


class Fake:
    """Handles to a freshly written package ``fakepkg_<uuid>`` and its modules."""

    def __init__(self, name):
        self.name = name
        self.a = importlib.import_module(f"{name}.a")
        self.b = importlib.import_module(f"{name}.b")
        self.c = importlib.import_module(f"{name}.c")
        # Shares the package name as a prefix without being inside it.
        self.outside = importlib.import_module(f"{name}x")

    def t(self, suffix):
        return f"{self.name}.{suffix}"

    def patch(self, suffix, replacement, kind, feature="feat", **kwargs):
        kwargs.setdefault("rebind_in", (self.name,))
        return Patch(self.t(suffix), replacement, kind, feature, **kwargs)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    name = f"fakepkg_{uuid.uuid4().hex[:12]}"
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(textwrap.dedent(MODULE_A))
    (pkg / "b.py").write_text(MODULE_B.format(pkg=name))
    (pkg / "c.py").write_text(f"from {name}.a import C\n")
    (pkg / "broken.py").write_text(f"import missing_dependency_{name}\n")
    (tmp_path / f"{name}x.py").write_text(f"from {name}.a import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield Fake(name)
    for mod in [m for m in sys.modules if m == name or m.startswith(name)]:
        del sys.modules[mod]


@pytest.fixture
def pm():
    return PatchManager(version_info=lambda: VERSION)


# ---------------------------------------------------------------- module functions


def test_replace_module_function(fake, pm):
    orig = fake.a.f
    pm.register(fake.patch("a.f", lambda: 2, "replace"))
    with pm.applied():
        assert fake.a.f() == 2
        assert fake.a.g() == 2  # callers going through the module global see it too
    assert fake.a.f is orig and fake.a.g() == 1


def test_wrap_module_function_receives_original(fake, pm):
    orig = fake.a.f
    seen = []

    def factory(original):
        seen.append(original)

        @functools.wraps(original)
        def wrapper():
            return original() + 10

        return wrapper

    pm.register(fake.patch("a.f", factory, "wrap"))
    with pm.applied():
        assert seen == [orig]
        assert fake.a.f() == 11
        assert fake.a.f.__wrapped__ is orig and fake.a.f.__name__ == "f"
    assert fake.a.f is orig


def test_wrap_metadata_is_left_to_the_factory(fake, pm):
    pm.register(fake.patch("a.f", lambda original: (lambda: 5), "wrap"))
    with pm.applied():
        assert fake.a.f.__name__ == "<lambda>"


# ---------------------------------------------------------------- class attributes


def test_replace_method(fake, pm):
    C = fake.a.C
    orig = C.__dict__["m"]
    pm.register(fake.patch("a.C.m", lambda self: "new", "replace"))
    with pm.applied():
        assert C().m() == "new"
    assert C.__dict__["m"] is orig and C().m() == "m"


def test_wrap_method(fake, pm):
    C = fake.a.C
    orig = C.__dict__["m"]
    pm.register(fake.patch("a.C.m", lambda o: lambda self: o(self) + "!", "wrap"))
    with pm.applied():
        assert C().m() == "m!"
    assert C.__dict__["m"] is orig


def test_replace_staticmethod_keeps_given_object(fake, pm):
    C = fake.a.C
    orig = C.__dict__["sm"]
    new = staticmethod(lambda: "new")
    pm.register(fake.patch("a.C.sm", new, "replace"))
    with pm.applied():
        assert C.__dict__["sm"] is new
        assert C.sm() == "new" and C().sm() == "new"
    assert C.__dict__["sm"] is orig


def test_wrap_staticmethod_unwraps_and_rewraps(fake, pm):
    C = fake.a.C
    orig = C.__dict__["sm"]
    seen = []

    def factory(original):
        seen.append(original)
        return lambda: original() + "!"

    pm.register(fake.patch("a.C.sm", factory, "wrap"))
    with pm.applied():
        assert seen == [orig.__func__]
        assert isinstance(C.__dict__["sm"], staticmethod)
        assert C.sm() == "sm!" and C().sm() == "sm!"
    assert C.__dict__["sm"] is orig


def test_replace_classmethod(fake, pm):
    C = fake.a.C
    orig = C.__dict__["cm"]
    pm.register(fake.patch("a.C.cm", classmethod(lambda cls: "new:" + cls.__name__), "replace"))
    with pm.applied():
        assert C.cm() == "new:C"
    assert C.__dict__["cm"] is orig


def test_wrap_classmethod_unwraps_and_rewraps(fake, pm):
    C = fake.a.C
    orig = C.__dict__["cm"]
    seen = []

    def factory(original):
        seen.append(original)
        return lambda cls: "<" + original(cls) + ">"

    pm.register(fake.patch("a.C.cm", factory, "wrap"))
    with pm.applied():
        assert seen == [orig.__func__]
        assert isinstance(C.__dict__["cm"], classmethod)
        assert C.cm() == "<C>" and C().cm() == "<C>"
    assert C.__dict__["cm"] is orig


def test_wrap_property_receives_property_object(fake, pm):
    C = fake.a.C
    orig = C.__dict__["prop"]
    seen = []

    def factory(original):
        seen.append(original)
        return property(lambda self: original.fget(self) + "!")

    pm.register(fake.patch("a.C.prop", factory, "wrap"))
    with pm.applied():
        assert seen == [orig]
        assert C().prop == "prop!"
    assert C.__dict__["prop"] is orig


@pytest.mark.parametrize("kind", ["replace", "wrap"])
def test_inherited_method_is_set_on_owner_and_deleted_by_undo(fake, pm, kind):
    C, Base = fake.a.C, fake.a.Base
    base_orig = Base.__dict__["inherited"]
    seen = []

    def factory(original):
        seen.append(original)
        return lambda self: "wrapped:" + original(self)

    replacement = (lambda self: "replaced") if kind == "replace" else factory
    pm.register(fake.patch("a.C.inherited", replacement, kind))
    assert "inherited" not in C.__dict__
    with pm.applied():
        assert "inherited" in C.__dict__
        assert C().inherited() == ("replaced" if kind == "replace" else "wrapped:base")
        assert Base().inherited() == "base"
        assert pm.original(fake.t("a.C.inherited")) is base_orig
    assert "inherited" not in C.__dict__
    assert Base.__dict__["inherited"] is base_orig
    if kind == "wrap":
        assert seen == [base_orig]


# ---------------------------------------------------------------- validation and missing targets


def test_kind_must_be_explicit_and_valid(fake):
    with pytest.raises(ValueError, match="foo"):
        fake.patch("a.f", lambda: 2, "foo")
    with pytest.raises(TypeError):
        fake.patch("a.f", 42, "wrap")


def test_string_after_is_not_split_into_characters(fake):
    assert fake.patch("a.f", lambda o: o, "wrap", after="first").after == ("first",)


@pytest.mark.parametrize("suffix,missing", [
    ("a.nope", "'nope'"),
    ("a.C.nope", "'nope'"),
    ("a.Nope.m", "'Nope'"),
    ("nomodule.f", "'nomodule'"),
])
def test_missing_target_raises_with_feature_target_and_version(fake, pm, suffix, missing):
    target = fake.t(suffix)
    with pytest.raises(PatchTargetError) as info:
        pm.register(fake.patch(suffix, lambda: 0, "replace", feature="my-feature"))
    message = str(info.value)
    for fragment in ("my-feature", target, VERSION, missing):
        assert fragment in message
    assert isinstance(info.value, PatchError)
    assert pm.patches == []
    assert not hasattr(fake.a, "nope") and "nope" not in fake.a.C.__dict__


def test_missing_top_level_module(pm):
    with pytest.raises(PatchTargetError, match="no module named"):
        pm.register(Patch(f"nomod_{uuid.uuid4().hex}.x.f", lambda: 0, "replace", "feat"))


def test_broken_module_is_reported_not_masked(fake, pm):
    with pytest.raises(PatchTargetError, match="importing .*broken.* failed"):
        pm.register(fake.patch("broken.f", lambda: 0, "replace"))


def test_default_version_info_mentions_megatron_core(fake):
    with pytest.raises(PatchTargetError, match="megatron-core"):
        PatchManager().register(fake.patch("a.nope", lambda: 0, "replace"))


# ---------------------------------------------------------------- conflicts and ordering


@pytest.mark.parametrize("kind1,kind2", [("replace", "replace"), ("replace", "wrap"),
                                         ("wrap", "replace"), ("wrap", "wrap")])
def test_conflicts_name_both_features(fake, pm, kind1, kind2):
    def value(kind):
        return (lambda: 0) if kind == "replace" else (lambda o: o)

    pm.register(fake.patch("a.f", value(kind1), kind1, feature="alpha"))
    second = fake.patch("a.f", value(kind2), kind2, feature="beta", after=("alpha",))
    if kind1 == kind2 == "wrap":
        second = fake.patch("a.f", value(kind2), kind2, feature="beta")
    with pytest.raises(PatchConflictError) as info:
        pm.register(second)
    assert "alpha" in str(info.value) and "beta" in str(info.value)
    assert fake.t("a.f") in str(info.value)
    assert [p.feature for p in pm.patches] == ["alpha"]


def test_replace_conflicts_even_with_after(fake, pm):
    pm.register(fake.patch("a.f", lambda: 0, "replace", feature="alpha"))
    with pytest.raises(PatchConflictError):
        pm.register(fake.patch("a.f", lambda o: o, "wrap", feature="beta", after=("alpha",)))


def test_mutual_after_is_a_conflict(fake, pm):
    pm.register(fake.patch("a.f", lambda o: o, "wrap", feature="alpha", after=("beta",)))
    with pytest.raises(PatchConflictError, match="each declares"):
        pm.register(fake.patch("a.f", lambda o: o, "wrap", feature="beta", after=("alpha",)))


def test_cyclic_after_is_a_conflict(fake, pm):
    pm.register(fake.patch("a.f", lambda o: o, "wrap", feature="x", after=("z",)))
    pm.register(fake.patch("a.f", lambda o: o, "wrap", feature="y", after=("x",)))
    with pytest.raises(PatchConflictError):
        pm.register(fake.patch("a.f", lambda o: o, "wrap", feature="z", after=("y",)))


def _tracing_factory(name, log):
    def factory(original):
        log.append(("wrap", name))

        def wrapper():
            log.append(("call", name))
            return original()

        return wrapper

    return factory


@pytest.mark.parametrize("register_first", ["inner", "outer"])
def test_wraps_with_after_apply_in_declared_order(fake, pm, register_first):
    log = []
    inner = fake.patch("a.f", _tracing_factory("inner", log), "wrap", feature="inner")
    outer = fake.patch("a.f", _tracing_factory("outer", log), "wrap", feature="outer",
                       after=("inner",))
    pm.register_all([inner, outer] if register_first == "inner" else [outer, inner])
    orig = fake.a.f
    with pm.applied():
        assert fake.a.f() == 1
        # outer wraps the result of inner, so it is applied second and runs first.
        assert log == [("wrap", "inner"), ("wrap", "outer"), ("call", "outer"), ("call", "inner")]
        assert pm.original(fake.t("a.f")) is orig
    assert fake.a.f is orig


def test_same_patch_object_twice_is_noop(fake, pm):
    patch = fake.patch("a.f", lambda: 2, "replace")
    pm.register(patch)
    pm.register(patch)
    assert pm.patches == [patch]
    with pm.applied():
        assert fake.a.f() == 2


def test_conflict_detected_across_spellings(fake, pm):
    pm.register(fake.patch("a.C.m", lambda o: o, "wrap", feature="alpha"))
    with pytest.raises(PatchConflictError) as info:
        pm.register(fake.patch("c.C.m", lambda o: o, "wrap", feature="beta"))
    message = str(info.value)
    assert "alpha" in message and "beta" in message
    assert fake.t("a.C.m") in message and fake.t("c.C.m") in message


# ---------------------------------------------------------------- rebinding


def test_rebinds_globals_imported_by_value(fake, pm):
    orig = fake.a.f
    new = lambda: 2  # noqa: E731
    pm.register(fake.patch("a.f", new, "replace"))
    assert fake.b.f is orig
    with pm.applied():
        assert fake.b.f is new and fake.b.call_f() == 2
        assert fake.outside.f is orig  # "<pkg>x" is not inside the "<pkg>" prefix
    assert fake.b.f is orig and fake.b.call_f() == 1


def test_default_rebind_scope_leaves_other_packages_alone(fake, pm):
    orig = fake.a.f
    pm.register(Patch(fake.t("a.f"), lambda: 2, "replace", "feat"))
    with pm.applied():
        assert fake.a.f() == 2
        assert fake.b.f is orig


def test_chained_wraps_rebind_through_the_chain(fake, pm):
    orig = fake.a.f
    pm.register(fake.patch("a.f", lambda o: lambda: o() + 1, "wrap", feature="one"))
    pm.register(fake.patch("a.f", lambda o: lambda: o() * 10, "wrap", feature="two",
                           after=("one",)))
    with pm.applied():
        assert fake.a.f() == 20 and fake.b.f is fake.a.f
    assert fake.b.f is orig


def test_constants_are_not_rebound_by_identity(fake, pm):
    pm.register(fake.patch("a.FLAG", "on", "replace"))
    with pm.applied():
        assert fake.a.FLAG == "on"
        assert fake.b.alias_none is None
    assert fake.a.FLAG is None


def test_undo_leaves_names_rebound_by_someone_else(fake, pm):
    pm.register(fake.patch("a.f", lambda: 2, "replace"))
    pm.apply()
    other = lambda: 3  # noqa: E731
    fake.b.f = other
    pm.undo()
    assert fake.b.f is other


# ---------------------------------------------------------------- lifecycle


def test_apply_is_idempotent(fake, pm):
    calls = []

    def factory(original):
        calls.append(original)
        return lambda: original() + 1

    pm.register(fake.patch("a.f", factory, "wrap"))
    pm.apply()
    pm.apply()
    assert len(calls) == 1 and fake.a.f() == 2
    pm.undo()


def test_undo_restores_identity_everywhere(fake, pm):
    a, C = fake.a, fake.a.C
    def snapshot():
        return (a.f, fake.b.f, *(C.__dict__[name] for name in ("m", "sm", "cm", "prop")))

    before = snapshot()
    pm.register_all([
        fake.patch("a.f", lambda o: lambda: 0, "wrap", feature="f"),
        fake.patch("a.C.m", lambda self: 0, "replace", feature="m"),
        fake.patch("a.C.sm", lambda o: lambda: 0, "wrap", feature="sm"),
        fake.patch("a.C.cm", lambda o: lambda cls: 0, "wrap", feature="cm"),
        fake.patch("a.C.prop", lambda o: property(lambda self: 0), "wrap", feature="prop"),
    ])
    pm.apply()
    pm.undo()
    assert all(x is y for x, y in zip(before, snapshot()))


def test_undo_never_applied_is_noop(fake, pm):
    orig = fake.a.f
    pm.register(fake.patch("a.f", lambda: 2, "replace"))
    pm.undo()
    assert fake.a.f is orig


def test_apply_after_undo_works_again(fake, pm):
    pm.register(fake.patch("a.f", lambda o: lambda: o() + 1, "wrap"))
    for _ in range(2):
        pm.apply()
        assert fake.a.f() == 2 and fake.b.f() == 2
        pm.undo()
        assert fake.a.f() == 1 and fake.b.f() == 1


def test_applied_context_restores_on_exception(fake, pm):
    orig = fake.a.f
    pm.register(fake.patch("a.f", lambda: 2, "replace"))
    with pytest.raises(RuntimeError):
        with pm.applied():
            assert fake.a.f() == 2
            raise RuntimeError("boom")
    assert fake.a.f is orig and fake.b.f is orig


def test_nested_applied_keeps_outer_patches(fake, pm):
    pm.register(fake.patch("a.f", lambda: 2, "replace"))
    pm.apply()
    pm.register(fake.patch("a.C.m", lambda self: "new", "replace"))
    with pm.applied():
        assert fake.a.C().m() == "new"
    assert fake.a.C().m() == "m" and fake.a.f() == 2
    pm.undo()


def test_patches_registered_after_apply_are_applied_next_time(fake, pm):
    pm.register(fake.patch("a.f", lambda: 2, "replace", feature="first"))
    pm.apply()
    pm.register(fake.patch("a.C.m", lambda self: "new", "replace", feature="second"))
    assert fake.a.C().m() == "m"
    pm.apply()
    assert fake.a.f() == 2 and fake.a.C().m() == "new"
    pm.undo()
    assert fake.a.f() == 1 and fake.a.C().m() == "m"


def test_late_patch_ordered_below_applied_one_rebuilds_chain(fake, pm):
    log = []
    orig = fake.a.f
    pm.register(fake.patch("a.f", _tracing_factory("outer", log), "wrap", feature="outer",
                           after=("inner",)))
    pm.apply()
    pm.register(fake.patch("a.f", _tracing_factory("inner", log), "wrap", feature="inner"))
    pm.apply()
    log.clear()
    assert fake.a.f() == 1
    assert log == [("call", "outer"), ("call", "inner")]
    pm.undo()
    assert fake.a.f is orig and fake.b.f is orig


def test_failing_factory_rolls_back_this_apply(fake, pm):
    orig_f, orig_m = fake.a.f, fake.a.C.__dict__["m"]

    def broken(original):
        raise RuntimeError("factory failed")

    pm.register(fake.patch("a.f", lambda: 2, "replace", feature="ok"))
    pm.register(fake.patch("a.C.m", broken, "wrap", feature="broken"))
    with pytest.raises(RuntimeError, match="factory failed"):
        pm.apply()
    assert fake.a.f is orig_f and fake.b.f is orig_f
    assert fake.a.C.__dict__["m"] is orig_m
    assert not any(entry["applied"] for entry in pm.describe())


# ---------------------------------------------------------------- introspection


def test_describe(fake, pm):
    pm.register(fake.patch("a.f", lambda: 2, "replace", feature="alpha"))
    pm.register(fake.patch("a.C.m", lambda o: o, "wrap", feature="beta"))
    expected = [
        {"target": fake.t("a.f"), "kind": "replace", "feature": "alpha", "applied": False},
        {"target": fake.t("a.C.m"), "kind": "wrap", "feature": "beta", "applied": False},
    ]
    assert pm.describe() == expected
    with pm.applied():
        assert [entry["applied"] for entry in pm.describe()] == [True, True]
    assert pm.describe() == expected


def test_original(fake, pm):
    orig = fake.a.f
    pm.register(fake.patch("a.f", lambda: 2, "replace"))
    assert pm.original(fake.t("a.f")) is orig
    with pm.applied():
        assert pm.original(fake.t("a.f")) is orig
    with pytest.raises(KeyError):
        pm.original(fake.t("a.g"))


def test_patch_manager_imports_only_stdlib():
    import hyper_adaptor.patch_manager as module

    source = open(module.__file__).read()
    imported = {line.split()[1].split(".")[0] for line in source.splitlines()
                if line.startswith(("import ", "from "))}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}


# ---------------------------------------------------------------- provide


@pytest.mark.parametrize("suffix,owner", [("a.provided", "a"), ("a.C.provided", "C")])
def test_provide_sets_then_undo_deletes_exactly(fake, pm, suffix, owner):
    where = fake.a if owner == "a" else fake.a.C
    value = object()
    before = dict(vars(where))
    pm.register(fake.patch(suffix, value, "provide"))
    assert not hasattr(where, "provided")  # registering changes nothing
    with pm.applied():
        assert where.provided is value and vars(where)["provided"] is value
    assert "provided" not in vars(where) and not hasattr(where, "provided")
    assert dict(vars(where)).keys() == before.keys()
    assert all(vars(where)[k] is v for k, v in before.items() if k != "__dict__")


def test_provide_is_idempotent_and_reapplies_after_undo(fake, pm):
    value = object()
    pm.register(fake.patch("a.provided", value, "provide"))
    for _ in range(2):
        pm.apply()
        pm.apply()
        assert fake.a.provided is value
        assert [e["applied"] for e in pm.describe()] == [True]
        pm.undo()
        assert not hasattr(fake.a, "provided")
    pm.undo()  # nothing left to undo: no error, still absent
    assert not hasattr(fake.a, "provided")


def test_provided_value_is_seen_by_call_time_lookups(fake, pm):
    # A function of the package that names a global only bound by the patch.
    with open(fake.a.__file__.replace("a.py", "late.py"), "w") as handle:
        handle.write("def call():\n    return provided_global()\n")
    late = importlib.import_module(fake.t("late"))
    with pytest.raises(NameError):
        late.call()
    pm.register(fake.patch("late.provided_global", lambda: "here", "provide"))
    with pm.applied():
        assert late.call() == "here"
    with pytest.raises(NameError):
        late.call()


@pytest.mark.parametrize("suffix,missing", [
    ("nomodule.provided", "'nomodule'"),
    ("a.Nope.provided", "'Nope'"),
])
def test_provide_missing_parent_names_feature_target_version(fake, pm, suffix, missing):
    with pytest.raises(PatchTargetError) as info:
        pm.register(fake.patch(suffix, 1, "provide", feature="my-feature"))
    for fragment in ("my-feature", fake.t(suffix), VERSION, missing):
        assert fragment in str(info.value)
    assert pm.patches == []


@pytest.mark.parametrize("suffix", ["a.f", "a.C.m", "a.C.inherited", "a.FLAG"])
def test_provide_on_present_attribute_is_an_error(fake, pm, suffix):
    snapshot = (fake.a.f, dict(vars(fake.a.C)))
    with pytest.raises(PatchTargetError) as info:
        pm.register(fake.patch(suffix, 1, "provide", feature="my-feature"))
    message = str(info.value)
    for fragment in ("my-feature", fake.t(suffix), VERSION, "already exists"):
        assert fragment in message
    assert pm.patches == []
    assert snapshot == (fake.a.f, dict(vars(fake.a.C)))


def test_provide_refuses_to_overwrite_an_attribute_that_appeared_later(fake, pm):
    pm.register(fake.patch("a.provided", "stand-in", "provide", feature="my-feature"))
    pm.register(fake.patch("a.f", lambda: 2, "replace", feature="other"))
    fake.a.provided = "real"
    try:
        with pytest.raises(PatchTargetError, match="already exists"):
            pm.apply()
        assert fake.a.provided == "real" and fake.a.f() == 1  # nothing half-applied
    finally:
        del fake.a.provided


@pytest.mark.parametrize("other_kind", ["provide", "replace", "wrap"])
@pytest.mark.parametrize("applied", [False, True])
def test_provide_conflicts_name_both_features(fake, pm, other_kind, applied):
    pm.register(fake.patch("a.provided", lambda: 0, "provide", feature="alpha"))
    if applied:
        pm.apply()
    second = fake.patch("a.provided", (lambda o: o) if other_kind == "wrap" else (lambda: 1),
                        other_kind, feature="beta", after=("alpha",))
    try:
        # Unapplied, a replace/wrap finds no attribute to patch; either way beta is refused.
        expected = PatchConflictError if applied or other_kind == "provide" else PatchError
        with pytest.raises(expected) as info:
            pm.register(second)
        assert "beta" in str(info.value) and fake.t("a.provided") in str(info.value)
        if expected is PatchConflictError:
            assert "alpha" in str(info.value) and "'provide'" in str(info.value)
        assert [p.feature for p in pm.patches] == ["alpha"]
    finally:
        pm.undo()
    assert not hasattr(fake.a, "provided")


def test_provide_in_describe_and_original(fake, pm):
    pm.register(fake.patch("a.provided", 5, "provide", feature="alpha"))
    expected = [{"target": fake.t("a.provided"), "kind": "provide", "feature": "alpha",
                 "applied": False}]
    assert pm.describe() == expected
    with pm.applied():
        assert pm.describe() == [dict(expected[0], applied=True)]
        with pytest.raises(AttributeError, match="provided"):
            pm.original(fake.t("a.provided"))
    with pytest.raises(AttributeError):
        pm.original(fake.t("a.provided"))


# ---------------------------------------------------------------- undo after imports mid-apply


def test_undo_restores_a_module_imported_while_patches_were_on(fake, pm, tmp_path):
    orig = fake.a.f
    pm.register(fake.patch("a.f", lambda: 2, "replace"))
    pm.apply()
    (tmp_path / fake.name / "late.py").write_text(f"from {fake.name}.a import f\n")
    late = importlib.import_module(f"{fake.name}.late")
    assert late.f() == 2  # took the patched function by value
    pm.undo()
    assert late.f is orig and fake.a.f is orig


def test_undo_of_stacked_wraps_restores_a_late_module_to_the_original(fake, pm, tmp_path):
    orig = fake.a.f
    pm.register(fake.patch("a.f", lambda o: lambda: o() + 1, "wrap", feature="one"))
    pm.register(fake.patch("a.f", lambda o: lambda: o() * 10, "wrap", feature="two", after=("one",)))
    pm.apply()
    (tmp_path / fake.name / "late2.py").write_text(f"from {fake.name}.a import f\n")
    late = importlib.import_module(f"{fake.name}.late2")
    assert late.f() == 20
    pm.undo()
    assert late.f is orig


# ---------------------------------------------------------------- item and module kinds


def test_item_sets_and_restores_a_mapping_entry(fake, pm, monkeypatch):
    monkeypatch.delenv("HYPER_ADAPTOR_TEST_ITEM", raising=False)
    monkeypatch.setenv("HYPER_ADAPTOR_TEST_ITEM2", "before")
    pm.register(Patch("os.environ.HYPER_ADAPTOR_TEST_ITEM", "1", "item", "feat"))
    pm.register(Patch("os.environ.HYPER_ADAPTOR_TEST_ITEM2", "after", "item", "feat"))
    with pm.applied():
        import os

        assert os.environ["HYPER_ADAPTOR_TEST_ITEM"] == "1" and os.environ["HYPER_ADAPTOR_TEST_ITEM2"] == "after"
    assert "HYPER_ADAPTOR_TEST_ITEM" not in os.environ and os.environ["HYPER_ADAPTOR_TEST_ITEM2"] == "before"
    with pytest.raises(PatchConflictError):
        pm.register(Patch("os.environ.HYPER_ADAPTOR_TEST_ITEM", "2", "item", "other"))
    with pytest.raises(PatchTargetError, match="is not a mapping"):
        pm.register(fake.patch("a.f.x", "1", "item"))


def test_module_stand_in_is_served_then_withdrawn(fake, pm, tmp_path):
    (tmp_path / fake.name / "needs_gpu.py").write_text("import missing_gpu_library_xyz\n")
    name = fake.t("needs_gpu")
    with pytest.raises(ImportError):
        importlib.import_module(name)

    def fill(module):
        module.ANSWER = 42

    pm.register(Patch(name, fill, "module", "feat"))
    assert {"target": name, "kind": "module", "feature": "feat", "applied": False} in pm.describe()
    with pm.applied():
        assert importlib.import_module(name).ANSWER == 42
        from importlib import import_module

        assert import_module(fake.name).needs_gpu.ANSWER == 42
    assert name not in sys.modules and not hasattr(sys.modules[fake.name], "needs_gpu")
    with pytest.raises(ImportError):
        importlib.import_module(name)


def test_module_stand_in_needs_the_real_file_and_refuses_an_imported_module(fake, pm):
    with pytest.raises(PatchTargetError,
                       match=r"module '.*\.nowhere' does not exist in the installed megatron-core 9\.9\.9"):
        pm.register(Patch(fake.t("nowhere"), lambda m: None, "module", "feat"))
    pm.register(Patch(fake.t("a"), lambda m: None, "module", "feat"))  # exists, but imported already
    with pytest.raises(PatchError, match="already imported"):
        pm.apply()


def test_check_says_why_a_target_does_not_resolve(fake, pm):
    assert pm.check(fake.patch("a.f", lambda: 2, "replace")) is None
    problem = pm.check(fake.patch("a.nope", lambda: 2, "replace"))
    assert "does not exist in the installed megatron-core 9.9.9" in problem and "a.nope" in problem
