"""Level 2 — hot-expert replicas for megatron's ``MoELayer`` served by the engine (``--moe-hot-expert-replicas R``).

megatron's experts module (``SequentialMLP``) holds only this rank's own experts, so a replica cannot
be one of its rows: the engine's dispatcher (``dispatcher.py``) routes the layer's tokens over the
plan's slots (``route_to_slots``), dispatches them with the plan's uneven placement, hands megatron's
experts only the rows of the slots this rank owns, and computes the rows of its replica slots here,
with copies of the owners' weights: level 1's ``grouped_experts_forward`` (megatron's own expert
``forward``, so its activation, SwiGLU or not, around two grouped GEMMs) over stand-in experts whose
linears hold the replica copies.

Counting: only forwards that build a graph count towards the plan (not evaluation, not the first pass
of megatron's recompute). The plan is not checkpointed: a resumed run starts without replicas and
replans after ``--moe-replica-interval`` steps. With pipeline parallel, rank 0 logs its own stage's layers.

The training loop's two points, each a wrap of the smallest megatron seam:

- ``DistributedDataParallel.finish_grad_sync``: before megatron reduces the gradients over
  expert-data-parallel, every replica's weight gradient is sent to its owner and added to the owner's
  ``main_grad`` — the owner's gradient is then that of every token routed to its expert, and the
  optimizer (and its state) stays with the owner. Without DDP (a plain module), ``grad`` is used.
- ``megatron.training.training.train_step``: after the optimizer step, each layer counts the step
  (every ``--moe-replica-interval`` steps a new plan from the measured token counts; rank 0 logs the
  per-rank load before / after) and refreshes its replica weights from the owners.

Dropless only, expert tensor parallel 1, no chunked overlap (the shared expert of
``--moe-shared-expert-overlap`` is then computed between the engine's steps, in megatron's order); the
feature's ``validate`` refuses the rest by name. Gradient reduction overlapped with the backward
(``--overlap-grad-reduce``) would start before the replica gradients arrive and is refused too.
"""

from __future__ import annotations

import functools
import types

import torch

from hyper_adaptor.patch_manager import Patch

FEATURE = "expert_parallel"
FINISH_TARGET = "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.finish_grad_sync"
STEP_TARGET = "megatron.training.training.train_step"


class ReplicaRouting:
    """One MoE layer's replicas: the plan's manager, the engine dispatcher over its slots, and the
    rows of this rank's replica slots between ``split`` and ``join``."""

    def __init__(self, dispatcher, replicas: int, interval: int):
        from hyper_adaptor.parallel.expert import HotExpertReplicas

        self.num_local_experts = dispatcher.num_local_experts
        self.ep_group, self.topk = dispatcher.ep_group, dispatcher.config.moe_router_topk
        self.manager = HotExpertReplicas(dispatcher.num_experts, self.ep_group, replicas=replicas, interval=interval)
        self.experts = None       # megatron's experts module; bound by ``after_step``
        self.layer_number = None
        self._inner = None
        self._rows = self._counts = None

    def dispatch(self, tokens, routing_map, probs):
        from hyper_adaptor.parallel.expert import AllToAllDispatcher, route_to_slots

        if torch.is_grad_enabled():
            # counted once per training forward: not in evaluation, not in a recompute's first pass
            self.manager.observe(routing_map.sum(0))
            slot_map, slot_probs = self.manager.route(routing_map, probs)
        else:
            slot_map, slot_probs = route_to_slots(self.manager.plan, routing_map, probs)
        if self._inner is None or self._inner.placement != self.manager.placement:
            self._inner = AllToAllDispatcher(self.manager.num_slots, self.ep_group, topk=self.topk,
                                             placement=self.manager.placement)
        return self._inner.dispatch(tokens, slot_map, slot_probs)

    def combine(self, expert_output):
        return self._inner.combine(expert_output)

    def split(self, rows, tokens_per_slot):
        """The rows of the owned slots (for megatron's experts); the replica slots' rows are kept."""
        counts = torch.as_tensor(list(tokens_per_slot), dtype=torch.long)
        owned = int(counts[:self.num_local_experts].sum())
        self._rows, self._counts = rows[owned:], counts[self.num_local_experts:].tolist()
        return rows[:owned], counts[:self.num_local_experts].tolist()

    def join(self, owned_output):
        rows, counts = self._rows, self._counts
        self._rows = self._counts = None
        if not counts:
            return owned_output
        if self.experts is None:
            raise RuntimeError("hot-expert replicas: a plan with replicas before the experts were bound")
        return torch.cat([owned_output, self._replica_output(rows, counts)])

    def _replica_output(self, rows, counts):
        from hyper_adaptor.patches.fused.grouped_gemm import grouped_experts_forward

        names = _names(self.experts)
        # this rank's replica copies in slot order, as sync_weights made them (local_weights would first
        # concatenate the owned experts' weights, which megatron's experts compute with themselves)
        copies = self.manager._replica_weights
        if len(copies) != len(names) or copies[0].shape[0] != len(counts):
            raise RuntimeError("hot-expert replicas: the replica weights do not match the plan (sync_weights must "
                               "run after a new plan, before the forward)")
        per_slot = [{name: w[k] for name, w in zip(names, copies)} for k in range(len(counts))]
        expert0 = self.experts.local_experts[0]
        # stand-ins for megatron's expert modules: expert 0's class and attributes (so its forward and its
        # activation run as megatron's), the replica copies as the linears' weights
        stand_in = type("ReplicaExpert", (_ReplicaExpert,), {"forward": type(expert0).forward})
        replicas = [stand_in(expert0, *(types.SimpleNamespace(weight=s[f"{which}.weight"], bias=s.get(f"{which}.bias"),
                                                              gradient_accumulation_fusion=False)
                                        for which in ("linear_fc1", "linear_fc2"))) for s in per_slot]
        ones = torch.ones(rows.shape[0], dtype=rows.dtype, device=rows.device)
        output, _ = grouped_experts_forward(types.SimpleNamespace(local_experts=replicas), rows, counts, ones)
        return output


