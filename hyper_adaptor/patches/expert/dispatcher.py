"""Level 2 — megatron's all-to-all token dispatcher served by the engine's ``AllToAllDispatcher``.

The seam: ``MoELayer.__init__`` builds its dispatcher by calling the name ``MoEAlltoAllTokenDispatcher``
it imported into ``megatron.core.transformer.moe.moe_layer`` (when ``moe_token_dispatcher_type ==
"alltoall"``). That one binding is replaced — not the class in ``token_dispatcher``, so megatron's own
dispatcher stays intact for anything else that names it — by a ``MoETokenDispatcher`` subclass whose
six steps megatron's layer calls in order:

    dispatch_preprocess   tokens [S, B, H] -> [T, H]; the shared expert's input gathered (overlap)
    token_dispatch        engine.dispatch: permute by expert, count exchange, all-to-all over EP, the
                          expert-tensor-parallel gather; the shared expert's fc1 (overlap)
    dispatch_postprocess  rows per local expert as megatron's experts take them
    combine_preprocess    nothing (the engine reorders inside combine)
    token_combine         engine.combine: ETP reduce-scatter, all-to-all back, un-permutation weighted
                          by the router's probabilities; the shared expert's fc2 (overlap)
    combine_postprocess   [T, H] -> [S, B, H], plus the shared expert's output (overlap)

megatron's router, experts and shared expert are untouched, so level 1's grouped GEMM still serves the
experts and the aux losses / expert bias work as before.

Where the router's probabilities are applied: megatron's all-to-all dispatcher sends each routed
copy's probability along with it and the experts scale their activation by it; the engine keeps the
probabilities on the token's rank and weights the expert outputs when it combines them. The experts
here get probabilities of one (so they scale nothing) — the same arithmetic up to rounding, since the
expert's second projection is linear (an expert bias is weighted too, as megatron does). With
megatron's ``moe_apply_probs_on_input`` (top-1) the token is scaled by its probability before the
dispatch, as megatron's experts scale their input, and the combine weights each copy by 1 (0 for
the zero-probability copies megatron's router adds when it pads to capacity).

Capacity: megatron's router already drops tokens over ``--moe-expert-capacity-factor`` (and, with
``--moe-pad-expert-input-to-capacity``, fills each expert up to its capacity); the engine gets the same
factor, pad switch and ``--moe-token-drop-policy``, so its own capacity (the same formula over the
same tokens) keeps every routed copy and pads each expert to a static row count.

Overlap (the engine's ``overlapped_moe_forward``): with ``--moe-dispatch-chunks N`` > 1, or with megatron's
``--moe-shared-expert-overlap`` (megatron hands the dispatcher its shared expert, ``set_shared_experts``,
and leaves computing it to the dispatcher), dispatch, experts and combine run as one overlapped
schedule — the exchanges of one chunk in flight while the experts compute another, the shared expert
(megatron's own overlap steps, in order) while the first dispatch is in flight. megatron's layer calls
its experts between ``dispatch_postprocess`` and ``combine_preprocess``; the overlapped schedule must
call them itself, so a second wrap, of ``MoELayer.routed_experts_compute``, hands this dispatcher the
layer's experts in that mode (and is megatron's own method otherwise). The overlapped schedule keeps
each chunk's sizes dynamic and its collectives on the expert-parallel group: expert tensor parallel
and padding to capacity are served by the plain path only (the shared expert's steps then run between
the engine's, in megatron's order; chunks > 1 there is an error).

megatron's combined 1F1B (``--overlap-moe-expert-parallel-comm``) cuts the layer into schedule nodes —
router, dispatch, experts, combine — that hand detached tensors to each other and free a node's inputs after
its forward; the plain path serves them with copies where megatron's own dispatcher makes new tensors
(see ``split_nodes``). Under hyper_adaptor's interleaved schedule the same flag wraps the engine's dispatch
and combine in the hooks of :func:`pair_overlap` instead.

Hot-expert replicas (``--moe-hot-expert-replicas R``, ``replicas.py``): the dispatch goes over the plan's
slots with its uneven placement; ``dispatch_postprocess`` hands megatron's experts the rows of the slots
this rank owns and ``combine_preprocess`` appends the rows of its replica slots, computed with copies of
the owners' weights. The plain path serves them (with megatron's ``--moe-shared-expert-overlap`` the
shared expert then runs between the engine's steps, as with expert tensor parallel).

Groups are megatron's (``pg_collection``): expert parallel ``ep``, expert tensor parallel ``expt_tp``
(the all-gather megatron's dispatcher does after the exchange, and the reduce-scatter before it).
With attention tensor parallel and sequence parallel each TP rank routes its own part of the sequence,
as megatron's dispatcher does.
"""

