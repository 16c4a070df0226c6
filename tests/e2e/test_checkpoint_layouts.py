"""A torch_dist checkpoint saved under one layout resumes under another with the model AND the optimizer
state carried over: examples/pretrain_gpt.py on forked CPU ranks.

Each source layout trains 3 iterations and saves at 2 and 3 (the uninterrupted run). Each target layout
loads the source's iteration 2, trains iteration 3 and saves it. Iteration 3's loss must equal the
uninterrupted run's within 1e-5 (relative), and the two iteration-3 checkpoints, read back whole in one
process, must hold the same weights and the same Adam moments (exp_avg, exp_avg_sq: every tensor within
1e-5 of its largest entry). Equal moments after one more step mean equal moments after the load (same
gradients, same update); a moment reset by the load would be off by far more (the check fails on a target
run with ``--no-load-optim``, ``test_a_reset_optimizer_is_seen``).

The model: 4 layers, hidden 64, RMSNorm, SwiGLU, RoPE, untied output layer, dropout 0 (another layout
draws other dropout masks), vocabulary 256 padded by 64 (megatron pads the vocabulary to a multiple of
``--make-vocab-size-divisible-by`` x TP: with a vocabulary that is a multiple of 64 x 4 every TP up to 4
keeps the same padded size; ``checkpoint inspect`` refuses a change of it).
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_pretrain_gpt import MODEL, grad_norms, pretrain

pytestmark = pytest.mark.e2e

_DROP = {"--hidden-dropout", "--attention-dropout", "--vocab-size"}
_BASE = []
for _i, _a in enumerate(MODEL):
    if _a in _DROP or (_i and MODEL[_i - 1] in _DROP):
        continue
    _BASE.append(_a)
DENSE = [*_BASE, "--hidden-dropout", "0", "--attention-dropout", "0", "--vocab-size", "256",
         "--make-vocab-size-divisible-by", "64", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
MOE = [*DENSE, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128"]
COMMON = ["--mock-data", "--num-workers", "0", "--train-iters", "3", "--save-interval", "2"]

DISTOPT = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
HSDP3 = ["--use-hsdp", "--hsdp-optimizer-level", "level3", "--hsdp-threshold-kb", "0"]
ZBV = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
       "--pipeline-schedule", "zbv"]

# name: (model, ranks, flags)
SOURCES = {
    "TP2xPP2+distopt": (DENSE, 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                   *DISTOPT]),
    "DP4+hsdp3": (DENSE, 4, HSDP3),
    "PP2-zbv": (DENSE, 2, ZBV),
    "EP2+distopt": (MOE, 2, ["--expert-model-parallel-size", "2", *DISTOPT]),
    # megatron's default format for the distributed optimizer (dp_reshardable): it moves across DP only
    "DP2+distopt-default": (DENSE, 2, ["--use-distributed-optimizer"]),
    # hyper_adaptor's Muon (momentum in model space under megatron's DDP and HSDP)
    "DP2+muon-hsdp3": (DENSE, 2, ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high", *HSDP3]),
}
# (source, target, ranks, flags)
PAIRS = [
    ("TP2xPP2+distopt", "TP1xPP4+hsdp3", 4, ["--pipeline-model-parallel-size", "4", *HSDP3]),
    ("TP2xPP2+distopt", "DP2+distopt", 2, DISTOPT),
    ("TP2xPP2+distopt", "TP4+hsdp1", 4, ["--tensor-model-parallel-size", "4", "--use-hsdp",
                                         "--hsdp-optimizer-level", "level1"]),
    ("TP2xPP2+distopt", "PP2xDP2-zbv", 4, ZBV),
    ("TP2xPP2+distopt", "CP2xDP2", 4, ["--context-parallel-size", "2"]),
    ("DP4+hsdp3", "DP2+hsdp3", 2, HSDP3),
    ("DP4+hsdp3", "TP2xDP2+distopt", 4, ["--tensor-model-parallel-size", "2", *DISTOPT]),
    ("PP2-zbv", "PP2-1f1b", 2, ["--pipeline-model-parallel-size", "2"]),
    ("PP2-zbv", "DP2", 2, []),
    ("EP2+distopt", "EP1xDP2+distopt", 2, DISTOPT),
    ("EP2+distopt", "EP1+hsdp3", 2, HSDP3),
    ("DP2+distopt-default", "DP1+distopt-default", 1, ["--use-distributed-optimizer"]),
    ("DP2+muon-hsdp3", "TP2+muon", 2, ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high",
                                       "--tensor-model-parallel-size", "2", "--muon-tp-mode", "duplicated"]),
]


# Adam's moments; Muon's momentum
MOMENTS = (".exp_avg", ".momentum_buffer")


def _close(a: float, b: float, rtol: float = 1e-5) -> bool:
    return abs(a - b) <= rtol * abs(b)


def read_whole(iteration_dir) -> dict:
    """Every tensor of a torch_dist checkpoint, whole, read in this one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(iteration_dir))
    meta = reader.read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def compare_states(want: dict, got: dict, tol: float = 1e-5) -> list[str]:
    """Weights and Adam moments of ``want`` against ``got`` (keys in model space: the same in every layout)."""
    keys = [k for k in want if not k.startswith("optimizer.") or any(m in k for m in MOMENTS)]
    bad = [f"missing {k}" for k in keys if k not in got]
    moments = [k for k in keys if any(m in k for m in MOMENTS)]
    if not moments:
        bad.append("no optimizer moments in the reference checkpoint")
    for k in keys:
        if k not in got:
            continue
        a, b = want[k].float(), got[k].float()
        if a.shape != b.shape:
            bad.append(f"{k}: shape {tuple(b.shape)} != {tuple(a.shape)}")
            continue
        scale = max(a.abs().max().item(), 1e-30)
        err = (a - b).abs().max().item()
        if err > tol * scale:
            bad.append(f"{k}: max err {err:.3e} (largest entry {scale:.3e})")
    return bad


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each source layout, run lazily once: (checkpoint dir, losses, grad norms)."""
    done = {}

    def get(name):
        if name not in done:
            model, ranks, flags = SOURCES[name]
            ckpt = tmp_path_factory.mktemp(name.replace("+", "_")) / "ckpt"
            losses, output = pretrain(ranks, *COMMON, *flags, "--save", str(ckpt), model=model)
            assert sorted(losses) == [1, 2, 3], output[-3000:]
            done[name] = (ckpt, losses, grad_norms(output))
        return done[name]

    return get


def resume(sources, source, ranks, flags, tmp_path, *extra):
    ckpt, losses, norms = sources(source)
    model = SOURCES[source][0]
    target = tmp_path / "ckpt"
    got, output = pretrain(ranks, *COMMON, *flags, "--load", str(ckpt), "--ckpt-step", "2", "--save", str(target),
                           *extra, model=model)
    return (ckpt, losses, norms), (target, got, grad_norms(output), output)


@pytest.mark.parametrize("source,target,ranks,flags", PAIRS, ids=[f"{s}->{t}" for s, t, _, _ in PAIRS])
def test_resume_under_another_layout_carries_model_and_optimizer_state(sources, source, target, ranks, flags,
                                                                      tmp_path):
    (ckpt, losses, norms), (saved, got, got_norms, output) = resume(sources, source, ranks, flags, tmp_path)
    assert sorted(got) == [3], output[-3000:]
    assert _close(got[3], losses[3]), (source, target, got[3], losses[3])
    assert _close(got_norms[3], norms[3], 1e-4), (got_norms[3], norms[3])
    bad = compare_states(read_whole(ckpt / "iter_0000003"), read_whole(saved / "iter_0000003"))
    assert not bad, f"{source} -> {target}: {len(bad)} tensors differ: {bad[:8]}"


def test_a_reset_optimizer_is_seen(sources, tmp_path):
    """The moment check can fail: a target that loads the weights but not the optimizer state."""
    source, _, ranks, flags = PAIRS[1]
    (ckpt, losses, _), (saved, got, _, _) = resume(sources, source, ranks, flags, tmp_path, "--no-load-optim")
    bad = compare_states(read_whole(ckpt / "iter_0000003"), read_whole(saved / "iter_0000003"))
    assert any(".exp_avg" in b for b in bad), bad
