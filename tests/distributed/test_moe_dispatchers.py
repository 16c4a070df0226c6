"""Level 0: megatron-core's own MoE token dispatchers on gloo against one process.

megatron's ``MoELayer`` (4 experts, top-2, aux-loss router; tests/distributed/moe_dispatcher_checks.py)
with the ``alltoall`` and ``allgather`` dispatchers at EP 2 (2 ranks), EP 4 and EP 2 x TP 2 with
sequence parallel and expert tensor parallel 1 and 2 (4 ranks), with token dropping and capacity
padding, with a shared expert, sigmoid scores, the expert bias and the per-sequence aux loss, and with
``--moe-grouped-gemm`` at level 0 (the flag switched off, megatron's experts) and at level 1
(hyper_adaptor's grouped GEMM): the loss, every rank's output and input gradient, the router's and
each expert's weight gradient equal the single-process layer's (EP 1, TP 1, the same weights, one call
per data-parallel chunk) within 1e-5 (fp32; only the order of sums differs). Without level 0's
``all_to_all_single`` wrap the all-to-all dispatcher dies in its first forward.
"""

from __future__ import annotations

import pytest
import torch

from hyper_adaptor.testing import run_world
from tests.distributed.moe_dispatcher_checks import FFN

pytestmark = pytest.mark.distributed

TARGET = "tests.distributed.moe_dispatcher_checks"
RTOL = ATOL = 1e-5
REFUSED = "all_to_all_single(): incompatible function arguments"

# Extra TransformerConfig settings a run may name (as "variant"); the reference runs each.
VARIANTS = {
    "base": {},
    # token dropping: capacity from each rank's own tokens, padded to it (the dispatcher's
    # count-exchange path with a static output size)
    "capacity": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
    # a shared expert beside the routed ones, sigmoid scores with the aux-loss-free expert bias, and
    # the per-sequence aux loss
    "shared-sigmoid-seq-aux": dict(moe_shared_expert_intermediate_size=FFN, moe_router_score_function="sigmoid",
                                   moe_router_enable_expert_bias=True, moe_router_load_balancing_type="seq_aux_loss"),
}

# Level-0 runs first, level-1 runs last: applied features stay applied in the worker processes.
WORLD2 = {
    "ep2-alltoall": dict(ep=2),
    "ep2-allgather": dict(ep=2, dispatcher="allgather"),
    "ep2-alltoall-capacity": dict(ep=2, variant="capacity"),
    "ep2-alltoall-shared-sigmoid-seq-aux": dict(ep=2, variant="shared-sigmoid-seq-aux"),
    "ep2-allgather-shared-sigmoid-seq-aux": dict(ep=2, dispatcher="allgather", variant="shared-sigmoid-seq-aux"),
    "ep2-alltoall-grouped-flag-level0": dict(ep=2, grouped=True, level=0),
    "ep2-alltoall-without-the-wrap": dict(ep=2, unfixed=True),
    "ep2-alltoall-grouped-level1": dict(ep=2, grouped=True, level=1),
    "ep2-allgather-grouped-level1": dict(ep=2, dispatcher="allgather", grouped=True, level=1),
}
WORLD4 = {
    "ep4-alltoall": dict(ep=4),
    "ep4-allgather": dict(ep=4, dispatcher="allgather"),
    "ep4-alltoall-capacity": dict(ep=4, variant="capacity"),
    "ep2-tp2-etp2-alltoall": dict(ep=2, tp=2, etp=2),
    "ep2-tp2-etp1-alltoall": dict(ep=2, tp=2, etp=1),
    "ep2-tp2-etp2-allgather": dict(ep=2, tp=2, etp=2, dispatcher="allgather"),
    "ep2-tp2-etp1-alltoall-shared-sigmoid-seq-aux": dict(ep=2, tp=2, etp=1, variant="shared-sigmoid-seq-aux"),
    "ep2-tp2-etp2-alltoall-grouped-level1": dict(ep=2, tp=2, etp=2, grouped=True, level=1),
}
GROUPED = {name for name, run in {**WORLD2, **WORLD4}.items() if run.get("level") == 1}


@pytest.fixture(scope="module")
def reference(moe_reference):
    # tests/distributed/conftest.py: computed once with test_expert_parallel_megatron.py's variants
    from tests.distributed.test_expert_parallel_megatron import VARIANTS as COMPUTED

    assert all(COMPUTED[name] == extra for name, extra in VARIANTS.items())
    return {name: moe_reference[name] for name in VARIANTS}


def _sent(runs: dict) -> dict:
    """The runs as the ranks take them: a variant's config as ``extra``."""
    return {name: {**{k: v for k, v in run.items() if k != "variant"}, "extra": VARIANTS[run.get("variant", "base")]}
            for name, run in runs.items()}


def world_fixture(size: int, target: str, runs: dict, timeout: float):
    """The fixture ``world<size>``: ``runs`` in one spawned world of ``size`` ranks, once per module;
    every rank's results."""

    @pytest.fixture(scope="module", name=f"world{size}")
    def world():
        return run_world(size, target, timeout=timeout, runs=runs)

    return world


world2 = world_fixture(2, f"{TARGET}:layouts", _sent(WORLD2), timeout=300)
world4 = world_fixture(4, f"{TARGET}:layouts", _sent(WORLD4), timeout=400)


def _totals(reference: list, chunks: int) -> dict:
    used = reference[:chunks]
    grads = {key: sum(c["grads"][key] for c in used) for key in used[0]["grads"]}
    return {"loss": sum(c["loss"] for c in used), "router_grad": sum(c["router_grad"] for c in used),
            "grads": grads}


