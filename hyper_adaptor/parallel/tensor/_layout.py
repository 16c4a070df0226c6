"""``Layout``: HyperParallel's way of naming a sharding by mesh-axis names, mapped onto torch placements.

torch describes a sharding per *mesh* dimension (a placement list); HyperParallel's ``Layout`` describes
it per *tensor* dimension (which axis or axes split it). ``TensorLayout`` converts the second into the
first, so everything downstream (DTensor, redistribute, parallelize_module) is torch's own.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from hyper_adaptor.parallel.tensor import _mesh

_NONE = ("None", None)


class Layout:
    """A mesh shape with axis names; calling it with one entry per tensor dim gives a ``TensorLayout``.

    The mesh is built on first use (over the whole world, or ``rank_list``) and shared by every
    ``TensorLayout`` this ``Layout`` makes.
    """

    def __init__(self, mesh_shape, mesh_dim_names, rank_list=None):
        self.mesh_shape = tuple(int(s) for s in mesh_shape)
        self.mesh_dim_names = tuple(mesh_dim_names)
        _mesh.check_mesh_args(self.mesh_shape, self.mesh_dim_names)
        self.rank_list = None if rank_list is None else [int(r) for r in rank_list]
        if self.rank_list is not None and len(self.rank_list) != math.prod(self.mesh_shape):
            raise ValueError(f"rank_list has {len(self.rank_list)} ranks but mesh_shape {self.mesh_shape} holds "
                             f"{math.prod(self.mesh_shape)}")
        self._mesh: DeviceMesh | None = None

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            if self.rank_list is None:
                self._mesh = _mesh.init_device_mesh(None, self.mesh_shape, self.mesh_dim_names)
            else:
                from hyper_adaptor.platform import device_type

                ranks = torch.tensor(self.rank_list).reshape(self.mesh_shape)
                self._mesh = _mesh._remember(DeviceMesh(device_type(), ranks, mesh_dim_names=self.mesh_dim_names))
        return self._mesh

    def axis_size(self, name: str) -> int:
        return self.mesh_shape[self.mesh_dim_names.index(name)]

    def __call__(self, *tensor_map) -> TensorLayout:
        return TensorLayout(self, tensor_map)

    def __repr__(self):
        return f"Layout(mesh_shape={self.mesh_shape}, mesh_dim_names={self.mesh_dim_names})"


class TensorLayout:
    """One tensor's sharding: ``tensor_map[d]`` names the axis (or tuple of axes) splitting tensor dim d."""

    def __init__(self, layout: Layout, tensor_map):
        self.layout = layout
        entries, used = [], {}
        for dim, entry in enumerate(tensor_map):
            axes = () if entry in _NONE else (entry,) if isinstance(entry, str) else tuple(entry)
            for axis in axes:
                if axis not in layout.mesh_dim_names:
                    raise ValueError(f"layout axis {axis!r} (tensor dim {dim}) is not in the mesh's axes "
                                     f"{layout.mesh_dim_names}")
                if axis in used:
                    raise ValueError(f"layout axis {axis!r} is used twice (tensor dims {used[axis]} and {dim})")
                used[axis] = dim
            order = [layout.mesh_dim_names.index(a) for a in axes]
            # torch applies Shard placements mesh dim by mesh dim (outer first); a tuple in another
            # order would need torch's private strided sharding, so it is refused instead
            if order != sorted(order):
                raise ValueError(f"layout axes {axes} for tensor dim {dim} must follow the mesh order "
                                 f"{layout.mesh_dim_names}")
            entries.append(axes)
        self.tensor_map = tuple(entries)

    @property
    def mesh(self) -> DeviceMesh:
        return self.layout.mesh

    @property
    def placements(self) -> tuple:
        out = [Replicate()] * len(self.layout.mesh_shape)
        for dim, axes in enumerate(self.tensor_map):
            for axis in axes:
                out[self.layout.mesh_dim_names.index(axis)] = Shard(dim)
        return tuple(out)

    def check(self, shape) -> None:
        """Raise a ValueError naming the axis if ``shape`` cannot take this layout evenly."""
        shape = tuple(shape)
        if self.tensor_map and len(self.tensor_map) != len(shape):
            raise ValueError(f"layout {self} has {len(self.tensor_map)} entries but the tensor has "
                             f"{len(shape)} dims (shape {shape})")
        for dim, axes in enumerate(self.tensor_map):
            size = math.prod(self.layout.axis_size(a) for a in axes)
            if size and shape[dim] % size:
                raise ValueError(f"tensor dim {dim} of size {shape[dim]} is not divisible by layout axis "
                                 f"{'x'.join(axes)!r} of size {size}")

    def __repr__(self):
        names = ["None" if not a else a[0] if len(a) == 1 else a for a in self.tensor_map]
        return f"TensorLayout({', '.join(map(repr, names))}; {self.layout!r})"


def resolve(layout_or_mesh, placements=None, shape=None):
    """(mesh, placements) from a TensorLayout or a DeviceMesh + placements; checks ``shape`` if given."""
    if isinstance(layout_or_mesh, TensorLayout):
        if placements is not None:
            raise ValueError("pass placements only with a DeviceMesh; a TensorLayout already carries them")
        if shape is not None:
            layout_or_mesh.check(shape)
        return layout_or_mesh.mesh, layout_or_mesh.placements
    if isinstance(layout_or_mesh, Layout):
        raise TypeError("a Layout names the mesh only; call it with the tensor's axes, e.g. layout('dp', 'None')")
    if layout_or_mesh is None:
        # torch would fall back to its own mesh context stack, which our init_device_mesh does not fill
        layout_or_mesh = _mesh.get_current_mesh()
    return layout_or_mesh, placements
