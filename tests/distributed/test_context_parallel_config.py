"""Context parallel for megatron-core library users: a ``TransformerConfig(context_parallel_size=N,
cp_comm_type=...)`` built without megatron.training's flags, on megatron's local spec.

One 2-rank world (``cp_config_checks.config_checks``, which documents the model and the tolerance: 1e-5
fp32 on outputs, input gradients and parameter gradients): at ``HYPER_ADAPTOR_OPTIMIZATION_LEVEL=2`` a
CP 2 block on its ranks' sequence chunks equals the CP 1 block on the whole
sequence, for every cp_comm_type megatron names, a list per layer, and process groups handed to the block
(megatron's TestMixedProcessGroups way); at levels 0 and 1 megatron's assertion stands and says how to get
CP served; a cp_comm_type with no implementation, or the hybrid algorithm without hierarchical groups, is a
clear error. Attention dropout: every algorithm with dropout equals a dense reference with the same
global-position masks (outputs and gradients), eval mode drops nothing, training draws a fresh mask per
forward from megatron's RNG tracker (``cp_config_checks.dropout_checks``). That the comparison can fail
is shown by ``tests/distributed/cp_checks.py``'s tolerance and the
per-layer check of which algorithm ran; without the level-0 wrap every layout fails with megatron's assertion.
"""

import pytest

from hyper_adaptor import features
from hyper_adaptor.patches.context import library
from hyper_adaptor.testing import run_world
from tests.distributed.cp_config_checks import DROPOUT_ALGOS, LAYOUTS

pytestmark = pytest.mark.distributed
SERVED = [name for name in LAYOUTS if name != "a2a+p2p-no-groups"]


@pytest.fixture(scope="module")
def ranks():
    return run_world(2, "tests.distributed.cp_config_checks:config_checks", timeout=240)


def test_the_wrap_serves_from_the_features_level():
    assert library.LEVEL == features.get("context_parallel").level


@pytest.mark.parametrize("name", SERVED)
def test_cp_config_block_matches_cp1_block(ranks, name):
    for rank, result in enumerate(ranks):
        assert name not in result["errors"], (rank, result["errors"].get(name))
        assert result["parity"][name] == [], (rank, result["parity"][name])
        # hyper_adaptor's engine ran each layer, with the layer's own cp_comm_type, on the groups megatron would
        # use (the block's pg_collection, else parallel_state)
        assert result["algos"][name] == LAYOUTS[name][1], rank
        assert result["intended_group"][name], rank


@pytest.mark.parametrize("level", ["0", "1"])
def test_below_level_2_megatrons_assertion_says_how_to_get_cp(ranks, level):
    message = ranks[0]["errors"][f"level {level}"]
    assert message.startswith("AssertionError: Context parallelism is only supported by TEDotProductAttention!")
    assert "HYPER_ADAPTOR_OPTIMIZATION_LEVEL=2" in message and f"the level is {level}" in message
    assert "context_parallel_size=2" in message


def test_an_unimplemented_cp_comm_type_is_a_clear_error(ranks):
    message = ranks[0]["errors"]["unimplemented"]
    assert message.startswith("ContextParallelUnsupported: cp_comm_type 'a2a+a2a'"), message
    assert "p2p, a2a, a2a+p2p, allgather" in message


def test_hybrid_without_hierarchical_groups_is_a_clear_error(ranks):
    message = ranks[0]["errors"]["a2a+p2p-no-groups"]
    assert message.startswith("ContextParallelUnsupported: the hybrid context-parallel algorithm"), message
    assert "hierarchical_context_parallel_sizes" in message


DROPOUT_CHECKS = [f"{name} causal={causal} load_balanced={lb}" for name in DROPOUT_ALGOS for causal in (True, False)
                  for lb in (True, False)] + [
    "another seed differs", "fresh seed per call", "style train", "style eval", "style dropout_p=1 refused",
    "p2p eval = CP 1 without dropout", "p2p training drops, seeded by the RNG tracker",
    "a2a eval = CP 1 without dropout", "a2a training drops, seeded by the RNG tracker"]


@pytest.mark.parametrize("check", DROPOUT_CHECKS)
def test_attention_dropout_under_cp(ranks, check):
    for rank, result in enumerate(ranks):
        assert result["dropout"][check] == [], (rank, result["dropout"][check])
