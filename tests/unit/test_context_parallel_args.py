"""--context-parallel-size on the local spec: the algorithm's two spellings, adjustments and bad input
(one process, megatron's own argument parser)."""

import inspect

import pytest

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor import features
from hyper_adaptor.features import FeatureConfigError
from tests.unit.test_adaptor import megatron_args

ADAPTOR = adaptor_module.ADAPTOR
MODEL = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "1", "--attention-dropout", "0")


def _prepare(*flags):
    args = megatron_args(*MODEL, *flags)
    args.rank, args.world_size = 0, 8
    notices = ADAPTOR.prepare(args, say=False)
    return args, notices


# each line: what megatron's layers are handed (--cp-comm-type, TransformerEngine's names) and the algorithm
# the adaptor runs, written out per case rather than read from the table under test
@pytest.mark.parametrize("flags, algo, comm_type", [
    ((), "ring", "p2p"),
    (("--context-parallel-algo", "megatron_cp_algo"), "ring", "p2p"),
    (("--context-parallel-algo", "ulysses_cp_algo"), "ulysses", "a2a"),
    (("--context-parallel-algo", "ulysses"), "ulysses", "a2a"),
    (("--context-parallel-algo", "allgather"), "allgather", "allgather"),
    (("--cp-comm-type", "a2a"), "ulysses", "a2a"),
    (("--cp-comm-type", "allgather"), "allgather", "allgather"),
    (("--cp-comm-type", "p2p"), "ring", "p2p"),
    (("--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2"), "hybrid", "a2a+p2p"),
    (("--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"), "hybrid", "a2a+p2p"),
])
def test_both_spellings_select_the_algorithm(flags, algo, comm_type):
    from hyper_adaptor.patches.context.attention import COMM_TYPE_ALGO

    args, _ = _prepare("--context-parallel-size", "4", *flags)
    cp = features.get("context_parallel")
    assert cp.is_enabled(args) and cp.algorithm(args) == algo
    # megatron hands each layer's core attention its --cp-comm-type, and the layer runs what it names
    assert args.cp_comm_type == [comm_type]
    assert COMM_TYPE_ALGO[comm_type] == algo


def test_hybrid_degree_becomes_megatrons_hierarchical_groups_with_a_notice():
    args, notices = _prepare("--context-parallel-size", "4", "--context-parallel-algo", "hybrid",
                             "--ulysses-degree-in-cp", "2")
    assert args.hierarchical_context_parallel_sizes == [2, 2]
    assert any("--hierarchical-context-parallel-sizes" in n and "--ulysses-degree-in-cp 2" in n for n in notices)
    assert any("--cp-comm-type" in n for n in notices)


def test_cp1_and_transformer_engine_leave_the_feature_off():
    assert not features.get("context_parallel").is_enabled(_prepare()[0])
    args = megatron_args(*MODEL, "--context-parallel-size", "2", "--transformer-impl", "transformer_engine")
    assert not features.get("context_parallel").requested(args)


@pytest.mark.parametrize("flags, message", [
    (("--context-parallel-algo", "ulysses", "--cp-comm-type", "allgather"),
     "--context-parallel-algo ulysses and --cp-comm-type allgather ask for different algorithms"),
    (("--cp-comm-type", "a2a", "p2p"), "one algorithm for every layer"),
    (("--context-parallel-algo", "hybrid"), "needs --ulysses-degree-in-cp K"),
    (("--context-parallel-algo", "hybrid", "--ulysses-degree-in-cp", "3"),
     "--ulysses-degree-in-cp 3 must divide --context-parallel-size 4"),
    (("--context-parallel-algo", "hybrid", "--ulysses-degree-in-cp", "2", "--hierarchical-context-parallel-sizes",
      "4", "1"), "--ulysses-degree-in-cp 2 and --hierarchical-context-parallel-sizes 4 1 disagree"),
    (("--context-parallel-algo", "ring", "--ulysses-degree-in-cp", "2"), "is for the hybrid algorithm"),
    (("--context-parallel-algo", "ulysses", "--num-attention-heads", "6"),
     r"--num-attention-heads 6 / --tensor-model-parallel-size 1\) must divide by the Ulysses degree 4"),
    (("--context-parallel-algo", "ulysses", "--tensor-model-parallel-size", "4"),
     r"--num-attention-heads 8 / --tensor-model-parallel-size 4\) must divide by the Ulysses degree 4"),
    (("--seq-length", "36", "--max-position-embeddings", "36"),
     r"--seq-length 36 must be a multiple of 2 x --context-parallel-size \(8\)"),
    (("--reset-attention-mask",), "cannot be combined with --reset-attention-mask"),
])
def test_bad_input_is_an_error_naming_the_flags(flags, message):
    with pytest.raises(FeatureConfigError, match=message):
        _prepare("--context-parallel-size", "4", *flags)


def test_attention_dropout_is_served():
    _prepare("--context-parallel-size", "4", "--attention-dropout", "0.1")  # no error: dropout runs in the engines


def test_cp_below_level_2_on_the_local_spec_says_which_level_it_needs():
    with pytest.raises(FeatureConfigError, match="--context-parallel-size 2 with --transformer-impl local needs "
                                                 "--optimization-level 2.*got --optimization-level 1"):
        _prepare("--context-parallel-size", "2", "--optimization-level", "1")


@pytest.fixture(scope="module")
def cp2_attention():
    """megatron's local DotProductAttention built with a CP 2 config under the feature's patches (the
    constructor asserts CP == 1 without them), in a world of one (the refusals come before any group)."""
    import torch
    import torch.distributed as dist

    from hyper_adaptor.patch_manager import PatchManager
    from hyper_adaptor.patches.context import attention

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, context_parallel_size=2,
                               attention_dropout=0.0, use_cpu_initialization=True)
    build = lambda: DotProductAttention(config, 1, AttnMaskType.causal, "self", cp_comm_type="a2a",  # noqa: E731
                                        pg_collection=ProcessGroupCollection(tp=dist.group.WORLD))
    # megatron's own constructor (level 0 serves a CP config itself at level 2: patches/context/library.py)
    with pytest.raises(AssertionError, match="only supported by TEDotProductAttention"):
        inspect.unwrap(DotProductAttention.__init__)(DotProductAttention.__new__(DotProductAttention), config, 1,
                                                     AttnMaskType.causal, "self", cp_comm_type="a2a",
                                                     pg_collection=ProcessGroupCollection(tp=dist.group.WORLD))
    manager = PatchManager()
    manager.register_all(attention.patches(None))
    with manager.applied():
        module = build()
        q = torch.zeros(4, 1, 2, 8)
        yield module, q
    dist.destroy_process_group()


def test_the_local_attention_is_built_at_cp2_with_its_layers_algorithm(cp2_attention):
    module, _ = cp2_attention
    assert module.config.context_parallel_size == 2 and module.hyper_cp_algo == "ulysses"


@pytest.mark.parametrize("call, message", [
    (dict(packed_seq_params=object()), "packed sequences"),
    (dict(attention_bias=object()), "an attention bias"),
    (dict(attn_mask_type="padding"), "mask type padding"),
])
def test_calls_context_parallel_does_not_serve_are_refused(cp2_attention, call, message):
    from hyper_adaptor.patches.context.attention import ContextParallelUnsupported

    from megatron.core.transformer.enums import AttnMaskType

    module, q = cp2_attention
    if call.get("attn_mask_type") == "padding":
        call = dict(attn_mask_type=AttnMaskType.padding)
    with pytest.raises(ContextParallelUnsupported, match=f"--context-parallel-size 2 \\(ulysses\\): {message}"):
        module(q, q, q, None, **call)