class _ReplicaExpert:
    """An expert module seen with other linears: everything else is the wrapped expert's."""

    def __init__(self, expert, linear_fc1, linear_fc2):
        self._expert, self.linear_fc1, self.linear_fc2 = expert, linear_fc1, linear_fc2

    def __getattr__(self, name):
        return getattr(self._expert, name)


def _names(experts) -> list[str]:
    """The expert parameters a replica copies, the same names in every local expert."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    if not isinstance(experts, SequentialMLP):
        raise RuntimeError(f"hot-expert replicas serve megatron's SequentialMLP experts, got {type(experts).__name__}")
    expert = experts.local_experts[0]
    return [name for name in ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")
            if _param(expert, name) is not None]


def _param(expert, name: str):
    module, attr = name.split(".")
    return getattr(getattr(expert, module), attr, None)


def _stacked(experts, trainable: bool = False) -> list[torch.Tensor]:
    """[E_local, ...] per parameter name: the local experts' weights stacked (detached; ``trainable``:
    marked as needing a gradient, so that the replica copies made from them get one)."""
    return [torch.stack([_param(e, name).detach() for e in experts.local_experts]).requires_grad_(trainable)
            for name in _names(experts)]


def replica_layers(model):
    """(MoE layer, its ReplicaRouting) for every layer of ``model`` (a module or a list of chunks)
    whose dispatcher has replicas."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        for module in chunk.modules():
            routing = getattr(getattr(module, "token_dispatcher", None), "replicas", None)
            if isinstance(routing, ReplicaRouting):
                yield module, routing


_GRAD = "_replica_grad"


def reduce_replica_grads(model) -> None:
    """Every replica's weight gradient added to its owner's ``main_grad`` (``grad`` without megatron's
    DDP). A collective over each layer's EP group: every rank calls it after the backward."""
    for layer, routing in replica_layers(model):
        experts = layer.experts
        # shaped like the stacked weights without copying them: the incoming rows land in ``_GRAD``
        first = experts.local_experts[0]
        holders = [_param(first, name).new_zeros((1, *_param(first, name).shape))
                   .expand(len(experts.local_experts), *_param(first, name).shape) for name in _names(experts)]
        routing.manager.reduce_grads(holders, grad_attr=_GRAD)
        for name, holder in zip(_names(experts), holders):
            incoming = getattr(holder, _GRAD, None)
            if incoming is None:
                continue
            for i, expert in enumerate(experts.local_experts):
                param = _param(expert, name)
                if hasattr(param, "main_grad"):
                    param.main_grad.add_(incoming[i].to(param.main_grad.dtype))
                elif param.grad is None:
                    param.grad = incoming[i].to(param.dtype).clone()
                else:
                    param.grad.add_(incoming[i].to(param.grad.dtype))


def after_step(model) -> list[str]:
    """After an optimizer step: each layer counts the step (a new plan every interval steps) and
    copies the owners' weights into its replicas. Returns the load lines of the layers that replanned."""
    lines = []
    for layer, routing in replica_layers(model):
        routing.experts = layer.experts
        routing.layer_number = getattr(layer, "layer_number", None)
        if routing.manager.step():
            lines.append(load_line(routing))
        routing.manager.sync_weights(_stacked(layer.experts, trainable=True))
    return lines


def load_line(routing: ReplicaRouting) -> str:
    r = routing.manager.load_report()
    hosted = ", ".join(f"expert {e} on rank {d}" for _, e, d in r["replicas"]) or "none"
    return (f"hot-expert replicas (MoE layer {routing.layer_number}): tokens per EP rank over the last "
            f"{routing.manager.interval} steps before {r['before']} (max/mean {r['before_max_over_mean']:.3f}), "
            f"after {r['after']} (max/mean {r['after_max_over_mean']:.3f}); new plan {_rounded(r['planned'])} "
            f"(max/mean {r['planned_max_over_mean']:.3f}), replicas: {hosted}")


def _rounded(values) -> list:
    return [round(v, 1) for v in values]


def _log(lines) -> None:
    import torch.distributed as dist

    if lines and (not dist.is_initialized() or dist.get_rank() == 0):
        for line in lines:
            print(line, flush=True)


def _wrap_finish_grad_sync(original):
    @functools.wraps(original)
    def finish_grad_sync(self, *args, **kwargs):
        reduce_replica_grads(self.module)
        return original(self, *args, **kwargs)

    return finish_grad_sync


def _wrap_train_step(original):
    @functools.wraps(original)
    def train_step(*args, **kwargs):
        result = original(*args, **kwargs)
        model = kwargs["model"] if "model" in kwargs else args[2]
        _log(after_step(model))
        return result

    return train_step


def patches(args) -> list[Patch]:
    if not int(getattr(args, "moe_hot_expert_replicas", 0) or 0):
        return []
    return [Patch(FINISH_TARGET, _wrap_finish_grad_sync, "wrap", FEATURE),
            # around --profile's wrap when both are on: the weight copy is part of the profiled step's tail
            Patch(STEP_TARGET, _wrap_train_step, "wrap", FEATURE, after=("profiling",))]
