"""Level 2 — megatron's ``MoELayer`` with hyper_adaptor's token-dispatch engine (``--moe-dispatcher-engine hyper``).

megatron's router, experts (so level 1's ``--moe-grouped-gemm`` still serves them), shared expert,
aux losses and expert bias stay megatron's; what changes is the token dispatcher megatron's
``--moe-token-dispatcher-type alltoall`` builds: its dispatch and combine are served by the engine in
``hyper_adaptor/parallel/expert`` (dropless uneven all-to-all over the expert-parallel group, the
expert-tensor-parallel gather / reduce-scatter, capacity and padding as megatron's router asks).
With ``--moe-dispatcher-engine megatron`` (the default) megatron's own dispatcher runs, untouched.

The flags around it:

- ``--moe-dispatch-chunks N``: the dispatch / combine of one chunk of tokens in flight while the
  experts compute another (the engine's chunked overlap); 1 is no chunking. Expert tensor parallel and
  padding to capacity are not chunked (an error naming the flags).
- megatron's ``--moe-shared-expert-overlap``: served by the engine's dispatcher (megatron hands it the
  shared expert with ``set_shared_experts``; it is computed while the dispatch is in flight — with
  expert tensor parallel or padding to capacity, between the engine's steps in megatron's order).
- MindSpeed's ``--moe-alltoall-overlap-comm`` (alltoall dispatcher, forward communication hidden under
  expert compute): asks for the engine with its chunked overlap.
- megatron's ``--overlap-moe-expert-parallel-comm`` (its combined 1F1B: one micro-batch's forward paired
  with another's backward, the layer cut into nodes that call the dispatcher's steps one by one): served
  by the engine's plain dispatch and combine in megatron's dispatch and combine nodes. The engine's
  chunked overlap runs dispatch, experts and combine as one schedule inside a node, so
  ``--moe-dispatch-chunks`` > 1 (and MindSpeed's flag) is an error with it.
- ``--moe-hot-expert-replicas R`` / ``--moe-replica-interval N``: every N steps the R most loaded experts
  get a copy on the least loaded expert-parallel ranks (``patches/expert/replicas.py``); dropless, expert
  tensor parallel 1 and no chunks (errors naming the flags otherwise).
"""

from __future__ import annotations

from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag, refuse_combined, switch

ENGINES = ("megatron", "hyper")
# the chunk count MindSpeed's --moe-alltoall-overlap-comm gets when --moe-dispatch-chunks is left at 1
ALLTOALL_OVERLAP_CHUNKS = 2


def engine(args) -> str:
    return getattr(args, "moe_dispatcher_engine", None) or "megatron"


def hot_replicas(args) -> int:
    return int(getattr(args, "moe_hot_expert_replicas", None) or 0)


def chunks(args) -> int:
    value = getattr(args, "moe_dispatch_chunks", None)
    return 1 if value is None else int(value)


