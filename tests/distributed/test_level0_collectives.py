"""Level 0 on gloo: megatron-core's gathers and scatters in the shapes it calls them with.

gloo (torch's CPU backend) takes a single-tensor all-gather / reduce-scatter only in the
concatenated shape and a list all-gather only with equal shapes; NCCL takes any shapes whose sizes
add up, and megatron relies on that (``gather_split_1d_tensor``, uneven
``gather_from_sequence_parallel_region``). One world per size runs every check with level 0 on and
again with its wraps taken off.
"""

import pytest
import torch

from hyper_adaptor.patches.compat import gloo_collectives
from hyper_adaptor.testing import run_world

pytestmark = pytest.mark.distributed

TARGET = "tests.distributed.level0_collective_checks:megatron_collectives"

# Checks that fail without the level-0 wraps, and the start of the error gloo gives.
GLOO_REFUSES = {
    "gather_split_1d_megatron_test": "ProcessGroupGloo::allgather: invalid tensor size",
    "split_gather_1d_round_trip": "ProcessGroupGloo::allgather: invalid tensor size",
    "gather_first_dim_uneven": "ProcessGroupGloo::allgather: invalid tensor size",
    "sequence_parallel_gather_uneven_with_backward": "ProcessGroupGloo::allgather: invalid tensor size",
    "torch_forms_gloo_refused": "ProcessGroupGloo::allgather: invalid tensor size",
    "coalesced_flat_output": "ProcessGroupGloo::allgather_coalesced: invalid size",
    "uneven_all_gather_async": "ProcessGroupGloo::allgather: invalid tensor size",
}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def world(request):
    return request.param, run_world(request.param, TARGET, timeout=300)


def test_every_check_passes_with_level0(world):
    size, ranks = world
    for rank, result in enumerate(ranks):
        for layout, runs in result.items():
            failed = {name: outcome for name, outcome in runs["fixed"].items() if outcome is not True}
            assert not failed, f"world of {size}, rank {rank}, {layout}: {failed}"


def test_the_checks_fail_without_the_wraps(world):
    size, ranks = world
    for rank, result in enumerate(ranks):
        for layout, runs in result.items():
            unfixed = runs["unfixed"]
            for name, message in GLOO_REFUSES.items():
                assert isinstance(unfixed[name], str) and message in unfixed[name], (size, rank, layout, name,
                                                                                       unfixed[name])
            # what gloo already took stays as it was
            for name in set(unfixed) - set(GLOO_REFUSES):
                assert unfixed[name] is True, (size, rank, layout, name, unfixed[name])


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "work"


@pytest.mark.parametrize("backend", ["nccl", "hccl", "cpu:gloo,cuda:nccl"])
def test_other_backends_and_device_tensors_get_the_call_unchanged(monkeypatch, backend):
    """Away from gloo on the host, the wraps hand on exactly what they were given."""
    monkeypatch.setattr(gloo_collectives.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(gloo_collectives.dist, "get_world_size", lambda group=None: 2)
    output, inp = torch.empty(16), torch.ones(2, 4)
    recorder = _Recorder()
    gather = gloo_collectives._flat_on_gloo(True)(_signature_of_all_gather_into_tensor(recorder))
    assert gather(output, inp, group=None, async_op=True) == "work"
    args, kwargs = recorder.calls[-1]
    if "gloo" in backend:  # the host's tensors on a device-mapped group do go to gloo
        assert args[0].shape == (16,) and args[1].shape == (8,)
        assert args[0].data_ptr() == output.data_ptr() and args[1].data_ptr() == inp.data_ptr()
    else:
        assert args[0] is output and args[1] is inp and kwargs == {"group": None, "async_op": True}


def test_shapes_gloo_takes_are_handed_on_as_given(monkeypatch):
    monkeypatch.setattr(gloo_collectives.dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(gloo_collectives.dist, "get_world_size", lambda group=None: 2)
    recorder = _Recorder()
    gather = gloo_collectives._flat_on_gloo(True)(_signature_of_all_gather_into_tensor(recorder))
    output, inp = torch.empty(4, 3), torch.ones(2, 3)
    gather(output, inp)
    assert recorder.calls[-1][0][0] is output and recorder.calls[-1][0][1] is inp
    # sizes that do not add up reach torch as given, so its own error names the caller's shapes
    wrong = torch.empty(7)
    gather(wrong, inp)
    assert recorder.calls[-1][0][0] is wrong


def test_one_handle_waits_for_every_part_once():
    class Work:
        def __init__(self):
            self.waits = 0

        def wait(self, timeout=None):
            self.waits += 1
            return True

        def is_completed(self):
            return self.waits > 0

    works = [Work(), Work()]
    destination, stand_in = torch.zeros(3), torch.arange(3.0)
    handle = gloo_collectives.AllWorks(works, [(destination, stand_in)])
    assert not handle.is_completed()
    assert handle.wait() and handle.wait()
    assert [w.waits for w in works] == [1, 1] and torch.equal(destination, stand_in) and handle.is_completed()


def _signature_of_all_gather_into_tensor(recorder):
    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        return recorder(output_tensor, input_tensor, group=group, async_op=async_op)

    return all_gather_into_tensor
