"""Public entry points: ``hsdp`` (HyperParallel's signature), ``fully_shard`` (FSDP2's), and the
methods every wrapped module gains.

Wrap inner blocks first, then the root (each call manages the parameters not already managed by
a nested call), and build the optimizer afterwards: ``module.parameters()`` then yields the shards.
Apply tensor parallel before: parameters that are DTensors on a 1-D tp mesh are sharded over data
parallel on their TP-local tensors (``_param.py``), their shards placed on the (dp dims..., tp) mesh.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_adaptor import platform
from hyper_adaptor.parallel.hsdp._config import DEFAULT_BUCKET_KB, HSDPConfig, MixedPrecisionPolicy, OffloadPolicy
from hyper_adaptor.parallel.hsdp._mesh import build_mesh, with_tensor_parallel
from hyper_adaptor.parallel.hsdp._pool import HostBufferPool
from hyper_adaptor.parallel.hsdp._state import HSDPState, sync_all


class HSDPModule:
    """Mixed into the class of every wrapped module (the module keeps its own class as a base)."""

    _hsdp_state: HSDPState

    def _hsdp_states(self) -> list[HSDPState]:
        return [m._hsdp_state for m in self.modules() if isinstance(m, HSDPModule)]

    def set_requires_grad_sync(self, requires_grad_sync: bool) -> None:
        """False: following backwards accumulate full gradients locally without communication (needs
        ``enable_grad_accumulation=True``); True: the next backward reduces everything accumulated."""
        if not isinstance(requires_grad_sync, bool):
            raise ValueError(f"hsdp: requires_grad_sync must be a bool; got {requires_grad_sync!r}")
        for state in self._hsdp_states():
            if not requires_grad_sync and not state.config.enable_grad_accumulation:
                raise ValueError(
                    "hsdp: set_requires_grad_sync(False) needs enable_grad_accumulation=True; "
                    "got enable_grad_accumulation=False"
                )
            state.requires_grad_sync = requires_grad_sync

    def zero_grads(self) -> None:
        """Drop the gradient shards and the local full gradients of every wrapped submodule."""
        for state in self._hsdp_states():
            state.zero_grads()

    def set_forward_prefetch_cells(self, cells) -> None:
        """Start gathering ``cells``' parameters when this module's forward starts."""
        self._hsdp_state.forward_prefetch = _states_of(cells, "set_forward_prefetch_cells")

    def set_backward_prefetch_cells(self, cells) -> None:
        """Start gathering ``cells``' parameters when this module's backward starts."""
        self._hsdp_state.backward_prefetch = _states_of(cells, "set_backward_prefetch_cells")

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Level 3: whether this module (and, with ``recurse``, every wrapped submodule) frees its
        full parameters after forward (True) or keeps them until its backward is done (False). Not
        called: every unit reshards except the root and the last unit (see the HSDP docs).
        Levels 1/2 never free the full parameters; there it has no effect."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"hsdp: reshard_after_forward must be a bool; got {reshard_after_forward!r}")
        for state in self._hsdp_states() if recurse else [self._hsdp_state]:
            state.reshard_after_forward = reshard_after_forward

    def unshard(self) -> None:
        self._hsdp_state.unshard()

    def reshard(self) -> None:
        self._hsdp_state.reshard()

    def hsdp_comm_bytes(self) -> int:
        """Collective volume this process issued so far (all wrapped submodules)."""
        return sum(state.comm_bytes() for state in self._hsdp_states())


def _states_of(cells, method: str) -> list[HSDPState]:
    cells = list(cells) if isinstance(cells, (list, tuple)) else [cells]
    for cell in cells:
        if not isinstance(cell, HSDPModule):
            raise ValueError(f"hsdp: {method} takes modules wrapped by hsdp/fully_shard; got {type(cell).__name__}")
    return [cell._hsdp_state for cell in cells]


def _tensor_parallel_mesh(module: nn.Module):
    """The 1-D mesh the not yet managed DTensor parameters of ``module`` are tensor-parallel over
    (torch's ``parallelize_module`` on ``mesh["tp"]``), or None when it has none."""
    meshes = []
    for _, sub in module.named_modules():
        for name, param in sub._parameters.items():
            if isinstance(param, DTensor) and not hasattr(param, "_hsdp_param"):
                if param.device_mesh.ndim != 1:
                    raise ValueError(
                        f"hsdp: parameter {name!r} of {type(sub).__name__} is a DTensor on a "
                        f"{param.device_mesh.ndim}-D mesh; tensor-parallel parameters must live on the 1-D "
                        f"tp mesh (parallelize_module(..., mesh['tp'], ...))")
                if all(m != param.device_mesh for m in meshes):
                    meshes.append(param.device_mesh)
    if len(meshes) > 1:
        raise ValueError(f"hsdp: the DTensor parameters of one wrapped module must share one tp mesh; got "
                         f"{[m.mesh.tolist() for m in meshes]}")
    return meshes[0] if meshes else None


def _wrap(module: nn.Module, config: HSDPConfig, group, shard_size: int,
          buffer_pool: HostBufferPool | None) -> nn.Module:
    if not isinstance(module, nn.Module):
        raise ValueError(f"hsdp: module must be a torch.nn.Module; got {type(module).__name__}")
    if isinstance(module, HSDPModule):
        raise ValueError(f"hsdp: module {type(module).__name__} is already wrapped")
    if buffer_pool is not None and not isinstance(buffer_pool, HostBufferPool):
        raise ValueError(f"hsdp: buffer_pool must be None or a HostBufferPool; got {buffer_pool!r}")
    if not dist.is_initialized():
        raise RuntimeError("hsdp: torch.distributed is not initialized (call init_process_group first)")
    dp_size = dist.get_world_size(group)
    config.validate(dp_size)
    device_type = platform.device_type()
    mesh = build_mesh(group, shard_size, device_type)
    tp_mesh = _tensor_parallel_mesh(module)
    tp = None
    if tp_mesh is not None:
        dp_ranks = set(dist.get_process_group_ranks(mesh.dp_group))
        if dp_ranks & set(tp_mesh.mesh.tolist()) != {dist.get_rank()}:
            raise ValueError(f"hsdp: the data-parallel group {sorted(dp_ranks)} must meet the tensor-parallel "
                             f"mesh {tp_mesh.mesh.tolist()} in this rank only (shard over dp, not over tp)")
        tp = (tp_mesh, with_tensor_parallel(mesh, tp_mesh))
    device = platform.current_device(device_type)
    state = HSDPState(module, config, mesh, device, buffer_pool if buffer_pool is not None else mesh.pool, tp)
    # the outermost wrapped module casts inputs; nested ones are never root
    for sub in module.modules():
        if sub is not module and isinstance(sub, HSDPModule):
            sub._hsdp_state.is_root = False
    state.is_root = True
    cls = module.__class__
    module.__class__ = type(f"HSDP{cls.__name__}", (HSDPModule, cls), {})
    module._hsdp_state = state
    return module


def hsdp(module: nn.Module, shard_size: int = -1, threshold: float = 64, optimizer_level: str = "level1",
         enable_grad_accumulation: bool = False, use_eager_hook: bool = True, grad_scale: float = 1.0,
         reduce_dtype: torch.dtype | None = None, comm_async: bool = False, comm_fusion: bool = False,
         bucket_size: float = DEFAULT_BUCKET_KB, *, group: dist.ProcessGroup | None = None,
         param_dtype: torch.dtype | None = None, offload: bool = False,
         gloo_reduce_scatter_as_all_to_all: bool = True, gloo_all_gather_as_all_to_all: bool = True,
         buffer_pool: HostBufferPool | None = None) -> nn.Module:
    """Hybrid sharded data parallel over ``group`` (default: the world).

    ``optimizer_level``: ``"level1"`` shards optimizer state, ``"level2"`` also gradients,
    ``"level3"`` also parameters. ``shard_size``: ranks per shard group (-1: the whole group); the
    groups beyond it hold replicas. ``threshold`` (KB): smaller parameters stay whole.
    ``bucket_size`` (KB, default 25 MiB as torch DDP's): the most bytes one collective's buffer holds
    (a larger parameter goes alone); ``comm_fusion`` packs parameters into buckets up to it (-1: one
    bucket per module and no limit anywhere, 0: one collective per parameter).
    ``comm_async`` overlaps gradient reduction with the rest of backward. Gradients are averaged
    over the data-parallel group, then multiplied by ``grad_scale``, reduced in ``reduce_dtype``.
    ``gloo_reduce_scatter_as_all_to_all`` / ``gloo_all_gather_as_all_to_all``: on gloo (CPU), run
    those collectives as an all-to-all exchange of point-to-point messages (faster there, and no
    buffer beyond the collective's own) or, False, as gloo's own. ``buffer_pool``: the
    :class:`HostBufferPool` this module's collectives take their host buffers from (None: the one
    shared by every module wrapped over the same groups; ``HostBufferPool(keep=0)`` keeps none).
    """
    config = HSDPConfig(
        shard_size=shard_size, threshold=threshold, optimizer_level=optimizer_level,
        enable_grad_accumulation=enable_grad_accumulation, use_eager_hook=use_eager_hook,
        grad_scale=grad_scale, reduce_dtype=reduce_dtype, param_dtype=param_dtype, comm_async=comm_async,
        comm_fusion=comm_fusion, bucket_size=bucket_size, offload=offload,
        gloo_reduce_scatter_as_all_to_all=gloo_reduce_scatter_as_all_to_all,
        gloo_all_gather_as_all_to_all=gloo_all_gather_as_all_to_all,
    )
    return _wrap(module, config, group, shard_size, buffer_pool)


def fully_shard(module: nn.Module, mesh=None, *, reshard_after_forward: bool = True,
                mixed_precision: MixedPrecisionPolicy | None = None, offload_policy: OffloadPolicy | None = None,
                comm_fusion: bool = True, comm_fusion_zero_copy: bool | None = None,
                bucket_size: float = DEFAULT_BUCKET_KB, gloo_reduce_scatter_as_all_to_all: bool = True,
                gloo_all_gather_as_all_to_all: bool = True, buffer_pool: HostBufferPool | None = None) -> nn.Module:
    """FSDP2-style entry (HyperParallel's signature): ``reshard_after_forward=True`` is level 3, False
    level 2. ``mesh``: None (the world), a 1-D DeviceMesh (shard over it), a 2-D (replicate, shard) one
    (HSDP), or one whose last dim is the tp mesh of the module's tensor-parallel DTensor parameters:
    (dp, tp) shards each TP-local tensor over dp, (replicate, shard, tp) adds replicas. Tensor-parallel
    parameters are found by themselves with any mesh (a 1-D dp mesh beside them works too).
    ``comm_fusion_zero_copy`` is accepted for HyperParallel's signature: the fused buckets already are
    rank-major buffers the collectives read and write in place (see ``_bucket.py``), so there is no
    copy for it to remove; it must be None or a bool. The gloo switches, ``bucket_size`` and
    ``buffer_pool`` are :func:`hsdp`'s."""
    if comm_fusion_zero_copy is not None and not isinstance(comm_fusion_zero_copy, bool):
        raise ValueError(f"fully_shard: comm_fusion_zero_copy must be None or a bool; got {comm_fusion_zero_copy!r}")
    if not isinstance(comm_fusion, bool):
        raise ValueError(f"fully_shard: comm_fusion must be a bool; got {comm_fusion!r}")
    group, shard_size = _groups_of(module, mesh)
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"fully_shard: reshard_after_forward must be a bool; got {reshard_after_forward!r}")
    mp = mixed_precision or MixedPrecisionPolicy()
    if not isinstance(mp, MixedPrecisionPolicy):
        raise ValueError(f"fully_shard: mixed_precision must be a MixedPrecisionPolicy; got {mixed_precision!r}")
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(f"fully_shard: offload_policy must be an OffloadPolicy; got {offload_policy!r}")
    config = HSDPConfig(
        shard_size=shard_size, threshold=0, optimizer_level="level3" if reshard_after_forward else "level2",
        enable_grad_accumulation=True, param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
        cast_forward_inputs=mp.cast_forward_inputs, comm_fusion=comm_fusion, bucket_size=bucket_size,
        offload=offload_policy is not None, gloo_reduce_scatter_as_all_to_all=gloo_reduce_scatter_as_all_to_all,
        gloo_all_gather_as_all_to_all=gloo_all_gather_as_all_to_all,
    )
    return _wrap(module, config, group, shard_size, buffer_pool)


