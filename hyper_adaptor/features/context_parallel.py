"""Level 2 — context parallel on megatron's local spec (``--context-parallel-size N``), no TransformerEngine.

megatron-core 0.19.2 serves context parallel only through TransformerEngine: the local
``DotProductAttention`` asserts ``context_parallel_size == 1``. This feature serves it with the engines
in ``hyper_adaptor/parallel/context`` (Ulysses, load-balanced ring, all-gather, hybrid); megatron's own
CP machinery stays as it is — its batch split per CP rank, its RoPE slice, its loss scaling and its
gradient reduction over the data x context group.

Two spellings pick the algorithm, so that both MindSpeed's and Megatron's launch scripts run unchanged:

- MindSpeed's ``--context-parallel-algo`` (``ulysses_cp_algo`` / ``megatron_cp_algo`` / ``hybrid_cp_algo``,
  or ``ulysses`` / ``ring`` / ``hybrid`` / ``allgather``) with ``--ulysses-degree-in-cp K``;
- Megatron's ``--cp-comm-type`` (TE's names: ``a2a``, ``p2p``, ``allgather``, ``a2a+p2p``) with
  ``--hierarchical-context-parallel-sizes K CP/K``.

``adjust`` writes the algorithm asked with the first spelling into the second (the one megatron hands
each layer's core attention), so that megatron also builds the hierarchical (Ulysses x ring) groups the
hybrid algorithm runs on; ``validate`` refuses the two spellings disagreeing.

Without a command line (megatron-core used as a library: a ``TransformerConfig(context_parallel_size=N,
cp_comm_type=...)`` built by the framework) no flag requests this feature; level 0's wrap in
``hyper_adaptor/patches/context/library.py`` applies it when such a config reaches the local attention at
``HYPER_ADAPTOR_OPTIMIZATION_LEVEL`` >= 2, and otherwise lets megatron's assertion say how to get it.
"""

from __future__ import annotations

from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag, refuse_combined, switch
from hyper_adaptor.patches.context.attention import ALGORITHMS, COMM_TYPE_ALGO, DEFAULT_ALGORITHM

# --context-parallel-algo value -> the algorithm: MindSpeed's names, then the algorithms' own
ALGO_NAMES = {**{a["mindspeed"]: name for name, a in ALGORITHMS.items() if a["mindspeed"]},
              **{name: name for name in ALGORITHMS}}
MEGATRON_DEFAULT_COMM_TYPE = [ALGORITHMS[DEFAULT_ALGORITHM]["comm_type"]]


def cp_size(args) -> int:
    return int(getattr(args, "context_parallel_size", 1) or 1)


def _comm_types(args) -> list[str]:
    value = getattr(args, "cp_comm_type", None) or MEGATRON_DEFAULT_COMM_TYPE
    return [value] if isinstance(value, str) else list(value)


def _asked_algo(args) -> str | None:
    name = getattr(args, "context_parallel_algo", None)
    return None if name is None else ALGO_NAMES[name]


def ulysses_degree(args, algo: str) -> int:
    """Ranks of one Ulysses all-to-all: the whole CP group for Ulysses, none for ring / all-gather."""
    size = cp_size(args)
    if algo == "ulysses":
        return size
    if algo == "hybrid":
        degree = getattr(args, "ulysses_degree_in_cp", None)
        hier = getattr(args, "hierarchical_context_parallel_sizes", None)
        return int(degree if degree is not None else (hier[0] if hier else 0))
    return 1


