"""HyperParallel's HSDP usage on CPU: ``hsdp(model, shard_size=...)`` then an ordinary training loop.

    torchrun --nproc_per_node 2 examples/hyperparallel/hsdp_example.py [--steps 3] [--shard-size -1]

Every rank fits its own batch; the printed loss is the mean over ranks (the same on every rank).
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn

from hyper_adaptor.parallel import destroy_process_group, hsdp_sync_stream, init_process_group
from hyper_adaptor.parallel.hsdp import hsdp


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shard-size", type=int, default=-1)
    parser.add_argument("--level", default="level3", choices=["level1", "level2", "level3"])
    args = parser.parse_args()
    init_process_group()                       # gloo on CPU: the platform's backend
    rank = dist.get_rank()
    torch.manual_seed(0)                       # the same initial weights on every rank
    model = Model()
    for block in model.blocks:                 # inner modules first: each one is a gather unit
        hsdp(block, shard_size=args.shard_size, optimizer_level=args.level)
    hsdp(model, shard_size=args.shard_size, optimizer_level=args.level)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)   # built after wrapping: it sees the shards
    data = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, 64, generator=data)     # one batch per rank, fitted over the steps
    y = x.sum(dim=1, keepdim=True)
    for step in range(args.steps):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        hsdp_sync_stream()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step} loss {mean.item() / dist.get_world_size():.6f}", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    main()
