import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # These tests use tiny tensors: on a shared 2-core machine a second intra-op thread only adds waits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
