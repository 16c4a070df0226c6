"""A tiny megatron-core GPT trained for a few Adam steps under a given parallel layout.

Used by the parity tests and by bench/level0_overhead.py. Runs inside a rank of ``world.run_world``
(so the one-line adaptor is already imported). Returns, on every rank, the per-step mean loss and
the full (TP-gathered, globally named) gradients and parameters after each step, merged over the
world, so rank 0 can compare them with the single-process reference of the same model and seed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

SEQ = 32
VOCAB = 128
MICRO_BATCH = 2
GLOBAL_BATCH = 8
LAYERS = 4


@dataclass
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # with cp > 1: megatron's --cp-comm-type (p2p / a2a / allgather / a2a+p2p) and, for a2a+p2p, its
    # --hierarchical-context-parallel-sizes (Ulysses degree, ring size)
    cp_comm_type: str | None = None
    hierarchical_cp: list | None = None
    vpp: int | None = None
    sequence_parallel: bool = False
    ddp_overlap: bool = False
    distributed_optimizer: bool = False
    bf16: bool = False
    steps: int = 3
    dropout: float = 0.0
    seed: int = 1234
    batch_p2p_comm: bool | None = None  # None: unbatched for PP=2 with VPP (see the PP2-VPP trap test)
    extra: dict = field(default_factory=dict)  # TransformerConfig fields (override the defaults below)
    model: dict = field(default_factory=dict)  # GPTModel keyword arguments
    spec: dict = field(default_factory=dict)  # get_gpt_layer_local_spec keyword arguments (e.g. num_experts)
    # Megatron-style feature arguments (e.g. {"optimization_level": 1, "use_fused_rmsnorm": True}):
    # given to the process-wide adaptor's prepare + apply_features before the model is built, as
    # megatron.training's validate_args would. Applied features stay applied in that process.
    features: dict | None = None
    # megatron.core.transformer config class: "MLATransformerConfig" for multi-latent attention (with
    # spec={"multi_latent_attention": True} and its head sizes in extra)
    config_class: str = "TransformerConfig"
    # after the steps, one forward-only pass (megatron's evaluation) over the first batch: history["eval"]
    evaluate: bool = False


def _batches(step: int, seed: int):
    """The global batch of ``step``: GLOBAL_BATCH sequences of SEQ+1 tokens, same on every rank."""
    g = torch.Generator().manual_seed(seed)  # the same batch each step, so the loss must fall
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return [tokens[i : i + MICRO_BATCH] for i in range(0, GLOBAL_BATCH, MICRO_BATCH)]


def _micro_batch_dicts(micro_batches):
    out = []
    for mb in micro_batches:
        out.append(
            {
                "tokens": mb[:, :-1].contiguous(),
                "labels": mb[:, 1:].contiguous(),
                "position_ids": torch.arange(SEQ).unsqueeze(0).expand(mb.shape[0], SEQ).contiguous(),
                "attention_mask": torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5,
            }
        )
    return out


def build(layout: Layout, init_params: dict | None = None):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import transformer_config

    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        hierarchical_context_parallel_sizes=layout.hierarchical_cp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(layout.seed)
    torch.manual_seed(layout.seed)
    if layout.features is not None:
        import types

        from hyper_adaptor.megatron_adaptor import ADAPTOR

        args = types.SimpleNamespace(transformer_impl="local", **layout.features)
        ADAPTOR.prepare(args)
        ADAPTOR.apply_features(args)
    config_kwargs = dict(
        num_layers=LAYERS,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        hidden_dropout=layout.dropout,
        attention_dropout=layout.dropout,
        use_cpu_initialization=True,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        cp_comm_type=layout.cp_comm_type,
        sequence_parallel=layout.sequence_parallel,
        pipeline_dtype=torch.bfloat16 if layout.bf16 else torch.float32,
        params_dtype=torch.bfloat16 if layout.bf16 else torch.float32,
        bf16=layout.bf16,
        batch_p2p_comm=(
            not (layout.vpp and layout.pp == 2) if layout.batch_p2p_comm is None else layout.batch_p2p_comm
        ),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    config_kwargs.update(layout.extra)
    config = getattr(transformer_config, layout.config_class)(**config_kwargs)
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        stage = vp_stage if layout.vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(**layout.spec),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=layout.vpp is None, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=layout.vpp is None, vp_stage=stage),
            vp_stage=stage,
            **{"share_embeddings_and_output_weights": True, **layout.model},
        )
        if init_params is not None:
            # Same starting point as the reference: megatron seeds each pipeline stage from the same
            # CPU generator state, so stage 1 would otherwise draw layers 2-3 from layer 0's numbers.
            _load_full(model, init_params)
        if layout.bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=layout.ddp_overlap,
            use_distributed_optimizer=layout.distributed_optimizer,
            bucket_size=4096 if layout.ddp_overlap else None,
        )
        chunks.append(
            DistributedDataParallel(config, ddp_config, model, disable_bucketing=(vp_stage > 0))
        )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            weight_decay=0.01,
            clip_grad=1.0,
            bf16=layout.bf16,
            params_dtype=torch.bfloat16 if layout.bf16 else torch.float32,
            use_distributed_optimizer=layout.distributed_optimizer,
        ),
        chunks,
    )
    return config, chunks, optimizer


def _global_name(chunk, name: str) -> str:
    """Parameter name with the global layer index, so stages and chunks line up with the reference."""
    module = chunk
    while hasattr(module, "module"):
        module = module.module
    match = re.match(r"(?:module\.)*decoder\.layers\.(\d+)\.(.*)", name)
    if match:
        layer = module.decoder.layers[int(match.group(1))]
        return f"decoder.layers.{layer.layer_number - 1}.{match.group(2)}"
    name = re.sub(r"^(?:module\.)+", "", name)
    if name == "output_layer.weight" and module.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"  # the tied copy on the last stage
    return name


def _full(tensor, param):
    """The whole tensor of a TP-partitioned parameter (gathered along its partition dimension)."""
    from megatron.core import parallel_state as ps

    tensor = tensor.detach().float()
    if not getattr(param, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_world_size() == 1:
        return tensor.clone()
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def _load_full(model, full: dict) -> None:
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = full[_global_name(model, name)]
            if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
                value = value.chunk(tp_size, dim=param.partition_dim)[tp_rank]
            param.copy_(value)


def _snapshot(chunks, what: str) -> dict:
    out = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            value = param if what == "param" else getattr(param, "main_grad", None)
            if value is None:
                continue
            out[_global_name(chunk, name)] = _full(value, param)
    return out


def _merge_over_world(local: dict) -> dict:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = {}
    for part in gathered:
        merged.update(part)
    return merged


def train(rank: int, world_size: int, layout: Layout, init_params: dict | None = None) -> dict:
    """Run ``layout.steps`` Adam steps; returns losses, grads and params per step (merged)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    config, chunks, optimizer = build(layout, init_params)
    config.finalize_model_grads_func = finalize_model_grads
    if layout.ddp_overlap:
        config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        config.grad_sync_func = [c.start_grad_sync for c in chunks] if len(chunks) > 1 else chunks[0].start_grad_sync

    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    num_micro = GLOBAL_BATCH // MICRO_BATCH // dp_size
    forward_backward = get_forward_backward_func()

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

        def loss_func(output_tensor):
            # megatron's two-value loss convention under context parallel (Megatron-LM's pretrain_gpt):
            # this rank's token-loss sum over the token count of the whole sequence; the schedule
            # multiplies it by the CP size (in place, so the reported value is this rank's mean) and the
            # gradients are averaged over data x context
            loss = output_tensor.float().mean() / layout.cp
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    history = {"loss": [], "grads": [], "params": [], "init": _merge_over_world(_snapshot(chunks, "param"))}
    def my_micro_batches(step: int) -> list:
        micro = _micro_batch_dicts(_batches(step, layout.seed))
        if layout.cp > 1:
            # this rank's load-balanced chunks of every sequence, cut as megatron.training cuts them
            from megatron.core.utils import get_batch_on_this_cp_rank

            micro = [get_batch_on_this_cp_rank(mb, is_hybrid_cp=False, cp_group=ps.get_context_parallel_group())
                     for mb in micro]
        return micro[dp_rank * num_micro : (dp_rank + 1) * num_micro]

    for step in range(layout.steps):
        mine = my_micro_batches(step)
        iterators = [iter(list(mine)) for _ in chunks]
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=num_micro,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        if losses:  # the rank that returns the losses (the last pipeline rank, for every schedule)
            # the schedule already divides each microbatch's reported loss by num_microbatches
            loss = torch.stack([d["lm loss"] for d in losses]).sum()
        else:
            loss = torch.zeros(())
        # the loss lives on the last stage; sum over PP, average over DP and CP (what each CP rank
        # reports is the mean over its own, equally many, tokens: see loss_func)
        dist.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
        dist.all_reduce(loss, group=ps.get_data_parallel_group(with_context_parallel=True))
        history["loss"].append(loss.item() / (dp_size * layout.cp))
        if not layout.distributed_optimizer:
            # (the distributed optimizer keeps only its shard of the reduced gradient)
            history["grads"].append(_merge_over_world(_snapshot(chunks, "grad")))
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful
        history.setdefault("grad_norm", []).append(float(grad_norm))
        history["params"].append(_merge_over_world(_snapshot(chunks, "param")))
    if layout.evaluate:
        iterators = [iter(my_micro_batches(0)) for _ in chunks]
        with torch.no_grad():
            losses = forward_backward(forward_step_func=forward_step,
                                      data_iterator=iterators if len(chunks) > 1 else iterators[0],
                                      model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=num_micro,
                                      seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=True)
        loss = torch.stack([d["lm loss"] for d in losses]).sum() if losses else torch.zeros(())
        dist.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
        dist.all_reduce(loss, group=ps.get_data_parallel_group(with_context_parallel=True))
        history["eval"] = loss.item() / (dp_size * layout.cp)
    ps.destroy_model_parallel()
    if layout.features is not None:
        from hyper_adaptor.ops import backend

        history["op_calls"] = backend.call_counts()  # cumulative in this process
    if rank == 0:
        return history
    return {key: history[key] for key in ("loss", "grad_norm", "eval") if key in history}


