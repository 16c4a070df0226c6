"""patches/pipeline/wgrad.py on megatron's own output layer and cross entropy, one process, TP 1.

The loss stage of a zero-bubble schedule: megatron's ``vocab_parallel_cross_entropy`` computes the softmax in
place in the logits and hands it back as the gradient, so the output layer's ``grad_output`` is the logits
tensor itself, whose ``grad_fn`` is the output layer's own autograd node. Whatever keeps that tensor from the
node (megatron's ``grad_output_buffer`` on ctx did) makes a reference cycle that holds the micro-batch's whole
graph until Python's cyclic collector runs: under megatron.training every rank with the loss grew each
iteration (bench/dry_run.py's pp2-zbh1 row). The checks run with the collector off, so a cycle stays a cycle.
"""

import contextlib
import gc
import weakref

import pytest
import torch

import hyper_adaptor.megatron_adaptor  # noqa: F401  (before megatron, as a training script's line)
from tests.unit.ops._world import megatron_world_of_one

VOCAB, HIDDEN, SEQ, BATCH = 32, 16, 8, 2


@pytest.fixture
def megatron_tp1():
    from megatron.core import tensor_parallel

    with megatron_world_of_one():
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        yield


@contextlib.contextmanager
def _collector_off():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _output_layer():
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    torch.manual_seed(0)
    config = ModelParallelConfig(use_cpu_initialization=True, perform_initialization=True)
    return ColumnParallelLinear(HIDDEN, VOCAB, config=config, init_method=torch.nn.init.normal_, bias=False,
                                gather_output=False)


def _loss_stage_backward(layer, deferred: list | None):
    """Megatron GPT's loss stage: output layer, fp32 logits, vocab-parallel cross entropy, summed; the backward
    with the weight gradients deferred into ``deferred`` (None: not deferred). Returns (input, weakrefs to the
    output layer's node and to the logits)."""
    from hyper_adaptor.patches.pipeline import wgrad

    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(1)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g, requires_grad=True)
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=g)
    logits, _ = layer(x)
    loss = vocab_parallel_cross_entropy(logits.float(), target).sum()
    refs = weakref.ref(logits.grad_fn), weakref.ref(logits)
    with wgrad.deferring(deferred) if deferred is not None else contextlib.nullcontext():
        loss.backward()
    return x, refs


def test_the_loss_stages_deferred_backward_leaves_no_cycle_and_the_same_gradients(megatron_tp1):
    from hyper_adaptor.patch_manager import PatchManager
    from hyper_adaptor.patches.pipeline import wgrad

    plain, deferred_layer = _output_layer(), _output_layer()
    x_plain, _ = _loss_stage_backward(plain, None)
    manager = PatchManager()
    manager.register_all(wgrad.patches())
    with manager.applied(), _collector_off():
        queue = []
        x, (node, logits) = _loss_stage_backward(deferred_layer, queue)
        assert len(queue) == 1 and deferred_layer.weight.grad is None
        keeps_graph = [t.grad_fn is not None for t in (queue[0].grad_output, queue[0].input)]
        wgrad.run_deferred(queue)
        assert node() is None and logits() is None, \
            "the output layer's autograd node outlived its backward and W step (a reference cycle)"
    # until the W step, the queue holds the values it multiplies, not the graph they came from
    assert keeps_graph == [False, False]
    assert torch.equal(deferred_layer.weight.grad, plain.weight.grad)
    assert torch.equal(x.grad, x_plain.grad)