from __future__ import annotations

import functools

import torch

from hyper_adaptor.patch_manager import Patch

FEATURE = "expert_parallel"
TARGET = "megatron.core.transformer.moe.moe_layer.MoEAlltoAllTokenDispatcher"
EXPERTS_TARGET = "megatron.core.transformer.moe.moe_layer.MoELayer.routed_experts_compute"


class ExpertDispatchUnsupported(RuntimeError):
    """A configuration the engine's dispatcher does not serve (said instead of a wrong answer)."""


_PAIR_OVERLAP = None


def pair_overlap(create: bool = True):
    """The process's ``CommComputeOverlap``: hyper_adaptor's pipeline schedules run their ``FWD_BWD`` pairs
    through it, and the dispatcher built with ``pair_hooks`` puts its hooks around the engine's dispatch
    and combine (outside a pair they meet no partner and cost an identity op). ``create=False``: ``None``
    unless such a dispatcher was built — without its hooks the two sides would not keep their expert-parallel
    exchanges in one order."""
    global _PAIR_OVERLAP
    if _PAIR_OVERLAP is None and create:
        from hyper_adaptor.parallel.expert import CommComputeOverlap

        _PAIR_OVERLAP = CommComputeOverlap()
    return _PAIR_OVERLAP


def dispatcher_class(chunks: int = 1, pair_hooks: bool = False, replicas: int = 0, interval: int = 100) -> type:
    """megatron's ``MoETokenDispatcher`` with the engine's dispatch and combine (``chunks`` > 1: the
    engine's chunked overlap; ``pair_hooks``: dispatch and combine wrapped by :func:`pair_overlap`;
    ``replicas`` > 0: hot-expert replicas, ``replicas.py``), built when the patch is made so that these are
    bound into it."""
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    class EngineAlltoAllTokenDispatcher(MoETokenDispatcher):
        """megatron's all-to-all token dispatcher served by hyper_adaptor's ``AllToAllDispatcher``."""

        CHUNKS = chunks
        PAIR_HOOKS = pair_hooks

        def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
            from hyper_adaptor.parallel.expert import AllToAllDispatcher

            super().__init__(config=config, pg_collection=pg_collection)
            if getattr(config, "moe_router_padding_for_quantization", False) \
                    or getattr(config, "moe_latent_size", None):
                raise ExpertDispatchUnsupported("--moe-dispatcher-engine hyper: fp8/fp4 row padding and latent "
                                                "MoE projections are not served by the engine's dispatcher")
            self.num_local_experts = num_local_experts
            self.local_expert_indices = list(local_expert_indices)
            self.num_experts = config.num_moe_experts
            self.pad = bool(config.moe_pad_expert_input_to_capacity)
            if chunks > 1 and (self.tp_size > 1 or self.pad):
                raise ExpertDispatchUnsupported(
                    f"--moe-dispatch-chunks {chunks} is not served with expert tensor parallel "
                    f"(--expert-tensor-parallel-size {self.tp_size}) or --moe-pad-expert-input-to-capacity")
            self.engine = AllToAllDispatcher(
                config.num_moe_experts, self.ep_group,
                etp_group=self.tp_group if self.tp_size > 1 else None,
                capacity_factor=config.moe_expert_capacity_factor,
                pad_to_capacity=self.pad,
                drop_policy=config.moe_token_drop_policy,
                topk=config.moe_router_topk,
            )
            self.hidden_shape = None
            self.hidden_states = None
            self.routing_map = None
            self.probs_dtype = None
            self.overlapped = False
            # megatron's combined 1F1B (--overlap-moe-expert-parallel-comm) runs dispatch and combine as
            # schedule nodes of their own (see token_dispatch); with pair hooks hyper_adaptor's pipeline
            # schedule runs in its place
            self.split_nodes = bool(getattr(config, "overlap_moe_expert_parallel_comm", False)) and not pair_hooks
            self.tokens_per_expert = None
            self.dispatch_fn, self.combine_fn = self.engine.dispatch, self.engine.combine
            if pair_hooks:
                overlap = pair_overlap()
                self.dispatch_fn = overlap.wrap_dispatch(self.engine.dispatch)
                self.combine_fn = overlap.wrap_combine(self.engine.combine)
            self.replicas = None
            if replicas:
                from hyper_adaptor.patches.expert.replicas import ReplicaRouting

                if chunks > 1 or self.tp_size > 1 or self.pad or config.moe_expert_capacity_factor is not None:
                    raise ExpertDispatchUnsupported(
                        f"--moe-hot-expert-replicas {replicas} needs dropless dispatch, expert tensor parallel 1 "
                        "and --moe-dispatch-chunks 1")
                self.replicas = ReplicaRouting(self, replicas, interval)

        def dispatch_preprocess(self, hidden_states, routing_map, probs):
            self.hidden_shape = hidden_states.shape
            self.routing_map = routing_map
            self.probs_dtype = probs.dtype
            self.overlapped = (chunks > 1 or self.shared_experts is not None) and self.tp_size == 1 \
                and not self.pad and self.replicas is None
            tokens = hidden_states.reshape(-1, self.hidden_shape[-1])
            if self.config.moe_apply_probs_on_input:
                # top-1: the token's one probability scales its expert input, as megatron's experts do
                tokens = (probs.sum(dim=-1, keepdim=True) * tokens).to(tokens.dtype)
                probs = (routing_map & (probs != 0)).to(probs.dtype)
            if self.overlapped:
                self.hidden_states = hidden_states  # the shared expert's input
            elif self.shared_experts is not None:
                self.shared_experts.pre_forward_comm(hidden_states)
            if self.split_nodes:
                # these are the inputs of megatron's dispatch node, which frees them after its forward (its
                # own preprocess returns a permuted copy); the router's backward still reads its input and
                # output, so the node gets copies
                tokens, probs = tokens.clone(), probs.clone()
            return tokens, probs

        def token_dispatch(self, hidden_states, probs):
            if self.overlapped:  # dispatched with the experts, in overlapped_forward
                return hidden_states, probs
            if self.split_nodes:
                # megatron frees the dispatch node's inputs after its forward; the probabilities' gradient,
                # taken in the combine node, still reads them
                probs = probs.clone()
            dispatch = self.dispatch_fn if self.replicas is None else self.replicas.dispatch
            expert_input, tokens_per_expert = dispatch(hidden_states, self.routing_map, probs)
            if self.shared_experts is not None:
                self.shared_experts.linear_fc1_forward_and_act()
            if self.split_nodes:
                # megatron's dispatch node detaches its second output into the experts' node and back-
                # propagates it with that node's gradient, so it must be a tensor the experts differentiate:
                # a unit weight per row (the combine applies the probabilities). The counts wait here for
                # dispatch_postprocess, the next forward step of this same micro-batch and layer — the
                # schedule pairs this forward only with another micro-batch's backward, which is autograd's
                # and reads no dispatcher state.
                self.tokens_per_expert = tokens_per_expert
                unit = torch.ones(expert_input.shape[0], dtype=probs.dtype, device=expert_input.device,
                                  requires_grad=True)
                return expert_input, unit
            # megatron's layer hands the second value on to dispatch_postprocess
            return expert_input, tokens_per_expert

        def dispatch_postprocess(self, hidden_states, tokens_per_expert):
            unit = None
            if self.split_nodes and not self.overlapped:
                unit, tokens_per_expert, self.tokens_per_expert = tokens_per_expert, self.tokens_per_expert, None
                if tokens_per_expert is None:
                    raise ExpertDispatchUnsupported("dispatch_postprocess without a token_dispatch before it")
            if self.replicas is not None and not self.overlapped:  # the replica slots' rows stay here
                hidden_states, tokens_per_expert = self.replicas.split(hidden_states, tokens_per_expert)
            counts = torch.as_tensor(list(tokens_per_expert), dtype=torch.long)
            if len(counts) != self.num_local_experts:
                raise ExpertDispatchUnsupported(f"the engine dispatched to {len(counts)} experts; this rank "
                                                f"holds {self.num_local_experts}")
            if unit is not None:
                # megatron frees its experts' node input after the forward (its own postprocess makes a
                # permuted copy); the experts keep theirs for the weight gradient
                return hidden_states.clone(), counts, unit
            # the combine applies the probabilities: the experts scale by one
            ones = torch.ones(hidden_states.shape[0], dtype=self.probs_dtype, device=hidden_states.device)
            return hidden_states, counts, ones

        def overlapped_forward(self, tokens, probs, experts):
            """Dispatch, ``experts`` and combine as the engine's overlapped schedule: [T, H], weighted,
            with the shared expert's output added."""
            from hyper_adaptor.parallel import expert

            def experts_fn(rows, per_expert):
                rows, counts, ones = self.dispatch_postprocess(rows, per_expert)
                return experts(rows, counts, ones)[0]

            shared_fn = None
            if self.shared_experts is not None:
                hidden = self.hidden_states

                def shared_fn(_scaled):  # the layer's own input, not the (probability-scaled) tokens
                    return self._shared_output(hidden).reshape(tokens.shape)
            self.hidden_states = None
            return expert.overlapped_moe_forward(tokens, self.routing_map, probs, experts_fn, ep_group=self.ep_group,
                                                 chunks=chunks, shared_fn=shared_fn)

        def _shared_output(self, hidden_states):
            shared = self.shared_experts
            shared.pre_forward_comm(hidden_states)
            shared.linear_fc1_forward_and_act()
            shared.linear_fc2_forward()
            shared.post_forward_comm()
            return shared.get_output()

        def combine_preprocess(self, hidden_states):
            if self.replicas is not None:  # the replica slots' rows after the owned ones, in slot order
                return self.replicas.join(hidden_states)
            return hidden_states

        def token_combine(self, hidden_states, *args, **kwargs):
            if self.overlapped:
                return hidden_states
            output = self.combine_fn(hidden_states) if self.replicas is None else self.replicas.combine(hidden_states)
            if self.shared_experts is not None:
                self.shared_experts.linear_fc2_forward()
                self.shared_experts.post_forward_comm()
            return output

        def combine_postprocess(self, hidden_states):
            output = hidden_states.view(self.hidden_shape)
            self.routing_map = None
            if self.shared_experts is not None and not self.overlapped:
                output = output + self.shared_experts.get_output()
            return output

    EngineAlltoAllTokenDispatcher.__module__ = __name__
    return EngineAlltoAllTokenDispatcher


