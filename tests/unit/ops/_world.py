"""A one-process gloo group for op tests that build megatron modules."""

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
