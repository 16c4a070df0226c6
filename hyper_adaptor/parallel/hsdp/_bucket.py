"""Buckets: the unit of communication.

A bucket packs several parameters (``comm_fusion``) so that one all-gather / reduce-scatter moves
all of them. The flat buffer is rank-major: ``(S, L)`` where column block ``[off_i, off_i + c_i)``
holds parameter i's padded rows of each rank, so rank r's slice of the flat buffer is exactly the
concatenation of its shards — the input / output of ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` without further copies. Below-threshold (replicated) parameters form
buckets of their own and are all-reduced over the whole data-parallel group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyper_adaptor.parallel.hsdp._mesh import HSDPMesh
from hyper_adaptor.parallel.hsdp._param import HSDPParam


class Bucket:
    def __init__(self, params: list[HSDPParam], mesh: HSDPMesh, grad_scale: float):
        self.params = params
        self.mesh = mesh
        self.sharded = params[0].sharded
        self.S = mesh.shard_size if self.sharded else 1
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.chunk_numel
        self.L = offset
        self.device = params[0].device
        self.compute_dtype = params[0].compute_dtype
        self.reduce_dtype = params[0].reduce_dtype
        self.scale = grad_scale / mesh.dp_size  # gradients are averaged over data parallel, then scaled
        self.ready: set[int] = set()
        self._gather = None
        self._reduce = None
        # Collective volume in the usual convention (all-gather / reduce-scatter: the full buffer,
        # all-reduce: twice it), to compare with the ZeRO theory in bench/hsdp.py.
        self.comm_bytes = 0

    def __iter__(self):
        return iter(zip(self.params, self.offsets))

    @property
    def wants_grad(self) -> bool:
        return any(p.full.requires_grad for p in self.params)

    # -- parameters ------------------------------------------------------------------------------
    def start_gather(self, async_op: bool) -> None:
        if not self.sharded:
            for p in self.params:
                p.refresh_unsharded()
            return
        send = torch.empty(self.L, dtype=self.compute_dtype, device=self.device)
        for p, off in self:
            p.gather_input(send[off : off + p.chunk_numel])
        recv = torch.empty(self.S * self.L, dtype=self.compute_dtype, device=self.device)
        work = dist.all_gather_into_tensor(recv, send, group=self.mesh.shard_group, async_op=async_op)
        self.comm_bytes += recv.numel() * recv.element_size()
        self._gather = (work, recv)

    def finish_gather(self) -> None:
        if self._gather is None:
            return
        work, recv = self._gather
        self._gather = None
        if work is not None:
            work.wait()
        blocks = recv.view(self.S, self.L)
        for p, off in self:
            p.write_gathered(blocks[:, off : off + p.chunk_numel])

    # -- gradients -------------------------------------------------------------------------------
    def start_reduce(self, async_op: bool) -> None:
        send = torch.empty(self.S * self.L, dtype=self.reduce_dtype, device=self.device)
        blocks = send.view(self.S, self.L)
        for p, off in self:
            p.reduce_input(blocks[:, off : off + p.chunk_numel])
            if not p.config.keeps_full_grads:
                p.full.grad = None  # packed: level 2/3 release the full gradient at once
        nbytes = send.numel() * send.element_size()
        if self.sharded:
            out = torch.empty(self.L, dtype=self.reduce_dtype, device=self.device)
            work = dist.reduce_scatter_tensor(out, send, group=self.mesh.shard_group, async_op=async_op)
            self.comm_bytes += nbytes
        else:
            out = send
            work = dist.all_reduce(send, group=self.mesh.dp_group, async_op=async_op)
            self.comm_bytes += 2 * nbytes
        self._reduce = (work, out)

    def finish_reduce(self) -> None:
        if self._reduce is None:
            return
        work, out = self._reduce
        self._reduce = None
        if work is not None:
            work.wait()
        if self.sharded and self.mesh.replicas > 1:
            dist.all_reduce(out, group=self.mesh.replicate_group)
            self.comm_bytes += 2 * out.numel() * out.element_size()
        out.mul_(self.scale)
        for p, off in self:
            if p.full.requires_grad:
                p.accept_reduced(out[off : off + p.chunk_numel])
        self.ready.clear()


def make_buckets(params: list[HSDPParam], mesh: HSDPMesh, bucket_bytes: int | None, grad_scale: float) -> list[Bucket]:
    """Buckets in backward order (the reverse of registration), never mixing sharded with
    replicated parameters or different dtypes. ``bucket_bytes``: None one bucket per kind, 0 one
    bucket per parameter, else a bucket closes once it holds that many bytes."""
    buckets: list[Bucket] = []
    open_: dict[tuple, list[HSDPParam]] = {}
    sizes: dict[tuple, int] = {}

    def close(key):
        if open_.get(key):
            buckets.append(Bucket(open_.pop(key), mesh, grad_scale))
            sizes.pop(key, None)

    for p in reversed(params):
        key = (p.sharded, p.compute_dtype, p.reduce_dtype)
        open_.setdefault(key, []).append(p)
        sizes[key] = sizes.get(key, 0) + p.chunk_numel * (mesh.shard_size if p.sharded else 1) * p.full.element_size()
        if bucket_bytes is not None and sizes[key] >= bucket_bytes:
            close(key)
    for key in list(open_):
        close(key)
    return buckets
