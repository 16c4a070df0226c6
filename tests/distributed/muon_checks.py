"""Sharded Muon (hyper_adaptor.optim.ShardedMuon) over HSDP shards, inside a 4-rank gloo world.

A small model whose matrices have row counts the shard size does not divide (38 rows over 4 ranks:
10, 10, 10, 8) and one fused QKV matrix split per query group, trained 3 steps with Muon on the
matrices and Adam on the rest, under HSDP levels 1 and 3 with shard groups of 2 (two replicas) and 4,
against the same model and optimizers in one process. The owner bookkeeping is checked too: every
rank counts the matrices it ran Newton-Schulz on, and that count must be exactly what the balanced
assignment gives it (a rank that skipped or repeated a matrix shows there, and in the parameters).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed.hsdp_checks import compare, full_params

VOCAB, DIM, HIDDEN, SEQ, GROUPS = 24, 16, 38, 5, 4
QKV_SPLIT = [2, 1, 1]  # rows of Q, K, V per query group: GROUPS * 4 = 16 rows
GLOBAL_BATCH, STEPS, LR = 8, 3, 2e-2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, GROUPS * sum(QKV_SPLIT), bias=False)
        self.proj = nn.Linear(GROUPS * sum(QKV_SPLIT), DIM, bias=False)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        x = x + self.proj(torch.tanh(self.qkv(x)))
        return self.norm(x + self.fc2(F.gelu(self.fc1(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return F.linear(x, self.emb.weight)


def make_model():
    torch.manual_seed(0)
    return Model()


def batch(step):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)


def loss_of(model, tokens):
    return F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def optimizers(model):
    from hyper_adaptor.optim import ShardedMuon

    named = list(model.named_parameters())
    matrices = [p for n, p in named if p.dim() == 2 and "emb" not in n]
    qkv = {id(p) for n, p in named if n.endswith("qkv.weight")}
    rest = [p for n, p in named if not (p.dim() == 2 and "emb" not in n)]
    muon = ShardedMuon(matrices, lr=LR, momentum=0.9, nesterov=True, weight_decay=0.1, scale_mode="spectral",
                       coefficient_type="quintic", fp32_matmul_prec="highest",
                       qkv_split=lambda p: QKV_SPLIT if id(p) in qkv else None)
    return muon, torch.optim.Adam(rest, lr=1e-2, foreach=False)


def train(model, rank=0, world=1):
    muon, adam = optimizers(model)
    losses = []
    for step in range(STEPS):
        muon.zero_grad()
        adam.zero_grad()
        loss = loss_of(model, batch(step).chunk(world)[rank])
        loss.backward()
        muon.step()
        adam.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses, muon


def expected_counts(model, shard_size: int) -> list[int]:
    """Newton-Schulz runs per shard rank over the whole run, from the balanced owner assignment."""
    from hyper_adaptor.optim import assign_owners, ns_flops

    costs, runs = [], []
    for name, p in model.named_parameters():
        if p.dim() != 2 or "emb" in name:
            continue
        if name.endswith("qkv.weight"):
            costs.append(sum(ns_flops((GROUPS * part, DIM)) for part in QKV_SPLIT))
            runs.append(len(QKV_SPLIT))
        else:
            costs.append(ns_flops(tuple(p.shape)))
            runs.append(1)
    counts = [0] * shard_size
    for owner, n in zip(assign_owners(costs, shard_size), runs, strict=True):
        counts[owner] += n * STEPS
    return counts


def sharded_matrix(rank: int, world_size: int) -> dict:
    from hyper_adaptor.parallel.hsdp import hsdp

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ref_model = make_model()
    ref_losses, _ = train(ref_model)
    ref = {"loss": ref_losses, "params": {k: v.detach().clone() for k, v in ref_model.state_dict().items()}}
    results = {}
    for level in ("level1", "level3"):
        for shard_size in (2, 4):
            model = make_model()
            plan = make_model()  # unwrapped twin: parameter names and shapes for the expected counts
            for block in model.blocks:
                hsdp(block, optimizer_level=level, shard_size=shard_size, threshold=0)
            hsdp(model, optimizer_level=level, shard_size=shard_size, threshold=0)
            losses, muon = train(model, rank, world_size)
            problems = compare(ref, losses, full_params(model), rtol=1e-6, atol=2e-6)
            counts = torch.zeros(world_size, dtype=torch.long)
            counts[rank] = muon.orthogonalised["matrices"]
            dist.all_reduce(counts)
            want = expected_counts(plan, shard_size) * (world_size // shard_size)
            if counts.tolist() != want:
                problems.append(f"Newton-Schulz runs per rank {counts.tolist()}, owners say {want}")
            results[f"{level}-S{shard_size}"] = problems
    dist.destroy_process_group()
    return results
