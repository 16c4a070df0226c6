"""Embedded default training data for the demo Megatron GPT run: the stdlib's own Python source.

No download: every Python install ships its standard library as ``.py`` text. Each UTF-8 file
(sorted by relative path, up to ``max_bytes``) becomes one document, tokenized byte-level, and is
written with megatron.core's ``IndexedDatasetBuilder`` as ``<prefix>.bin`` / ``<prefix>.idx``.

Tokenizer agreement (checked against megatron-core 0.19.2):

* There is no ``megatron.training.tokenizer`` any more; ``--tokenizer-type NullTokenizer`` goes
  through ``megatron.core.tokenizers.utils.build_tokenizer``, which passes ``--vocab-size N`` as is
  to ``megatron.core.tokenizers.text.libraries.NullTokenizer(vocab_size=N)``. Its ``vocab_size`` is
  exactly N and its ``eod`` is ``N - 1`` (unless ``--null-tokenizer-eod-id`` says otherwise); its
  pad id is -1, which never occurs in the data. (The legacy Megatron-LM ``_NullTokenizer`` instead
  added the eod on top: ``--vocab-size 256`` meant 257 ids. That is not what 0.19.2 does.)
* So bytes are ids 0..255, EOD is 256, and the run passes ``--vocab-size 257``. With the default
  ``pad_vocab_size`` the model's embedding is padded to ``ceil(257 / (128 * TP)) * 128 * TP`` rows
  (384 at TP=1); the extra rows simply never appear in the data.
* megatron.core's ``ByteLevelTokenizer`` is not reachable from ``--tokenizer-type`` and its eos/pad
  ids (0, 1) collide with byte values, so it is not used.

EOD placement: ``GPTDataset`` concatenates documents exactly as stored and never inserts a
separator; ``--eod-mask-loss``, ``--reset-position-ids`` and ``--reset-attention-mask`` find
document boundaries only where ``tokens == tokenizer.eod``. So, as ``preprocess_data.py
--append-eod`` does (and megatron's own ``MockGPTLowLevelDataset``), every document ends with one
EOD token that counts in the document's length.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import sysconfig
import time

import numpy

try:
    from hyper_adaptor.patches.compat import imports
except ImportError:  # `python examples/corpus.py` from a checkout: the package is the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from hyper_adaptor.patches.compat import imports

EOD_ID = 256  # first id after the 256 byte values
VOCAB_SIZE = 257  # NullTokenizer: vocab_size == N, eod == N - 1 == EOD_ID
PRETRAIN_TOKENIZER_ARGS = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB_SIZE)]
# 8 MiB (~700 files) reads, tokenizes and writes in well under a second; all of 3.11 is ~31 MB.
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
STAMP_FORMAT = 1  # bump when the layout of the written data changes
# Directories under the stdlib path that are not the stdlib: third-party code varies per
# environment (it would break determinism), caches are not source.
_NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}


def _indexed_dataset():
    # Imported lazily: `import megatron.core` takes seconds, and a cache hit needs none of it.
    imports.install()  # must precede any megatron import (triton-less Python 3.11)
    from megatron.core.datasets import indexed_dataset

    return indexed_dataset


def iter_sources(stdlib_dir: str, max_bytes: int):
    """Yield ``(relative path, raw bytes)`` of the non-empty UTF-8 ``.py`` files, sorted by path,
    stopping before the first file that would push the total past ``max_bytes``."""
    paths = []
    for root, dirs, files in os.walk(stdlib_dir):
        dirs[:] = [d for d in dirs if d not in _NOT_STDLIB]
        paths += [os.path.join(root, f) for f in files if f.endswith(".py")]
    total = 0
    for rel in sorted(os.path.relpath(p, stdlib_dir) for p in paths):
        with open(os.path.join(stdlib_dir, rel), "rb") as f:
            data = f.read()
        try:
            data.decode("utf-8")  # a few test files are latin-1/koi8-r on purpose
        except UnicodeDecodeError:
            continue
        if not data:  # empty __init__.py files would be documents made of a lone EOD
            continue
        if total + len(data) > max_bytes:
            return  # a prefix of the sorted list, so the cap never reorders anything
        total += len(data)
        yield rel, data


def decode(ids) -> bytes:
    """Token ids back to the source bytes (EOD tokens dropped)."""
    ids = numpy.asarray(ids)
    return ids[ids != EOD_ID].astype(numpy.uint8).tobytes()


def _read_stamp(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def build_corpus(
    output_prefix: str, max_bytes: int = DEFAULT_MAX_BYTES, stdlib_dir: str | None = None
) -> dict:
    """Write ``<prefix>.bin/.idx`` (+ ``<prefix>.json`` stamp) unless an identical build exists.

    Returns the stats: documents, tokens (bytes + one EOD per document), bytes, seconds (of the
    build that made the files), first_file, and ``cached`` (True when nothing was rebuilt).
    """
    stdlib_dir = os.path.abspath(stdlib_dir or sysconfig.get_paths()["stdlib"])
    # The stamp keys on parameters, not file contents: an installed stdlib does not change under
    # a given Python version, which is recorded too.
    params = {
        "format": STAMP_FORMAT,
        "stdlib_dir": stdlib_dir,
        "python": platform.python_version(),
        "max_bytes": int(max_bytes),
        "vocab_size": VOCAB_SIZE,
        "eod_id": EOD_ID,
    }
    bin_path, idx_path, stamp_path = (output_prefix + ext for ext in (".bin", ".idx", ".json"))
    stamp = _read_stamp(stamp_path)
    if stamp and stamp.get("params") == params and all(map(os.path.exists, (bin_path, idx_path))):
        return {**stamp["stats"], "cached": True}

    idx_mod = _indexed_dataset()
    start = time.perf_counter()  # after the import: "seconds" is the read + tokenize + write time
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    if os.path.exists(stamp_path):
        os.remove(stamp_path)  # an old stamp must never vouch for files being rewritten
    dtype = idx_mod.DType.optimal_dtype(VOCAB_SIZE)  # uint16, as GPTDataset expects for it
    # Build under temporary names and rename at the end: a crash or a concurrent reader never
    # sees a half-written .bin next to a complete .idx.
    tmp = f"{output_prefix}.tmp{os.getpid()}"
    builder = idx_mod.IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    documents, nbytes, first_file = 0, 0, None
    for rel, data in iter_sources(stdlib_dir, max_bytes):
        ids = numpy.empty(len(data) + 1, dtype=dtype)
        ids[:-1] = numpy.frombuffer(data, dtype=numpy.uint8)  # byte-level: byte value == id
        ids[-1] = EOD_ID  # see the module docstring: GPTDataset finds boundaries by EOD only
        builder.add_document(ids, [ids.size])  # one sequence per document
        documents += 1
        nbytes += len(data)
        first_file = first_file or rel
    builder.finalize(tmp + ".idx")
    if documents == 0:
        for path in (tmp + ".bin", tmp + ".idx"):
            os.remove(path)
        raise ValueError(f"no UTF-8 .py file of at most {max_bytes} bytes under {stdlib_dir}")
    os.replace(tmp + ".bin", bin_path)
    os.replace(tmp + ".idx", idx_path)

    stats = {
        "documents": documents,
        "tokens": nbytes + documents,
        "bytes": nbytes,
        "seconds": round(time.perf_counter() - start, 3),
        "first_file": first_file,
    }
    with open(stamp_path + ".tmp", "w") as f:
        json.dump({"params": params, "stats": stats}, f, indent=1)
    os.replace(stamp_path + ".tmp", stamp_path)  # written last: it vouches for finished files
    return {**stats, "cached": False}


def verify_corpus(output_prefix: str) -> None:
    """Read the files back with megatron's IndexedDataset and check them against the stamp and
    the first source file; raises RuntimeError on any mismatch."""
    stamp = _read_stamp(output_prefix + ".json")
    if stamp is None:
        raise RuntimeError(f"{output_prefix}.json missing: build the corpus first")
    stats, params = stamp["stats"], stamp["params"]
    dataset = _indexed_dataset().IndexedDataset(output_prefix)
    documents, tokens = len(dataset.document_indices) - 1, int(dataset.sequence_lengths.sum())
    read_back = (documents, len(dataset), tokens)
    if read_back != (stats["documents"], stats["documents"], stats["tokens"]):
        raise RuntimeError(f"read back (documents, sequences, tokens) {read_back}; stamp: {stats}")
    first = dataset[0]
    with open(os.path.join(params["stdlib_dir"], stats["first_file"]), "rb") as f:
        source = f.read()
    if first[-1] != EOD_ID or decode(first) != source or EOD_ID in first[:-1]:
        raise RuntimeError(f"document 0 does not round-trip to {stats['first_file']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin/.idx/.json")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    parser.add_argument("--stdlib-dir", default=None, help="default: this Python's stdlib")
    args = parser.parse_args(argv)
    stats = build_corpus(args.output_prefix, args.max_bytes, args.stdlib_dir)
    verify_corpus(args.output_prefix)
    print(json.dumps(stats))
    print("pretrain tokenizer flags:", " ".join(PRETRAIN_TOKENIZER_ARGS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
