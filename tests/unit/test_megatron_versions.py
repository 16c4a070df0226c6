"""Which megatron-core the adaptor accepts, and proof that every patch resolves in each accepted release.

Each release is unpacked as a Megatron-LM checkout has it (a directory on PYTHONPATH, no pip metadata;
tests/megatron_trees.py) and imported by a fresh interpreter, where ``python -m hyper_adaptor describe``
with every feature's flags resolves every patch target against it: 0.19.0 .. 0.19.2 and the preview,
a named snapshot of Megatron-LM main (skipped, with the reason, where the snapshot is absent).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_adaptor import megatron_version
from hyper_adaptor.megatron_version import (
    ALLOW_ENV,
    PREVIEW,
    PREVIEW_SNAPSHOT,
    SUPPORTED,
    MegatronVersion,
    UnsupportedMegatronError,
)
from hyper_adaptor.patches import megatron_releases
from tests.megatron_trees import (
    MAIN_SKIP,
    MAIN_VERSION,
    copy_tree,
    main_commit,
    main_snapshot,
    main_tree,
    source_tree,
)

ROOT = Path(__file__).resolve().parents[2]

# every feature on (level 2): describe prints and resolves each one's patches
EVERY_FEATURE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 128 --normalization RMSNorm --swiglu "
    "--position-embedding-type rope --use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb "
    "--use-flash-attn --num-experts 4 --moe-grouped-gemm --moe-token-dispatcher-type alltoall "
    "--moe-dispatcher-engine hyper --fused-backend eager --use-hsdp "
    "--context-parallel-size 2 --context-parallel-algo hybrid --ulysses-degree-in-cp 2 --attention-dropout 0 "
    "--profile --deterministic-mode --swap-attention --recompute-activation-function --optimizer-cpu-offload "
    "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --untie-embeddings-and-output-weights "
    "--pipeline-schedule interleaved --save /tmp/hyper-adaptor-describe-ckpt --save-interval 4"
).split()


def run(code_or_module, tree: Path | None, *argv, env=None, timeout=300):
    environment = {k: v for k, v in os.environ.items() if k != ALLOW_ENV}
    environment.update(env or {})
    if tree is not None:
        environment["PYTHONPATH"] = os.pathsep.join([str(tree), str(ROOT)])
    head = ["-m", code_or_module] if code_or_module == "hyper_adaptor" else ["-c", code_or_module]
    return subprocess.run([sys.executable, *head, *argv], capture_output=True, text=True, timeout=timeout,
                          env=environment, cwd=ROOT)


@pytest.fixture(scope="module")
def tree_0192(tmp_path_factory):
    return source_tree("0.19.2", tmp_path_factory.mktemp("mcore-0.19.2"))


def test_the_pip_package_is_found_by_its_metadata():
    found = megatron_version.detect()
    assert found.source == "pip metadata" and found.version == "0.19.2"
    assert megatron_version.check(found) == (found, None)


# describe three times in one interpreter: --use-hsdp switches gradient-accumulation fusion off, so its
# patches are resolved by the second run, without HSDP (and with ZBV, which HSDP refuses: its V placement);
# the third serves --optimizer muon (which --optimizer-cpu-offload refuses)
DESCRIBE_BOTH = f"""
import sys
from hyper_adaptor import cli
flags = {EVERY_FEATURE!r}
first = cli.main(["describe", *flags])
print("=" * 20)
second = cli.main(["describe", *["zbv" if f == "interleaved" else f for f in flags if f != "--use-hsdp"]])
print("=" * 20)
third = cli.main(["describe", *[f for f in flags if f != "--optimizer-cpu-offload"], "--optimizer", "muon"])
sys.exit(first or second or third)
"""


@pytest.mark.parametrize("version", [*SUPPORTED, "main"])
def test_every_patch_resolves_in_each_supported_release_as_a_checkout(version, tmp_path):
    """Megatron-LM's core_r0.19.0 branch reports 0.19.1; the wheels are 0.19.0 .. 0.19.2; "main" is the
    Megatron-LM main snapshot (0.20.0, the preview): accepted without ALLOW_ENV, imported without triton."""
    from hyper_adaptor.features import FEATURES

    if version == "main":
        if main_snapshot() is None:
            pytest.skip(MAIN_SKIP)
        tree, version = main_tree(tmp_path / "Megatron-LM"), MAIN_VERSION
    else:
        tree = source_tree(version, tmp_path)
    result = run(DESCRIBE_BOTH, tree)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"megatron-core {version} (source tree at {tree / 'megatron' / 'core'})" in result.stdout
    # describe's "Megatron releases" section, from the record the patches use
    section = result.stdout.split("Megatron releases: seams that differ in")[1].split("\n\n")[0]
    if version in PREVIEW:
        assert "PREVIEW release" in result.stdout and main_commit()[:12] in result.stdout
        assert all(f"    {seam.target} [" in section for seam in megatron_releases.SEAMS)
    else:
        assert f"none ({len(megatron_releases.SEAMS)} seams checked)" in section
    assert "MISSING" not in result.stdout
    patching = [f.name for f in FEATURES if f.name != "fused_backend"]  # the one feature without patches
    for feature in patching:
        assert f"[x] {feature}  (level" in result.stdout, feature
    assert result.stdout.count("\n    wrap    ") > 40  # the targets were listed, not skipped


def test_a_checkout_is_what_python_imports_even_with_the_pip_package_installed(tree_0192):
    code = ("import torch, hyper_adaptor.megatron_adaptor as a, megatron.core, megatron.training.arguments as t\n"
            "print(a.ADAPTOR.megatron.source.replace(' ', '-'), megatron.core.__file__, t.__file__)")
    result = run(code, tree_0192)
    assert result.returncode == 0, result.stderr[-3000:]
    source, core, training = result.stdout.split()[-3:]
    assert source == "source-tree"
    assert core.startswith(str(tree_0192)) and training.startswith(str(tree_0192))


def _pretend(tree: Path, version: str) -> None:
    info = tree / "megatron" / "core" / "package_info.py"
    text = info.read_text()
    major, minor, patch = version.split(".")
    for name, value in (("MAJOR", major), ("MINOR", minor), ("PATCH", patch)):
        text = "\n".join(f"{name} = {value}" if line.startswith(f"{name} = ") else line for line in text.splitlines())
    info.write_text(text + "\n")


def test_an_unlisted_release_is_refused_then_allowed_at_the_users_risk(tree_0192, tmp_path):
    tree = copy_tree(tree_0192, tmp_path / "t")
    _pretend(tree, "0.21.0")
    refused = run("import torch, hyper_adaptor.megatron_adaptor", tree)
    assert refused.returncode != 0
    message = refused.stderr.strip().splitlines()[-1]
    assert "UnsupportedMegatronError" in message and "found megatron-core 0.21.0 (source tree at" in message
    assert "supports megatron-core 0.19.0, 0.19.1, 0.19.2 (and 0.20.0 from Megatron-LM main as a preview)" in message
    assert f"{ALLOW_ENV}=0.21.0" in message and "README" in message and "DEVELOPERS" not in message

    allowed = run("import torch, hyper_adaptor.megatron_adaptor; print('adapted')", tree, env={ALLOW_ENV: "0.21.0"})
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "[hyper_adaptor] WARNING: megatron-core 0.21.0" in allowed.stdout and "adapted" in allowed.stdout

    # a target gone from that release is still an error naming feature, target and version
    random_py = tree / "megatron" / "core" / "tensor_parallel" / "random.py"
    random_py.write_text(random_py.read_text().replace("def _set_cuda_rng_state(", "def _set_device_rng_state("))
    drifted = run("import torch, hyper_adaptor.megatron_adaptor", tree, env={ALLOW_ENV: "any"})
    assert drifted.returncode != 0
    last = drifted.stderr.strip().splitlines()[-1]
    assert "PatchTargetError: feature 'compat': patch target " \
           "'megatron.core.tensor_parallel.random._set_cuda_rng_state' does not exist" in last
    assert "megatron-core 0.21.0 (source tree at" in last


def test_no_megatron_at_all_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(megatron_version, "detect", lambda: None)
    with pytest.raises(UnsupportedMegatronError, match="cannot import megatron.core: pip install megatron-core, "
                                                         "or put a Megatron-LM checkout on PYTHONPATH"):
        megatron_version.check()


def test_package_info_is_read_without_running_it(tmp_path):
    info = tmp_path / "package_info.py"
    info.write_text("MAJOR = 0\nMINOR = 19\nPATCH = 1\nPRE_RELEASE = 'rc2'\nraise SystemExit('never run')\n")
    assert megatron_version.read_package_info(info) == "0.19.1rc2"
    with pytest.raises(UnsupportedMegatronError, match="0.19.1rc2"):
        megatron_version.check(MegatronVersion("0.19.1rc2", "source tree", str(tmp_path)))


def _checkout(tmp_path: Path, version="0.20.0") -> MegatronVersion:
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    return MegatronVersion(version, "source tree", str(core))


def test_the_preview_is_accepted_with_a_notice_naming_the_commit(tmp_path, monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    found = _checkout(tmp_path)
    assert megatron_version.check(found)[0] is found
    notice = megatron_version.check(found)[1]
    assert "PREVIEW release (Megatron-LM main, checkout commit unknown;" in notice
    assert PREVIEW_SNAPSHOT[:12] in notice
    (tmp_path / "COMMIT").write_text("0123456789abcdef0123 Sat Aug 22 15:22:22 2026 +0000\n")
    assert "checkout commit 0123456789ab;" in megatron_version.check(found)[1]
    # a git checkout answers with its HEAD
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    if subprocess.run([*git, "init", "-q"], capture_output=True).returncode == 0:
        subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True, capture_output=True)
        head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
        assert f"checkout commit {head};" in megatron_version.check(found)[1]
    # a release that is neither supported nor the preview is still refused
    with pytest.raises(UnsupportedMegatronError, match="found megatron-core 0.21.0"):
        megatron_version.check(_checkout(tmp_path / "other", "0.21.0"))


def test_the_seam_record_answers_0192_as_the_reference_and_main_otherwise():
    installed = Path(megatron_version.detect().location).parent.parent
    assert megatron_releases.differing(installed) == []
    if main_snapshot() is None:
        pytest.skip(MAIN_SKIP)
    moved = dict((seam.target, answer) for seam, answer in megatron_releases.differing(main_snapshot()))
    assert sorted(moved) == sorted(seam.target for seam in megatron_releases.SEAMS)
    assert moved["megatron.training.arguments._add_regularization_args"] == "duplicated"


def test_the_moved_seams_take_mains_calls():
    """The calls megatron-core main makes at the fused seams (0.19.x never makes them)."""
    import torch

    from hyper_adaptor.patches.fused import rope, swiglu

    x, bias = torch.randn(3, 2, 8) * 4, torch.randn(8)
    # the MLP's positional clamp_value: megatron main's clamped SwiGLU, in fp32
    gate, linear = (x + bias).chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate.clamp(max=1.5)) * linear.clamp(-1.5, 1.5)
    torch.testing.assert_close(swiglu.bias_swiglu_impl(x, bias, False, False, 1.5), expected)
    torch.testing.assert_close(swiglu.bias_swiglu_impl(x, bias, False, False, None),
                               torch.nn.functional.silu((x + bias)[..., :4]) * (x + bias)[..., 4:])

    calls = []

    def original(t, freqs, config, **kwargs):
        calls.append(kwargs)
        return t

    class Config:
        rotary_interleaved, multi_latent_attention = False, False

    wrapped = rope._wrap_apply_rotary_pos_emb(original)
    t, freqs = torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 8)
    out = wrapped(t, freqs, config=Config(), mscale=1.0, cp_group=None, max_seqlen=None)  # attention's bshd call
    assert calls == [] and out.shape == t.shape
    wrapped(t, freqs, Config(), inverse=True)
    assert calls and calls[0]["inverse"] is True
