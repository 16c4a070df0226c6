"""Level 0 in real gloo worlds: TP RNG semantics, and the PP=2 interleaved-schedule trap."""

import pytest

from hyper_adaptor.testing import WorldError, run_world
from tests.distributed.gpt_parity import Layout

pytestmark = pytest.mark.distributed


def test_tp_rng_tracker_forks_on_the_emulated_device():
    result = run_world(2, "tests.distributed.rng_checks:tracker_semantics", timeout=300)[0]
    # Megatron's expectations: dropout inside the model-parallel fork differs across TP ranks
    # (each rank holds a different slice), outside it is the same, and the fork restores the stream.
    assert result["patched"] == {
        "inside_differs_across_tp": True,
        "outside_same_across_tp": True,
        "default_stream_restored": True,
    }
    # Without level 0's RNG fix, megatron's state changes are queued and never applied: seeding the
    # tracker leaves the default stream on the TP-specific seed and the fork neither switches nor
    # restores anything, so the default stream no longer agrees across TP ranks.
    assert result["unpatched"]["outside_same_across_tp"] is False, result["unpatched"]


def test_pp2_interleaved_with_batched_p2p_is_refused():
    layout = Layout(pp=2, vpp=2, batch_p2p_comm=True, steps=1)
    with pytest.raises(WorldError, match="pipeline parallel size 2 and batch_p2p_comm=True"):
        run_world(2, "tests.distributed.gpt_parity:train", timeout=300, layout=layout)
