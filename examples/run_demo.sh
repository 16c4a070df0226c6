#!/usr/bin/env bash
# The demo: a real Megatron GPT pretraining run through megatron.training's pretrain(), with the
# one-line hyper_adaptor import, on 4 processes (TP2 x PP2) of whatever this machine has
# (CPU + gloo here). Builds the embedded corpus (the Python stdlib's own source) on first use.
#
#   bash examples/run_demo.sh                 # defaults below
#   NPROC=1 TP=1 PP=1 bash examples/run_demo.sh --mock-data    # extra args go to pretrain_gpt.py
set -euo pipefail
cd "$(dirname "$0")/.."
# the project's environment (made by `make setup` / `make demo`) when there is one, else python on PATH
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
NPROC=${NPROC:-4}
TP=${TP:-2}
PP=${PP:-2}
ITERS=${ITERS:-30}
OUT=${OUT:-runs/demo}
DATA_PREFIX=${DATA_PREFIX:-data-cache/stdlib_text_document}
mkdir -p "$OUT"

if [[ " $* " != *" --mock-data "* ]]; then
  "$PYTHON" examples/corpus.py --output-prefix "$DATA_PREFIX"
  DATA_ARGS=(--data-path "$DATA_PREFIX" --split 98,2,0)
else
  DATA_ARGS=()
fi

GPT_ARGS=(
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 512
  --seq-length 128 --max-position-embeddings 128 --position-embedding-type rope
  --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0.0 --hidden-dropout 0.1
  --tokenizer-type NullTokenizer --vocab-size 257
)
TRAIN_ARGS=(
  --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS"
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 3 --weight-decay 0.1 --clip-grad 1.0
  --seed 1234 --use-cpu-initialization
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
)
OUTPUT_ARGS=(
  --log-interval 1 --eval-interval "$ITERS" --eval-iters 2
  --save "$OUT/checkpoint" --save-interval "$ITERS" --ckpt-format torch_dist
  --tensorboard-dir "$OUT/tensorboard" --log-throughput
)

set -x
exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "${MASTER_PORT:-29500}" \
  examples/pretrain_gpt.py "${GPT_ARGS[@]}" "${TRAIN_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${DATA_ARGS[@]}" "$@"
