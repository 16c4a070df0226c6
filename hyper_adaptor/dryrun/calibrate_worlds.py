"""The calibration's measurements that start worlds of ranks (``hyper_adaptor.dryrun.calibrate`` runs them):
the latency and bandwidth of each collective on a 2-rank world of the device's backend, and megatron-core's own
fixed costs per layer, micro-batch and step and the slowdown of a real step's compute, from one-rank GPT steps.
The worlds come from the benches' launcher (``hyper_adaptor.testing.world``): this module is a micro-benchmark
of the machine, as the benches are."""

from __future__ import annotations

import time

from hyper_adaptor.dryrun.calibrate import ASSUMED_LINK, COLLECTIVES, _timer


def _collective_rank(rank: int, world_size: int, device: str, sizes: list[int], reps: int) -> dict:
    """On each rank of a 2-rank world: the fastest time of each collective at each buffer size."""
    import torch
    import torch.distributed as dist

    from hyper_adaptor import platform

    if device != "cpu":
        getattr(torch, device).set_device(rank)
    dist.init_process_group(platform.distributed_backend(device), rank=rank, world_size=world_size)
    dev = torch.device(device, rank) if device != "cpu" else torch.device("cpu")
    clock = _timer(device)
    out: dict[str, list | None] = {op: [] for op in COLLECTIVES}
    for nbytes in sizes:
        n = max(nbytes // 4, world_size)
        n -= n % world_size
        buf = torch.ones(n, device=dev)
        shard = torch.empty(n // world_size, device=dev)
        recv = torch.empty_like(buf)
        ops = {
            "all_reduce": lambda buf=buf: dist.all_reduce(buf),
            "all_gather": lambda buf=buf, shard=shard: dist.all_gather_into_tensor(buf, shard),
            "reduce_scatter": lambda buf=buf, shard=shard: dist.reduce_scatter_tensor(shard, buf),
            "all_to_all": lambda buf=buf, recv=recv: dist.all_to_all_single(recv, buf),
            "send_recv": lambda buf=buf, recv=recv: _exchange(dist, rank, buf, recv),
        }
        for op, fn in ops.items():
            if out[op] is None:
                continue
            dist.barrier()
            try:
                fn()
            except (RuntimeError, NotImplementedError):
                # a backend without this collective (both ranks fail alike): priced as the all-gather
                out[op] = None
                continue
            best = float("inf")
            for _ in range(reps):
                dist.barrier()
                t0 = clock()
                fn()
                best = min(best, clock() - t0)
            out[op].append((4 * n, best))
    dist.barrier()
    return out


def _exchange(dist, rank, buf, recv):
    # both ranks send their whole buffer to the other one: what a pipeline boundary or a ring step does
    ops = [dist.P2POp(dist.isend, buf, 1 - rank), dist.P2POp(dist.irecv, recv, 1 - rank)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def _framework_rank(rank: int, world_size: int, reps: int, tp: int = 1) -> dict:
    """megatron-core's fixed costs, from one-rank GPT training steps so small that their arithmetic is
    negligible: steps of (layers, micro-batches) = (1, 1), (3, 1), (1, 3) give a layer per micro-batch, a
    micro-batch and a step by differences, and (1, 1), (3, 1) of MoE layers (4 experts, top-2, the all-to-all
    dispatcher) an MoE layer's cost beyond a dense one's. Then the steps of COMPUTE_SHAPES, whose arithmetic is
    not negligible: their seconds (under "compute_steps") let the caller fit how much slower a training step's
    matmuls and elementwise work run than the micro-benchmarks (``step_fit.fit_compute_scales``). With ``tp`` 2
    (a 2-rank world) only COMM_SHAPE's step, tensor parallel with sequence parallel: its seconds (the slower
    rank's, under "comm_step") give how much longer the collectives inside a step take than the idle
    micro-benchmark (``step_fit.fit_comm_scale``). The model is built as bench/_gpt_step.py builds it (local
    spec, DDP, megatron's Adam)."""
    import logging
    import warnings

    # the calibration prints its figures, not megatron's build log
    logging.getLogger("megatron").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist

    from hyper_adaptor.testing.gpt import forward_step

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)  # the same tokens on every rank of a TP group

    def build(layers: int, micro: int, hidden: int = 16, heads: int = 2, seq: int = 16, vocab: int = 64,
              micro_batch: int = 1, experts: int = 0):
        tokens = torch.randint(0, vocab, (micro_batch, seq + 1))
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                 "position_ids": torch.arange(seq).unsqueeze(0).expand(micro_batch, -1),
                 "attention_mask": torch.tril(torch.ones(1, 1, seq, seq)) < 0.5}
        config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                   ffn_hidden_size=4 * hidden, use_cpu_initialization=True,
                                   pipeline_dtype=torch.float32, params_dtype=torch.float32,
                                   bias_activation_fusion=False, bias_dropout_fusion=False,
                                   masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                                   persist_layer_norm=False, tensor_model_parallel_size=tp,
                                   sequence_parallel=tp > 1,
                                   **({} if not experts else dict(  # MoE_LAYER's router and dispatcher
                                       num_moe_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=2 * hidden,
                                       moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2,
                                       moe_router_load_balancing_type="aux_loss", add_bias_linear=False)))
        spec = get_gpt_layer_local_spec(num_experts=experts or None)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0,
                                                           params_dtype=torch.float32), [ddp])
        config.finalize_model_grads_func = finalize_model_grads

        def one():
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch] * micro),
                                        model=ddp, num_microbatches=micro, seq_length=seq,
                                        micro_batch_size=micro_batch, forward_only=False)
            optimizer.step()

        one()
        return one

    if tp > 1:
        one = build(**COMM_SHAPE)
        times = []
        for _ in range(reps):
            dist.barrier()
            times.append(_timed(one))
        return {"comm_step": {**COMM_SHAPE, "tp": tp, "seconds": min(times)}}
    # the steps take turns, so that whatever else runs on the machine slows them alike
    # (the 3-layer MoE model first: megatron's MoE metrics tracker sizes its per-layer record on the first model)
    steps = [build(1, 1), build(3, 1), build(1, 3), build(3, 1, experts=4), build(1, 1, experts=4)]
    best = [float("inf")] * len(steps)
    for _ in range(reps):
        for i, one in enumerate(steps):
            best[i] = min(best[i], _timed(one))
    base, layers3, micro3, moe3, moe1 = best
    layer = max((layers3 - base) / 2, 0.0)
    micro = max((micro3 - base) / 2 - layer, 0.0)
    # an MoE layer's fixed cost beyond a dense one's: its router, top-k, aux loss, token permutation and the
    # per-expert loop, which at this size are all operator dispatch
    moe_layer = max((moe3 - moe1) / 2 - layer, 0.0)
    # each alone, as a training run has the machine's caches to itself (taking turns with the steps above, they
    # measured 10-20 % slower)
    compute = []
    for shape in COMPUTE_SHAPES:
        one = build(**shape)
        compute.append({**shape, "seconds": min(_timed(one) for _ in range(reps))})
    return {"layer_s": layer, "micro_batch_s": micro, "step_s": max(base - layer - micro, 0.0),
            "moe_layer_s": moe_layer, "compute_steps": compute}