def train_many(rank: int, world_size: int, layouts: dict, init_params: dict | None = None) -> dict:
    """Several layouts one after the other in one world (a world costs ~10 s to start)."""
    return {name: train(rank, world_size, layout, init_params) for name, layout in layouts.items()}


# bf16 against bf16 of another layout or backend: losses within 2e-2 relative (8 bits of mantissa; TP
# and the fused ops change the reduction order); each parameter's gradient within 3e-2 of the
# reference's in norm (||got - want|| <= 3e-2 ||want||; seen: at most 1.5e-2 for level 0 TP2 at the
# first step, 1.9e-2 for level 1 over three steps). A per-element bound could not be both safe and
# useful: a bf16 element is off by up to 20% of its tensor's largest one. A 10% error in any one
# gradient fails it (missed_wrong_gradients).
BF16 = dict(loss_rtol=2e-2, grad_rtol=3e-2)


def compare(reference: dict, result: dict, loss_rtol: float, grad_atol: float | None = None,
            param_atol: float | None = None, grad_rtol: float | None = None,
            grad_steps: int | None = None) -> list[str]:
    """Differences beyond tolerance, as readable lines (empty when the run matches).

    Losses are always compared; gradients when ``grad_atol`` (largest element difference) or
    ``grad_rtol`` (difference in norm, relative to the reference's) is given, over the first
    ``grad_steps`` steps (all when None); parameters when ``param_atol`` is given. Both sides must
    have logged every step of what is compared, with the same parameter names and a gradient for
    every parameter: a run that logged less is a difference, never a pass."""
    steps = len(reference.get("loss", []))
    if steps == 0:
        return ["the reference logged no loss"]
    if len(result.get("loss", [])) != steps:
        return [f"{len(result.get('loss', []))} losses logged against the reference's {steps}"]
    problems = [f"step {step}: loss {got!r} vs reference {want!r}"
                for step, (want, got) in enumerate(zip(reference["loss"], result["loss"]))
                if not abs(want - got) <= loss_rtol * abs(want)]  # (a NaN loss fails too)
    kinds = []
    if grad_atol is not None or grad_rtol is not None:
        kinds.append(("grads", grad_atol, grad_rtol, steps if grad_steps is None else grad_steps))
    if param_atol is not None:
        kinds.append(("params", param_atol, None, steps))
    sides = (("reference", reference), ("result", result))
    for kind, atol, rtol, count in kinds:
        short = [f"{side}: {len(history.get(kind, []))} steps of {kind} logged, not {steps}"
                 for side, history in sides if len(history.get(kind, [])) != steps]
        if short:
            problems += short
            continue
        for step in range(count):
            problems += _tensor_differences(f"step {step}: {kind}", reference[kind][step], result[kind][step],
                                            atol, rtol)
            if kind == "grads":
                # the snapshots leave out a parameter without a gradient
                for side, history in sides:
                    params = history.get("params", [])
                    missing = sorted(set(params[step] if step < len(params) else ()) - set(history[kind][step]))
                    if missing:
                        problems.append(f"step {step}: {side} has no gradient for {missing[:4]}")
    return problems


