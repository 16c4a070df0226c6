#!/usr/bin/env bash
# One call on a CUDA machine: the package's CUDA paths, the GPU-only tests and the benches that run
# on one GPU, with logs and JSON written under $OUT (default runs/gpu). Rerunnable by anyone with a GPU:
#
#   bash bench/gpu_session.sh            # all stages
#   STAGES="gpu memory" bash bench/gpu_session.sh
#
# Stages (each with its own time limit, so one hang cannot eat the others):
#   gpu      tests/gpu: CUDA-only checks (skipped on machines without CUDA), megatron GPT runs on one GPU
#            against the unpatched script included
#   unit     (not in the default) tests/unit, the CPU tier, on this machine's CPUs with CUDA hidden: a check of
#            the image's torch version, not of CUDA (docs/gpu.md lists what it found on torch 2.11)
#   expert   bench/expert_parallel.py --one-device, fp32 and bf16: one MoE layer at expert parallel 1,
#            megatron's dispatcher / the engine's / the engine's MoE block (time, step peak, output parity)
#   memory   bench/memory.py on CUDA (max_memory_allocated, swap + prefetch vs save_on_cpu)
#   ops      bench/ops.py on CUDA, fp32 and bf16
#   memory-large  bench/memory.py at GPT-scale sizes (hidden 2048, sequence 4096, fp32 and bf16; hidden 4096
#            bf16): the swap step-time target (about 90 s on an H200)
#
# The default stages take about 9 minutes on an H100 or H200 and write 13 files; where one call is limited (10
# minutes, 8 files back), split it: STAGES="gpu expert" (4 files), STAGES="memory ops" (4), then
# STAGES="memory-large" (4).
#
# The multi-rank benches (hsdp, pipeline, context_parallel) need one device per rank (NCCL refuses two
# ranks on one GPU), so a one-GPU machine does not run them.
#
# Where a megatron-core 0.19.2 wheel for this Python sits in .whl/ (no network on the machine), it is
# installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
STAGES=${STAGES-"gpu expert memory ops memory-large"}   # STAGES="" installs and runs nothing
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$PYTHON" -c "import sys, torch, megatron.core as m; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'mcore', m.__version__, torch.cuda.get_device_name())"
} 2>&1

stage() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  [[ " $STAGES " == *" $name "* ]] || return 0
  echo "=== stage $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== stage $name rc=$rc in $((SECONDS - t0))s"
  tail -n 25 "$OUT/$name.log"
}

XDIST=""
"$PYTHON" -c "import xdist" 2>/dev/null && XDIST="-n 8"

# tests/unit are the CPU tier's in-process tests (CPU tensors, megatron's CPU emulation): run on this
# machine's CPUs with CUDA hidden, beside the GPU tests (this checks torch / Python versions, not CUDA);
# the benches time afterwards, on a quiet machine.
if [[ " $STAGES " == *" unit "* ]]; then
  CUDA_VISIBLE_DEVICES="" HYPER_ADAPTOR_DEVICE=cpu timeout -k 10 300 "$PYTHON" -m pytest -q -p no:cacheprovider \
    tests/unit $XDIST --timeout 120 --ignore tests/unit/test_megatron_versions.py > "$OUT/unit.log" 2>&1 &
  UNIT_PID=$!
fi
stage gpu 330 "$PYTHON" -m pytest -q -s -p no:cacheprovider tests/gpu -rs --timeout 300
if [[ -n "${UNIT_PID:-}" ]]; then
  wait "$UNIT_PID"; echo "=== stage unit (CPU, CUDA hidden) rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/unit.log" | tail -n 25
fi
stage expert 120 bash -c "'$PYTHON' bench/expert_parallel.py --one-device --json '$OUT/expert-one-device.json' && \
  '$PYTHON' bench/expert_parallel.py --one-device --dtype bf16 --json '$OUT/expert-one-device-bf16.json'"
stage memory 60 "$PYTHON" bench/memory.py --json "$OUT/memory-cuda.json"
stage ops 150 bash -c "'$PYTHON' bench/ops.py --json '$OUT/ops-cuda.json' && '$PYTHON' bench/ops.py --dtype bf16 --json '$OUT/ops-cuda-bf16.json'"
LARGE="--layers 4 --hidden 2048 --heads 16 --seq 4096 --batch 2 --rounds 5 --threads 16"
stage memory-large 240 bash -c "'$PYTHON' bench/memory.py $LARGE --json '$OUT/memory-cuda-large.json' && \
  '$PYTHON' bench/memory.py $LARGE --dtype bf16 --activations-only --json '$OUT/memory-cuda-large-bf16.json' && \
  '$PYTHON' bench/memory.py --layers 4 --hidden 4096 --heads 32 --seq 4096 --batch 1 --rounds 5 --threads 16 \
    --dtype bf16 --activations-only --json '$OUT/memory-cuda-h4096-bf16.json'"
