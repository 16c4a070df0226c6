"""HSDP library checks, run inside a gloo world (hyper_adaptor/testing/world.py).

A small tied-embedding model whose blocks mix parameters above and below the size threshold, with
row counts that do not divide the shard size (so padding is exercised), trained for a few Adam
steps under each HSDP configuration and compared with the same model trained in one process on
the whole global batch (every rank computes that reference locally, without communication).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HIDDEN, SEQ = 40, 16, 36, 6
GLOBAL_BATCH = 16  # 4 sequences per rank on 4 ranks: 4 micro-batches of 1 for accumulation
STEPS = 3
THRESHOLD_KB = 1  # 1 KB: the 16x36 / 36x16 / 40x16 matrices are sharded; norms and biases stay whole


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.norm(self.fc1(x))))


class TinyLM(nn.Module):
    def __init__(self, blocks: int = 3):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.out_norm = nn.LayerNorm(DIM)
        # e.g. torch.utils.checkpoint.checkpoint: each region of ``region`` blocks recomputed in backward
        self.checkpoint, self.region = None, 1

    def forward(self, tokens):
        x = self.emb(tokens)
        for start in range(0, len(self.blocks), self.region):
            x = self._blocks(x, start) if self.checkpoint is None else self.checkpoint(self._blocks, x, start)
        return F.linear(self.out_norm(x), self.emb.weight)  # tied head

    def _blocks(self, x, start: int):
        for block in self.blocks[start : start + self.region]:
            x = block(x)
        return x


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)


def loss_of(model, tokens) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def reference(steps: int = STEPS, lr: float = 1e-2) -> dict:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    losses, first_grads = [], {}
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, batch(step))
        loss.backward()
        if step == 0:
            first_grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return {"loss": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "first_grads": first_grads}


def wrap(model, **kwargs):
    from hyper_adaptor.parallel.hsdp import hsdp

    for block in model.blocks:
        hsdp(block, **kwargs)
    return hsdp(model, **kwargs)


def full_params(model) -> dict:
    out = {}
    for name, value in model.state_dict().items():
        out[name] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return out


def train(model, *, micro_batches: int = 1, steps: int = STEPS, lr: float = 1e-2, comm_async: bool = False) -> list:
    from hyper_adaptor.parallel.hsdp import hsdp_sync_stream

    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        mine = batch(step).chunk(world)[rank]
        total = torch.zeros(())
        for i, micro in enumerate(mine.chunk(micro_batches)):
            if micro_batches > 1:
                model.set_requires_grad_sync(i == micro_batches - 1)
            loss = loss_of(model, micro) / micro_batches
            loss.backward()
            total += loss.detach()
        if comm_async:
            hsdp_sync_stream()
        opt.step()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def compare(ref: dict, losses: list, params: dict, rtol: float = 1e-6, atol: float = 1e-6) -> list[str]:
    # a run that logged fewer steps or fewer parameters is a difference, never a pass
    if len(losses) != len(ref["loss"]) or not losses:
        return [f"{len(losses)} losses logged against the reference's {len(ref['loss'])}"]
    if set(params) != set(ref["params"]):
        return [f"parameters {sorted(set(params) ^ set(ref['params']))} on one side only"]
    problems = []
    for step, (want, got) in enumerate(zip(ref["loss"], losses)):
        if abs(want - got) > rtol * abs(want):
            problems.append(f"step {step}: loss {got!r} vs {want!r}")
    for name, want in ref["params"].items():
        diff = (want - params[name]).abs().max().item()
        if diff > atol:
            problems.append(f"param {name}: max |diff| {diff:.3g}")
    return problems


def level_matrix(rank: int, world_size: int) -> dict:
    """Every level x shard_size {2, 4} x comm_async x comm_fusion: problems per configuration."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ref = reference()
    results = {}
    for level in ("level1", "level2", "level3"):
        for shard_size in (2, 4):
            for comm_async in (False, True):
                for comm_fusion in (False, True):
                    key = (f"{level}-S{shard_size}-{'async' if comm_async else 'sync'}-"
                           f"{'fused' if comm_fusion else 'per-param'}")
                    model = wrap(
                        make_model(), optimizer_level=level, shard_size=shard_size, threshold=THRESHOLD_KB,
                        comm_async=comm_async, comm_fusion=comm_fusion, bucket_size=-1 if comm_fusion else 0,
                    )
                    losses = train(model, comm_async=comm_async)
                    results[key] = compare(ref, losses, full_params(model))
    return results