class ContextParallel(Feature):
    name = "context_parallel"
    level = 2
    summary = "context parallel on the local spec: Ulysses, load-balanced ring, all-gather, hybrid (no TE)"
    flags = (
        Flag("--context-parallel-size", "megatron's flag; on the local spec served by hyper_adaptor at level 2",
             owner="megatron"),
        Flag("--context-parallel-algo",
             "context-parallel algorithm: ring (default; MindSpeed: megatron_cp_algo), ulysses (ulysses_cp_algo), "
             "hybrid (hybrid_cp_algo: Ulysses inside groups of --ulysses-degree-in-cp, ring across) or allgather. "
             "Megatron's --cp-comm-type p2p / a2a / allgather / a2a+p2p selects the same.",
             {"choices": tuple(ALGO_NAMES), "default": None}),
        Flag("--ulysses-degree-in-cp", "hybrid: ranks per Ulysses group (divides --context-parallel-size)",
             {"type": int, "default": None}),
    )
    # megatron's local DotProductAttention asserts CP == 1: below level 2 a CP run cannot start, so
    # asking for it there is an error (naming the level), not the usual "not applied" notice
    refuse_below_level = True

    def requested(self, args) -> bool:
        return cp_size(args) > 1 and getattr(args, "transformer_impl", "local") == "local"

    def below_level_error(self, args) -> str:
        return (f"--context-parallel-size {cp_size(args)} with --transformer-impl local needs "
                f"--optimization-level 2 (hyper_adaptor's context parallel; megatron's local attention has none); "
                f"got --optimization-level {args.optimization_level}")

    def algorithm(self, args) -> str:
        asked = _asked_algo(args)
        return asked if asked is not None else COMM_TYPE_ALGO.get(_comm_types(args)[0], DEFAULT_ALGORITHM)

    def adjust(self, args) -> list[str]:
        notices = []
        asked = _asked_algo(args)
        comm = _comm_types(args)
        if asked is not None and comm == MEGATRON_DEFAULT_COMM_TYPE and asked != DEFAULT_ALGORITHM:
            notices.append(switch(args, "cp_comm_type", [ALGORITHMS[asked]["comm_type"]],
                                  f"--context-parallel-algo {args.context_parallel_algo}"))
        algo = self.algorithm(args)
        degree = getattr(args, "ulysses_degree_in_cp", None)
        if algo == "hybrid" and degree and not getattr(args, "hierarchical_context_parallel_sizes", None) \
                and cp_size(args) % degree == 0:
            # megatron builds its hierarchical CP groups (Ulysses inner, ring outer) from this flag
            notices.append(switch(args, "hierarchical_context_parallel_sizes", [degree, cp_size(args) // degree],
                                  f"--ulysses-degree-in-cp {degree}"))
        return notices

    def validate(self, args) -> None:
        size = cp_size(args)
        asked = _asked_algo(args)
        comm = _comm_types(args)
        comm_algos = {COMM_TYPE_ALGO.get(c) for c in comm}
        unknown = [c for c in comm if c not in COMM_TYPE_ALGO]
        if unknown:
            raise FeatureConfigError(f"--cp-comm-type {' '.join(comm)}: unknown value {unknown[0]!r}; "
                                     f"choose from {', '.join(sorted(a['comm_type'] for a in ALGORITHMS.values()))}")
        if len(comm_algos) > 1:
            raise FeatureConfigError(f"--cp-comm-type {' '.join(comm)}: one algorithm for every layer is served "
                                     "on the local spec; give a single value")
        if asked is not None and comm_algos != {asked} and comm != MEGATRON_DEFAULT_COMM_TYPE:
            raise FeatureConfigError(f"--context-parallel-algo {args.context_parallel_algo} and --cp-comm-type "
                                     f"{' '.join(comm)} ask for different algorithms ({asked} vs "
                                     f"{comm_algos.pop()}); give one of them, or both alike")
        algo = self.algorithm(args)
        degree = getattr(args, "ulysses_degree_in_cp", None)
        hier = getattr(args, "hierarchical_context_parallel_sizes", None)
        if degree is not None and (degree < 1 or size % degree):
            raise FeatureConfigError(f"--ulysses-degree-in-cp {degree} must divide --context-parallel-size {size}")
        if algo == "hybrid":
            if degree is None and not hier:
                raise FeatureConfigError("the hybrid context-parallel algorithm needs --ulysses-degree-in-cp K "
                                         "(or megatron's --hierarchical-context-parallel-sizes K CP/K)")
            if hier and (len(hier) != 2 or hier[0] * hier[1] != size):
                raise FeatureConfigError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, hier))}: "
                                         f"two sizes (Ulysses, ring) whose product is --context-parallel-size {size}")
            if hier and degree is not None and hier[0] != degree:
                raise FeatureConfigError(f"--ulysses-degree-in-cp {degree} and --hierarchical-context-parallel-sizes "
                                         f"{' '.join(map(str, hier))} disagree (the first size is the Ulysses degree)")
        elif degree is not None and degree != ulysses_degree(args, algo):
            raise FeatureConfigError(f"--ulysses-degree-in-cp {degree} is for the hybrid algorithm; "
                                     f"the {algo} algorithm was chosen")
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        heads = getattr(args, "num_attention_heads", None)
        ulysses = ulysses_degree(args, algo)
        if heads and ulysses > 1 and (heads % tp or (heads // tp) % ulysses):
            raise FeatureConfigError(
                f"--context-parallel-algo {algo}: the attention heads per tensor-parallel rank "
                f"(--num-attention-heads {heads} / --tensor-model-parallel-size {tp}) must divide by the Ulysses "
                f"degree {ulysses}")
        seq = getattr(args, "seq_length", None)
        if seq and seq % (2 * size):
            raise FeatureConfigError(f"--seq-length {seq} must be a multiple of 2 x --context-parallel-size "
                                     f"({2 * size}): megatron splits each sequence into 2 x CP load-balanced chunks")
        refused = {
            "reset_attention_mask": "--reset-attention-mask (document masks; context parallel serves causal "
                                    "and unmasked attention)",
            "hybrid_context_parallel": "--hybrid-context-parallel (megatron's variable-size CP groups for packed "
                                       "sequences need TransformerEngine)",
            "multi_latent_attention": "--multi-latent-attention (key and value head sizes differ)",
        }
        refuse_combined(args, f"--context-parallel-size {size}", refused)
        if getattr(args, "window_size", None) is not None:
            raise FeatureConfigError(f"--context-parallel-size {size} cannot be combined with --window-size "
                                     "(sliding-window attention)")

    def patches(self, args):
        from hyper_adaptor.patches.context import attention

        return attention.patches(args)
