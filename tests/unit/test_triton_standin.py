"""The level-0 triton stand-in (hyper_adaptor/patches/compat/triton_standin.py): a module that imports
triton unconditionally imports without it, its kernels fail only when run, naming kernel and triton;
an import megatron guards with ``except ImportError`` still fails, so its ``HAVE_TRITON`` flags say no;
and nothing is registered where triton is installed."""

import importlib
import importlib.util
import sys
import textwrap

import pytest

from hyper_adaptor.patch_manager import PatchManager
from hyper_adaptor.patches.compat import imports, triton_standin
from hyper_adaptor.patches.compat.triton_standin import TARGET, TritonUnavailableError

KERNELS = '''
import triton
import triton.language as tl
from packaging import version

OLD_TRITON = version.parse(triton.__version__) < version.parse("2.2.0")
ONE = tl.constexpr(1)


@triton.autotune(configs=[triton.Config({"BLOCK": 128}, num_warps=4)], key=["n"])
@triton.jit
def add_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets))


@triton.heuristics({"EVEN": lambda args: args["n"] % 2 == 0})
@triton.jit(do_not_specialize=["n"])
def scale_kernel(x_ptr, n, EVEN: tl.constexpr):
    pass


def launch(x, y):
    grid = (triton.cdiv(len(x), 128),)
    add_kernel[grid](x, y, len(x))
'''

GUARDED = '''
try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

try:
    from triton.language.extra import libdevice  # noqa: F401

    HAVE_LIBDEVICE = True
except (ImportError, AttributeError):
    HAVE_LIBDEVICE = False
'''

# an unconditional import, then at once a guarded one: the second finds the stand-in in sys.modules
BOTH = '''
import triton

try:
    import triton as again  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
'''


def _forget_triton():
    for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
        del sys.modules[name]


@pytest.fixture
def modules(tmp_path, monkeypatch):
    if importlib.util.find_spec("triton") is not None and not triton_standin.is_standin(sys.modules.get("triton")):
        pytest.skip("triton is installed here: the stand-in is never registered")
    # other tests' imports.install() may have left the stand-in applied in this process: start without it
    bootstrap = sys.modules["importlib._bootstrap"]
    for attr in ("_find_spec", "_lock_unlock_module"):
        function = getattr(bootstrap, attr)
        while getattr(getattr(function, "__code__", None), "co_name", "").endswith("_with_triton_standin"):
            function = function.__wrapped__
        monkeypatch.setattr(bootstrap, attr, function)
    (tmp_path / "standin_kernels.py").write_text(KERNELS)
    (tmp_path / "standin_guarded.py").write_text(GUARDED)
    (tmp_path / "standin_both.py").write_text(BOTH)
    monkeypatch.syspath_prepend(str(tmp_path))
    _forget_triton()
    yield tmp_path
    for name in ("standin_kernels", "standin_guarded", "standin_both"):
        sys.modules.pop(name, None)
    _forget_triton()


@pytest.fixture
def standin():
    manager = PatchManager()
    manager.register_all(triton_standin.patches("compat"))
    manager.apply()
    yield manager
    manager.undo()


def test_without_the_standin_the_unconditional_import_fails(modules):
    with pytest.raises(ModuleNotFoundError, match="triton"):
        importlib.import_module("standin_kernels")


def test_an_unconditional_importer_imports_and_its_kernels_name_triton_when_run(modules, standin):
    kernels = importlib.import_module("standin_kernels")
    assert kernels.OLD_TRITON and kernels.ONE == 1 and bool(kernels.ONE)
    assert kernels.triton.cdiv(300, 128) == 3 and kernels.triton.next_power_of_2(100) == 128
    with pytest.raises(TritonUnavailableError, match=r"^standin_kernels\.add_kernel is a triton kernel and "
                                                     r"triton is not installed"):
        kernels.launch([1, 2], [0, 0])  # kernel[grid](...)
    with pytest.raises(TritonUnavailableError, match=r"^standin_kernels\.scale_kernel is a triton kernel"):
        kernels.scale_kernel(None, 4)
    with pytest.raises(TritonUnavailableError, match=r"^triton\.language\.arange is part of triton and triton is not"):
        kernels.tl.arange(0, 4)


def test_guarded_imports_still_fail_so_availability_flags_say_no_triton(modules, standin):
    importlib.import_module("standin_kernels")  # an unconditional importer first: its stand-in is not reused
    guarded = importlib.import_module("standin_guarded")
    assert guarded.HAVE_TRITON is False and guarded.HAVE_LIBDEVICE is False
    assert importlib.util.find_spec("triton") is None
    both = importlib.import_module("standin_both")
    assert both.HAVE_TRITON is False and triton_standin.is_standin(both.triton)


def test_undo_takes_the_standin_back(modules, standin):
    standin.undo()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("standin_kernels")


def test_nothing_is_registered_where_triton_is_installed(tmp_path, monkeypatch):
    package = tmp_path / "triton"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent('''
        __version__ = "3.4.0"
        REAL = True
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    _forget_triton()
    try:
        assert TARGET not in [p.target for p in imports.patches()]
        # and a stand-in applied anyway (triton installed after start-up) hands out the real package
        manager = PatchManager()
        manager.register_all(triton_standin.patches("compat"))
        manager.apply()
        try:
            assert importlib.import_module("triton").REAL is True
        finally:
            manager.undo()
    finally:
        _forget_triton()
    assert TARGET in [p.target for p in imports.patches()] or importlib.util.find_spec("triton") is not None