class ExpertParallel(Feature):
    name = "expert_parallel"
    level = 2
    summary = "megatron's MoE layer with hyper_adaptor's token-dispatch engine (all-to-all, EP x ETP, overlap)"
    flags = (
        Flag("--moe-dispatcher-engine",
             "who serves megatron's all-to-all token dispatcher (--moe-token-dispatcher-type alltoall): megatron "
             "(its own, default) or hyper (hyper_adaptor's engine: dropless uneven all-to-all, expert tensor "
             "parallel, capacity and padding, shared expert during the dispatch, chunked overlap)",
             {"choices": ENGINES, "default": "megatron"}),
        Flag("--moe-dispatch-chunks",
             "with --moe-dispatcher-engine hyper: split each MoE layer's tokens into N chunks whose dispatch / "
             "combine run while the experts compute another chunk (1: no chunking)",
             {"type": int, "default": 1}),
        Flag("--moe-alltoall-overlap-comm",
             "MindSpeed's spelling: hide the all-to-all dispatcher's communication under expert compute; "
             "served by --moe-dispatcher-engine hyper with --moe-dispatch-chunks "
             f"{ALLTOALL_OVERLAP_CHUNKS} unless given"),
        Flag("--moe-hot-expert-replicas",
             "with --moe-dispatcher-engine hyper: R extra copies of the most loaded experts on the least loaded "
             "expert-parallel ranks, replanned from the measured token counts; training equals the run without "
             "(replica gradients added to the owner's, optimizer state with the owner). 0: none; at most "
             "experts x (EP - 1)",
             {"type": int, "default": 0}),
        Flag("--moe-replica-interval",
             "with --moe-hot-expert-replicas: steps between two replica plans (per-rank load logged at each)",
             {"type": int, "default": 100}),
    )
    # asking for the engine and getting megatron's dispatcher instead would change what runs without a word
    refuse_below_level = True

    def requested(self, args) -> bool:
        return (engine(args) != "megatron" or chunks(args) != 1 or hot_replicas(args) != 0
                or bool(getattr(args, "moe_alltoall_overlap_comm", False)))

    def below_level_error(self, args) -> str:
        asked = [f"--moe-dispatcher-engine {engine(args)}"] if engine(args) != "megatron" else []
        if chunks(args) != 1:
            asked.append(f"--moe-dispatch-chunks {chunks(args)}")
        if getattr(args, "moe_alltoall_overlap_comm", False):
            asked.append("--moe-alltoall-overlap-comm")
        if hot_replicas(args):
            asked.append(f"--moe-hot-expert-replicas {hot_replicas(args)}")
        return (f"{', '.join(asked)} (hyper_adaptor's token-dispatch engine) needs --optimization-level 2; "
                f"got --optimization-level {args.optimization_level}")

    def adjust(self, args) -> list[str]:
        notices = []
        if getattr(args, "moe_alltoall_overlap_comm", False):
            if engine(args) == "megatron":
                notices.append(switch(args, "moe_dispatcher_engine", "hyper",
                                      "--moe-alltoall-overlap-comm is served by hyper_adaptor's engine"))
            if chunks(args) == 1:
                notices.append(switch(args, "moe_dispatch_chunks", ALLTOALL_OVERLAP_CHUNKS,
                                      "--moe-alltoall-overlap-comm: communication of one chunk under the "
                                      "experts' compute of another"))
        return notices

    def validate(self, args) -> None:
        if hot_replicas(args):
            self._validate_replicas(args)
        n = chunks(args)
        if n < 1:
            raise FeatureConfigError(f"--moe-dispatch-chunks must be >= 1; got {n}")
        if engine(args) != "hyper":
            raise FeatureConfigError(f"--moe-dispatch-chunks {n} needs --moe-dispatcher-engine hyper "
                                     f"(megatron's own dispatcher does not chunk); got --moe-dispatcher-engine "
                                     f"{engine(args)}")
        asked = "--moe-dispatcher-engine hyper"
        experts = getattr(args, "num_experts", None)
        if not experts:
            raise FeatureConfigError(f"{asked} needs --num-experts (it serves megatron's MoE layers)")
        kind = getattr(args, "moe_token_dispatcher_type", None)
        if kind != "alltoall":
            why = " (megatron's default)" if kind == "allgather" else ""
            raise FeatureConfigError(f"{asked} serves megatron's all-to-all token dispatcher: add "
                                     f"--moe-token-dispatcher-type alltoall (got {kind}{why})")
        etp = getattr(args, "expert_tensor_parallel_size", None) \
            or getattr(args, "tensor_model_parallel_size", 1) or 1  # megatron's default: the TP size
        chunked = f"--moe-dispatch-chunks {n}" + (" (asked by --moe-alltoall-overlap-comm)"
                                                  if getattr(args, "moe_alltoall_overlap_comm", False) else "")
        if n > 1 and etp > 1:
            raise FeatureConfigError(f"{chunked} is not served with expert tensor parallel "
                                     f"(--expert-tensor-parallel-size {etp}, megatron's default being "
                                     "--tensor-model-parallel-size): add --expert-tensor-parallel-size 1 or use "
                                     "--moe-dispatch-chunks 1")
        if n > 1 and getattr(args, "moe_pad_expert_input_to_capacity", False):
            raise FeatureConfigError(f"{chunked} cannot be combined with "
                                     "--moe-pad-expert-input-to-capacity (chunks keep their sizes dynamic)")
        factor = getattr(args, "moe_expert_capacity_factor", None)
        if factor is not None and not factor > 0:  # also nan
            raise FeatureConfigError(f"--moe-expert-capacity-factor must be > 0 with {asked}; got {factor}")
        if getattr(args, "moe_pad_expert_input_to_capacity", False) and factor is None:
            raise FeatureConfigError(f"--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor "
                                     f"(the capacity to pad to) with {asked}")
        if getattr(args, "moe_shared_expert_overlap", False) \
                and not getattr(args, "moe_shared_expert_intermediate_size", None):
            raise FeatureConfigError(f"--moe-shared-expert-overlap with {asked} needs a shared expert: "
                                     "add --moe-shared-expert-intermediate-size")
        if getattr(args, "overlap_moe_expert_parallel_comm", False):
            combined = "--overlap-moe-expert-parallel-comm (megatron's combined 1F1B, whose schedule runs " \
                       "dispatch, experts and combine as separate nodes)"
            if n > 1:
                raise FeatureConfigError(
                    f"{chunked} cannot be combined with {combined}: the engine's chunked overlap runs dispatch, "
                    "experts and combine of every chunk together inside one of those nodes; use "
                    "--moe-dispatch-chunks 1 (the engine's plain dispatch and combine serve megatron's nodes)")
            if getattr(args, "moe_shared_expert_overlap", False):
                raise FeatureConfigError(f"--moe-shared-expert-overlap cannot be combined with {combined}: there "
                                         "megatron computes the shared expert in its own node")
        refused = {
            "moe_permute_fusion": "--moe-permute-fusion (TransformerEngine's permutation kernels; the engine "
                                  "permutes itself)",
            "moe_router_padding_for_quantization": "--moe-router-padding-for-quantization (fp8/fp4 row alignment "
                                                   "of the expert input)",
            "moe_router_padding_for_fp8": "--moe-router-padding-for-fp8 (fp8 row alignment of the expert input)",
            "moe_latent_size": "--moe-latent-size",
        }
        refuse_combined(args, asked, refused)

    @staticmethod
    def _validate_replicas(args) -> None:
        r = hot_replicas(args)
        asked = f"--moe-hot-expert-replicas {r}"
        if r < 0:
            raise FeatureConfigError(f"--moe-hot-expert-replicas must be >= 0; got {r}")
        interval = getattr(args, "moe_replica_interval", 100)
        if interval is None or interval < 1:
            raise FeatureConfigError(f"--moe-replica-interval must be >= 1 step with {asked}; got {interval}")
        if engine(args) != "hyper":
            raise FeatureConfigError(f"{asked} needs --moe-dispatcher-engine hyper (replicas are served by "
                                     f"hyper_adaptor's engine); got --moe-dispatcher-engine {engine(args)}")
        ep = getattr(args, "expert_model_parallel_size", 1) or 1
        if ep < 2:
            raise FeatureConfigError(f"{asked} needs --expert-model-parallel-size > 1 (a replica lives on another "
                                     f"expert-parallel rank); got --expert-model-parallel-size {ep}")
        experts = getattr(args, "num_experts", None)
        if experts and r > experts * (ep - 1):
            raise FeatureConfigError(f"{asked}: at most --num-experts x (--expert-model-parallel-size - 1) = "
                                     f"{experts * (ep - 1)} (one copy of an expert per rank)")
        if getattr(args, "moe_expert_capacity_factor", None) is not None:
            raise FeatureConfigError(f"{asked} cannot be combined with --moe-expert-capacity-factor (replicas "
                                     "need dropless dispatch: a capacity per copy would drop other tokens)")
        if getattr(args, "moe_pad_expert_input_to_capacity", False):
            raise FeatureConfigError(f"{asked} cannot be combined with --moe-pad-expert-input-to-capacity "
                                     "(replicas need dropless dispatch)")
        if chunks(args) > 1:
            raise FeatureConfigError(f"{asked} cannot be combined with --moe-dispatch-chunks {chunks(args)}"
                                     + (" (asked by --moe-alltoall-overlap-comm)"
                                        if getattr(args, "moe_alltoall_overlap_comm", False) else ""))
        etp = getattr(args, "expert_tensor_parallel_size", None) \
            or getattr(args, "tensor_model_parallel_size", 1) or 1
        if etp > 1:
            raise FeatureConfigError(f"{asked} is not served with expert tensor parallel "
                                     f"(--expert-tensor-parallel-size {etp}, megatron's default being "
                                     "--tensor-model-parallel-size): add --expert-tensor-parallel-size 1")
        refuse_combined(args, asked, {
            "overlap_grad_reduce": "--overlap-grad-reduce (the replica gradients reach their owners before "
                                   "megatron's gradient reduction, which then must not start in the backward)",
            "overlap_param_gather": "--overlap-param-gather (replicas copy the owners' weights after the "
                                    "optimizer step)",
            "overlap_moe_expert_parallel_comm": "--overlap-moe-expert-parallel-comm (its schedule nodes and the "
                                                "replica rows are not tested together)",
            "use_hsdp": "--use-hsdp",
            "use_megatron_fsdp": "--use-megatron-fsdp",
            "use_torch_fsdp2": "--use-torch-fsdp2",
        })

    def patches(self, args):
        from hyper_adaptor.patches.expert import dispatcher

        return dispatcher.patches(args)