def _groups_of(module: nn.Module, mesh) -> tuple:
    """(data-parallel group, shard size) of ``fully_shard``'s mesh; a last dim that is the tp mesh of
    the module's DTensor parameters is not data parallel and is left out."""
    if mesh is None:
        return None, -1
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard: mesh must be None or a DeviceMesh; got {type(mesh).__name__}")
    dims = list(range(mesh.ndim))
    tp_mesh = _tensor_parallel_mesh(module) if isinstance(module, nn.Module) else None
    if tp_mesh is not None and mesh.ndim > 1:
        last = dist.get_process_group_ranks(mesh.get_group(mesh.ndim - 1))
        if sorted(last) == sorted(tp_mesh.mesh.tolist()):
            dims = dims[:-1]
    if len(dims) == 1:
        return mesh.get_group(dims[0]), -1
    if len(dims) == 2:
        return _flat_group(mesh, dims), mesh.size(dims[1])
    raise ValueError(f"fully_shard: mesh must be 1-D, 2-D (replicate, shard), or either with the tp dim "
                     f"last; got {mesh.ndim}-D with dims {mesh.mesh_dim_names}")


def _flat_group(mesh, dims) -> dist.ProcessGroup:
    """One group over the (replicate, shard) dims of ``mesh``."""
    if mesh.ndim == 2 and sorted(mesh.mesh.flatten().tolist()) == list(range(dist.get_world_size())):
        return dist.group.WORLD
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("fully_shard: a mesh with replicate, shard and tp dims, or a 2-D one that is not the "
                         "whole world, needs mesh_dim_names (its data-parallel dims are flattened into one group)")
    return mesh[tuple(names[d] for d in dims)]._flatten().get_group()


