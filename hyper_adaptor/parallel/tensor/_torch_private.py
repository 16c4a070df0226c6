"""torch's DTensor RNG tracker, ``torch.distributed.tensor._random``: not a public API, and it has changed
shape between releases, so every use goes through the two functions below. It is listed with the
package's other private torch APIs, and the releases they were checked on, in
hyper_adaptor/platform/torch_private.py.
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
