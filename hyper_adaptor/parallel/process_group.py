"""HyperParallel's process-group helpers over ``torch.distributed``.

``init_process_group`` picks the backend of this process's device (``hyper_adaptor.platform``) when none is
given. ``split_group`` cuts a group into contiguous sub-groups of ``split_size`` ranks and returns the one
this rank belongs to; torch's ``new_group`` is collective over the whole default group, so every rank creates
every sub-group (in the same order) and keeps its own. Groups made here, and groups made elsewhere and
passed to ``mark_created_groups``, are destroyed by ``destroy_process_group()`` before the default group.
"""

from __future__ import annotations

import torch.distributed as dist

from hyper_adaptor import platform

__all__ = ["destroy_process_group", "get_backend", "get_group_local_rank", "get_process_group_ranks",
           "init_process_group", "mark_created_groups", "split_group"]

_created: list = []


def init_process_group(backend: str | None = None, **kwargs) -> None:
    """``torch.distributed.init_process_group`` with ``backend`` defaulting to the device's (gloo on cpu,
    nccl on cuda, hccl on npu); every other keyword is torch's (``init_method``, ``world_size``, ``rank``...)."""
    if dist.is_initialized():
        raise RuntimeError("init_process_group: the default process group is already initialised")
    dist.init_process_group(backend=backend or platform.distributed_backend(), **kwargs)


def _require_init(what: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{what}: torch.distributed is not initialised; call init_process_group first")


def mark_created_groups(groups) -> None:
    """Record groups created outside this module (a group or an iterable of them) so that
    ``destroy_process_group()`` destroys them too."""
    items = [groups] if isinstance(groups, dist.ProcessGroup) else list(groups)
    for g in items:
        if not isinstance(g, dist.ProcessGroup):
            raise TypeError(f"mark_created_groups: expected process groups, got {type(g).__name__}")
        if all(g is not c for c in _created):
            _created.append(g)


def destroy_process_group(group=None) -> None:
    """Destroy ``group``; with None, every recorded group and then the default group."""
    if group is not None:
        dist.destroy_process_group(group)
        _forget(group)
        return
    if not dist.is_initialized():
        return
    while _created:
        dist.destroy_process_group(_created.pop())
    dist.destroy_process_group()


def _forget(group) -> None:
    _created[:] = [g for g in _created if g is not group]


def get_process_group_ranks(group=None) -> list[int]:
    """The global ranks of ``group`` (None: the default group), in group-rank order."""
    _require_init("get_process_group_ranks")
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def get_backend(group=None) -> str:
    """The backend name of ``group`` (None: the default group)."""
    _require_init("get_backend")
    return str(dist.get_backend(group))


def get_group_local_rank(group=None) -> int:
    """This process's rank inside ``group`` (None: the default group)."""
    _require_init("get_group_local_rank")
    return dist.get_rank(group)


def split_group(group=None, split_size: int | None = None, **kwargs):
    """Split ``group`` (None: the default group) into contiguous sub-groups of ``split_size`` ranks and
    return this rank's. Every rank of the default group must call it (torch's ``new_group`` is collective).
    Other keywords go to ``torch.distributed.new_group`` (``backend``, ``timeout``, ``pg_options``)."""
    _require_init("split_group")
    ranks = get_process_group_ranks(group)
    if not isinstance(split_size, int) or isinstance(split_size, bool) or split_size < 1:
        raise ValueError(f"split_group: split_size must be a positive int, got {split_size!r}")
    if len(ranks) % split_size:
        raise ValueError(f"split_group: split_size={split_size} does not divide the group's {len(ranks)} ranks")
    me = dist.get_rank()
    mine = None
    for start in range(0, len(ranks), split_size):
        part = ranks[start:start + split_size]
        g = dist.new_group(part, **kwargs)
        if me in part:
            mine = g
            _created.append(g)
    return mine
