"""The dry-run's memory model: each part against a hand-computed case (the arithmetic is in the test), the
parameter counts against megatron's own GPT, and one layer's activation formula against what megatron's layer
really saves for backward (torch's saved-tensor hooks)."""

import pytest

import hyper_adaptor.megatron_adaptor  # noqa: F401  (level 0 first: megatron imports on CPU)
from hyper_adaptor.dryrun import ModelShape, memory, parse, predict
from hyper_adaptor.dryrun.shape import padded_vocab

# s=32, b=2, h=64, 4 heads of 16, ffn 256, 4 layers, vocab 257 -> 384 (x128), 2 micro-batches at DP 1
MODEL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 "
         "--tokenizer-type NullTokenizer --vocab-size 257 --no-bias-gelu-fusion --no-bias-dropout-fusion "
         "--no-bias-swiglu-fusion").split()


def run(extra="", world=1):
    args = parse(MODEL + extra.split(), world)
    return args, ModelShape.from_args(args)


# one layer of MODEL: LayerNorm 2 x 64 twice; qkv 64 x 192 + 192; proj 64 x 64 + 64; fc1 64 x 256 + 256;
# fc2 256 x 64 + 64
LAYER = 2 * 128 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)


def test_padded_vocab_is_megatrons():
    assert padded_vocab(257, 128, 1) == 384
    assert padded_vocab(257, 128, 2) == 512      # a multiple of 128 x TP
    assert padded_vocab(50257, 128, 8) == 51200