def _tensor_differences(where: str, want: dict, got: dict, atol: float | None, rtol: float | None) -> list[str]:
    if not want:
        return [f"{where}: nothing logged"]
    if set(got) != set(want):
        return [f"{where}: names differ: {sorted(set(want) ^ set(got))[:4]}"]
    problems = []
    for name, tensor in want.items():
        if tensor.shape != got[name].shape:
            problems.append(f"{where} {name}: shape {tuple(got[name].shape)} vs {tuple(tensor.shape)}")
            continue
        diff = (tensor - got[name]).float()
        # `not <=`: a NaN difference fails
        if atol is not None and not diff.abs().max().item() <= atol:
            problems.append(f"{where} {name}: max |diff| {diff.abs().max().item():.3g} > {atol}")
        if rtol is not None and not diff.norm().item() <= rtol * tensor.float().norm().item():
            problems.append(f"{where} {name}: |diff| {diff.norm().item():.3g} > {rtol} x |reference| "
                            f"{tensor.float().norm().item():.3g}")
    return problems


def missed_wrong_gradients(reference: dict, result: dict, tolerance: dict, factor: float = 1.1) -> list[str]:
    """The parameters whose first-step gradient, scaled by ``factor`` in ``result``, ``compare`` with
    ``tolerance`` still lets pass (empty: the tolerance catches such an error in any one gradient)."""
    first = result["grads"][0]
    missed = []
    for name in first:
        wrong = dict(result, grads=[{**first, name: first[name] * factor}, *result["grads"][1:]])
        if not compare(reference, wrong, **tolerance):
            missed.append(name)
    return missed
