"""The contenders of bench/tensor_parallel.py: one Llama-shaped model tensor-parallel three ways (hyper_adaptor's
styles, torch's own ``parallelize_module``, megatron-core's TP layers), data parallel on top (HSDP levels 1-3,
torch's ``fully_shard``, megatron's DDP / distributed optimizer), and how their collectives are counted.

DTensor's collectives go through ``torch.distributed._functional_collectives`` (funcol), not through the
``torch.distributed`` functions :class:`~hyper_adaptor.testing.measure.CollectiveCounter` wraps, so
:class:`FuncolCounter` wraps funcol's module attributes the same way (DTensor's placements call them as
``funcol.<name>``) and counts bytes with the same "sent" convention.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyper_adaptor.testing.measure import CollectiveCounter

SEED = 1234
LR = 1e-3


@dataclass(frozen=True)
class Spec:
    name: str
    tp: str  # "hyper", "torch" or "megatron": whose tensor parallel
    dp: str | None = None  # None, "hsdp-level1..3", "fsdp2", "ddp", "distopt"
    sequence_parallel: bool = False


TP2 = (Spec("hyper-tp2", "hyper"), Spec("torch-tp2", "torch"), Spec("megatron-tp2", "megatron"),
       Spec("hyper-tp2-sp", "hyper", sequence_parallel=True), Spec("torch-tp2-sp", "torch", sequence_parallel=True),
       Spec("megatron-tp2-sp", "megatron", sequence_parallel=True))
TP2_DP2 = (Spec("hyper-tp2-hsdp-level1", "hyper", "hsdp-level1"), Spec("hyper-tp2-hsdp-level2", "hyper", "hsdp-level2"),
           Spec("hyper-tp2-hsdp-level3", "hyper", "hsdp-level3"), Spec("torch-tp2-fsdp2", "torch", "fsdp2"),
           Spec("megatron-tp2-ddp", "megatron", "ddp"), Spec("megatron-tp2-distopt", "megatron", "distopt"))
CONTENDERS = {s.name: s for s in TP2 + TP2_DP2}


# ------------------------------------------------------------------------------------ the collectives
def _group_size(group) -> int:
    if isinstance(group, tuple):  # (mesh, mesh_dim)
        return group[0].size(group[1])
    if hasattr(group, "size") and hasattr(group, "mesh_dim_names"):  # a 1-D DeviceMesh
        return group.size()
    if isinstance(group, (list, tuple)):
        return len(group)
    if isinstance(group, str):
        return dist.get_world_size(torch.distributed.distributed_c10d._resolve_process_group(group))
    return dist.get_world_size(group)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


# name -> (index of the group argument, bytes this rank sends in the bandwidth-optimal schedule)
FUNCOL_SENT = {
    "all_reduce": (2, lambda t, n: 2 * (n - 1) * _nbytes(t) // n),
    "all_gather_single": (2, lambda t, n: (n - 1) * _nbytes(t)),
    "all_gather_tensor": (2, lambda t, n: (n - 1) * _nbytes(t)),
    "all_gather_tensor_autograd": (2, lambda t, n: (n - 1) * _nbytes(t)),
    "reduce_scatter_single": (3, lambda t, n: (n - 1) * _nbytes(t) // n),
    "reduce_scatter_tensor": (3, lambda t, n: (n - 1) * _nbytes(t) // n),
    "reduce_scatter_tensor_autograd": (3, lambda t, n: (n - 1) * _nbytes(t) // n),
    "all_to_all_single": (3, lambda t, n: (n - 1) * _nbytes(t) // n),
}


class FuncolCounter(CollectiveCounter):
    """:class:`CollectiveCounter` over funcol's collectives (nested calls count once; ``take`` is its)."""

    def __init__(self):
        super().__init__({})
        self._saved: list = []

    def __enter__(self) -> FuncolCounter:
        import torch.distributed._functional_collectives as funcol

        for name, (group_at, sent) in FUNCOL_SENT.items():
            fn = getattr(funcol, name, None)
            if fn is not None:
                self._saved.append((funcol, name, fn))
                setattr(funcol, name, self._wrap_funcol(name, fn, group_at, sent))
        return self

    def __exit__(self, *exc_info) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved = []

    def _wrap_funcol(self, name, fn, group_at, sent):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self.phase is not None and self.depth == 0:
                group = args[group_at] if len(args) > group_at else kwargs.get("group")
                n = _group_size(group)
                self.record(f"funcol.{name}", sent(args[0], n) if n > 1 else 0)
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return counted


