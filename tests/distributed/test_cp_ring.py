"""Ring attention (hyper_adaptor.parallel.context._ring) on 2 and 4 gloo ranks against one process.

One spawned world per size runs every check (``tests/distributed/cp_checks.py``, tolerances there):
causal load-balanced, causal contiguous and non-causal layouts x MHA and GQA x fp32 and bf16 x the fast
and eager block kernels, on the whole world; then strided 2-rank sub-rings (4 ranks only) and rings of
one; the block and byte counters; an odd local sequence refused.
"""

import pytest

from hyper_adaptor.testing import run_world
from tests.distributed.cp_checks import BACKENDS, BATCH, CHUNK, DTYPES, HEAD_DIM, KV_HEADS, LAYOUTS

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def world(request):
    n = request.param
    return n, run_world(n, "tests.distributed.cp_checks:ring_checks", timeout=60 * n)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", KV_HEADS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_single_process(world, layout, heads, dtype, backend):
    _, results = world
    for rank, result in enumerate(results):
        assert result["parity"][f"{layout}-{heads}-{dtype}-{backend}"] == [], f"rank {rank}"


@pytest.mark.parametrize("kind", ["pair", "single"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sub_rings_match_single_process(world, kind, layout):
    n, results = world
    if kind == "pair" and n != 4:
        pytest.skip("strided pairs need 4 ranks")
    for rank, result in enumerate(results):
        assert result["parity"][f"{kind}-{layout}"] == [], f"rank {rank}"


def _expected_blocks(layout, n, r):
    """(full, causal, skipped) blocks of position r of n in the forward."""
    if layout == "causal-lb":  # own block causal; every other step one half-sized block, the other half skipped
        return n - 1, 1, n - 1
    if layout == "causal-contig":  # earlier ranks full, later ranks skipped whole
        return r, 1, n - 1 - r
    return n, 0, 0


def _kv_bytes(ng, element_size):
    s_local = 2 * CHUNK  # 2N chunks of CHUNK over N ranks, whichever layout
    return s_local * BATCH * ng * HEAD_DIM * element_size


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", KV_HEADS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_counters(world, layout, heads, dtype):
    n, results = world
    element_size = 4 if dtype == "fp32" else 2
    k_bytes = _kv_bytes(KV_HEADS[heads], element_size)
    k_grad_bytes = _kv_bytes(KV_HEADS[heads], 4)  # dK/dV travel as fp32 accumulators
    forward_bytes = (n - 1) * 2 * k_bytes  # K and V, N-1 hops
    backward_bytes = (n - 1) * 2 * k_bytes + n * 2 * k_grad_bytes  # dK/dV take one more hop home
    for rank, result in enumerate(results):
        for backend in BACKENDS:
            stats = result["stats"][f"{layout}-{heads}-{dtype}-{backend}"]
            full, causal, skipped = _expected_blocks(layout, n, rank)
            want = dict(blocks_full=full, blocks_causal=causal, blocks_skipped=skipped)
            assert stats["forward"] == dict(want, bytes_sent=forward_bytes), f"rank {rank} {backend}"
            assert stats["total"] == dict(want, bytes_sent=forward_bytes + backward_bytes), f"rank {rank} {backend}"


def test_load_balanced_ranks_do_equal_work(world):
    n, results = world
    work = {tuple(sorted(r["stats"]["causal-lb-mha-fp32-fast"]["forward"].items())) for r in results}
    assert len(work) == 1
    if n == 4:
        assert results[0]["stats"]["causal-lb-mha-fp32-fast"]["forward"]["blocks_full"] == 3


def test_ring_of_one_sends_nothing(world):
    _, results = world
    for result in results:
        for layout in LAYOUTS:
            stats = result["stats"][f"single-{layout}"]["total"]
            assert stats["bytes_sent"] == 0
            assert (stats["blocks_causal"], stats["blocks_full"]) == ((1, 0) if layout != "noncausal" else (0, 1))


def test_odd_local_sequence_is_refused(world):
    _, results = world
    for result in results:
        assert "load_balanced needs an even local sequence" in result["odd_refused"]
        assert "s_local=5" in result["odd_refused"]
