"""Bad arguments to the context-parallel library (ContextParallel, build_cp_groups, the engines), in one
process: each raises ValueError naming the argument, what it must be and the value, before any
communication. The same checks that need a real mesh or group run in tests/distributed/test_context_parallel.py."""

from types import SimpleNamespace

import pytest
import torch

from hyper_adaptor.parallel.context import ContextParallel, build_cp_groups, context_parallel_attention
from hyper_adaptor.parallel.context._ulysses import ulysses_attention


@pytest.mark.parametrize("kwargs, words", [
    ({"seq_dim": 3}, ["seq_dim", "dimension 0, 1 or 2", "got 3"]),
    ({"seq_dim": "1"}, ["seq_dim", "'1'"]),
    ({"head_dim": -1}, ["head_dim", "got -1"]),
    ({"seq_dim": 2, "head_dim": -2}, ["head_dim must differ from seq_dim", "-2"]),
    ({"ulysses_degree": 0}, ["ulysses_degree", "positive int", "got 0"]),
    ({"ulysses_degree": 2.0}, ["ulysses_degree", "got 2.0"]),
    ({"ulysses_degree": True}, ["ulysses_degree", "got True"]),
    ({"load_balance": 1}, ["load_balance", "bool", "got 1"]),
    ({"causal": None}, ["causal", "bool", "got None"]),
    ({"algo": "p2p"}, ["algo", "'ulysses', 'ring', 'allgather', 'hybrid'", "'p2p'"]),
    ({"algo": "ring", "ulysses_degree": 2}, ["ulysses_degree", "None or 1", "algo='ring'", "got 2"]),
    ({"algo": "allgather", "ulysses_degree": 4}, ["ulysses_degree", "algo='allgather'", "got 4"]),
    ({"algo": "hybrid"}, ["ulysses_degree must be given", "algo='hybrid'", "got None"]),
    ({"scale": 0.0}, ["scale", "positive number", "got 0.0"]),
    ({"backend": "cuda"}, ["backend", "'npu', 'fast', 'eager'", "'cuda'"]),
])
def test_context_parallel_style_refuses(kwargs, words):
    with pytest.raises(ValueError) as error:
        ContextParallel(**kwargs)
    for word in words:
        assert word in str(error.value), (word, str(error.value))


def test_context_parallel_style_accepts_the_documented_forms():
    for kwargs in ({}, {"seq_dim": 2, "head_dim": 1}, {"seq_dim": 0, "head_dim": 2}, {"ulysses_degree": 1},
                   {"ulysses_degree": 2, "load_balance": True}, {"algo": "ring"},
                   {"algo": "hybrid", "ulysses_degree": 2},
                   {"seq_dim": -3, "head_dim": -2, "causal": False, "scale": 0.5, "backend": "eager"}):
        ContextParallel(**kwargs)
    style = ContextParallel(seq_dim=-2, head_dim=-3)
    assert (style.seq_dim, style.head_dim, style.batch_dim) == (2, 1, 0)


def _mesh(ranks, ndim=1):  # what ContextParallel reads from a DeviceMesh before any communication
    return SimpleNamespace(ndim=ndim, mesh=torch.tensor(ranks))


@pytest.mark.parametrize("kwargs, mesh, words", [
    ({"ulysses_degree": 3}, _mesh([0, 1, 2, 3]), ["ulysses_degree", "divide", "size 4", "got 3"]),
    ({"ulysses_degree": 8}, _mesh([0, 1, 2, 3]), ["ulysses_degree", "got 8"]),
    ({"ulysses_degree": 2, "algo": "ulysses"}, _mesh([0, 1, 2, 3]), ["ulysses_degree", "mesh size 4", "got 2"]),
    ({"ulysses_degree": 4, "algo": "hybrid"}, _mesh([0, 1, 2, 3]), ["ulysses_degree", "strictly between", "got 4"]),
    ({"ulysses_degree": 1, "algo": "hybrid"}, _mesh([0, 1, 2, 3]), ["ulysses_degree", "got 1"]),
    ({}, _mesh([[0, 1], [2, 3]], ndim=2), ["device_mesh must be 1-D", "2-D"]),
    ({}, _mesh([1, 0]), ["device_mesh", "ascending", "[1, 0]"]),
])
def test_context_parallel_style_refuses_a_mesh(kwargs, mesh, words):
    with pytest.raises(ValueError) as error:
        ContextParallel(**kwargs)._apply(torch.nn.Identity(), mesh)
    for word in words:
        assert word in str(error.value), (word, str(error.value))


