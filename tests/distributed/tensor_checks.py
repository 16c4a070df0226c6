"""Tensor-parallel checks run inside a 2-rank gloo world (hyper_adaptor/testing/world.py).

A tiny pre-norm transformer block stack (multi-head attention + GELU MLP, dropout on the residual
branches) trained with AdamW under TP2 and TP2 + sequence parallel, compared with the same model
trained in one process (computed locally on every rank, no communication) with the same seed.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, HIDDEN, SEQ, BATCH = 32, 16, 4, 32, 8, 4
STEPS, P_DROP, SEED = 3, 0.2, 1234


def _dropout(x, p, training):
    from hyper_adaptor.parallel.tensor import dropout

    return dropout(x, p, training)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        # no key bias: softmax is invariant to it, its gradient is rounding noise that Adam would
        # amplify to a visible (and meaningless) parameter difference
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        # -1: a tensor-parallel rank holds HEADS / tp heads
        q, k, v = (t(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for t in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn = nn.RMSNorm(DIM), Attention()
        self.norm2, self.mlp = nn.RMSNorm(DIM), MLP()

    def forward(self, x):
        x = x + _dropout(self.attn(self.norm1(x)), P_DROP, self.training)
        return x + _dropout(self.mlp(self.norm2(x)), P_DROP, self.training)


class TinyModel(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def make_model() -> TinyModel:
    torch.manual_seed(0)
    return TinyModel()


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)  # data RNG apart from the dropout stream
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def train(model, steps: int = STEPS, mesh=None) -> dict:
    from hyper_adaptor.parallel.tensor import manual_seed

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    manual_seed(SEED, mesh)
    losses, grads = [], []
    model.train()
    for step in range(steps):
        opt.zero_grad()
        tokens = batch(step)
        logits = full(model(tokens[:, :-1]))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        grads.append({n: full(p.grad).detach().clone() for n, p in model.named_parameters()})
        opt.step()
        losses.append(loss.item())
    return {"loss": losses, "grads": grads,
            "params": {n: full(p).detach().clone() for n, p in model.named_parameters()}}


def tp_plan(sp: bool) -> dict:
    from hyper_adaptor.parallel.tensor import (
        ColwiseParallel,
        NoParallel,
        Replicate,
        RowwiseParallel,
        SequenceParallel,
        Shard,
    )

    if not sp:
        return {"emb": RowwiseParallel(input_layouts=Replicate()),
                "layers.*.norm*": NoParallel(),
                "layers.*.attn.[qkv]": ColwiseParallel(),
                "layers.*.attn.o": RowwiseParallel(),
                "layers.*.mlp.fc1": ColwiseParallel(),
                "layers.*.mlp.fc2": RowwiseParallel(),
                "norm": NoParallel(),
                "head": ColwiseParallel(output_layouts=Replicate())}
    # the residual stream stays a sequence-sharded DTensor (use_local_output=False) so that the
    # dropout on it sees the sharding and draws the unsharded mask
    seq = Shard(1)
    return {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False),
            "layers.*.norm*": SequenceParallel(),
            "layers.*.attn.[qkv]": ColwiseParallel(input_layouts=seq),
            "layers.*.attn.o": RowwiseParallel(output_layouts=seq, use_local_output=False),
            "layers.*.mlp.fc1": ColwiseParallel(input_layouts=seq),
            "layers.*.mlp.fc2": RowwiseParallel(output_layouts=seq, use_local_output=False),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}


def compare(ref: dict, got: dict, tol: float = 1e-5) -> list:
    bad = []
    for i, (a, b) in enumerate(zip(ref["loss"], got["loss"])):
        if abs(a - b) > tol:
            bad.append(f"loss step {i}: {a} vs {b}")
    for i, (ga, gb) in enumerate(zip(ref["grads"], got["grads"])):
        for n, g in ga.items():
            err = (g - gb[n]).abs().max().item()
            if err > tol:
                bad.append(f"grad step {i} {n}: max err {err:.2e}")
    for n, p in ref["params"].items():
        err = (p - got["params"][n]).abs().max().item()
        if err > tol:
            bad.append(f"param {n}: max err {err:.2e}")
    return bad


def tp_parity(mesh) -> dict:
    from hyper_adaptor.parallel.tensor import DTensor, parallelize_module

    ref = train(make_model())
    out = {}
    for name, sp in (("tp2", False), ("tp2-sp", True)):
        model = parallelize_module(make_model(), mesh, tp_plan(sp))
        got = train(model, mesh=mesh)
        out[name] = {"bad": compare(ref, got), "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters())}
    # the same masks are really in use: without dropout the losses differ from the reference's
    ref_nodrop = train_no_dropout()
    out["dropout_matters"] = abs(ref_nodrop["loss"][0] - ref["loss"][0]) > 1e-3
    return out


def train_no_dropout() -> dict:
    global P_DROP
    saved, P_DROP = P_DROP, 0.0
    try:
        return train(make_model(), steps=1)
    finally:
        P_DROP = saved


def naive_dropout_differs(mesh) -> bool:
    """torch's own F.dropout on the local shard of a sequence-sharded DTensor (what the CPU RNG gives
    without the full-mask path) does not reproduce one process's mask."""
    from hyper_adaptor.parallel.tensor import Shard, distribute_tensor, manual_seed

    x = torch.ones(2, 8, 4)
    manual_seed(7)
    ref = F.dropout(x, 0.5, True)
    manual_seed(7)
    shard = distribute_tensor(x, mesh, [Shard(1)])
    local = F.dropout(shard.to_local(), 0.5, True)
    from torch.distributed.tensor import DTensor

    naive = DTensor.from_local(local, mesh, [Shard(1)]).full_tensor()
    manual_seed(7)
    from hyper_adaptor.parallel.tensor import dropout

    exact = dropout(shard, 0.5, True).full_tensor()
    return {"naive_differs": not torch.equal(naive, ref), "exact": torch.equal(exact, ref)}


