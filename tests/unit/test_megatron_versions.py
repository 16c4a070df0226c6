"""Which megatron-core the adaptor accepts, and proof that every patch resolves in each accepted release.

Each release is unpacked as a Megatron-LM checkout has it (a directory on PYTHONPATH, no pip metadata;
tests/megatron_trees.py) and imported by a fresh interpreter, where ``python -m hyper_adaptor describe``
with every feature's flags resolves every patch target against it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_adaptor import megatron_version
from hyper_adaptor.megatron_version import ALLOW_ENV, SUPPORTED, MegatronVersion, UnsupportedMegatronError
from tests.megatron_trees import copy_tree, source_tree

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


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_patch_resolves_in_each_supported_release_as_a_checkout(version, tmp_path):
    """Megatron-LM's core_r0.19.0 branch reports 0.19.1; the wheels are 0.19.0 .. 0.19.2."""
    from hyper_adaptor.features import FEATURES

    tree = source_tree(version, tmp_path)
    result = run(DESCRIBE_BOTH, tree)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"megatron-core {version} (source tree at {tree / 'megatron' / 'core'})" in result.stdout
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
    _pretend(tree, "0.20.0")
    refused = run("import torch, hyper_adaptor.megatron_adaptor", tree)
    assert refused.returncode != 0
    message = refused.stderr.strip().splitlines()[-1]
    assert "UnsupportedMegatronError" in message and "found megatron-core 0.20.0 (source tree at" in message
    assert "supports megatron-core 0.19.0, 0.19.1, 0.19.2" in message
    assert f"{ALLOW_ENV}=0.20.0" in message and "README" in message and "DEVELOPERS" not in message

    allowed = run("import torch, hyper_adaptor.megatron_adaptor; print('adapted')", tree, env={ALLOW_ENV: "0.20.0"})
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "[hyper_adaptor] WARNING: megatron-core 0.20.0" in allowed.stdout and "adapted" in allowed.stdout

    # a target gone from that release is still an error naming feature, target and version
    random_py = tree / "megatron" / "core" / "tensor_parallel" / "random.py"
    random_py.write_text(random_py.read_text().replace("def _set_cuda_rng_state(", "def _set_device_rng_state("))
    drifted = run("import torch, hyper_adaptor.megatron_adaptor", tree, env={ALLOW_ENV: "any"})
    assert drifted.returncode != 0
    last = drifted.stderr.strip().splitlines()[-1]
    assert "PatchTargetError: feature 'compat': patch target " \
           "'megatron.core.tensor_parallel.random._set_cuda_rng_state' does not exist" in last
    assert "megatron-core 0.20.0 (source tree at" in last


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
