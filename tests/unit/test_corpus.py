"""Unit tests for examples/corpus.py on a tiny synthetic "stdlib" (fast: no real stdlib walk)."""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # plain `pytest` from anywhere: make hyper_adaptor importable
    sys.path.insert(0, str(REPO))

from hyper_adaptor.patches.compat import imports  # noqa: E402

imports.install()  # before anything imports megatron

import argparse  # noqa: E402
import importlib.util  # noqa: E402

import numpy  # noqa: E402
import pytest  # noqa: E402

from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.core.datasets.utils import Split  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402

_spec = importlib.util.spec_from_file_location("examples_corpus", REPO / "examples" / "corpus.py")
corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus)

# Sorted by relative path these are the documents, in this order.
GOOD = {
    "a.py": b"x = 1\n",
    "c.py": b"def f():\n    return 2\n",
    "pkg/b.py": "s = 'héllo — ünïcode ✓'\n".encode(),  # multi-byte UTF-8
}
SKIPPED = {
    "bad.py": "# -*- coding: latin-1 -*-\nname = 'é'\n".encode("latin-1"),  # not UTF-8
    "empty.py": b"",
    "notes.txt": b"not python\n",
    "site-packages/third_party.py": b"y = 2\n",  # not stdlib
    "__pycache__/cached.py": b"z = 3\n",
}


@pytest.fixture
def stdlib(tmp_path):
    root = tmp_path / "stdlib"
    for rel, data in {**GOOD, **SKIPPED}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return str(root)


@pytest.fixture
def built(stdlib, tmp_path):
    prefix = str(tmp_path / "out" / "tiny_text_document")
    return prefix, corpus.build_corpus(prefix, stdlib_dir=stdlib)


def test_documents_round_trip_through_indexed_dataset(built):
    prefix, stats = built
    nbytes = sum(map(len, GOOD.values()))
    assert stats["documents"] == 3 and not stats["cached"]
    assert stats["bytes"] == nbytes and stats["tokens"] == nbytes + 3
    assert stats["first_file"] == "a.py"

    dataset = IndexedDataset(prefix)
    assert len(dataset.document_indices) - 1 == 3 and len(dataset) == 3
    assert dataset.index.dtype == numpy.uint16  # DType.optimal_dtype(257)
    for i, source in enumerate(GOOD.values()):
        ids = dataset[i]
        assert ids.size == len(source) + 1
        assert ids.max() <= corpus.EOD_ID
        assert corpus.decode(ids) == source
        assert ids[:-1].astype(numpy.uint8).tobytes() == source
    corpus.verify_corpus(prefix)


def test_each_document_ends_with_exactly_one_eod(built):
    prefix, _ = built
    dataset = IndexedDataset(prefix)
    for i in range(len(dataset)):
        ids = dataset[i]
        assert ids[-1] == corpus.EOD_ID
        assert (ids == corpus.EOD_ID).sum() == 1


def test_pretrain_flags_build_a_tokenizer_that_agrees(monkeypatch):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *corpus.PRETRAIN_TOKENIZER_ARGS])
    args = parse_args(ignore_unknown_args=True)
    args.rank, args.tensor_model_parallel_size = 0, 1
    tokenizer = build_tokenizer(args)
    assert tokenizer.vocab_size == corpus.VOCAB_SIZE == 257
    assert tokenizer.eod == corpus.EOD_ID == 256
    assert tokenizer.pad == -1  # never a data id, so GPTDataset's pad masking touches nothing
    assert args.padded_vocab_size >= 257  # 384 at TP=1: padding rows never appear in the data


def test_gpt_dataset_sees_document_boundaries(built):
    # With --eod-mask-loss/--reset-position-ids/--reset-attention-mask GPTDataset finds the
    # document boundaries only through tokenizer.eod in the stored tokens.
    prefix, _ = built
    args = argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=257, pad_vocab_size=False)
    tokenizer = build_tokenizer(args)
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=16,
        tokenizer=tokenizer,
        reset_position_ids=True,
        reset_attention_mask=True,
        eod_mask_loss=True,
        create_attention_mask=True,
        path_to_cache=None,
        split="1,0,0",
    )
    indexed = IndexedDataset(prefix)
    dataset = GPTDataset(indexed, prefix, numpy.arange(len(indexed)), None, Split.train, config)
    eods_seen = 0
    for sample in (dataset[i] for i in range(len(dataset))):
        tokens, loss_mask, positions = sample["tokens"], sample["loss_mask"], sample["position_ids"]
        assert tokens.max() <= corpus.EOD_ID
        for i in (tokens == corpus.EOD_ID).nonzero().flatten().tolist():
            eods_seen += 1
            assert loss_mask[i] == 0
            if i + 1 < len(tokens):
                assert positions[i + 1] == 0  # next document starts at position 0
                assert sample["attention_mask"][0, i + 1 :, : i + 1].all()  # True == masked
        assert (loss_mask[tokens != corpus.EOD_ID] == 1).all()
    assert eods_seen > 0


def test_second_call_is_a_cache_hit_and_parameters_invalidate_it(built, stdlib):
    prefix, first = built
    paths = [prefix + ext for ext in (".bin", ".idx", ".json")]
    mtimes = [os.stat(p).st_mtime_ns for p in paths]

    again = corpus.build_corpus(prefix, stdlib_dir=stdlib)
    assert again["cached"]
    assert {**again, "cached": False} == first  # the stamp's stats, seconds included
    assert [os.stat(p).st_mtime_ns for p in paths] == mtimes  # nothing rewritten

    # A smaller cap is a different corpus: rebuilt, and it keeps a prefix of the sorted files.
    cap = len(GOOD["a.py"]) + len(GOOD["c.py"])
    capped = corpus.build_corpus(prefix, max_bytes=cap, stdlib_dir=stdlib)
    assert not capped["cached"] and capped["documents"] == 2
    assert len(IndexedDataset(prefix)) == 2


def test_missing_data_file_forces_rebuild(built, stdlib):
    prefix, _ = built
    os.remove(prefix + ".bin")
    stats = corpus.build_corpus(prefix, stdlib_dir=stdlib)
    assert not stats["cached"] and stats["documents"] == 3
    corpus.verify_corpus(prefix)


def test_nothing_to_write_is_an_error(tmp_path):
    (tmp_path / "only_bad.py").write_bytes(b"\xff\xfe\n")
    with pytest.raises(ValueError):
        corpus.build_corpus(str(tmp_path / "out" / "x"), stdlib_dir=str(tmp_path))
    assert not list((tmp_path / "out").iterdir())  # no half-written leftovers
