"""Tensor parallelism and DTensor helpers following HyperParallel's API, built on torch.distributed.tensor.

torch's ``DeviceMesh``, ``DTensor``, placements, styles and ``parallelize_module`` are used as they are;
this package adds what HyperParallel's contract has and torch's lacks: ``Layout`` (sharding named by
mesh-axis names per tensor dim), the current mesh, layout-aware ``from_local`` / ``distribute_tensor`` /
factories, meta-device creation with sharded materialisation equal to plain init, ``shard_module``,
``NoParallel``, plan-key and mesh checks in ``parallelize_module``, and an RNG under which dropout on
sharded activations equals one process.
"""

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from hyper_adaptor.parallel.tensor._dtensor import (
    DTensor,
    distribute_module,
    distribute_tensor,
    empty,
    full,
    is_partial,
    ones,
    rand,
    randn,
    reduce_partial,
    zeros,
)
from hyper_adaptor.parallel.tensor._init import init_empty_weights, init_on_device, init_parameters, shard_module
from hyper_adaptor.parallel.tensor._layout import Layout
from hyper_adaptor.parallel.tensor._mesh import get_current_mesh, init_device_mesh
from hyper_adaptor.parallel.tensor._random import manual_seed
from hyper_adaptor.parallel.tensor._styles import (
    ColwiseParallel,
    NoParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = [
    "Layout", "DeviceMesh", "init_device_mesh", "get_current_mesh", "DTensor", "Shard", "Replicate", "Partial",
    "Placement", "distribute_tensor", "distribute_module", "init_parameters", "init_empty_weights",
    "init_on_device", "manual_seed", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "NoParallel", "parallelize_module",
    "shard_module", "ones", "zeros", "empty", "full", "rand", "randn", "is_partial", "reduce_partial",
]

# importable too, but outside __all__ (which holds HyperParallel's names only): the layout object a
# Layout call returns, and what HyperParallel offers as methods torch's classes lack
from hyper_adaptor.parallel.tensor._dtensor import from_local as from_local
from hyper_adaptor.parallel.tensor._layout import TensorLayout as TensorLayout
from hyper_adaptor.parallel.tensor._mesh import get_device_num_along_axis as get_device_num_along_axis
from hyper_adaptor.parallel.tensor._random import DistributedDropout as DistributedDropout
from hyper_adaptor.parallel.tensor._random import dropout as dropout
