"""Level 0 on CPU: each fix, shown to be needed (the original fails) and to work (one process).

Distributed behaviour (RNG across TP ranks, the PP2-VPP trap, parity) is in tests/distributed.
"""

import types

import pytest
import torch

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor import platform

pytestmark = pytest.mark.skipif(platform.device_type() != "cpu", reason="CPU emulation of the cuda device")
MANAGER = adaptor_module.ADAPTOR.manager


def original(target):
    return MANAGER.original(target)


def test_device_literals_land_on_the_host():
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(1, device=torch.device("cuda:0")).device.type == "cpu"
    assert torch.tensor([1.0], device=f"cuda:{torch.cuda.current_device()}").device.type == "cpu"
    t = torch.arange(4)
    assert t.cuda() is t and t.to("cuda").device.type == "cpu" and t.to(0).dtype == t.dtype
    assert t.new_zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(2, pin_memory=True).device.type == "cpu"
    with pytest.raises((RuntimeError, AssertionError)):  # what megatron would hit unpatched
        original("torch.zeros")(2, device="cuda")


def test_cuda_namespace_answers_as_one_host_device():
    assert torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
    assert torch.cuda.is_available() is False  # torch's own CPU paths stay as they are
    stream = torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.Stream())
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    torch.cuda.synchronize()
    assert event.query() and stream.query()
    assert torch.cuda.get_device_properties(0).major == 0
    assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated() > 0


def test_record_stream_on_the_host_stream_is_a_no_op():
    """megatron's schedule nodes (--overlap-moe-expert-parallel-comm's combined 1F1B) record their freed
    inputs on the node's stream; torch's binding refuses the host's stand-in stream."""
    t = torch.ones(3)
    assert t.record_stream(torch.cuda.Stream()) is None and t.record_stream(torch.cuda.current_stream()) is None
    with pytest.raises(RuntimeError, match="unknown parameter type"):  # what megatron hit unpatched
        original("torch.Tensor.record_stream")(t, torch.cuda.current_stream())


def test_cuda_rng_is_the_host_generator_and_really_changes():
    torch.cuda.manual_seed(7)
    state = torch.cuda.get_rng_state()
    a = torch.rand(4)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4), a)
    import torch.cuda.random as cuda_random

    assert cuda_random.get_rng_state is torch.cuda.get_rng_state  # rebound in torch.cuda's submodule


def test_megatron_set_cuda_rng_state_really_sets_it():
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(1)
    state = torch.get_rng_state()
    torch.rand(8)
    mrandom._set_cuda_rng_state(state)
    after_patched = torch.get_rng_state()
    assert torch.equal(after_patched, state)
    # unpatched, the call is queued lazily and never runs: the state does not come back
    torch.rand(8)
    moved = torch.get_rng_state()
    original(f"{mrandom.__name__}._set_cuda_rng_state")(state)
    assert torch.equal(torch.get_rng_state(), moved)


def test_tracker_fork_draws_from_its_own_stream_and_restores():
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 99)
    torch.manual_seed(5)
    outside_before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        inside = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside_before)  # default stream restored
    torch.manual_seed(99)
    assert torch.equal(inside, torch.rand(4))  # fork drew from the tracker's seed


def test_optimizer_type_checks_accept_host_tensors():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(p.grad, torch.full((3,), 0.5), atol=1e-5)
    with pytest.raises(AssertionError):  # unpatched: 'torch.FloatTensor' != 'torch.cuda.FloatTensor'
        original("megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32")([p], 1.0, 4.0)
    assert p.type() == "torch.FloatTensor"  # the type view ends with the call


def _norm_config(sequence_parallel):
    return types.SimpleNamespace(
        layernorm_zero_centered_gamma=False,
        persist_layer_norm=False,
        sequence_parallel=sequence_parallel,
        memory_efficient_layer_norm=False,
        normalization="LayerNorm",
        layernorm_epsilon=1e-5,
    )