def hsdp_sync_stream() -> None:
    """Wait until every gradient reduction and parameter gather issued so far has finished, and
    the device has caught up with them (before ``optimizer.step()`` when ``comm_async`` is on)."""
    sync_all()
    if platform.device_type() != "cpu":
        platform.synchronize()


def grad_sq_sum(grads) -> torch.Tensor:
    """Sum of squares of the whole gradients behind ``grads`` (DTensors or plain tensors), in fp64.

    A gradient with a ``Shard`` placement contributes its local shard, summed over that mesh
    dimension's group (each shard counted once, replicas not); a replicated one counts once.
    Used by ``clip_grad_norm_`` and by Megatron's gradient norm under ``--use-hsdp``."""
    sharded: dict = {}
    device = grads[0].device if len(grads) else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)  # on the device: nccl/hccl need it there
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        sq = local.detach().double().pow(2).sum()
        dims = [i for i, pl in enumerate(grad.placements) if pl.is_shard() or isinstance(pl, _StridedShard)
                ] if isinstance(grad, DTensor) else []
        if dims:
            # sharded over several mesh dims (dp x tp): summed over each of their groups in turn
            groups = tuple(grad.device_mesh.get_group(d) for d in dims)
            sharded[groups] = sharded[groups] + sq if groups in sharded else sq
        else:
            total += sq
    for groups, sq in sharded.items():
        for group in groups:
            dist.all_reduce(sq, group=group)
        total += sq
    return total


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of an HSDP module by their global norm; returns the norm (before clipping)."""
    if norm_type != 2.0:
        raise ValueError(f"hsdp: clip_grad_norm_ supports norm_type 2.0; got {norm_type!r}")
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    total = math.sqrt(float(grad_sq_sum(grads)))
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return torch.tensor(total)