def mismatch(what: str, value: torch.Tensor, want: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> list[str]:
    """How ``value`` differs from ``want`` (shape, or values beyond the tolerance): [] where it does not."""
    if value.shape != want.shape:
        return [f"{what}: shape {tuple(value.shape)} vs {tuple(want.shape)}"]
    if not torch.allclose(value, want, rtol=rtol, atol=atol):
        return [f"{what}: max abs difference {(value - want).abs().max().item():.3g}"]
    return []


def compare(got: dict, reference: list, chunks: int) -> list[str]:
    """Where one rank's result differs from the single process's (``chunks``: the data-parallel
    size of the layout, i.e. how many reference chunks its world covers)."""
    bad = []

    def check(what, value, want):
        bad.extend(mismatch(what, value, want))

    if len(got["grads"]) != 2 * len(got["experts_here"]):
        bad.append(f"{len(got['grads'])} expert gradients for experts {got['experts_here']}")
    total, mine = _totals(reference, chunks), reference[got["chunk"]]
    tp, tp_rank = got["tp"], got["tp_rank"]
    check("loss", got["loss"], total["loss"])
    check("output", got["out"], mine["out"].chunk(tp, 0)[tp_rank])
    check("input gradient", got["x_grad"], mine["x_grad"].chunk(tp, 0)[tp_rank])
    check("router gradient", got["router_grad"], total["router_grad"])
    for (expert, name), grad in got["grads"].items():
        dim = 0 if name == "linear_fc1" else 1  # fc1 column-parallel, fc2 row-parallel over ETP
        want = total["grads"][(expert, name)].chunk(got["etp"], dim)[got["etp_rank"]]
        check(f"expert {expert} {name} gradient", grad, want)
    return bad


def _chunks(world: int, run: dict) -> int:
    return world // run.get("tp", 1)


@pytest.mark.parametrize("name", [n for n, r in WORLD2.items() if not r.get("unfixed")])
def test_two_ranks_match_one_process(world2, reference, name):
    for rank, results in enumerate(world2):
        got = results[name]
        assert not isinstance(got, str), f"rank {rank}: {got[:400]}"
        assert compare(got, reference[WORLD2[name].get("variant", "base")], _chunks(2, WORLD2[name])) == [], (
            rank, name)
        assert got["experts"] == "SequentialMLP"
        assert (got["grouped_gemm_calls"] > 0) == (name in GROUPED), (rank, name, got["grouped_gemm_calls"])


@pytest.mark.parametrize("name", list(WORLD4))
def test_four_ranks_match_one_process(world4, reference, name):
    for rank, results in enumerate(world4):
        got = results[name]
        assert not isinstance(got, str), f"rank {rank}: {got[:400]}"
        assert compare(got, reference[WORLD4[name].get("variant", "base")], _chunks(4, WORLD4[name])) == [], (
            rank, name)
        # one local expert at EP 4: nothing to group, megatron's forward runs
        grouped = name in GROUPED and WORLD4[name]["ep"] < 4
        assert (got["grouped_gemm_calls"] > 0) == grouped, (rank, name, got["grouped_gemm_calls"])


def test_without_the_wrap_the_alltoall_dispatcher_dies_in_its_first_forward(world2):
    for rank, results in enumerate(world2):
        got = results["ep2-alltoall-without-the-wrap"]
        assert isinstance(got, str) and got.startswith("TypeError") and REFUSED in got, (rank, got)


def test_the_comparison_sees_one_wrong_expert_gradient(world2, reference):
    got = dict(world2[0]["ep2-alltoall"])
    key = next(iter(got["grads"]))
    got["grads"] = {**got["grads"], key: got["grads"][key] * 1.001}
    assert [m for m in compare(got, reference["base"], 2) if "gradient" in m]


@pytest.mark.parametrize("backend", ["gloo", "nccl", "hccl"])
def test_tensor_split_sizes_become_ints_on_every_backend(monkeypatch, backend):
    """The wrap alone: tensor split sizes go on as lists of ints whatever the group's backend (torch's
    binding refuses a tensor on each); split sizes given as lists or numpy arrays, and calls without
    split sizes, are handed on exactly as made."""
    import numpy as np

    from hyper_adaptor.patches.compat import gloo_collectives

    monkeypatch.setattr(gloo_collectives.dist, "get_backend", lambda group=None: backend)
    calls = []

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        calls.append((output_split_sizes, input_split_sizes, group, async_op))
        return "work"

    wrapped = gloo_collectives._split_sizes_as_ints(all_to_all_single)
    out, inp = torch.empty(5, 3), torch.ones(4, 3)
    received, sent = torch.tensor([2, 3]), torch.tensor([1, 3])
    assert wrapped(out, inp, received, input_split_sizes=sent, group="g", async_op=True) == "work"
    assert calls[-1] == ([2, 3], [1, 3], "g", True)
    assert all(type(n) is int for n in calls[-1][0] + calls[-1][1])
    for given in ([2, 3], np.array([2, 3]), None):
        wrapped(out, inp, given, given)
        assert calls[-1][0] is given and calls[-1][1] is given


@pytest.mark.parametrize("device", ["cpu", "npu", "cuda"])
def test_the_split_size_wrap_is_installed_on_every_device_but_cuda(monkeypatch, device):
    """megatron converts the split sizes itself only for CUDA tensors (``is_cuda``); an NPU tensor
    answers False, so level 0 wraps ``all_to_all_single`` there as on the host."""
    import hyper_adaptor.megatron_adaptor  # noqa: F401  (megatron importable: the patches resolve in it)
    from hyper_adaptor import platform
    from hyper_adaptor.features.compat import Compat

    monkeypatch.setattr(platform, "device_type", lambda: device)
    targets = [p.target for p in Compat().patches(None)]
    assert (targets.count("torch.distributed.all_to_all_single") == 1) == (device != "cuda"), targets