def grad_accumulation(rank: int, world_size: int) -> dict:
    """4 micro-batches per rank, synced only on the last, against the whole batch in one process;
    and two synced backwards in one step (gradient shards accumulate exactly)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ref = reference()
    results = {}
    for level in ("level1", "level2", "level3"):
        for shard_size in (2, 4):
            model = wrap(make_model(), optimizer_level=level, shard_size=shard_size, threshold=THRESHOLD_KB,
                         enable_grad_accumulation=True, comm_fusion=True, bucket_size=2)
            results[f"noSync-{level}-S{shard_size}"] = compare(ref, train(model, micro_batches=4), full_params(model))
    for level in ("level1", "level2", "level3"):
        for shard_size in (2, 4):
            model = wrap(make_model(), optimizer_level=level, shard_size=shard_size, threshold=THRESHOLD_KB)
            results[f"sync2-{level}-S{shard_size}"] = compare(ref, _train_synced_twice(model), full_params(model))
    return results


def _train_synced_twice(model) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = torch.zeros(())
        for micro in batch(step).chunk(world)[rank].chunk(2):
            loss = loss_of(model, micro) / 2
            loss.backward()  # reduced every time: the shard gradients must add up
            total += loss.detach()
        opt.step()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def structure(rank: int, world_size: int) -> dict:
    """What is sharded, shapes of the shards, and the memory a level keeps."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    out = {}
    for level in ("level1", "level2", "level3"):
        model = wrap(make_model(), optimizer_level=level, shard_size=4, threshold=THRESHOLD_KB)
        train(model, steps=1)
        info = {}
        for name, param in model.named_parameters():
            hp = param._hsdp_param
            info[name] = {
                "sharded": hp.sharded, "local_shape": tuple(param.to_local().shape), "full_shape": tuple(param.shape),
                "full_storage": hp.full.untyped_storage().size(),
                "full_grad": None if hp.full.grad is None else tuple(hp.full.grad.shape),
                "grad_local_shape": None if param.grad is None else tuple(param.grad.to_local().shape),
            }
        out[level] = info
    return out


def extras(rank: int, world_size: int) -> dict:
    """Grad accumulation, structure, clipping and bf16 compute in one world (a world costs ~10 s)."""
    out = {"accumulation": grad_accumulation(rank, world_size)}
    out["structure"] = structure(rank, world_size)
    out["clip"] = _clip_matches_reference()
    out["bf16"] = _bf16_compute()
    out["offload"] = _offload()
    out["collectives"] = _collective_paths()
    out["per_object"] = _per_object_settings()
    out["reshard_schedule"] = _reshard_schedule()
    out["in_flight"] = _reductions_in_flight()
    out["bucket_bound"] = _bucket_bound()
    out["recompute"] = _recompute_gathers()
    return out


BOUND_BUCKET_KB = 3  # larger than every sharded parameter (2.5 KB at most), far smaller than the model


class _RecordingTorch:
    """Stands in for ``torch`` inside hyper_adaptor/parallel/hsdp/_bucket.py: records the bytes of
    every buffer that module allocates with ``torch.empty`` (gather send buffers, reduction outputs,
    all-reduce buffers of whole parameters); everything else is torch's."""

    def __init__(self, real, sizes: list):
        self._real, self._sizes = real, sizes

    def __getattr__(self, name):
        return getattr(self._real, name)

    def empty(self, *args, **kwargs):
        t = self._real.empty(*args, **kwargs)
        self._sizes.append(t.numel() * t.element_size())
        return t


