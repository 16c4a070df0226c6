import pytest

from tests.unit.ops._world import open_world_of_one


@pytest.fixture(scope="module")
def world_of_one():
    """A one-process gloo group for the tests of a module (left alone when one exists already)."""
    import torch.distributed as dist

    own = open_world_of_one()
    yield
    if own:
        dist.destroy_process_group()
