"""Tensor-parallel styles and ``parallelize_module``: torch's, with the checks and the one style
(``NoParallel``) HyperParallel's contract has and torch's lacks."""

from __future__ import annotations

import fnmatch

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel import parallelize_module as _torch_parallelize_module

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
           "PrepareModuleOutput", "PrepareModuleInputOutput", "NoParallel", "parallelize_module"]


class NoParallel(ParallelStyle):
    """Keep a module whole on every tensor-parallel rank, but as Replicate DTensors on the TP mesh.

    Left as plain tensors, such parameters would sit in the optimizer next to DTensors, and torch's
    foreach optimizers and ``clip_grad_norm_`` refuse a mix of the two; as replicated DTensors every
    parameter is one kind of tensor. Plain-tensor inputs are wrapped as Replicate (every TP rank holds
    the same activation there) and the output is handed back as a local tensor unless
    ``use_local_output=False``.
    """

    def __init__(self, *, use_local_output: bool = True):
        super().__init__()
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        replicate = [Replicate()] * device_mesh.ndim

        def wrap_inputs(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, replicate, run_check=False)
                         if hasattr(x, "shape") and not isinstance(x, DTensor) else x for x in inputs)

        def unwrap_output(mod, output, mesh):
            if self.use_local_output and isinstance(output, DTensor):
                return output.redistribute(mesh, replicate).to_local()
            return output

        return distribute_module(module, device_mesh, input_fn=wrap_inputs, output_fn=unwrap_output)


def _atoms_match(fqn: str, key: str) -> bool:
    # torch matches a plan key atom by atom along the dotted path, so "*" never crosses a dot
    a, b = fqn.split("."), key.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b))


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh | None = None, parallelize_plan=None, *,
                       src_data_rank: int | None = 0) -> nn.Module:
    """torch's ``parallelize_module``, refusing what it would silently ignore or fail on obscurely:
    a plan key matching no submodule (torch skips it, leaving that layer unsharded) and a mesh that
    is not 1-D (slice the tensor-parallel axis first, e.g. ``mesh["tp"]``)."""
    if device_mesh is None:
        from hyper_adaptor.parallel.tensor._mesh import get_current_mesh

        device_mesh = get_current_mesh()
    if device_mesh.ndim != 1:
        raise ValueError(f"parallelize_module needs a 1-D tensor-parallel mesh, got {device_mesh.ndim} dims "
                         f"{device_mesh.mesh_dim_names}; pass a slice such as mesh['tp']")
    if isinstance(parallelize_plan, dict):
        fqns = [n for n, _ in module.named_modules() if n]
        for key, style in parallelize_plan.items():
            if not isinstance(style, ParallelStyle):
                raise TypeError(f"parallelize_module: plan[{key!r}] must be a ParallelStyle, "
                                f"got {type(style).__name__}")
            if not any(_atoms_match(fqn, key) for fqn in fqns):
                raise ValueError(f"parallelize_module: plan key {key!r} matches no submodule of "
                                 f"{type(module).__name__}")
    elif parallelize_plan is not None and not isinstance(parallelize_plan, ParallelStyle):
        raise TypeError(f"parallelize_plan must be a ParallelStyle or a dict, got {type(parallelize_plan).__name__}")
    return _torch_parallelize_module(module, device_mesh, parallelize_plan, src_data_rank=src_data_rank)