def _wrap_routed_experts_compute(original):
    @functools.wraps(original)
    def routed_experts_compute(self, hidden_states, probs):
        dispatcher = self.token_dispatcher
        if not getattr(dispatcher, "overlapped", False):
            return original(self, hidden_states, probs)
        return dispatcher.overlapped_forward(hidden_states, probs, self.experts), None

    return routed_experts_compute


def patches(args) -> list[Patch]:
    from hyper_adaptor.patches.expert import replicas

    chunks = int(getattr(args, "moe_dispatch_chunks", 1) or 1)
    # the pipeline feature pairs micro-batches through pair_overlap() under this combination
    pair_hooks = bool(getattr(args, "overlap_moe_expert_parallel_comm", False) and getattr(args, "pipeline_schedule",
                                                                                           None))
    hot = int(getattr(args, "moe_hot_expert_replicas", 0) or 0)
    interval = int(getattr(args, "moe_replica_interval", 100) or 100)
    return [
        # only moe_layer's binding: megatron's class stays what token_dispatcher defines
        Patch(TARGET, dispatcher_class(chunks, pair_hooks, hot, interval), "replace", FEATURE, rebind_in=()),
        # megatron's own method unless this feature's dispatcher runs its overlapped schedule
        Patch(EXPERTS_TARGET, _wrap_routed_experts_compute, "wrap", FEATURE),
        *replicas.patches(args),
    ]