def _bucket_bound() -> dict:
    """``bucket_size`` smaller than the model (3 KB; the model's sharded parameters are ~16 KB): per
    level, 3 Adam steps (so levels 1/2 re-gather every unit after an optimizer step, and level 1 reduces
    at the end of backward) recording the largest communication buffer allocated in a step — every
    block the pool hands out (a reused block counted at its whole size) and every buffer _bucket.py
    allocates itself — the largest block the pool holds after the steps, and parity."""
    from hyper_adaptor.parallel.hsdp import HostBufferPool, _bucket

    class RecordingPool(HostBufferPool):
        def take(self, numel, dtype, device):
            t = super().take(numel, dtype, device)
            block = t if t._base is None else t._base
            sizes.append(block.numel() * block.element_size())
            return t

    ref = reference()
    out = {"bucket_bytes": int(BOUND_BUCKET_KB * 1024)}
    real = _bucket.torch
    for level in ("level1", "level2", "level3"):
        sizes: list[int] = []
        pool = RecordingPool()
        model = wrap(make_model(), optimizer_level=level, shard_size=4, threshold=THRESHOLD_KB, comm_fusion=True,
                     bucket_size=BOUND_BUCKET_KB, buffer_pool=pool)
        _bucket.torch = _RecordingTorch(real, sizes)
        try:
            losses = train(model)
        finally:
            _bucket.torch = real
        out[level] = {
            "problems": compare(ref, losses, full_params(model)),
            "largest_buffer": max(sizes, default=0), "buffers": len(sizes),
            "largest_pooled_after": max((b.numel() * b.element_size() for bs in pool.free.values() for b in bs),
                                        default=0),
            "model_bytes": sum(p._hsdp_param.full.numel() * 4 for p in model.parameters() if p._hsdp_param.sharded),
        }
    return out


def _reductions_in_flight() -> dict:
    """Per level and comm_async (one bucket per parameter, so there are many reductions): the most
    gradient reductions started and not yet finished at any moment of a backward, and how many
    overlapped backward compute (another gradient was accumulated between their start and finish).
    comm_async=False keeps at most one in flight, each overlapping the next gradients; comm_async=True
    lets them all run until the end of backward."""
    from hyper_adaptor.parallel.hsdp import _bucket, _state

    live = {"now": 0, "most": 0, "overlapped": 0, "grads": 0}
    original_init, original_finish = _bucket._Reduction.__init__, _bucket._Reduction.finish
    original_accumulate = _state.HSDPState._after_accumulate

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self._grads_at_start = live["grads"]
        live["now"] += 1
        live["most"] = max(live["most"], live["now"])

    def finish(self):
        live["now"] -= 1
        live["overlapped"] += live["grads"] > self._grads_at_start
        original_finish(self)

    def accumulate(self, full):
        live["grads"] += 1
        original_accumulate(self, full)

    out = {}
    _bucket._Reduction.__init__, _bucket._Reduction.finish = init, finish
    _state.HSDPState._after_accumulate = accumulate  # (bound by the hooks at wrap time, below)
    try:
        for level in ("level2", "level3"):
            for comm_async in (False, True):
                model = wrap(make_model(), optimizer_level=level, shard_size=4, threshold=THRESHOLD_KB,
                             comm_async=comm_async, comm_fusion=False)
                live.update(most=0, overlapped=0)
                loss_of(model, batch(0).chunk(dist.get_world_size())[dist.get_rank()]).backward()
                out[f"{level}-{'async' if comm_async else 'sync'}"] = {
                    "most": live["most"], "left": live["now"], "overlapped": live["overlapped"]}
    finally:
        _bucket._Reduction.__init__, _bucket._Reduction.finish = original_init, original_finish
        _state.HSDPState._after_accumulate = original_accumulate
    return out


