"""DTensor entry points that accept a ``TensorLayout`` as well as torch's (mesh, placements).

``DTensor`` itself is torch's class, not a subclass: every DTensor op returns torch's class, so a
subclass would not survive the first operation and ``isinstance`` checks would disagree. The
HyperParallel methods torch lacks (``is_partial``, ``reduce_partial``, ``from_local`` with a layout)
are therefore module functions.
"""

from __future__ import annotations

import torch
import torch.distributed.tensor as dt
from torch.distributed.tensor import DTensor, Partial, Replicate

from hyper_adaptor.parallel.tensor._layout import TensorLayout, resolve


def from_local(local_tensor: torch.Tensor, layout_or_mesh, placements=None, **kwargs) -> DTensor:
    """``DTensor.from_local`` with a TensorLayout or a mesh + placements."""
    mesh, placements = resolve(layout_or_mesh, placements)
    if isinstance(layout_or_mesh, TensorLayout) and "shape" not in kwargs:
        # the local shard must tile the global shape the layout implies; an uneven split would make
        # torch infer a wrong global shape silently
        global_shape = list(local_tensor.shape)
        for dim, axes in enumerate(layout_or_mesh.tensor_map):
            for axis in axes:
                global_shape[dim] *= layout_or_mesh.layout.axis_size(axis)
        layout_or_mesh.check(global_shape)
    return DTensor.from_local(local_tensor, mesh, placements, **kwargs)


def distribute_tensor(tensor: torch.Tensor, layout_or_mesh=None, placements=None, *, src_data_rank=0) -> DTensor:
    """torch's ``distribute_tensor``; a TensorLayout is checked against the tensor's shape first."""
    mesh, placements = resolve(layout_or_mesh, placements, shape=tensor.shape)
    return dt.distribute_tensor(tensor, mesh, placements, src_data_rank=src_data_rank)


distribute_module = dt.distribute_module


def is_partial(tensor) -> bool:
    """True when ``tensor`` is a DTensor holding unreduced partial sums on some mesh dim."""
    return isinstance(tensor, DTensor) and any(isinstance(p, Partial) for p in tensor.placements)


def reduce_partial(tensor):
    """Reduce every Partial placement of ``tensor`` (to Replicate); other placements are kept."""
    if not is_partial(tensor):
        return tensor
    placements = [Replicate() if isinstance(p, Partial) else p for p in tensor.placements]
    return tensor.redistribute(tensor.device_mesh, placements)


def _factory(torch_fn):
    def make(*size, layout=None, device_mesh=None, placements=None, **kwargs):
        # HyperParallel passes its TensorLayout as ``layout``; torch uses that keyword for
        # torch.strided/sparse, so both meanings are accepted
        if isinstance(layout, TensorLayout):
            if device_mesh is not None or placements is not None:
                raise ValueError("pass either a TensorLayout or device_mesh/placements, not both")
            shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            layout.check(shape)
            device_mesh, placements = layout.mesh, layout.placements
        elif layout is not None:
            kwargs["layout"] = layout
        if device_mesh is None:
            from hyper_adaptor.parallel.tensor._mesh import get_current_mesh

            device_mesh = get_current_mesh()
        return torch_fn(*size, device_mesh=device_mesh, placements=placements, **kwargs)

    make.__name__ = torch_fn.__name__
    make.__doc__ = f"torch.distributed.tensor.{torch_fn.__name__}, also taking ``layout=TensorLayout``."
    return make


ones = _factory(dt.ones)
zeros = _factory(dt.zeros)
empty = _factory(dt.empty)
rand = _factory(dt.rand)
randn = _factory(dt.randn)


def full(size, fill_value, *, layout=None, device_mesh=None, placements=None, **kwargs) -> DTensor:
    """torch.distributed.tensor.full, also taking ``layout=TensorLayout``."""
    return _factory(lambda *s, **kw: dt.full(s[0] if len(s) == 1 else s, fill_value, **kw))(
        size, layout=layout, device_mesh=device_mesh, placements=placements, **kwargs)