def test_parameters_per_rank_hand_counted():
    args, shape = run()
    # embedding 384 x 64, positions 32 x 64, 4 layers, final norm 128; tied: no output layer at PP 1
    total = 384 * 64 + 32 * 64 + 4 * LAYER + 128
    assert sum(shape.params_on(0).values()) == total
    assert memory.parameters(shape, args, 0) == total * 4
    args, shape = run("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 4)
    # TP 2: vocab 512 / 2; qkv 96 columns + bias 96; proj 32 rows, whole bias 64; fc1 128 + 128; fc2 128 rows + 64
    layer = 2 * 128 + (64 * 96 + 96) + (32 * 64 + 64) + (64 * 128 + 128) + (128 * 64 + 64)
    first = 256 * 64 + 32 * 64 + 2 * layer
    last = 2 * layer + 128 + 256 * 64          # tied at PP 2: the last stage holds the embedding's copy
    assert sum(shape.params_on(0).values()) == first and sum(shape.params_on(1).values()) == first  # TP ranks
    assert sum(shape.params_on(2).values()) == last
    assert shape.layers_on(2) == [2, 3] and shape.rank_coords(3) == dict(tp=1, cp=0, dp=0, pp=1, etp=1, ep=0, edp=0)


def test_experts_split_over_ep_and_etp():
    _, shape = run("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --expert-model-parallel-size 2 "
                   "--disable-bias-linear", 2)
    # 4 experts / EP 2 = 2 local, each fc1 64 x 32 and fc2 32 x 64; router 4 x 64 on every rank
    assert shape.layer_params(0)["experts"] == 2 * (64 * 32 + 32 * 64)
    assert shape.layer_params(0)["router"] == 4 * 64
    assert shape.edp == 1


def test_vpp_chunks_are_dealt_round_robin():
    _, shape = run("--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2", 2)
    assert shape.chunks_on(0) == [[0, 1], [4, 5]] and shape.chunks_on(1) == [[2, 3], [6, 7]]


def test_gradients_and_optimizer_fp32():
    args, shape = run()
    n = sum(shape.params_on(0).values())
    assert memory.gradients(shape, args, 0) == 4 * n            # fp32 main_grad buffer
    assert memory.main_parameters(shape, args, 0) == 0           # fp32: the optimizer steps the parameters
    assert memory.optimizer_state(shape, args, 0) == 8 * n       # Adam: exp_avg + exp_avg_sq, fp32


def test_bf16_distributed_optimizer_pads_and_shards():
    args, shape = run("--bf16 --use-distributed-optimizer", 2)
    numels = [n for _, n in shape.tensors_on(0)]
    padded = 0
    for n in reversed(numels):          # each start on 64 elements, the end on lcm(DP 2, 128) = 128
        padded = -(-padded // 64) * 64 + n
    padded = -(-padded // 128) * 128
    assert memory.buffer_numel(shape, args, 0, False) == padded
    assert memory.parameters(shape, args, 0) == 2 * padded       # bf16 parameters in DDP's buffer
    assert memory.gradients(shape, args, 0) == 4 * padded        # megatron accumulates bf16 grads in fp32
    assert memory.main_parameters(shape, args, 0) == 4 * padded // 2   # fp32 masters, half per DP rank
    assert memory.optimizer_state(shape, args, 0) == 8 * padded // 2


def test_hsdp_levels_shard_what_they_say():
    n = None
    for level, grads_sharded, params_sharded in (("level1", False, False), ("level2", True, False),
                                                 ("level3", True, True)):
        args, shape = run(f"--use-hsdp --hsdp-optimizer-level {level} --global-batch-size 8", 4)
        n = sum(shape.params_on(0).values())
        assert memory.optimizer_state(shape, args, 0) == 8 * -(-n // 4)
        assert memory.gradients(shape, args, 0) == 4 * n // (4 if grads_sharded else 1)
        # level 3: the root unit (embedding 384 x 64, positions 32 x 64, final norm 128) stays gathered too
        root = 384 * 64 + 32 * 64 + 128
        assert memory.parameters(shape, args, 0) == (4 * n // 4 + 4 * root if params_sharded else 4 * n)


def test_hsdp_level3_under_full_recompute_gathers_no_layer_again():
    # the engine starts no forward prefetch from a forward rerun inside backward, so no layer whose backward is
    # done is gathered again: the parameters are the shards and the root, as without recompute (the rebuilt
    # layer, gathered into its own backward, is transient's one layer)
    root = 384 * 64 + 32 * 64 + 128
    for recompute in ("--recompute-method uniform --recompute-num-layers 1",
                      "--recompute-method block --recompute-num-layers 2"):
        args, shape = run("--use-hsdp --hsdp-optimizer-level level3 --global-batch-size 8 --recompute-granularity "
                          f"full {recompute}", 4)
        n = sum(shape.params_on(0).values())
        assert memory.parameters(shape, args, 0) == 4 * n // 4 + 4 * root, recompute
        # a layer's backward: fc1's output gradient twice (s 32 x b 2 x ffn 256, above the scores' 2 x 4 heads x
        # 32 x 32), the layer input's and output's gradients (32 x 2 x 64), and the one gathered layer
        assert memory.transient(shape, args, 0, 0) == 4 * (2 * 32 * 2 * 256 + 2 * 32 * 2 * 64 + LAYER), recompute


def test_hsdp_gradients_stay_whole_while_micro_batches_accumulate():
    # DP 2 at global batch 8: 2 micro-batches; megatron's no_sync keeps the first one's gradients local, whole
    # and unreduced, until the last backward reduces them (level 1 keeps them whole anyway)
    for level in ("level1", "level2", "level3"):
        args, shape = run(f"--use-hsdp --hsdp-optimizer-level {level} --global-batch-size 8", 2)
        n = sum(shape.params_on(0).values())
        assert shape.num_micro_batches == 2 and memory.gradients(shape, args, 0) == 4 * n, level
    # in the parameters' dtype (bf16), not megatron's fp32 gradient buffer
    args, shape = run("--use-hsdp --hsdp-optimizer-level level3 --global-batch-size 8 --bf16", 2)
    assert memory.gradients(shape, args, 0) == 2 * sum(shape.params_on(0).values())


def test_hsdp_buffers_on_cpu_are_the_pools_fused_blocks():
    # two buckets of one layer each in flight on an accelerator; on a CPU HSDP's pool keeps the blocks of the
    # collective fused over every unit (the default 25 MB bucket holds the whole model): level 1's reduction and
    # gloo's receive of 3 of its 4 chunks, level 2's gather and one layer's reduction
    for level, on_cpu in ((1, lambda n: 4 * n + 4 * n * 3 // 4), (2, lambda n: 4 * n + 4 * LAYER),
                          (3, lambda n: 2 * 4 * LAYER)):
        args, shape = run(f"--use-hsdp --hsdp-optimizer-level level{level} --global-batch-size 8", 4)
        n = sum(shape.params_on(0).values())
        assert memory.communication_buffers(shape, args, 0) == on_cpu(n), level
        args.device = "cuda"
        assert memory.communication_buffers(shape, args, 0) == 2 * 4 * LAYER, level
    args, shape = run("--use-hsdp --hsdp-optimizer-level level1 --hsdp-bucket-size-kb 16 --global-batch-size 8", 4)
    assert memory.communication_buffers(shape, args, 0) == 16 * 1024 + 16 * 1024 * 3 // 4


def test_optimizer_offload_moves_state_to_host():
    args, shape = run("--optimizer-cpu-offload --optimizer-offload-fraction 0.5 --bf16")
    n = sum(shape.params_on(0).values())
    assert memory.optimizer_state(shape, args, 0) == 8 * n // 2
    assert memory.main_parameters(shape, args, 0) == 4 * n // 2
    # the host masters' fp32 gradients, and torch's per-tensor Adam on the host: two of the largest tensor (the
    # embedding, 384 x 64) in fp32
    assert memory.host_memory(shape, args, 0, 0) == {"optimizer_state": 8 * n // 2, "main_parameters": 4 * n // 2,
                                                     "gradients": 4 * n // 2, "transient": 2 * 384 * 64 * 4}
    # megatron's distributed optimizer keeps its whole fp32 main shard on the device (DP 2: half the padded buffer)
    args, shape = run("--optimizer-cpu-offload --bf16 --use-distributed-optimizer --global-batch-size 8", 2)
    shard = memory.buffer_numel(shape, args, 0, False) // 2
    assert memory.main_parameters(shape, args, 0) == 4 * shard
    assert memory.host_memory(shape, args, 0, 0)["main_parameters"] == 4 * shard


# one layer of MODEL at fp32 on cpu, per micro-batch (s=32, b=2): sbh = 4096 elements, x 4 bytes
SBH = 32 * 2 * 64 * 4
LAYER_ACTIVATIONS = (
    SBH + 2 * 32 * 2 * 4          # input norm: its input, mean and rstd (fp32)
    + SBH                          # linear_qkv's input
    + 3 * SBH                      # q, k, v
    + 3 * 2 * 4 * 32 * 32 * 4      # softmax output, dropout mask (fp32 on cpu), dropout output: b x a x s x s
    + SBH + SBH                    # linear_proj's input, the residual dropout's mask
    + SBH + 2 * 32 * 2 * 4         # pre-MLP norm
    + SBH + 2 * 4 * SBH            # fc1's input, fc1's output and gelu's (ffn = 4h)
    + SBH                          # the MLP's residual dropout mask
)


def test_layer_activations_hand_counted():
    args, shape = run()
    assert sum(t.nbytes for t in memory.layer_terms(shape, args)) == LAYER_ACTIVATIONS
    args.device = "cuda"           # bool masks: 1 byte an element
    masks = 2 * 4 * 32 * 32 + 2 * 32 * 2 * 64
    assert sum(t.nbytes for t in memory.layer_terms(shape, args)) == LAYER_ACTIVATIONS - 3 * masks


def test_sp_cp_and_selective_recompute_cut_activations():
    args, shape = run("--tensor-model-parallel-size 2 --sequence-parallel", 2)
    terms = {t.name: t.nbytes for t in memory.layer_terms(shape, args)}
    assert terms["qkv input"] == SBH // 2 and terms["softmax output"] == 2 * 2 * 32 * 32 * 4
    args, shape = run("--recompute-granularity selective")
    kept = sum(t.nbytes for t in memory.recomputed(args, memory.layer_terms(shape, args)))
    assert kept == LAYER_ACTIVATIONS - 3 * 2 * 4 * 32 * 32 * 4     # core_attn's scores are rebuilt
    # ... during each layer's backward: one layer's rebuilt scores beside the 4 layers' kept tensors (PP 1: one
    # micro-batch in flight, and the embedding's dropout mask)
    assert memory.activations(shape, args, 0) == (4 * kept + 3 * 2 * 4 * 32 * 32 * 4 + SBH, 0)


def test_activations_times_inflight_micro_batches():
    args, shape = run("--pipeline-model-parallel-size 2 --global-batch-size 8", 2)
    # 1F1B: rank 0 keeps PP - 0 = 2 micro-batches of its 2 layers (+ the embedding's dropout mask), rank 1 one
    assert memory.inflight(shape, args, 0) == ([2], 0) and memory.inflight(shape, args, 1) == ([1], 0)
    assert memory.activations(shape, args, 0) == (2 * 2 * LAYER_ACTIVATIONS + 2 * SBH, 0)
    assert memory.activations(shape, args, 1) == (2 * LAYER_ACTIVATIONS, 0)
    args, shape = run("--pipeline-model-parallel-size 2 --global-batch-size 8 --pipeline-schedule gpipe", 2)
    assert memory.inflight(shape, args, 0)[0] == [4]                # GPipe: every micro-batch
    # full recompute, one layer a group: the inputs of 2 layers x 4 in flight, and one layer rebuilt
    args, shape = run("--pipeline-model-parallel-size 2 --global-batch-size 8 --pipeline-schedule gpipe "
                      "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", 2)
    assert memory.activations(shape, args, 1) == (4 * 2 * SBH + LAYER_ACTIVATIONS, 0)


def test_zero_bubble_keeps_each_deferred_weight_gradients_operands():
    # ZB-H1 at PP 2, 4 micro-batches: rank 1 runs F0 I0 F1 I1 W0 ...; as I1 begins micro-batch 1 is kept whole
    # and micro-batch 0 waits for its W step, holding each linear layer's input and output gradient
    args, shape = run("--pipeline-model-parallel-size 2 --global-batch-size 8 --pipeline-schedule zbh1", 2)
    assert memory.inflight(shape, args, 0) == ([2], 0) and memory.inflight(shape, args, 1) == ([1], 1)
    tokens = 32 * 2
    inputs = 3 * SBH + tokens * 256 * 4                          # qkv, proj, fc1 inputs (s x b x h); fc2's (ffn)
    grad_outputs = tokens * 192 * 4 + tokens * 64 * 4 + tokens * 256 * 4 + tokens * 64 * 4   # qkv, proj, fc1, fc2
    assert memory.linear_grad_outputs(shape) == {"qkv": tokens * 192 * 4, "proj": SBH, "fc1": tokens * 256 * 4,
                                                 "fc2": SBH}
    assert memory.activations(shape, args, 1) == (2 * LAYER_ACTIVATIONS + 2 * (inputs + grad_outputs), 0)
    # rank 0 (not the loss stage): the engine also keeps each kept micro-batch's sent output until its backward
    assert memory.activations(shape, args, 0) == (2 * 2 * LAYER_ACTIVATIONS + 2 * SBH + 2 * SBH, 0)
    # the waiting micro-batch's output layer: its input and its output gradient (the fp32 logits' storage)
    logits = 32 * 2 * 384 * 4 + SBH
    assert memory.logits_and_loss(shape, args, 1) == logits + logits
    # the layer in backward keeps its projection's and MLP's output gradients through the attention's backward
    # (the backward's temporaries, not the optimizer step's: those are freed activations' bytes here)
    one_f_one_b = run("--pipeline-model-parallel-size 2 --global-batch-size 8", 2)
    assert memory.transient(shape, args, 1, 10**9) == memory.transient(*reversed(one_f_one_b), 1, 10**9) + \
        grad_outputs - tokens * 192 * 4


def test_zero_bubble_under_full_recompute_keeps_the_rebuilt_weight_gradient_operands():
    # ZB-H1 at PP 2 with every layer checkpointed: a layer's W step still needs its linear inputs (rebuilt by the
    # recompute) and output gradients, so the queue keeps them past the layer's backward
    args, shape = run("--pipeline-model-parallel-size 2 --global-batch-size 8 --pipeline-schedule zbh1 "
                      "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", 2)
    tokens = 32 * 2
    operands = 3 * SBH + tokens * 256 * 4 + tokens * 192 * 4 + tokens * 64 * 4 + tokens * 256 * 4 + tokens * 64 * 4
    # rank 1 as I1 begins: the 2 layers' checkpointed inputs of micro-batch 1, micro-batch 0's 2 layers waiting
    # for W0; while its first layer is rebuilt, micro-batch 1's second layer is already queued
    assert memory.activations(shape, args, 1) == (2 * SBH + 2 * operands + LAYER_ACTIVATIONS + operands, 0)
    # rank 0 runs every W right after its I: only the current micro-batch's second layer waits; 2 micro-batches
    # keep their 2 checkpointed inputs, their sent outputs and the embedding's dropout mask
    assert memory.activations(shape, args, 0) == (2 * 2 * SBH + 2 * SBH + 2 * SBH + LAYER_ACTIVATIONS + operands,
                                                  0)


def test_logits_on_the_last_stage():
    args, shape = run("--pipeline-model-parallel-size 2", 2)
    assert memory.logits_and_loss(shape, args, 0) == 0
    # fp32 logits s x b x 384 (kept, their gradient in place) and the final norm's output s x b x h
    assert memory.logits_and_loss(shape, args, 1) == 32 * 2 * 384 * 4 + SBH


def test_prediction_groups_equal_ranks_and_peak_is_the_sum():
    prediction = predict(parse(MODEL + "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2".split(), 8))
    groups = prediction.groups()
    assert [g.ranks for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(g.peak == sum(g.parts.values()) for g in groups) and set(groups[0].parts) == set(memory.PARTS)


# -- against megatron's own model -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def megatron_world():
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.initialize_model_parallel(1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield
    ps.destroy_model_parallel()
    if own:
        dist.destroy_process_group()


def _megatron_gpt(args):
    """megatron.training's own builder of the GPT a training run of ``args`` builds (TP = PP = 1)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    model = GPTModelBuilder(gpt_config_from_args(args)).build_model(
        ProcessGroupCollection.use_mpu_process_groups(), pre_process=True, post_process=True)
    return model.bfloat16() if args.bf16 else model


def _part(name: str) -> str:
    for key, part in (("word_embeddings", "embedding"), ("position_embeddings", "position_embedding"),
                      ("output_layer", "output_layer"), (".router.", "router"), (".shared_experts.", "shared_experts"),
                      (".experts.", "experts")):
        if key in name:
            return part
    if "layernorm" in name and "self_attention" not in name:
        return "norms"
    return "attention" if "self_attention" in name else "mlp"


VARIANTS = [
    "",
    "--swiglu --normalization RMSNorm --group-query-attention --num-query-groups 2 --disable-bias-linear "
    "--qk-layernorm --untie-embeddings-and-output-weights --position-embedding-type rope",
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 48 "
    "--swiglu --moe-layer-freq [1,0,1,0] --add-qkv-bias --disable-bias-linear",
]


@pytest.mark.parametrize("extra", VARIANTS, ids=["gpt", "llama-like", "moe"])
def test_parameter_counts_match_megatrons_model(megatron_world, extra):
    args, shape = run(extra)
    model = _megatron_gpt(args)
    counted = {}
    for name, p in model.named_parameters():
        counted[_part(name)] = counted.get(_part(name), 0) + p.numel()
    assert counted == shape.params_on(0)


@pytest.mark.parametrize("extra", [
    "", "--bf16 --swiglu --normalization RMSNorm --attention-dropout 0",
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 --disable-bias-linear --swiglu "
    "--moe-shared-expert-intermediate-size 64",
    "--swiglu --normalization RMSNorm --position-embedding-type rope --num-experts 4 --moe-router-topk 2 "
    "--moe-ffn-hidden-size 64 --disable-bias-linear --moe-aux-loss-coeff 1e-2",
    "--bf16 --normalization RMSNorm --position-embedding-type rope --group-query-attention --num-query-groups 2",
    "--group-query-attention --num-query-groups 2",
], ids=["fp32-layernorm-gelu", "bf16-rmsnorm-swiglu", "moe-swiglu-shared", "fp32-rmsnorm-rope-moe-aux-loss",
        "bf16-rope-gqa", "fp32-gqa"])
def test_layer_activations_match_what_megatron_saves(megatron_world, extra):
    """Storages megatron's second layer saves for backward (parameters and storages saved before it left out),
    against layer_terms; without the formula's terms this fails by their size."""
    import torch

    args, shape = run(extra)
    model = _megatron_gpt(args)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, saved = ["before"], {}
    layer = model.decoder.layers[1]
    layer.register_forward_pre_hook(lambda *_: where.__setitem__(0, "layer"))
    layer.register_forward_hook(lambda *_: where.__setitem__(0, "after"))

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in saved:
            saved[key] = (where[0], storage.nbytes())
        return t

    s, b = args.seq_length, args.micro_batch_size
    tokens = torch.randint(0, 257, (b, s))
    mask = torch.ones(b, 1, s, s, dtype=torch.bool).tril().logical_not()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, torch.arange(s).expand(b, s), mask, labels=tokens)
    measured = sum(n for w, n in saved.values() if w == "layer")
    # an MoE layer's experts get uneven token counts; their sum is s x b x topk, which the formula counts
    assert measured == sum(t.nbytes for t in memory.layer_terms(shape, args, bool(shape.moe_pattern[1])))


def test_swap_moves_attention_to_host_but_keeps_the_layers_in_flight():
    args, shape = run("--swap-attention --swap-prefetch-layers 1 --min-offloaded-tensor-size 0")
    # self_attn = qkv_linear + core_attn + attn_proj: qkv input, q k v, softmax, dropout mask and output, proj input
    attention = SBH + 3 * SBH + 3 * 2 * 4 * 32 * 32 * 4 + SBH
    device, host = memory.activations(shape, args, 0)
    assert host == 4 * attention                       # 4 layers, one micro-batch in flight
    # on the device: the rest of every layer, the embedding's dropout mask, and 2 + 1 (prefetched) layers' attention
    assert device == 4 * (LAYER_ACTIVATIONS - attention) + SBH + 3 * attention
    args, shape = run("--swap-attention")                 # megatron's 1 MiB floor: these tensors all stay
    assert memory.activations(shape, args, 0) == (4 * LAYER_ACTIVATIONS + SBH, 0)


def test_context_parallel_keeps_no_scores():
    for algo in ("ring", "ulysses"):
        args, shape = run(f"--context-parallel-size 2 --context-parallel-algo {algo}", 2)
        names = {t.name: t.nbytes for t in memory.layer_terms(shape, args)}
        assert "softmax output" not in names
        # s = 32 / 2 = 16 local tokens: the output 16 x 2 x 64 and the log-sum-exp 2 x 4 heads x 16, fp32
        assert names["attention output"] == SBH // 2 and names["attention log-sum-exp"] == 2 * 4 * 16 * 4


def test_allgather_context_parallel_keeps_the_gathered_keys_and_values():
    from hyper_adaptor.dryrun.layer_tensors import layer_terms

    def terms(algo):
        args = parse(MODEL + ["--context-parallel-size", "2", "--context-parallel-algo", algo], 2)
        return {t.name: t.nbytes for t in layer_terms(ModelShape.from_args(args), args)}

    ring, allgather = terms("ring"), terms("allgather")
    # the whole sequence's keys and values (32 tokens x micro-batch 2 x 4 heads x 16), fp32, both gathered:
    # the algorithm's backward reads the keys before each query chunk from views of that one tensor
    assert allgather.pop("gathered k, v") == 2 * 32 * 2 * 64 * 4
    assert allgather == ring