def test_local_norm_under_sequence_parallel_marks_its_params():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norm = WrappedTorchNorm(_norm_config(True), 8)
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    assert not any(getattr(p, "sequence_parallel", False)
                   for p in WrappedTorchNorm(_norm_config(False), 8).parameters())
    with pytest.raises(AssertionError, match="sequence parallel"):
        original("megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__").__func__(
            WrappedTorchNorm, _norm_config(True), 8)


def test_jit_warm_up_leaves_host_rng_alone():
    """megatron's warm-up draws TP-size-dependent random shapes; with the host generator shared, TP1
    and TP2 would initialise different weights. (The real warm-up needs megatron's global args and a
    torch.compile; its effect on whole runs is covered by the TP parity tests.)"""
    from hyper_adaptor.patches.compat.megatron_training import _warm_up_without_moving_host_rng

    from megatron.training import initialize

    def draws(tp_size=None):  # stands for the warm-up's device="cuda" random inputs
        return torch.rand(16 // (tp_size or 1), device="cuda")

    torch.manual_seed(3)
    before = torch.get_rng_state()
    draws(tp_size=2)
    assert not torch.equal(torch.get_rng_state(), before)  # what an unguarded warm-up does
    torch.set_rng_state(before)
    _warm_up_without_moving_host_rng(draws)(tp_size=2)
    assert torch.equal(torch.get_rng_state(), before)
    assert initialize._warmup_jit_function.__wrapped__ is original("megatron.training.initialize._warmup_jit_function")


def test_jit_warm_up_is_skipped_when_no_bias_fusion_is_on(monkeypatch):
    """The warm-up only compiles the fused bias kernels; with all of them off it would spend tens of
    seconds in torch.compile on the host for kernels the run never calls."""
    import types

    from hyper_adaptor.patches.compat.megatron_training import _warm_up_without_moving_host_rng

    from megatron.training import global_vars

    calls = []
    warm = _warm_up_without_moving_host_rng(lambda tp_size=None: calls.append(tp_size))
    off = dict(bias_gelu_fusion=False, bias_swiglu_fusion=False, bias_dropout_fusion=False)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", types.SimpleNamespace(**off))
    warm(tp_size=2)
    assert calls == []
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", types.SimpleNamespace(**dict(off, bias_dropout_fusion=True)))
    warm(tp_size=2)
    assert calls == [2]


def test_dataset_helpers_are_not_rebuilt_with_make():
    from megatron.core.datasets import utils

    utils.compile_helpers()  # would run `make` (no Makefile in the wheel) and fail
    with pytest.raises(SystemExit):
        original("megatron.core.datasets.utils.compile_helpers")()


def test_rope_slice_per_context_parallel_rank_runs_on_the_host():
    """megatron's ``get_pos_emb_on_this_cp_rank`` (CP > 1 with RoPE) builds its chunk index with
    ``pin_memory=True`` and ``.cuda()``: the host-device mapping serves both, and the rank keeps its two
    load-balanced chunks (r and 2 x CP - 1 - r)."""
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    cp_group = types.SimpleNamespace(size=lambda: 2, rank=lambda: 1)
    positions = torch.arange(8.0).view(8, 1, 1, 1)
    assert get_pos_emb_on_this_cp_rank(positions, 0, cp_group).flatten().tolist() == [2.0, 3.0, 4.0, 5.0]
    # what megatron's index tensor hits unpatched (a CUDA build of torch on a host without a GPU: no driver)
    with pytest.raises(RuntimeError, match="pin_memory|NVIDIA driver"):
        original("torch.tensor")([1, 2], device="cpu", pin_memory=True)


def test_default_device_context_still_reaches_the_wrapped_factories():
    """``with torch.device("meta")`` (meta-device model building) must not be silently turned into real host
    allocations by level 0's factory wraps (torch recognises factories by identity). A fresh interpreter:
    in this one the set torch builds may already exist from before the adaptor."""
    import subprocess
    import sys

    code = ("import torch, hyper_adaptor.megatron_adaptor\n"
            "with torch.device('meta'):\n"
            "    w = torch.nn.Linear(4, 4).weight\n"
            "    z = torch.zeros(3)\n"
            "print(w.device, z.device, torch.zeros(2, device='cuda').device)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-3:] == ["meta", "meta", "cpu"], done.stdout[-500:]