def theory_tp_bytes(dims: dict, tp: int, micro_batch: int, gathered_logits: bool) -> int:
    """TP activation traffic per rank per step, fp32, in the "sent" convention: per layer two reductions of
    a [b, s, h] activation in forward (after attention's and the MLP's row-parallel projection) and two in
    backward (the input gradients of the column-parallel projections), each an all-reduce (2(t-1)/t of the
    buffer) or, with sequence parallel, a reduce-scatter plus an all-gather ((t-1)/t each, the same sum);
    plus the vocab-parallel embedding's forward reduction and, for the output projection, the input
    gradient's reduction in backward and, where the loss takes whole logits (``gathered_logits``: the
    hyper / torch rows; megatron's loss is vocab-parallel and reduces only [b, s] statistics), the gather
    of the logits [b, s, V] to every rank ((t-1)/t)."""
    activation = 4 * micro_batch * dims["seq"] * dims["dim"]
    logits = 4 * micro_batch * dims["seq"] * dims["vocab"]
    reduction = 2 * (tp - 1) * activation // tp
    per_layer = 4 * reduction
    return dims["layers"] * per_layer + 2 * reduction + ((tp - 1) * logits // tp if gathered_logits else 0)


def theory_dp_bytes(dp: str | None, psi_local: int, n: int, psi_gathered_once: int = 0) -> int:
    """Data-parallel traffic per rank per step for ``psi_local`` fp32 parameters per TP rank over ``n``
    ranks: 2Ψ elements (all-reduce, or reduce-scatter + all-gather), 3Ψ when parameters are gathered again
    for backward (level 3 / FSDP2) less the units kept gathered from forward to backward
    (``psi_gathered_once``: HSDP level 3's root and last layer, FSDP2's root group) — times (n-1)/n in the
    "sent" convention."""
    if dp is None:
        return 0
    elements = 3 * psi_local - psi_gathered_once if dp in ("hsdp-level3", "fsdp2") else 2 * psi_local
    return 4 * elements * (n - 1) // n


def theory_megatron_sp_regather_bytes(dims: dict, tp: int, micro_batch: int) -> int:
    """Megatron's column-parallel GEMMs under sequence parallel keep their input sequence-sharded and
    all-gather it again in backward for the weight gradient (activation memory for traffic): per layer the
    fused QKV and fc1 inputs, plus the output layer's — one more all-gather of [b, s, h] each."""
    activation = 4 * micro_batch * dims["seq"] * dims["dim"]
    return (2 * dims["layers"] + 1) * (tp - 1) * activation // tp


# ----------------------------------------------------------------------------------------- the models
def llama_config(dims: dict):
    from hyper_adaptor.testing.llama import LlamaConfig

    return LlamaConfig(vocab_size=dims["vocab"], dim=dims["dim"], n_layers=dims["layers"], n_heads=dims["heads"],
                       n_kv_heads=dims["kv_heads"], ffn_hidden=dims["ffn"])


def tp_plan(styles, n_layers: int, sequence_parallel: bool) -> dict:
    """torchtitan's Llama plan, spelled with ``styles`` (hyper_adaptor.parallel or torch's module)."""
    Replicate, Shard = styles.Replicate, styles.Shard
    plan = {
        "tok_embeddings": styles.RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(1) if sequence_parallel else Replicate()),
        "output": styles.ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                                         output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan["norm"] = styles.SequenceParallel()
    for i in range(n_layers):
        p = f"layers.{i}."
        if sequence_parallel:
            plan[p + "attention_norm"] = styles.SequenceParallel()
            plan[p + "ffn_norm"] = styles.SequenceParallel()
        # The block's input becomes one DTensor before its column-parallel projections, so that backward
        # sums their input gradients locally and reduces once per block (2 reductions per layer, not 5).
        before = Shard(1) if sequence_parallel else Replicate()
        for block in ("attention", "feed_forward"):
            plan[p + block] = styles.PrepareModuleInput(input_layouts=(before,), desired_input_layouts=(Replicate(),))
        out = Shard(1) if sequence_parallel else Replicate()
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[p + name] = styles.ColwiseParallel()
        plan[p + "attention.wo"] = styles.RowwiseParallel(output_layouts=out)
        plan[p + "feed_forward.w2"] = styles.RowwiseParallel(output_layouts=out)
    return plan


def _styles(kind: str):
    import types

    if kind == "torch":
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor import parallel as tp
    else:
        import hyper_adaptor.parallel.tensor as tp
        from hyper_adaptor.parallel.tensor import Replicate, Shard
    return types.SimpleNamespace(Replicate=Replicate, Shard=Shard, ColwiseParallel=tp.ColwiseParallel,
                                 RowwiseParallel=tp.RowwiseParallel, SequenceParallel=tp.SequenceParallel,
                                 PrepareModuleInput=tp.PrepareModuleInput, parallelize_module=tp.parallelize_module)


def _megatron_gpt(dims: dict, tp: int, sequence_parallel: bool):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(
        num_layers=dims["layers"], hidden_size=dims["dim"], num_attention_heads=dims["heads"],
        num_query_groups=dims["kv_heads"], ffn_hidden_size=dims["ffn"], gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=dims["vocab"], max_sequence_length=dims["seq"], position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    return config, model


def _gathered_once(model, dp: str | None, dp_size: int) -> int:
    """TP-local elements of the units gathered once per step (kept from forward to backward)."""
    if dp == "hsdp-level3":
        states = (model._hsdp_state, *model._hsdp_state._nested_states())
        return sum(hp.full_data.numel() for state in states if state.reshard_after_forward is False
                   for hp in state.params if hp.sharded)
    if dp == "fsdp2":  # the root group: its shards times the data-parallel size (padding included)
        group = model._get_fsdp_state()._fsdp_param_group
        return sum(fp.sharded_param.to_local().numel() * dp_size for fp in group.fsdp_params) if group else 0
    return 0


class Contender:
    """One row built on this rank; ``mesh`` is the (dp, tp) mesh (dp of size 1 for the TP-only rows)."""

    def __init__(self, name: str, dims: dict, mesh):
        self.spec = spec = CONTENDERS[name]
        self.name, self.dims, self.mesh = name, dims, mesh
        self.pool = None
        if spec.tp == "megatron":
            self._build_megatron()
            return
        from hyper_adaptor.testing.llama import build_llama

        model = build_llama(llama_config(dims), seed=SEED)  # the same weights for hyper and torch
        styles = _styles(spec.tp)
        styles.parallelize_module(model, mesh["tp"], tp_plan(styles, dims["layers"], spec.sequence_parallel))
        # parameters a TP rank holds before data-parallel sharding (the Ψ of the data-parallel theory)
        self.psi_local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        if spec.dp == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        elif spec.dp is not None:  # hyper_adaptor's HSDP over the dp dim of the same mesh
            from hyper_adaptor.parallel.hsdp import HostBufferPool, hsdp

            self.pool = HostBufferPool()
            kwargs = dict(optimizer_level=spec.dp.split("-")[1], threshold=0, comm_fusion=True,
                          group=mesh.get_group("dp"), buffer_pool=self.pool)
            for layer in model.layers.values():
                hsdp(layer, **kwargs)
            model = hsdp(model, **kwargs)
        self.psi_gathered_once = _gathered_once(model, spec.dp, mesh["dp"].size())
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)  # (foreach: torch's default)

    def _build_megatron(self):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        spec = self.spec
        self.config, model = _megatron_gpt(self.dims, self.mesh["tp"].size(), spec.sequence_parallel)
        self.psi_local = sum(p.numel() for p in model.parameters())
        self.psi_gathered_once = 0
        distributed = spec.dp == "distopt"
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
        self.model = DistributedDataParallel(self.config, ddp_config, model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=0.0, params_dtype=torch.float32,
                            use_distributed_optimizer=distributed), [self.model])
        seq = self.dims["seq"]
        self.position_ids = torch.arange(seq).unsqueeze(0)
        self.mask = torch.tril(torch.ones(1, 1, seq, seq)) < 0.5

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        if self.spec.tp == "megatron":
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            per_token = self.model(tokens, self.position_ids.expand_as(tokens), self.mask, labels=labels)
            loss = per_token.float().mean()
            loss.backward()
            self.model.finish_grad_sync()
            ok, _, _ = self.optimizer.step()
            assert ok, f"{self.name}: optimizer step skipped"
            return loss.item()
        from hyper_adaptor.testing.llama import loss_fn

        self.optimizer.zero_grad()
        loss = loss_fn(self.model(tokens), labels)
        loss.backward()
        if self.spec.dp is not None and self.spec.dp.startswith("hsdp"):
            from hyper_adaptor.parallel.hsdp import hsdp_sync_stream

            hsdp_sync_stream()
        self.optimizer.step()
        return loss.item()

    def timed_step(self, tokens, labels) -> tuple[float, float]:
        start = time.perf_counter()
        loss = self.step(tokens, labels)
        return loss, time.perf_counter() - start

    def model_state(self) -> dict:
        """Bytes of parameters, gradients and optimizer state on this rank (every storage once)."""
        from bench._hsdp_contenders import Ledger, megatron_state

        if self.spec.tp == "megatron":
            return megatron_state(self.model, self.optimizer)
        ledger = Ledger()
        for p in self.model.parameters():
            ledger.add("params", p)
            ledger.add("grads", p.grad)
            hp = getattr(p, "_hsdp_param", None)
            if hp is not None:
                ledger.add("params", hp.full)
                ledger.add("grads", hp.full.grad)
        ledger.add_optimizer_state(self.optimizer)
        return ledger.bytes

    def pool_bytes(self) -> int | None:
        return self.pool.reserved_bytes() if self.pool is not None else None
