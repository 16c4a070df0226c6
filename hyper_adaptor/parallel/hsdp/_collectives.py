"""HSDP's collectives on gloo with CPU tensors, done as one round of point-to-point messages.

gloo's ``reduce_scatter_tensor`` on CPU is a clone, an all-reduce and a copy, and its all-gather a ring
of S-1 dependent steps; :func:`reduce_scatter` and :func:`all_gather` move exactly the bytes of the
collective in one round instead (``HSDPConfig.gloo_reduce_scatter_as_all_to_all`` /
``gloo_all_gather_as_all_to_all``; other backends use their native collectives). Buckets
(:mod:`._bucket`) call them with their flat rank-major buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyper_adaptor.parallel.hsdp._pool import HostBufferPool


def _on_gloo_cpu(tensor: torch.Tensor, group) -> bool:
    return tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group))


# Tags of HSDP's point-to-point messages on a shard group (gloo matches a receive to the first
# message of its source and tag, in the order they were posted): a parameter gather and a gradient
# reduction can be in flight between the same two ranks at once (level 3's backward), so each kind has
# its own tag, and within a kind every rank posts in the same order (the hooks run in the same order
# on every rank; gathers are read one at a time, see _GatherQueue).
_GATHER_TAG = 0x4853_0001
_REDUCE_TAG = 0x4853_0002


class _PairwiseWork:
    """Handle of an exchange done as point-to-point messages: waiting waits on every send and receive
    once (a second wait on a finished gloo work can hang), then runs ``then`` once (sum the received
    chunks, hand pooled buffers back)."""

    def __init__(self, works, then):
        self.works, self.then = works, then

    def wait(self) -> None:
        works, self.works = self.works, []
        for work in works:
            work.wait()
        if self.then is not None:
            then, self.then = self.then, None
            then()


def _exchange(sends, recvs, group, me: int, S: int, tag: int, async_op: bool, then):
    """Send ``sends[j]`` to member j of ``group`` (``S`` members, this rank is ``me``) and receive
    ``recvs[j]`` from it, for every member j but this rank, all posted at once (member ``me + k`` is
    sent to while ``me - k`` is received from, so every pair has its messages in flight together);
    ``then`` runs after the transfer."""
    works = []
    for k in range(1, S):
        to, frm = (me + k) % S, (me - k) % S
        works.append(dist.isend(sends[to], group=group, tag=tag, group_dst=to))
        works.append(dist.irecv(recvs[frm], group=group, tag=tag, group_src=frm))
    handle = _PairwiseWork(works, then)
    if async_op:
        return handle
    handle.wait()
    return None


def reduce_scatter(out: torch.Tensor, send: torch.Tensor, group, async_op: bool, pool: HostBufferPool,
                   as_all_to_all: bool):
    """``out`` := this rank's chunk of the sum over ``group`` of ``send`` (S chunks, rank-major);
    returns a handle to wait on when ``async_op``.

    ``as_all_to_all`` (HSDPConfig.gloo_reduce_scatter_as_all_to_all) on gloo with CPU tensors: torch's
    ``reduce_scatter_tensor`` there clones its input, all-reduces the clone and copies this rank's
    chunk out: twice the bytes of a reduce-scatter on the wire, plus a copy of the whole buffer. An
    all-to-all exchange moves exactly the reduce-scatter's bytes ((S-1)/S of the buffer per rank): chunk
    j goes to member j, and each rank sums the chunks it receives (its own chunk of every member) with
    its own, in rank order (in fp32 for lower-precision dtypes, as ``torch.sum`` would). It is done as
    one round of point-to-point sends and receives rather than ``all_to_all_single``: the receive
    buffer holds S-1 chunks, not S, and it is the faster of the two (docs/features/hsdp.md has the
    figures). Other backends (NCCL, HCCL) have a native reduce-scatter and always use
    it. The receive buffer comes from ``pool``."""
    if as_all_to_all and _on_gloo_cpu(send, group):
        me, S = dist.get_rank(group), dist.get_world_size(group)
        chunks = send.view(S, -1)
        if S == 1:
            out.copy_(chunks[0])
            return _PairwiseWork([], None) if async_op else None
        recv = pool.take((S - 1) * out.numel(), send.dtype, send.device).view(S - 1, -1)
        slot = {j: recv[j if j < me else j - 1] for j in range(S) if j != me}

        def sum_chunks():
            acc = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
            acc.copy_(slot[0] if me != 0 else chunks[0])
            for j in range(1, S):
                acc.add_(chunks[j] if j == me else slot[j])
            if acc is not out:
                out.copy_(acc)
            pool.give(recv)

        return _exchange(chunks, slot, group, me, S, _REDUCE_TAG, async_op, sum_chunks)
    return dist.reduce_scatter_tensor(out, send, group=group, async_op=async_op)


def all_gather(recv: torch.Tensor, send: torch.Tensor, group, async_op: bool, as_all_to_all: bool):
    """``recv`` (S chunks, rank-major) := every member's ``send``; returns a handle to wait on when
    ``async_op``.

    ``as_all_to_all`` (HSDPConfig.gloo_all_gather_as_all_to_all) on gloo with CPU tensors: gloo's
    all-gather is a ring of S-1 steps, each waiting for the neighbour's previous one; on a host with
    more ranks than cores every step waits for a rank to be scheduled again. An all-to-all exchange
    moves the same bytes in one round: this rank's ``send`` goes to every member, and every member's
    lands straight in its chunk of ``recv``. Done as point-to-point sends and receives, the one send
    buffer serves every peer; ``all_to_all_single`` would need the shard repeated S times in a buffer as
    large as ``recv`` (a whole bucket more at the step's peak), and is slower (docs/features/hsdp.md has
    the figures). It takes no buffer of its own, so no ``pool``."""
    if as_all_to_all and _on_gloo_cpu(send, group):
        me, S = dist.get_rank(group), dist.get_world_size(group)
        chunks = recv.view(S, -1)
        chunks[me].copy_(send)
        return _exchange([send] * S, chunks, group, me, S, _GATHER_TAG, async_op, None)
    return dist.all_gather_into_tensor(recv, send, group=group, async_op=async_op)
