"""hyper_adaptor.parallel.process_group on 4 gloo ranks: the default backend, split_group's contiguous
sub-groups, group-local ranks, and destroy_process_group taking the recorded groups with it."""

import pytest

from hyper_adaptor.testing import run_world

pytestmark = pytest.mark.distributed


def checks(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from hyper_adaptor.parallel import process_group as pg

    out = {}
    pg.init_process_group()                       # backend from the platform: gloo on CPU
    out["backend"] = pg.get_backend()
    out["world_ranks"] = pg.get_process_group_ranks(None)
    pairs = pg.split_group(split_size=2)
    out["pair_ranks"] = pg.get_process_group_ranks(pairs)
    out["pair_local"] = pg.get_group_local_rank(pairs)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=pairs)
    out["pair_sum"] = t.item()
    try:
        pg.split_group(split_size=3)
    except ValueError as e:
        out["bad_split"] = str(e)
    outside = dist.new_group([0, 1, 2, 3])
    pg.mark_created_groups([outside])
    pg.destroy_process_group()
    out["initialised_after"] = dist.is_initialized()
    out["recorded_after"] = len(pg._created)
    return out


def test_process_group_helpers():
    results = run_world(4, "tests.distributed.test_process_group:checks", timeout=120)
    for rank, r in enumerate(results):
        first = rank // 2 * 2
        assert r["backend"] == "gloo"
        assert r["world_ranks"] == [0, 1, 2, 3]
        assert r["pair_ranks"] == [first, first + 1]
        assert r["pair_local"] == rank % 2
        assert r["pair_sum"] == 2 * first + 1
        assert "split_size=3" in r["bad_split"] and "4 ranks" in r["bad_split"]
        assert r["initialised_after"] is False and r["recorded_after"] == 0
