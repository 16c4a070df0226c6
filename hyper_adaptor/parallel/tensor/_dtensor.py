"""DTensor entry points that accept a ``TensorLayout`` as well as torch's (mesh, placements).

Every DTensor op returns torch's class, so a DTensor of ours could not survive the first operation.
``DTensor`` here is therefore torch's class under HyperParallel's name: a subclass that is never
instantiated, whose type answers ``isinstance`` / ``issubclass`` for torch's class, and whose
``from_local`` also takes a layout (``DTensor.from_local(local, layout)``, HyperParallel's spelling).
The methods torch lacks (``is_partial``, ``reduce_partial``) are module functions, reachable as
``DTensor.is_partial(t)`` too; ``t.is_partial()`` on an instance (torch's class) does not exist.
"""

from __future__ import annotations

import torch
import torch.distributed.tensor as dt
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Partial, Replicate

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
    return TorchDTensor.from_local(local_tensor, mesh, placements, **kwargs)


def distribute_tensor(tensor: torch.Tensor, layout_or_mesh=None, placements=None, *, src_data_rank=0) -> DTensor:
    """torch's ``distribute_tensor``; a TensorLayout is checked against the tensor's shape first."""
    mesh, placements = resolve(layout_or_mesh, placements, shape=tensor.shape)
    return dt.distribute_tensor(tensor, mesh, placements, src_data_rank=src_data_rank)


distribute_module = dt.distribute_module


def is_partial(tensor) -> bool:
    """True when ``tensor`` is a DTensor holding unreduced partial sums on some mesh dim."""
    return isinstance(tensor, TorchDTensor) and any(isinstance(p, Partial) for p in tensor.placements)


def reduce_partial(tensor):
    """Reduce every Partial placement of ``tensor`` (to Replicate); other placements are kept."""
    if not is_partial(tensor):
        return tensor
    placements = [Replicate() if isinstance(p, Partial) else p for p in tensor.placements]
    return tensor.redistribute(tensor.device_mesh, placements)


class _TorchDTensorType(type(TorchDTensor)):
    """Every torch DTensor is an instance of ours (ours is never instantiated)."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, TorchDTensor)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, TorchDTensor)


class DTensor(TorchDTensor, metaclass=_TorchDTensorType):
    """torch's ``DTensor`` under HyperParallel's name (see the module doc)."""

    @staticmethod
    def from_local(local_tensor: torch.Tensor, device_mesh=None, placements=None, **kwargs) -> TorchDTensor:
        """torch's ``DTensor.from_local``; ``device_mesh`` may also be a TensorLayout (then no placements)."""
        if isinstance(device_mesh, TensorLayout):
            if placements is not None:
                raise ValueError("DTensor.from_local: a TensorLayout carries its placements; got placements too")
            return from_local(local_tensor, device_mesh, **kwargs)
        return TorchDTensor.from_local(local_tensor, device_mesh, placements, **kwargs)

    is_partial = staticmethod(is_partial)
    reduce_partial = staticmethod(reduce_partial)


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
