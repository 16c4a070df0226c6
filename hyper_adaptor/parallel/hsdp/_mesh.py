"""The process groups HSDP communicates over.

A data-parallel group of W ranks is cut into W/S shard groups of S consecutive ranks (parameters,
gradients and optimizer state are split over a shard group) and S replicate groups of the ranks
holding the same shard (gradient shards are all-reduced over them). The DTensor view of the sharded
parameters is a 1-D mesh over the shard group, or a 2-D (replicate, shard) mesh when W > S.

Groups are created with ``new_subgroups_by_enumeration`` from the list of every rank's
data-parallel group, gathered from all ranks, so that a data-parallel group that is itself a
subgroup (Megatron's, next to TP and PP) is cut the same way on every rank without deadlock.

A mesh also owns the default host buffer pool of the collectives over its groups. Meshes are cached
per group and shard size, so the units of one model (wrapped one call each) share one pool: their
collectives can be fused into one, and what stays reserved is bounded by one pool's ``keep`` rather
than by ``keep`` per unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hyper_adaptor.parallel.hsdp._pool import HostBufferPool


@dataclass
class HSDPMesh:
    dp_group: dist.ProcessGroup
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    device_mesh: DeviceMesh
    dp_size: int
    shard_size: int
    shard_rank: int
    pool: HostBufferPool = field(default_factory=HostBufferPool, compare=False)

    @property
    def replicas(self) -> int:
        return self.dp_size // self.shard_size


_CACHE: dict = {}


def _all_data_parallel_groups(dp_ranks: list[int]) -> list[list[int]]:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dp_ranks)
    return sorted({tuple(g) for g in gathered})


def build_mesh(dp_group: dist.ProcessGroup | None, shard_size: int, device_type: str) -> HSDPMesh:
    """Shard / replicate groups for ``dp_group`` (default: the world) with shards of ``shard_size``."""
    dp_group = dp_group if dp_group is not None else dist.group.WORLD
    dp_ranks = dist.get_process_group_ranks(dp_group)
    dp_size = len(dp_ranks)
    shard_size = dp_size if shard_size == -1 else shard_size
    key = (id(dp_group), tuple(dp_ranks), shard_size, device_type)
    cached = _CACHE.get(key)
    if cached is not None and cached.dp_group is dp_group:  # (a re-initialised world is a new object)
        return cached
    me = dist.get_rank()
    position = dp_ranks.index(me)
    if shard_size == dp_size:
        shard_group, replicate_group = dp_group, None
        mesh = DeviceMesh.from_group(dp_group, device_type, mesh=torch.tensor(dp_ranks), mesh_dim_names=("shard",))
    else:
        groups = _all_data_parallel_groups(dp_ranks)
        shard_lists, replicate_lists = [], []
        for ranks in groups:
            for start in range(0, len(ranks), shard_size):
                shard_lists.append(list(ranks[start : start + shard_size]))
            for offset in range(shard_size):
                replicate_lists.append(list(ranks[offset::shard_size]))
        shard_group, _ = dist.new_subgroups_by_enumeration(shard_lists)
        replicate_group, _ = dist.new_subgroups_by_enumeration(replicate_lists)
        layout = torch.tensor(dp_ranks).view(dp_size // shard_size, shard_size)
        mesh = DeviceMesh.from_group(
            [replicate_group, shard_group], device_type, mesh=layout, mesh_dim_names=("replicate", "shard")
        )
    result = HSDPMesh(dp_group, shard_group, replicate_group, mesh, dp_size, shard_size, position % shard_size)
    _CACHE[key] = result
    return result


_TP_CACHE: dict = {}


def with_tensor_parallel(hsdp_mesh: HSDPMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh the shards of tensor-parallel parameters live on: HSDP's dims, then ``tp_mesh``'s.

    Each data-parallel member's TP ranks, gathered over the data-parallel group, are the rows of the
    layout (every data-parallel group of the world is cut the same way, so no world-wide call)."""
    tp_group = tp_mesh.get_group()
    key = (id(hsdp_mesh), id(tp_group))
    cached = _TP_CACHE.get(key)
    if cached is not None and cached[0] is hsdp_mesh:
        return cached[1]
    tp_ranks = tp_mesh.mesh.tolist()
    rows = [None] * hsdp_mesh.dp_size
    dist.all_gather_object(rows, tp_ranks, group=hsdp_mesh.dp_group)
    if any(len(row) != len(tp_ranks) for row in rows):
        raise ValueError(f"hsdp: every data-parallel rank must have a tensor-parallel mesh of the same size; "
                         f"got TP rank lists {rows}")
    layout = torch.tensor(rows)
    if hsdp_mesh.replicate_group is None:
        groups, names = [hsdp_mesh.shard_group, tp_group], ("shard", "tp")
    else:
        layout = layout.view(hsdp_mesh.replicas, hsdp_mesh.shard_size, len(tp_ranks))
        groups, names = [hsdp_mesh.replicate_group, hsdp_mesh.shard_group, tp_group], ("replicate", "shard", "tp")
    mesh = DeviceMesh.from_group(groups, tp_mesh.device_type, mesh=layout, mesh_dim_names=names)
    _TP_CACHE[key] = (hsdp_mesh, mesh)
    return mesh