def layout_and_init(rank: int) -> dict:
    from hyper_adaptor.parallel.tensor import (
        DTensor,
        Layout,
        distribute_tensor,
        from_local,
        get_current_mesh,
        init_empty_weights,
        init_parameters,
        is_partial,
        reduce_partial,
        shard_module,
    )

    out = {}
    layout = Layout((2,), ("tp",))
    x = torch.arange(24.0).reshape(4, 6)
    d = distribute_tensor(x, layout("None", "tp"))
    out["distribute"] = torch.equal(d.to_local(), x[:, 3 * rank:3 * rank + 3]) and torch.equal(d.full_tensor(), x)
    out["current_mesh"] = get_current_mesh() is layout.mesh
    f = from_local(x[2 * rank:2 * rank + 2], layout("tp", "None"))
    out["from_local"] = torch.equal(f.full_tensor(), x)
    part = DTensor.from_local(x * (rank + 1), layout.mesh, [__import__("torch.distributed.tensor",
                                                                      fromlist=["Partial"]).Partial()])
    out["partial"] = is_partial(part) and torch.equal(reduce_partial(part).to_local(), 3 * x) \
        and not is_partial(reduce_partial(part))
    try:
        distribute_tensor(torch.ones(3, 4), layout("tp", "None"))
        out["indivisible_error"] = None
    except ValueError as e:
        out["indivisible_error"] = str(e)
    plain = make_model()
    with init_empty_weights():
        lazy = TinyModel()
    shard_module(lazy, {"layers.*.mlp.fc1.weight": layout("tp", "None"), "head.weight": layout("tp", "None")})
    out["lazy_sharded"] = lazy.layers[0].mlp.fc1.weight.to_local().shape == (HIDDEN // 2, DIM) and \
        lazy.layers[0].mlp.fc1.weight.to_local().is_meta
    init_parameters(lazy, seed=0)
    out["init_bad"] = [n for (n, a), b in zip(plain.named_parameters(), lazy.parameters())
                       if not torch.equal(a, full(b))]
    out["init_local_shape"] = tuple(lazy.head.weight.to_local().shape)
    return out


def plan_checks(mesh) -> dict:
    from hyper_adaptor.parallel.tensor import ColwiseParallel, DTensor, init_device_mesh, parallelize_module

    out = {}
    model = parallelize_module(make_model(), mesh, {"layers.*.mlp.fc[12]": ColwiseParallel()})
    out["glob"] = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    for key, call in (("bad_key", lambda: parallelize_module(make_model(), mesh,
                                                             {"layers.*.mlp.fc3": ColwiseParallel()})),
                      ("bad_mesh", lambda: parallelize_module(make_model(), init_device_mesh("cpu", (2, 1), ("a", "b")),
                                                              {"head": ColwiseParallel()}))):
        try:
            call()
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
    return out


def run(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from hyper_adaptor.parallel.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), ("tp",))
    out = {"parity": tp_parity(mesh), "dropout": naive_dropout_differs(mesh),
           "layout": layout_and_init(rank), "plan": plan_checks(mesh)}
    # the last check ends in creating a mesh's groups and no collective: without a barrier a rank that is done
    # exits while the other is still connecting its pairs of the new group (gloo: connection reset by peer)
    dist.barrier()
    return out