def _reshard_schedule() -> dict:
    """Level 3: which units hold their full parameters between forward and backward (default: the
    root and the last block; ``set_reshard_after_forward(True)``: none), inside backward once the first
    block's gradients are packed (only the root, whose tied embedding's gradient comes last: every
    block's full parameters were freed as their gradients were packed), after backward (none), after a
    forward without grad (none); the bytes gathered per step either way; parity of both with the
    reference."""
    ref = reference()
    rank, world = dist.get_rank(), dist.get_world_size()

    def held(model) -> dict:
        units = {"root": model, **{f"blocks.{i}": b for i, b in enumerate(model.blocks)}}
        return {name: any(hp.sharded and hp.full.untyped_storage().size() > 0 for hp in unit._hsdp_state.params)
                for name, unit in units.items()}

    out = {}
    for variant in ("default", "reshard-all"):
        model = wrap(make_model(), optimizer_level="level3", shard_size=4, threshold=THRESHOLD_KB)
        if variant == "reshard-all":
            model.set_reshard_after_forward(True)
        problems = compare(ref, train(model), full_params(model))
        mine = batch(0).chunk(world)[rank]
        with torch.no_grad():
            loss_of(model, mine)
        after_no_grad = held(model)
        # inside backward, once blocks.0.fc1.weight's gradient is accumulated (HSDP's own hook, registered
        # first, has packed it for reduction): which units still hold full parameters
        fc1 = next(hp for hp in model.blocks[0]._hsdp_state.params if hp.owners[0] == (model.blocks[0].fc1, "weight"))
        during: dict = {}
        hook = fc1.full.register_post_accumulate_grad_hook(lambda _: during.update(held(model)))
        before = model.hsdp_comm_bytes()
        loss = loss_of(model, mine)
        between = held(model)
        loss.backward()
        hook.remove()
        out[variant] = {"problems": problems, "after_no_grad": after_no_grad, "between": between,
                        "during_backward": during, "after_backward": held(model),
                        "step_bytes": model.hsdp_comm_bytes() - before}
    try:
        model.set_reshard_after_forward("yes")
    except ValueError as exc:
        out["bad_value"] = str(exc)
    return out