@pytest.mark.parametrize("lists, degree, words", [
    ([], None, ["cp_rank_lists", "non-empty", "[]"]),
    ([[0, 1], []], None, ["cp_rank_lists", "non-empty lists of global ranks", "[]"]),
    ([[0, -1]], None, ["cp_rank_lists", "[0, -1]"]),
    ([[1, 0]], None, ["ascending", "[1, 0]"]),
    ([[0, 0]], None, ["without repeats", "[0, 0]"]),
    ([[0, 1], [2]], None, ["same size", "[1, 2]"]),
    ([[0, 1], [1, 2]], None, ["a rank appears in two CP groups"]),
    ([[0, 1, 2, 3]], 3, ["ulysses_degree", "divide", "size 4", "got 3"]),
    ([[0, 1, 2, 3]], 0, ["ulysses_degree", "positive int", "got 0"]),
])
def test_build_cp_groups_refuses(lists, degree, words):
    with pytest.raises(ValueError) as error:
        build_cp_groups(lists, ulysses_degree=degree)
    for word in words:
        assert word in str(error.value), (word, str(error.value))


class _Group:  # the size and position the engines read before communicating
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


def _groups(size):
    return SimpleNamespace(cp=_Group(size), ulysses=None, ring=None, ulysses_degree=size)


def test_engine_refuses_bad_inputs():
    q, kv = torch.randn(6, 2, 4, 8), torch.randn(6, 2, 2, 8)
    cases = [
        (lambda: context_parallel_attention(q, kv, kv, groups=_groups(2), algo="a2a"), ["algo", "'a2a'"]),
        (lambda: context_parallel_attention(q[:5], kv[:5], kv[:5], groups=_groups(2), algo="ring"),
         ["load_balanced", "even", "s_local=5"]),
        (lambda: context_parallel_attention(q, kv[:4], kv[:4], groups=_groups(2), algo="ring"),
         ["do not fit", "(4, 2, 2, 8)"]),
        (lambda: context_parallel_attention(q, torch.randn(6, 2, 3, 8), torch.randn(6, 2, 3, 8),
                                            groups=_groups(2), algo="ring"), ["query heads a multiple"]),
        (lambda: context_parallel_attention(q[0], kv, kv, groups=_groups(2), algo="ring"), ["expected q"]),
        (lambda: ulysses_attention(q[:, :, :3], kv[:, :, :1], kv[:, :, :1], group=_Group(2), causal=True,
                                   load_balanced=True), ["query heads (3)", "Ulysses degree (2)"]),
        (lambda: ulysses_attention(q, kv, kv, group=_Group(8), causal=True, load_balanced=True),
         ["query heads (4)", "Ulysses degree (8)"]),
    ]
    for call, words in cases:
        with pytest.raises(ValueError) as error:
            call()
        for word in words:
            assert word in str(error.value), (word, str(error.value))


def test_one_rank_is_plain_attention_for_every_algorithm():
    from hyper_adaptor.ops.attention import attention

    q, kv = torch.randn(6, 2, 4, 8), torch.randn(6, 2, 2, 8)
    want = attention(q, kv, kv, causal=True).unflatten(2, (4, 8))
    for algo in ("ulysses", "ring", "allgather", "hybrid"):
        got = context_parallel_attention(q, kv, kv, groups=_groups(1), algo=algo)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_context_parallel_is_reexported_lazily_from_the_parallel_package():
    import hyper_adaptor.parallel as parallel
    from hyper_adaptor.parallel.context import ContextParallel as engine_style

    assert parallel.ContextParallel is engine_style and "ContextParallel" in parallel.__all__
    with pytest.raises(AttributeError):
        parallel.no_such_engine  # noqa: B018
