"""The contenders of bench/hsdp.py as data, the model they all train, and how their model state is counted."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

SEED = 1234
LR = 1e-3
DEFAULT_BUCKET_KB = 4096  # 4 MiB: smaller than the model (13 MiB), so the bound is not vacuous
ZERO_STAGE = {"ddp": "ddp", "zero1": "zero1", "level1": "zero1", "level2": "zero2", "level3": "zero3",
              "zero3": "zero3"}


@dataclass(frozen=True)
class Spec:
    """One row of the table: which engine, at which level (the ZeRO stage it implements), with what."""

    name: str
    kind: str  # "megatron", "hsdp" or "fsdp2"
    level: str  # megatron: ddp / zero1; hsdp: level1..3; fsdp2: zero3
    threshold_kb: float | None = None  # hsdp: parameters smaller than this stay whole
    comm_async: bool = False  # hsdp: reductions started as buckets fill, waited at the end of backward
    gloo_collectives: bool = False  # hsdp: gloo's own reduce-scatter / all-gather, not the all-to-alls
    reshard_all: bool = False  # hsdp level 3: every unit freed after forward, gathered again for backward
    unbounded: bool = False  # hsdp: bucket_size=-1, no bucket limit

    @property
    def stage(self) -> str:
        return ZERO_STAGE[self.level]


def _hsdp_rows() -> list[Spec]:
    rows = [Spec(f"hsdp-level{n}", "hsdp", f"level{n}", 0) for n in (1, 2, 3)]
    rows += [Spec(f"hsdp-level{n}-t64", "hsdp", f"level{n}", 64) for n in (1, 2, 3)]
    rows += [Spec(f"hsdp-level{n}-async", "hsdp", f"level{n}", 0, comm_async=True) for n in (1, 2, 3)]
    rows += [Spec(f"hsdp-level{n}-gloo", "hsdp", f"level{n}", 0, gloo_collectives=True) for n in (1, 3)]
    rows.append(Spec("hsdp-level3-reshard-all", "hsdp", "level3", 0, reshard_all=True))
    rows += [Spec(f"hsdp-level{n}-unbounded", "hsdp", f"level{n}", 0, unbounded=True) for n in (1, 2, 3)]
    return rows


CONTENDERS = {spec.name: spec for spec in (
    Spec("megatron-ddp", "megatron", "ddp"),
    Spec("megatron-distopt", "megatron", "zero1"),
    *_hsdp_rows(),
    Spec("fsdp2", "fsdp2", "zero3"),
)}
ANCHORS = ("megatron-ddp", "megatron-distopt", "fsdp2")  # every ratio is against these: they always run


def theory_state_bytes(stage: str, psi: int, n: int) -> float:
    """fp32 Adam model state per rank (bytes) for Ψ parameters over N ranks."""
    return {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi / n, "zero2": 4 * psi + 12 * psi / n,
            "zero3": 16 * psi / n}[stage]


def theory_comm_bytes(stage: str, psi: int) -> int:
    """Collective volume per rank per step (bytes, fp32): 2Ψ elements, 3Ψ when parameters are
    gathered again for backward (ZeRO-3)."""
    return (3 if stage == "zero3" else 2) * psi * 4


def configured_theory(stage: str, psi: int, n: int, psi_whole: int, psi_gathered_once: int) -> tuple[float, int]:
    """The theory for the layout as configured: parameters kept whole (HSDP's threshold) hold all 16
    bytes on every rank and are all-reduced (2 x 4 bytes); units not resharded after forward (FSDP2's
    root group; HSDP level 3's root and last layer) are gathered once per step, not twice."""
    state = theory_state_bytes(stage, psi - psi_whole, n) + 16 * psi_whole
    comm = theory_comm_bytes(stage, psi - psi_whole) + 8 * psi_whole - 4 * psi_gathered_once
    return state, comm


class Ledger:
    """Bytes per category, every storage counted once (the first category that sees it)."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes = {"params": 0, "grads": 0, "optim": 0}

    def add(self, kind: str, t) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        if hasattr(t, "to_local"):
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
            return
        self.seen.add(storage.data_ptr())
        self.bytes[kind] += storage.nbytes()

    def add_optimizer_state(self, optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.add("params", p)
                self.add("grads", p.grad)
        for state in optimizer.state.values():
            for value in state.values():
                self.add("optim", value)


def megatron_state(ddp, optimizer) -> dict:
    ledger = Ledger()
    for buffer in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", [])):
        ledger.add("params", getattr(buffer, "param_data", None))
        ledger.add("grads", buffer.grad_data)
    for p in ddp.parameters():
        ledger.add("params", p)
        ledger.add("grads", getattr(p, "main_grad", None))
        ledger.add("grads", p.grad)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for attr in ("shard_fp32_groups", "shard_fp32_from_float16_groups", "fp32_from_float16_groups",
                     "fp32_from_fp32_groups"):
            for group in getattr(opt, attr, None) or []:
                for master in group:
                    if master is not None:
                        ledger.add("params", master)
                        ledger.add("grads", master.grad)
        ledger.add_optimizer_state(opt.optimizer)
    return ledger.bytes


def hsdp_state(model, optimizer) -> dict:
    ledger = Ledger()
    for p in model.parameters():
        ledger.add("params", p)
        hp = p._hsdp_param
        ledger.add("params", hp.full)
        ledger.add("grads", p.grad)
        ledger.add("grads", hp.full.grad)
    ledger.add_optimizer_state(optimizer)
    return ledger.bytes


def fsdp2_state(model, optimizer) -> dict:
    from torch.distributed.fsdp import FSDPModule

    ledger = Ledger()
    for p in model.parameters():
        ledger.add("params", p)
        ledger.add("grads", p.grad)
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                ledger.add("params", getattr(fp, "_sharded_param_data", None))
                for t in getattr(fp, "all_gather_outputs", None) or []:
                    ledger.add("params", t)
                unsharded = getattr(fp, "_unsharded_param", None)
                ledger.add("params", unsharded)
                if unsharded is not None:
                    ledger.add("grads", unsharded.grad)
                ledger.add("grads", getattr(fp, "unsharded_accumulated_grad", None))
    ledger.add_optimizer_state(optimizer)
    return ledger.bytes


def _transformer_config(dims: dict):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=dims["layers"], hidden_size=dims["hidden"], num_attention_heads=dims["heads"],
        ffn_hidden_size=4 * dims["hidden"], hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )


def make_gpt(dims: dict, init: dict | None):
    """The same GPTModel (local spec, tied embedding) every time; ``init``: weights to load."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)
    config = _transformer_config(dims)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=dims["vocab"],
                     max_sequence_length=dims["seq"], share_embeddings_and_output_weights=True)
    if init is not None:  # (megatron seeds the same numbers; load them anyway, so it cannot drift)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(init[name])
    return config, model


class Contender:
    """One row built on this rank: the model wrapped as its :class:`Spec` says, its optimizer, its step."""

    def __init__(self, name: str, dims: dict, init: dict, bucket_kb: float = DEFAULT_BUCKET_KB):
        self.spec = spec = CONTENDERS[name]
        self.name, self.kind, self.level, self.stage = name, spec.kind, spec.level, spec.stage
        config, model = make_gpt(dims, init)
        self.pool = None
        self.bucket_kb = -1 if spec.unbounded else bucket_kb
        if self.kind == "megatron":
            self._build_megatron(config, model)
        elif self.kind == "hsdp":
            from hyper_adaptor.parallel.hsdp import HostBufferPool, hsdp

            self.pool = HostBufferPool()  # its own, so that what it keeps is this contender's
            all_to_all = not spec.gloo_collectives
            kwargs = dict(optimizer_level=self.level, threshold=spec.threshold_kb, comm_fusion=True,
                          bucket_size=self.bucket_kb, comm_async=spec.comm_async, buffer_pool=self.pool,
                          gloo_reduce_scatter_as_all_to_all=all_to_all, gloo_all_gather_as_all_to_all=all_to_all)
            for layer in model.decoder.layers:
                hsdp(layer, **kwargs)
            self.model = hsdp(model, **kwargs)
            if spec.reshard_all:
                self.model.set_reshard_after_forward(True)
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LR, foreach=True)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in model.decoder.layers:
                fully_shard(layer, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LR, foreach=True)

    def _build_megatron(self, config, model):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        distributed = self.level == "zero1"
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=distributed)
        self.model = DistributedDataParallel(config, ddp_config, model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=0.0, params_dtype=torch.float32,
                            use_distributed_optimizer=distributed),
            [self.model],
        )

    def step(self, batch: dict) -> tuple[float, float, float]:
        """One training step: (loss on this rank, seconds to the end of backward and gradient
        reduction, seconds of ``optimizer.step()``)."""
        start = time.perf_counter()
        if self.kind == "megatron":
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        output = self.model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        loss = output.mean()
        loss.backward()
        if self.kind == "megatron":
            self.model.finish_grad_sync()
        elif self.kind == "hsdp":
            from hyper_adaptor.parallel.hsdp import hsdp_sync_stream

            hsdp_sync_stream()
        backward_done = time.perf_counter()
        if self.kind == "megatron":
            ok, _, _ = self.optimizer.step()  # (the distributed optimizer all-gathers parameters here)
            assert ok, f"{self.name}: optimizer step skipped"
        else:
            self.optimizer.step()
        return loss.item(), backward_done - start, time.perf_counter() - backward_done

    def grad_norm(self) -> float:
        """Global norm of the reduced gradient after a step (Adam is invariant to the gradient's
        scale, so the losses alone would not catch a wrong averaging factor)."""
        if self.kind == "megatron":
            return float(self.optimizer.get_grad_norm())
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def layout(self) -> dict:
        """Parameters kept whole on every rank (HSDP's threshold) and those of units not resharded
        after forward, so not gathered again for backward (FSDP2's root group; HSDP level 3's root
        and last layer)."""
        whole = once = 0
        if self.kind == "hsdp":
            whole = sum(p._hsdp_param.full.numel() for p in self.model.parameters() if not p._hsdp_param.sharded)
            if self.level == "level3":
                for state in (self.model._hsdp_state, *self.model._hsdp_state._nested_states()):
                    if state.reshard_after_forward is False:
                        once += sum(hp.full.numel() for hp in state.params if hp.sharded)
        if self.kind == "fsdp2":
            for group in self.model._get_fsdp_state()._fsdp_param_groups:
                once += sum(fp.sharded_param.numel() for fp in group.fsdp_params)
        return {"psi_whole": whole, "psi_gathered_once": once}

    def model_state(self) -> dict:
        if self.kind == "megatron":
            return megatron_state(self.model, self.optimizer)
        if self.kind == "hsdp":
            return hsdp_state(self.model, self.optimizer)
        return fsdp2_state(self.model, self.optimizer)

    def bucket_bytes(self) -> int:
        """The largest collective buffer this contender's configuration allows (the "bucket" of the
        peak bound): HSDP its bucket size (-1: every sharded parameter at once); megatron its bucket,
        max(40 M, 1 M x DP) elements by default, capped by the model (one bucket here); FSDP2 its largest
        unit, gathered whole."""
        if self.kind == "hsdp":
            whole_model = 4 * sum(p._hsdp_param.full.numel() for p in self.model.parameters())
            return whole_model if self.bucket_kb == -1 else int(self.bucket_kb * 1024)
        if self.kind == "megatron":
            default_bucket = max(40_000_000, 1_000_000 * dist.get_world_size())
            return 4 * min(sum(p.numel() for p in self.model.parameters()), default_bucket)
        units = [4 * sum(fp.sharded_param.numel() for fp in group.fsdp_params)  # (a DTensor's numel is global)
                 for module in self.model.modules() if hasattr(module, "_get_fsdp_state")
                 for group in module._get_fsdp_state()._fsdp_param_groups]
        return max(units, default=0)

    def pool_bytes(self) -> int | None:
        """Bytes HSDP's CPU buffer pool keeps reserved between steps (not model state)."""
        return self.pool.reserved_bytes() if self.pool is not None else None

    def largest_pooled_block(self) -> int | None:
        if self.pool is None:
            return None
        return max((b.numel() * b.element_size() for blocks in self.pool.free.values() for b in blocks), default=0)

    def hsdp_comm_bytes(self) -> int | None:
        return self.model.hsdp_comm_bytes() if self.kind == "hsdp" else None


def batch(step: int, rank: int, world: int, dims: dict) -> dict:
    """This rank's micro-batch of the global batch of ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(SEED + step)
    mb, seq = dims["micro_batch"], dims["seq"]
    tokens = torch.randint(0, dims["vocab"], (world * mb, seq + 1), generator=g)[rank * mb : (rank + 1) * mb]
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(seq).unsqueeze(0).expand(mb, seq).contiguous(),
        "attention_mask": torch.tril(torch.ones(1, 1, seq, seq)) < 0.5,
    }
