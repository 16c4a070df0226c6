"""The one place this package touches private torch.distributed.tensor APIs.

Pinned to torch 2.13: ``torch.distributed.tensor._random`` (the DTensor RNG tracker) is not a public
API and has changed shape between releases, so every use goes through the two functions below and a
torch upgrade has one file to re-check.
"""

from __future__ import annotations

import warnings

from torch.distributed.device_mesh import DeviceMesh


def rng_tracker_supported(mesh: DeviceMesh) -> bool:
    """Whether torch's DTensor RNG tracker works on ``mesh``'s device (cuda-like devices only: the
    CPU generator has no offset-based state the tracker can advance)."""
    from torch.distributed.tensor import _random

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns on every unsupported query
        return bool(_random.is_rng_supported_mesh(mesh))


def seed_rng_tracker(seed: int, mesh: DeviceMesh) -> bool:
    """Seed torch's DTensor RNG tracker on ``mesh``; False (and nothing done) where unsupported."""
    if not rng_tracker_supported(mesh):
        return False
    from torch.distributed.tensor import _random

    _random.manual_seed(seed, mesh)
    return True
