"""Device meshes: torch's ``DeviceMesh`` plus the "current mesh" and axis-size query HyperParallel has.

``get_device_num_along_axis`` is a function rather than a method: torch builds sub-meshes
(``mesh["tp"]``, flattening) as plain ``DeviceMesh`` objects, so a method added by subclassing would
vanish on every slice, and patching torch's class would change it for every user of torch.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as _torch_init_device_mesh

_current: list[DeviceMesh] = []


def _remember(mesh: DeviceMesh) -> DeviceMesh:
    _current[:] = [mesh]
    return mesh


def init_device_mesh(device_type: str | None = None, mesh_shape=None, mesh_dim_names=None) -> DeviceMesh:
    """torch's ``init_device_mesh`` over the whole world; ``device_type`` defaults to this process's
    device (hyper_adaptor.platform). The mesh becomes the one ``get_current_mesh()`` returns."""
    if mesh_shape is None:
        raise ValueError("init_device_mesh: mesh_shape is required, e.g. (2, 2)")
    if device_type is None:
        from hyper_adaptor.platform import device_type as _device_type

        device_type = _device_type()
    mesh_shape = tuple(int(s) for s in mesh_shape)
    names = None if mesh_dim_names is None else tuple(mesh_dim_names)
    check_mesh_args(mesh_shape, names)
    _check_world(mesh_shape, names)
    return _remember(_torch_init_device_mesh(device_type, mesh_shape, mesh_dim_names=names))


def check_mesh_args(mesh_shape: tuple, names: tuple | None) -> None:
    if any(s < 1 for s in mesh_shape):
        raise ValueError(f"mesh_shape {mesh_shape}: every axis size must be >= 1")
    if names is None:
        return
    if len(names) != len(mesh_shape):
        raise ValueError(f"mesh_dim_names {names} has {len(names)} names but mesh_shape {mesh_shape} has "
                         f"{len(mesh_shape)} axes")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names {names}: axis names must be unique")


def _check_world(mesh_shape: tuple, names: tuple | None) -> None:
    import math

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if math.prod(mesh_shape) != world:
            raise ValueError(f"mesh_shape {mesh_shape} (axes {names}) holds {math.prod(mesh_shape)} devices but "
                             f"the world has {world} ranks")


def get_current_mesh() -> DeviceMesh:
    """The last mesh made by ``init_device_mesh`` or a ``Layout`` of this package."""
    if not _current:
        raise RuntimeError("get_current_mesh: no device mesh yet; call init_device_mesh(...) or use a Layout")
    return _current[0]


def get_device_num_along_axis(mesh: DeviceMesh, name: str) -> int:
    """Number of devices along the mesh axis called ``name``."""
    names = mesh.mesh_dim_names or ()
    if name not in names:
        raise ValueError(f"axis {name!r} is not in the mesh's axes {tuple(names)}")
    return mesh.size(names.index(name))
