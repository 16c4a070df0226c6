"""HyperParallel's Layout usage on CPU: a mesh with named axes, parameters sharded by ``shard_module``,
materialised shard by shard by ``init_parameters``, inputs made DTensors with ``DTensor.from_local(local, layout)``.

    torchrun --nproc_per_node 2 examples/hyperparallel/layout_example.py [--steps 3]

A two-layer MLP in Megatron's tensor-parallel split (first weight by rows, second by columns) over a "tp"
axis of all ranks. Rank 0 also trains the same model unsharded and prints both losses: they agree.
"""

import argparse
import copy

import torch
import torch.distributed as dist
from torch import nn

from hyper_adaptor.parallel import (
    DTensor,
    Layout,
    Replicate,
    destroy_process_group,
    init_empty_weights,
    init_parameters,
    init_process_group,
    shard_module,
)

DIM, HIDDEN, BATCH = 16, 64, 8


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)   # a row-parallel bias would be added once per rank

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout((world,), ("tp",))
    with init_empty_weights():                   # no memory yet: parameters on the meta device
        model = MLP()
    shard_module(model, {
        "up.weight": layout("tp", "None"),       # rows of the first weight split over tp
        "up.bias": layout("tp"),
        "down.weight": layout("None", "tp"),     # columns of the second
    })
    init_parameters(model, seed=0)               # each rank fills only its shard, with the unsharded values
    reference = None
    if rank == 0:
        torch.manual_seed(0)
        reference = MLP()                        # the same values, whole, on one process
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, DIM, generator=data)
    y = torch.randn(BATCH, DIM, generator=data)
    replicated = layout("None", "None")
    for step in range(args.steps):
        out = model(DTensor.from_local(x, replicated))   # every rank holds the whole input
        full = out.redistribute(placements=[Replicate()]).to_local()
        loss = nn.functional.mse_loss(full, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if reference is not None:
            ref_loss = nn.functional.mse_loss(reference(copy.deepcopy(x)), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            print(f"step {step} loss {loss.item():.6f} single-process {ref_loss.item():.6f}", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    main()
