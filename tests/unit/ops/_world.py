"""A one-process gloo group for op tests that build megatron modules."""

import contextlib
import socket

import torch.distributed as dist


def open_world_of_one() -> bool:
    """Initialise a gloo group of one on a free port unless one exists; True when created here."""
    if dist.is_initialized():
        return False
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return True


@contextlib.contextmanager
def megatron_world_of_one():
    """A gloo group of one and megatron's model-parallel state at TP 1 x PP 1, each created unless it exists
    and then torn down again."""
    from megatron.core import parallel_state as ps

    created = open_world_of_one()
    owned = not ps.model_parallel_is_initialized()
    if owned:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        yield
    finally:
        if owned:
            ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
