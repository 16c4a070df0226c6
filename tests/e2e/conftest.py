"""Runs that more than one end-to-end test reads, launched once per session: a launched run's cost is
mostly megatron's start-up on every rank, and several tests can read the same run."""

import subprocess
import sys

import pytest

from tests.e2e.test_pretrain_gpt import ROOT, pretrain, tp2_pp2_flags


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("corpus") / "stdlib_text_document"
    subprocess.run(
        [sys.executable, "examples/corpus.py", "--output-prefix", str(prefix), "--max-bytes", str(2 << 20)],
        cwd=ROOT, check=True, capture_output=True, timeout=300,
    )
    return str(prefix)


@pytest.fixture(scope="session")
def tp2_pp2_run(corpus, tmp_path_factory):
    """The uninterrupted TP2 x PP2 run on the corpus, saving at iterations 3 and 6: the reference of the
    resume (test_pretrain_gpt.py), the first of the two identical runs (test_determinism.py) and the
    pip package's losses (test_megatron_checkout.py). Returns (checkpoint directory, losses, output)."""
    ckpt = tmp_path_factory.mktemp("tp2_pp2") / "ckpt"
    # through torchrun itself, as the README launches it
    losses, output = pretrain(4, *tp2_pp2_flags(corpus), "--save", str(ckpt), "--save-interval", "3", torchrun=True)
    return ckpt, losses, output
