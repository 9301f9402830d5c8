#!/usr/bin/env bash
# GPU-side checks in one go, for whenever a machine with an NVIDIA GPU is at hand:
#   bash scripts/gpu_check.sh [OUT_DIR]
# - bf16 MFU of configs/llama_1b.py at seq 2048 on one GPU, with cudnn, xla and chunked attention
# - fp8 (e4m3) vs bf16 matmul throughput (the ceiling for fp8 training), and llama_1b in fp8
# - gpt2_124m throughput on one GPU
# - cudnn and pallas attention against the float32 reference (bf16, GQA, sliding window)
# Each result is one JSON line in OUT_DIR/gpu_results.jsonl (default ./gpu_results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-gpu_results}
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/gpu_results.jsonl"
: > "$RESULTS"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
PY=${PYTHON:-python}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT_DIR/nvidia_smi.txt"
$PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"

timeout 60 $PY scripts/matmul_peak.py >> "$RESULTS" || echo '{"check": "matmul_peak", "error": true}' >> "$RESULTS"
bench_llama() {  # attention [more --config overrides]
  local attention=$1; shift
  timeout 140 $PY scripts/bench.py --config configs/llama_1b.py --json --steps 5 \
    --config.model.attention=$attention "$@" >> "$RESULTS" \
    || echo "{\"check\": \"llama_1b\", \"attention\": \"$attention\", \"args\": \"$*\", \"error\": true}" >> "$RESULTS"
}
bench_llama cudnn
bench_llama cudnn --config.train.precision=fp8
bench_llama xla
timeout 100 $PY scripts/bench.py --config configs/gpt2_124m.py --json --steps 5 \
  --config.data.source=synthetic --config.train.global_batch=32 --config.train.microbatches=1 \
  --config.model.attention=cudnn >> "$RESULTS" \
  || echo '{"check": "gpt2_124m", "error": true}' >> "$RESULTS"
timeout 120 $PY scripts/attention_check.py --length 2048 >> "$RESULTS" \
  || echo '{"check": "attention", "error": true}' >> "$RESULTS"
bench_llama chunked
cat "$RESULTS"
