"""Deferred parameter creation (meta device) and sharded materialisation, plus ``shard_module``."""

from __future__ import annotations

import contextlib
import copy
import fnmatch

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from hyper_adaptor.parallel.tensor._dtensor import distribute_tensor
from hyper_adaptor.parallel.tensor._layout import TensorLayout


@contextlib.contextmanager
def init_on_device(device, include_buffers: bool = True):
    """Modules created inside get their parameters (and, by default, buffers) on ``device``."""
    device = torch.device(device)
    if include_buffers:
        with device:
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        if param is not None and param.device != device:
            kwargs = {k: v for k, v in vars(param).items() if k != "_is_param"}
            moved = type(param)(param.detach().to(device), requires_grad=param.requires_grad)
            moved.__dict__.update(kwargs)
            module._parameters[name] = moved

    # only for the duration of the block, and only parameter registration: buffers computed in
    # __init__ (rotary tables, masks) keep real values init_parameters could not recreate
    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def init_empty_weights(include_buffers: bool = False):
    """Modules created inside hold parameters on the meta device; buffers stay real unless
    ``include_buffers``. Without ``include_buffers`` each parameter exists for a moment on its
    original device before it is moved (the peak is one parameter); with it nothing is allocated.
    The parameter-only variant patches ``nn.Module.register_parameter`` for the block's duration, so
    do not build modules on other threads meanwhile. Materialise with ``init_parameters``."""
    return init_on_device("meta", include_buffers=include_buffers)


def _is_meta(param) -> bool:
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.is_meta


def _target_device(param) -> torch.device:
    if isinstance(param, DTensor):
        return torch.device(param.device_mesh.device_type)
    from hyper_adaptor.platform import device_type

    return torch.device(device_type())


def init_parameters(model: nn.Module, seed: int | None = None) -> nn.Module:
    """Materialise every meta (possibly DTensor-sharded) parameter of ``model`` in place.

    Values equal the same model built unsharded on CPU after ``torch.manual_seed(seed)``: modules are
    visited in ``model.modules()`` order (their construction order for the usual ``__init__``) and
    each one's ``reset_parameters()`` runs on a CPU stand-in holding full-size copies of its own
    parameters, drawing from the same global CPU generator; each rank then keeps its shard. The peak
    is therefore one module's full parameters, not the model's. A meta parameter whose module has no
    ``reset_parameters`` cannot be given its intended value and is an error naming it.
    """
    if seed is not None:
        torch.manual_seed(seed)
    # old parameter kept alive next to its replacement: a freed one's id could be reused by a new tensor
    done: dict[int, tuple] = {}
    for mod_name, module in model.named_modules():
        own = {n: p for n, p in module._parameters.items() if p is not None}
        todo = {n: p for n, p in own.items() if _is_meta(p) and id(p) not in done}
        if not todo:
            continue
        if not callable(getattr(module, "reset_parameters", None)):
            name = f"{mod_name}.{next(iter(todo))}" if mod_name else next(iter(todo))
            raise ValueError(f"init_parameters: parameter {name!r} is on the meta device and its module "
                             f"{type(module).__name__} has no reset_parameters() to initialise it")
        stand_in = copy.copy(module)
        stand_in._parameters = {n: None if p is None else
                                nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False)
                                for n, p in module._parameters.items()}
        with torch.no_grad():
            stand_in.reset_parameters()
        for n, p in todo.items():
            full = stand_in._parameters[n].detach().to(_target_device(p))
            if isinstance(p, DTensor):
                # every rank computed the same full tensor: src_data_rank=None slices locally, no comm
                value = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            else:
                value = full
            new = nn.Parameter(value, requires_grad=p.requires_grad)
            done[id(p)] = (p, new)
            module._parameters[n] = new
        del stand_in
    for module in model.modules():  # tied parameters seen a second time
        for n, p in list(module._parameters.items()):
            if p is not None and id(p) in done and done[id(p)][0] is p:
                module._parameters[n] = done[id(p)][1]
    return model


def shard_module(module: nn.Module, plan: dict) -> nn.Module:
    """Place parameters as DTensors: ``plan`` maps fnmatch patterns over parameter names to TensorLayouts.

    Parameters no pattern matches become Replicate DTensors on the mesh of the first layout, so that
    the optimizer sees one kind of tensor; a module no pattern matched is left untouched.
    """
    names = [n for n, _ in module.named_parameters()]
    chosen: dict[str, TensorLayout] = {}
    for pattern, layout in plan.items():
        if not isinstance(layout, TensorLayout):
            raise TypeError(f"shard_module: plan[{pattern!r}] must be a TensorLayout (layout('dp', 'None')), "
                            f"got {type(layout).__name__}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"shard_module: pattern {pattern!r} matches no parameter of "
                             f"{type(module).__name__} (parameters: {names[:8]}{'...' if len(names) > 8 else ''})")
        for n in hits:
            chosen.setdefault(n, layout)
    if not chosen:
        return module
    mesh = next(iter(chosen.values())).mesh
    replicate = [Replicate()] * mesh.ndim
    by_id = {id(p): n for n, p in module.named_parameters()}  # a tied parameter under its first name
    placed: dict[int, tuple] = {}
    for owner in module.modules():
        for leaf, param in list(owner._parameters.items()):
            if param is None or isinstance(param, DTensor) or id(param) not in by_id:
                continue
            if id(param) not in placed:
                layout = chosen.get(by_id[id(param)])
                value = (distribute_tensor(param.detach(), layout) if layout is not None
                         else distribute_tensor(param.detach(), mesh, replicate))
                placed[id(param)] = (param, nn.Parameter(value, requires_grad=param.requires_grad))
            owner._parameters[leaf] = placed[id(param)][1]
    return module
