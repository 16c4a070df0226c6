"""--deterministic-mode end to end: the same command run twice gives the same losses, the same gradient
norms and bitwise the same checkpoint (every parameter, both Adam moments, the RNG states), once per
feature family — TP2 x PP2 without feature flags (the embedded corpus, dropout on: the first of its two
runs is the one tests/e2e/conftest.py shares with the save/resume and checkout tests), level 1 with
every fused op, level 2 (HSDP level 3 with context parallel 2) — and inside every rank the switches are
really on (docs/features/determinism.md).

The logged losses and norms carry megatron's 7 / 4 significant digits; the bitwise evidence is the
checkpoint: after 5 steps the parameters and Adam's two moments are functions of every step's
gradients, so one differing bit anywhere in forward, backward, reduction or update shows there.
"""

import os
import re
import sys

import pytest
import torch

from hyper_adaptor.testing import run_world
from tests.e2e.test_pretrain_gpt import MODEL, grad_norms, pretrain, tp2_pp2_flags

pytestmark = pytest.mark.e2e
ITERS = "5"
COMMON = ["--mock-data", "--num-workers", "0", "--train-iters", ITERS, "--deterministic-mode", "--save-interval", ITERS]


def _checkpoint(path) -> dict:
    """One torch_dist checkpoint as {name: value}, every shard of every rank put together."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import hyper_adaptor.megatron_adaptor  # noqa: F401  (megatron's classes are in the pickles)

    out = path.parent / (path.name + ".pt")
    dcp_to_torch_save(str(path), str(out))
    state = torch.load(out, weights_only=False)
    for key, value in state.items():
        if key.startswith("common_state/"):
            # the arguments are stored with the run: --save names each run's own directory
            for entry in value:
                if isinstance(entry, dict) and "args" in entry:
                    entry["args"].save = None
    return state


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        # bitwise: the same dtype and shape and the same bytes (NaN == NaN, -0.0 != 0.0)
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bytes(a), _bytes(b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "tobytes"):  # numpy RNG state
        return a.tobytes() == b.tobytes()
    return a == b


def _twice(tmp_path, nproc, *flags, model=MODEL, first=None):
    """The command run twice (``first``: (checkpoint directory, losses, output) of its first run, made
    elsewhere with the same command); each run saves at its last iteration."""
    runs = []
    for i in (1, 2):
        if i == 1 and first is not None:
            save, losses, output = first
        else:
            save = tmp_path / f"run{i}"
            losses, output = pretrain(nproc, *flags, "--save", str(save), model=model)
        last = (save / "latest_checkpointed_iteration.txt").read_text().strip()
        runs.append((losses, grad_norms(output), _checkpoint(save / f"iter_{int(last):07d}"), output))
    (l1, g1, c1, out), (l2, g2, c2, _) = runs
    assert sorted(l1) == list(range(1, int(last) + 1)), out[-3000:]
    assert l1 == l2 and g1 == g2, (l1, l2, g1, g2)
    tensors = [k for k, v in c1.items() if isinstance(v, torch.Tensor)]
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in tensors), sorted(c1)[:20]
    differing = sorted(k for k in set(c1) | set(c2) if k not in c1 or k not in c2 or not _same(c1[k], c2[k]))
    assert not differing, differing
    # the comparison sees one ulp in one parameter (so equal above means equal)
    name = next(k for k in tensors if not k.startswith("optimizer."))
    assert not _same(c1[name], torch.nextafter(c1[name], torch.full_like(c1[name], float("inf"))))
    assert re.search(r"--deterministic-mode on \w+: torch.use_deterministic_algorithms\(True\)", out), out[-3000:]
    return l1, out


def test_tp2_pp2_twice_bitwise(corpus, tp2_pp2_run, tmp_path):
    """TP2 x PP2 with megatron's data-loader workers and dropout on, 6 steps, at the default level with no
    feature flags (level 0's patches and the gradient-accumulation fusion)."""
    _twice(tmp_path, 4, *tp2_pp2_flags(corpus), "--save-interval", "3", first=tp2_pp2_run)


def test_level1_every_fused_op_twice_bitwise(tmp_path):
    """RMSNorm, SwiGLU, RoPE, flash attention (attention dropout on: the RNG is part of it), the MoE
    experts' grouped GEMM and the fused weight-gradient accumulation, at TP 2 + SP with expert layers."""
    flags = ("--optimization-level 1 --use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb "
             "--use-flash-attn --normalization RMSNorm --swiglu --position-embedding-type rope "
             "--disable-bias-linear --num-experts 4 --moe-grouped-gemm --moe-router-topk 2 "
             "--tensor-model-parallel-size 2 --sequence-parallel").split()
    model = [a for a in MODEL if a != "--no-bias-swiglu-fusion"]  # the fused SwiGLU rides on that fusion
    _, output = _twice(tmp_path, 2, *COMMON, *flags, model=model)
    for feature in ("fused_rmsnorm", "fused_swiglu", "fused_rope", "flash_attn", "grad_accum_fusion",
                    "moe_grouped_gemm"):
        assert f"{feature} (level 1) applied" in output, feature


def test_level2_hsdp_level3_with_context_parallel_twice_bitwise(tmp_path):
    """HSDP level 3 (parameters, gradients and optimizer state sharded, reductions overlapped with
    backward) over data x context parallel, ring attention at CP 2: 4 ranks, CP 2 x DP 2."""
    flags = ("--use-hsdp --hsdp-optimizer-level level3 --hsdp-comm-async --context-parallel-size 2 "
             "--attention-dropout 0").split()
    _, output = _twice(tmp_path, 4, *COMMON, *flags)
    for feature in ("hsdp", "context_parallel"):
        assert f"{feature} (level 2) applied" in output, feature


# ------------------------------------------------------------------------ the switches, inside each rank
SWITCH_FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
                "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 128 --deterministic-mode").split()


def rank_switches(rank, world_size):
    """Megatron's own argument path in a rank: parse_args + (wrapped) validate_args, as pretrain does."""
    import hyper_adaptor.megatron_adaptor  # noqa: F401
    from hyper_adaptor import platform
    from hyper_adaptor.patches import determinism

    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    sys.argv = ["pretrain_gpt.py", *SWITCH_FLAGS]
    args = parse_args()
    validate_args(args)
    device = platform.device_type()
    state = determinism.switches_state(device)
    state["device"] = device
    state["args_deterministic_mode"] = args.deterministic_mode
    state["config_deterministic_mode"] = core_transformer_config_from_args(args).deterministic_mode
    # megatron's own set-up writes NCCL_ALGO on every device; it must not have run (the flag is hidden
    # from it): off CUDA nothing writes it, on CUDA the adaptor's item patch does
    state["nccl_algo"] = os.environ.get("NCCL_ALGO")
    return state


def test_switches_are_on_inside_every_rank(monkeypatch):
    from hyper_adaptor.patches import determinism

    for name in ("NCCL_ALGO", *(n for env in determinism.ENV.values() for n in env)):
        monkeypatch.delenv(name, raising=False)
    for state in run_world(2, "tests.e2e.test_determinism:rank_switches", timeout=240):
        assert state["torch_deterministic"] and not state["torch_warn_only"], state
        assert state["ops_deterministic"], state
        assert state["args_deterministic_mode"] and state["config_deterministic_mode"], state
        assert state["env"] == determinism.ENV[state["device"]], state
        assert state["nccl_algo"] == ("Ring" if state["device"] == "cuda" else None), state
        if state["device"] == "cuda":
            assert state["cudnn"] == (True, False), state
