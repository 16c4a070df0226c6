import pytest

from tests.unit.ops._world import open_world_of_one


@pytest.fixture(scope="module")
def megatron_state():
    """One-process gloo group and megatron's model-parallel state (tp = 1), with its RNG tracker."""
    import torch.distributed as dist

    from megatron.core import parallel_state, tensor_parallel

    own = open_world_of_one()
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    if own:
        dist.destroy_process_group()
