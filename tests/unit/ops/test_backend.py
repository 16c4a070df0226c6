"""``Compiled``: only a failure of torch.compile itself falls back to the uncompiled function; an error
of the call (out of memory, a bad shape) propagates and the next call is compiled again."""

import pytest
import torch

from hyper_adaptor.ops.backend import Compiled, raised_by_compiler


def _double(x):
    return x * 2


def _compiled_raising(error: BaseException):
    """A Compiled whose compiled function raises ``error`` on its first call only, and records its
    calls and those of the fallback."""
    calls = {"compiled": 0, "fallback": 0}

    def compiled_fn(x):
        calls["compiled"] += 1
        if calls["compiled"] == 1:
            raise error
        return x * 3  # tells the compiled result apart from the fallback's

    def fallback(x):
        calls["fallback"] += 1
        return _double(x)

    op = f"test_backend_{type(error).__name__}_{id(error)}"  # a notice of its own, not deduplicated away
    wrapper = Compiled(op, _double, fallback)
    wrapper.compiled = lambda: compiled_fn
    return wrapper, calls


def _notices(capsys, op):
    return [line for line in capsys.readouterr().out.splitlines() if op in line]


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
     RuntimeError("shape '[4, -1]' is invalid"), ValueError("bad value")],
    ids=["out-of-memory", "RuntimeError", "ValueError"],
)
def test_an_error_of_the_call_propagates_and_compilation_is_kept(error, capsys):
    wrapper, calls = _compiled_raising(error)
    with pytest.raises(type(error)):
        wrapper(torch.ones(2))
    assert not wrapper.failed and calls["fallback"] == 0
    assert torch.equal(wrapper(torch.ones(2)), torch.full((2,), 3.0))  # the compiled function again
    assert _notices(capsys, wrapper.op) == []


def _backend_compiler_failed():
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InvalidCxxCompiler

    return BackendCompilerFailed(lambda gm, inputs: gm, InvalidCxxCompiler(), None)


def _wrapped_cpp_compile_error():
    from torch._inductor.exc import CppCompileError

    try:
        raise CppCompileError(["g++", "kernel.cpp"], "g++: fatal error: no input files")
    except CppCompileError as cause:
        try:
            raise RuntimeError("while compiling a kernel") from cause
        except RuntimeError as wrapped:
            return wrapped


@pytest.mark.parametrize(
    "make_error", [_backend_compiler_failed, _wrapped_cpp_compile_error],
    ids=["BackendCompilerFailed", "raised-from-CppCompileError"],
)
def test_a_compiler_failure_falls_back_for_good_with_one_notice(make_error, capsys):
    wrapper, calls = _compiled_raising(make_error())
    capsys.readouterr()
    for _ in range(2):
        assert torch.equal(wrapper(torch.ones(2)), torch.full((2,), 2.0))
    assert wrapper.failed and calls == {"compiled": 1, "fallback": 2}
    lines = _notices(capsys, wrapper.op)
    assert len(lines) == 1 and "torch.compile failed" in lines[0], lines


def test_a_shape_bug_the_fallback_also_rejects_propagates_without_falling_back(capsys):
    from torch._dynamo.exc import TorchRuntimeError

    wrapper, calls = _compiled_raising(TorchRuntimeError("RuntimeError when making fake tensor call"))

    def eager_rejects(x):
        calls["fallback"] += 1
        raise RuntimeError("a and b must have same reduction dim")

    wrapper.fallback = eager_rejects
    with pytest.raises(RuntimeError, match="same reduction dim"):
        wrapper(torch.ones(2))
    assert not wrapper.failed and calls["fallback"] == 1
    assert _notices(capsys, wrapper.op) == []


def test_real_torch_compile_a_broken_backend_falls_back_a_shape_bug_propagates(capsys):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no C++ compiler (simulated)")

    def scale(x):
        return x * 2 + 1

    def matmul(a, b):
        return (a @ b).relu()

    broken = Compiled("test_backend_broken", scale)
    broken.compiled = lambda: torch.compile(scale, backend=broken_backend)
    assert torch.equal(broken(torch.ones(3)), torch.full((3,), 3.0))
    assert broken.failed and len(_notices(capsys, "test_backend_broken")) == 1

    # dynamo meets the bad shapes while tracing (TorchRuntimeError); eager rejects them too
    shapes = Compiled("test_backend_shapes", matmul)
    with pytest.raises(RuntimeError) as raised:
        shapes(torch.ones(2, 3), torch.ones(4, 5))
    assert not raised_by_compiler(raised.value) and not shapes.failed
    assert _notices(capsys, "test_backend_shapes") == []


def test_raised_by_compiler_walks_the_cause_chain_and_ignores_plain_errors():
    from torch._inductor.exc import InductorError

    assert raised_by_compiler(_wrapped_cpp_compile_error())
    assert raised_by_compiler(InductorError(RuntimeError("lowering"), None))
    assert not raised_by_compiler(torch.OutOfMemoryError("out of memory"))
    plain = RuntimeError("outer")
    plain.__cause__ = ValueError("inner")
    assert not raised_by_compiler(plain)
