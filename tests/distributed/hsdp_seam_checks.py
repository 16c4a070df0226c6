"""Rank code for test_hsdp_seams.py: megatron-optimizer seams of --use-hsdp on 2 gloo ranks."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist


def found_inf_agreement(rank, world_size):
    """An overflow in rank 0's gradient shard only: megatron's check alone (reduced over the
    model-parallel group, here nobody else) leaves rank 1 stepping; the HSDP wrap makes every
    rank skip."""
    from hyper_adaptor.patches.hsdp.optimizer import found_inf_over_data_parallel

    dist.init_process_group("gloo")

    def megatrons_check(self):
        self.found_inf.fill_(1.0 if rank == 0 else 0.0)  # inf/nan seen in this rank's shard
        return self.found_inf.item() > 0

    managed = SimpleNamespace(sharded=True, mesh=SimpleNamespace(dp_group=dist.group.WORLD))
    param = torch.nn.Parameter(torch.zeros(2))
    param._hsdp_param = managed
    optimizer = SimpleNamespace(found_inf=torch.zeros(1), float16_groups=[[param]])
    alone = megatrons_check(optimizer)
    wrapped = found_inf_over_data_parallel(megatrons_check)(optimizer)
    plain = SimpleNamespace(found_inf=torch.zeros(1), float16_groups=[[torch.nn.Parameter(torch.zeros(2))]])
    unmanaged = found_inf_over_data_parallel(megatrons_check)(plain)  # no HSDP parameter: megatron's answer
    return {"alone": alone, "wrapped": wrapped, "found_inf": float(optimizer.found_inf), "unmanaged": unmanaged}