class _CountCollectives:
    """While entered, counts the calls of the torch.distributed collectives HSDP may shard with (it
    calls them through the module's attributes, which are wrapped here)."""

    NAMES = ("all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor", "isend", "irecv")

    def __init__(self):
        self.calls = dict.fromkeys(self.NAMES, 0)
        self.originals = {}

    def __enter__(self):
        self.originals = {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self.originals.items():
            setattr(dist, name, self._counting(name, fn))
        return self

    def __exit__(self, *exc_info):
        for name, fn in self.originals.items():
            setattr(dist, name, fn)

    def _counting(self, name, fn):
        def call(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return call


class _Waited:
    """A handle already waited on (waiting again is a no-op)."""

    def __init__(self, work):
        if work is not None:
            work.wait()

    def wait(self) -> None:
        pass


def _collective_paths() -> dict:
    """HSDP's reduce-scatter and all-gather on gloo (each as an all-to-all) and gloo's own, sync and
    async, over the world and over a 2-rank subgroup, fp32 and bf16: the reduce-scatter gives this
    rank's chunk of the sum over the group, the all-gather every member's input in rank order, both
    against what is computed locally from every member's (seeded) input. Also which collective ran."""
    from hyper_adaptor.parallel.hsdp import HostBufferPool, _bucket

    rank = dist.get_rank()
    pair = dist.new_group([0, 1]) if dist.get_world_size() >= 2 else None
    groups = {"world": (None, list(range(dist.get_world_size())))}
    if rank in (0, 1):
        groups["pair"] = (pair, [0, 1])
    pool = HostBufferPool()
    problems = []

    def reduce_scatter(inputs, me, group, async_op, as_all_to_all):
        out = torch.empty(7, dtype=inputs[me].dtype)
        pool.free.clear()
        work = _bucket.reduce_scatter(out, inputs[me].clone(), group, async_op, pool, as_all_to_all)
        if as_all_to_all:
            # the exchange's receive buffer (S-1 chunks) comes from the pool and is back only after the
            # transfer (a block handed out while a peer may still write it would be corrupted)
            if async_op and pool.reserved_bytes() != 0:
                problems.append(f"rs async: a pooled block is back before the wait ({pool.reserved_bytes()} B)")
            work = _Waited(work)
            want_back = (len(inputs) - 1) * 7 * out.element_size()
            if pool.reserved_bytes() != want_back:
                problems.append(f"rs: {pool.reserved_bytes()} B pooled after the transfer, not {want_back}")
        return out, work, torch.stack([t.float() for t in inputs]).sum(0)[me * 7 : (me + 1) * 7]

    def all_gather(inputs, me, group, async_op, as_all_to_all):
        shard = inputs[me][:7].clone()
        out = torch.empty(7 * len(inputs), dtype=shard.dtype)
        work = _bucket.all_gather(out, shard, group, async_op, as_all_to_all)
        return out, work, torch.cat([t[:7].float() for t in inputs])

    used = {}
    with _CountCollectives() as counted:
        calls = counted.calls
        for op_name, op in (("rs", reduce_scatter), ("ag", all_gather)):
            for as_all_to_all in (True, False):
                for gname, (group, members) in groups.items():
                    S, me = len(members), members.index(rank)
                    for dtype in (torch.float32, torch.bfloat16):
                        for async_op in (False, True):
                            inputs = [torch.randn(S * 7, generator=torch.Generator().manual_seed(100 + m)).to(dtype)
                                      for m in members]
                            before = dict(calls)
                            out, work, want = op(inputs, me, group, async_op, as_all_to_all)
                            if async_op:
                                work.wait()
                            tol = 1e-6 if dtype == torch.float32 else 2e-2
                            err = (out.float() - want).abs().max().item()
                            key = (f"{op_name}-{'a2a' if as_all_to_all else 'gloo'}-{gname}-{dtype}-"
                                   f"{'async' if async_op else 'sync'}")
                            if err > tol * max(1.0, want.abs().max().item()):
                                problems.append(f"{key}: max error {err}")
                            used[key] = [n for n in calls if calls[n] > before[n]]
    return {"problems": problems, "used": used}


def _per_object_settings() -> dict:
    """Models wrapped with different gloo switches and buffer pools, all alive in one process: each
    trains with the collectives it was given (gloo's own, all-to-all, or one of each) and takes its
    buffers from its own pool only; every one matches the reference. Levels 1 (parameters gathered
    again after each optimizer step) and 3 (gathered for every forward and backward)."""
    from hyper_adaptor.parallel.hsdp import HostBufferPool

    class CountingPool(HostBufferPool):
        def __init__(self):
            super().__init__()
            self.takes = 0

        def take(self, *args, **kwargs):
            self.takes += 1
            return super().take(*args, **kwargs)

    ref = reference()
    variants = {"gloo": (False, False), "a2a": (True, True), "rs-a2a": (True, False)}
    out = {}
    for level in ("level1", "level3"):
        pools = {name: CountingPool() for name in variants}
        models = {
            name: wrap(make_model(), optimizer_level=level, shard_size=4, threshold=THRESHOLD_KB, comm_fusion=True,
                       buffer_pool=pools[name], gloo_reduce_scatter_as_all_to_all=rs,
                       gloo_all_gather_as_all_to_all=ag)
            for name, (rs, ag) in variants.items()
        }
        for name, model in models.items():
            takes = {other: pool.takes for other, pool in pools.items()}
            with _CountCollectives() as counted:
                losses = train(model)
            out[f"{level}-{name}"] = {
                "problems": compare(ref, losses, full_params(model)), "calls": counted.calls,
                "takes": {other: pool.takes - takes[other] for other, pool in pools.items()},
            }
    return out


def _offload() -> dict:
    """offload=True at each level: same numerics as the reference, and the shards, their gradients
    and the optimizer state are host tensors. (On this CPU-only machine the compute device is the host
    too, so this checks the offload code path and parity, not a device-to-host move.)"""
    ref = reference()
    out = {}
    for level in ("level1", "level2", "level3"):
        model = wrap(make_model(), optimizer_level=level, shard_size=2, threshold=THRESHOLD_KB, offload=True)
        losses = train(model)
        problems = compare(ref, losses, full_params(model))
        devices = {p.to_local().device.type for p in model.parameters()}
        devices |= {p.grad.to_local().device.type for p in model.parameters() if p.grad is not None}
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
        loss_of(model, batch(0).chunk(dist.get_world_size())[dist.get_rank()]).backward()
        opt.step()
        devices |= {v.to_local().device.type for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0}
        out[level] = {"problems": problems, "devices": sorted(devices)}
    return out


def _clip_matches_reference() -> dict:
    """HSDP's clip_grad_norm_ returns the reference's global norm and clips identically."""
    from hyper_adaptor.parallel.hsdp import clip_grad_norm_

    ref = make_model()
    loss_of(ref, batch(0)).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()
    out = {}
    for level in ("level1", "level3"):
        model = wrap(make_model(), optimizer_level=level, shard_size=2, threshold=THRESHOLD_KB)
        loss_of(model, batch(0).chunk(dist.get_world_size())[dist.get_rank()]).backward()
        norm = clip_grad_norm_(model, 0.5).item()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        worst = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
        out[level] = {"norm": norm, "ref_norm": ref_norm, "max_grad_diff": worst}
    return out


def _bf16_compute() -> dict:
    """param_dtype=bf16 (fp32 shards as master weights, fp32 reduction): the gathered copies are bf16
    and the losses stay within bf16 rounding of the fp32 reference."""
    ref = reference()
    model = wrap(make_model(), optimizer_level="level3", shard_size=4, threshold=THRESHOLD_KB,
                 param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dtypes = {}

    def record(fc1, args):  # inside the block's forward: the gathered copy is registered
        dtypes.setdefault("fc1", fc1.weight.dtype)

    model.blocks[0].fc1.register_forward_pre_hook(record)
    losses, first_grads = [], {}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    for step in range(STEPS):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, batch(step).chunk(dist.get_world_size())[dist.get_rank()])
        loss.backward()
        if step == 0:  # the reduced (averaged) gradients, whole, against the fp32 reference's
            first_grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                           for name, p in model.named_parameters() if p.grad is not None}
        opt.step()
        total = loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    shard_dtype = next(model.parameters()).dtype
    return {"losses": losses, "ref": ref["loss"], "gathered_dtype": str(dtypes.get("fc1")),
            "shard_dtype": str(shard_dtype),
            "grads": first_grads, "ref_grads": ref["first_grads"]}


def _recompute_gathers() -> dict:
    """Level 3 with every block checkpointed, by torch's reentrant checkpoint (megatron's CheckpointFunction
    under ``--recompute-granularity full`` works the same way: forward under no_grad, the block rerun from
    its node's backward before the block's own backward begins) and by the non-reentrant one, and with all
    three blocks in one reentrant region, against the same model without checkpointing; 3 Adam steps each.
    Per step, every all-gather issued (``_GatherRun``: one per unit here, at level 3) as (phase, unit,
    whether that unit's backward was already done: its gradients packed for reduction); the losses, the
    first step's gradient shards and the final parameters (compared bitwise between the variants), and the
    plain run's parity with the reference."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    from hyper_adaptor.parallel.hsdp import _bucket

    rank, world = dist.get_rank(), dist.get_world_size()
    now = {"phase": "forward", "done": set(), "events": [], "unit_of": {}}
    original_launch, original_pack = _bucket._GatherRun.launch, _bucket.Bucket.pack_grads

    def launch(self):
        for b in self.members:
            unit = now["unit_of"].get(id(b), "?")
            now["events"].append((now["phase"], unit, unit in now["done"]))
        original_launch(self)

    def pack_grads(self, blocks):
        now["done"].add(now["unit_of"].get(id(self), "?"))
        original_pack(self, blocks)

    reentrant = partial(checkpoint, use_reentrant=True)
    # name -> (checkpoint, blocks per checkpointed region)
    variants = {"plain": (None, 1), "reentrant": (reentrant, 1),
                "non-reentrant": (partial(checkpoint, use_reentrant=False), 1), "reentrant-region3": (reentrant, 3)}
    out = {}
    _bucket._GatherRun.launch, _bucket.Bucket.pack_grads = launch, pack_grads
    try:
        for name, (ckpt, region) in variants.items():
            # one bucket per unit (comm_fusion, bucket_size=-1): an all-gather is a unit's
            model = wrap(make_model(), optimizer_level="level3", shard_size=4, threshold=THRESHOLD_KB,
                         comm_fusion=True, bucket_size=-1)
            model.checkpoint, model.region = ckpt, region
            units = {"root": model, **{f"blocks.{i}": b for i, b in enumerate(model.blocks)}}
            now["unit_of"] = {id(b): unit for unit, m in units.items() for b in m._hsdp_state.buckets}
            opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
            losses, steps, grads = [], [], {}
            for step in range(STEPS):
                opt.zero_grad()
                now.update(phase="forward", done=set(), events=[])
                loss = loss_of(model, batch(step).chunk(world)[rank])
                loss.register_hook(lambda grad: now.update(phase="backward"))
                loss.backward()
                if step == 0:
                    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
                opt.step()
                steps.append(list(now["events"]))
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(total.item() / world)
            out[name] = {"steps": steps, "losses": losses, "grads": grads, "params": full_params(model)}
    finally:
        _bucket._GatherRun.launch, _bucket.Bucket.pack_grads = original_launch, original_pack
    out["plain"]["problems"] = compare(reference(), out["plain"]["losses"], out["plain"]["params"])
    return out
