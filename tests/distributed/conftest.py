import pytest

from hyper_adaptor.testing import run_world


@pytest.fixture(scope="session")
def moe_reference():
    """The single-process MoE layer (moe_dispatcher_checks.reference, 4 chunks) of every variant that
    test_expert_parallel_megatron.py and test_moe_dispatchers.py compare with, in one world of one: the
    second file's variants are among the first's."""
    from tests.distributed.test_expert_parallel_megatron import VARIANTS

    return run_world(1, "tests.distributed.moe_dispatcher_checks:reference", timeout=400, chunks=4,
                     variants=VARIANTS)[0]