# Two one-rank GPT steps whose arithmetic is a real share of the time, one mostly matmuls (hidden 256, short
# sequence: about 5 x the model's elementwise time) and one mostly elementwise work (hidden 32, long sequence:
# the attention probabilities' passes, about 5 x its matmul time), so that the two slowdowns against the
# micro-benchmarks can be told apart. Not the accuracy matrix's model (hidden 128, sequence 256): the fit is
# checked on a model it was not made on. The matmuls' slowdown grows with their size on this CPU (about 1.3 at
# hidden 256, 2-2.5 at hidden 512, as operands leave the caches): a model far larger than these is priced
# with the hidden-256 figure.
COMPUTE_SHAPES = (
    {"layers": 2, "micro": 2, "hidden": 256, "heads": 4, "seq": 128, "vocab": 512, "micro_batch": 2},
    {"layers": 2, "micro": 2, "hidden": 32, "heads": 4, "seq": 512, "vocab": 64, "micro_batch": 1},
)


# The tensor-parallel step: the matmul-heavy GPT above on 2 ranks (hidden 256 in 128-wide shards), its activations
# gathered and reduce-scattered around every attention and MLP block; its compute is what the one-rank step fitted.
COMM_SHAPE = COMPUTE_SHAPES[0]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def framework() -> dict:
    from hyper_adaptor.testing.world import WorldError, run_world

    try:
        found = run_world(1, "hyper_adaptor.dryrun.calibrate_worlds:_framework_rank", timeout=180, reps=15)[0]
    except WorldError:
        return {}
    try:
        ranks = run_world(2, "hyper_adaptor.dryrun.calibrate_worlds:_framework_rank", timeout=180, reps=15, tp=2)
        found["comm_step"] = max((r["comm_step"] for r in ranks), key=lambda step: step["seconds"])
    except WorldError:
        pass
    return found


def _sent_fraction(op: str, group: int) -> float:
    """Bytes one rank sends per byte of the collective's (full) buffer."""
    if op == "all_reduce":
        return 2 * (group - 1) / group
    if op == "send_recv":
        return 1.0
    return (group - 1) / group


def _fit(points: list[tuple[int, float]], op: str) -> dict[str, float]:
    """latency + sent bytes / rate through the smallest and the largest buffer (2 ranks: one ring step)."""
    (b0, t0), (b1, t1) = points[0], points[-1]
    s0, s1 = b0 * _sent_fraction(op, 2), b1 * _sent_fraction(op, 2)
    rate = (s1 - s0) / max(t1 - t0, 1e-9)
    latency = max(t0 - s0 / rate, 1e-7)
    return {"latency_s": latency, "bytes_per_s": rate}


def collectives(device: str) -> tuple[dict, str]:
    from hyper_adaptor.testing.world import WorldError, run_world

    if device != "cpu":
        import torch

        if getattr(torch, device).device_count() < 2:
            latency, rate = ASSUMED_LINK[device]
            return ({op: {"latency_s": latency, "bytes_per_s": rate} for op in COLLECTIVES},
                    "assumed (one device: no second rank to measure a link)")
    sizes = [16 * 2 ** 10, 4 * 2 ** 20] if device == "cpu" else [64 * 2 ** 10, 64 * 2 ** 20]
    try:
        results = run_world(2, "hyper_adaptor.dryrun.calibrate_worlds:_collective_rank", timeout=120,
                            device=device, sizes=sizes, reps=5)
    except WorldError as err:
        latency, rate = ASSUMED_LINK[device]
        first = str(err).splitlines()[0]
        return ({op: {"latency_s": latency, "bytes_per_s": rate} for op in COLLECTIVES},
                f"assumed (the 2-rank world failed: {first})")
    table, missing = {}, []
    for op in COLLECTIVES:
        if results[0][op] is None:
            missing.append(op)
            continue
        # the slower rank's time is the collective's
        points = [(nbytes, max(r[op][i][1] for r in results)) for i, (nbytes, _) in enumerate(results[0][op])]
        table[op] = _fit(points, op)
    for op in missing:
        table[op] = dict(table.get("all_gather") or table["all_reduce"])
    if missing:
        return table, f"measured ({', '.join(missing)} not served by the backend: priced as all_gather)"
    return table, "measured"
