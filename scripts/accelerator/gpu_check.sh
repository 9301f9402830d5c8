#!/usr/bin/env bash
# The GPU checks in one go, ≤ 10 minutes on one H200 from a bare machine:
#   bash scripts/accelerator/gpu_check.sh [--rehearse] [OUT_DIR]   # OUT_DIR: from the repo root
# 1. installs what is missing: with jax already on a GPU (the lent machine's image), the
#    wheels gpu_wheels.sh put in .whl/; else .[cuda12] from PyPI (skipped with
#    --rehearse);
# 2. matmul peak per dtype (bf16, fp32, fp8);
# 3. configs/llama_1b.py (bf16, one GPU) per attention kernel: tokens/s, MFU, XLA memory;
# 4. the same in fp8, against bf16;
# 5. cuDNN and Pallas attention against the float32 reference;
# 6. the report (gpu_report.py): measured step time and memory next to the
#    planner's prediction for the same run (hardware from the device kind).
# Every check runs under its own time limit, inside a global deadline (DEADLINE_S, default
# 570 s): a check that no longer fits is recorded as skipped, a failure as an error row.
# Results: OUT_DIR/gpu_results.jsonl (one JSON line per check) and OUT_DIR/gpu_report.md +
# gpu_report.json. --rehearse runs the same steps on CPU with tiny shapes (GPU-only kernels
# recorded as skipped) so that everything but the device is tried before the day.
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root: every path below is from there
REHEARSE=0
if [ "${1:-}" = "--rehearse" ]; then REHEARSE=1; shift; fi
OUT_DIR=${1:-gpu_results}
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/gpu_results.jsonl"
: > "$RESULTS"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-570}

record() {  # one JSON line: check name, status, more fields as a JSON object body
  echo "{\"check\": \"$1\", \"status\": \"$2\"${3:+, $3}}" >> "$RESULTS"
}

run_check() {  # name limit_s command...: appends the command's last JSON line, or a status
  local name=$1 limit=$2; shift 2
  local left=$(( DEADLINE_S - ($(date +%s) - START) - 10 ))
  if [ "$left" -lt 20 ]; then record "$name" skipped "\"reason\": \"global deadline\""; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local log="$OUT_DIR/${name// /_}.log" t0=$(date +%s)
  if timeout "$limit" "$@" > "$log.out" 2> "$log"; then
    $PY scripts/accelerator/gpu_report.py --row "$name" "$(( $(date +%s) - t0 ))" "$log.out" >> "$RESULTS" \
      || record "$name" error '"reason": "no JSON output"'
  else
    local rc=$?
    local why="exit $rc"; [ "$rc" -eq 124 ] && why="time limit ${limit}s"
    record "$name" error "\"reason\": \"$why\", \"stderr\": $(tail -c 400 "$log" | $PY -c 'import json,sys; print(json.dumps(sys.stdin.read()))')"
  fi
}

if [ "$REHEARSE" -eq 1 ]; then
  export JAX_PLATFORMS=cpu
  # One CPU device, like one GPU (a test runner may have asked for fake ones); a runner's
  # compile-speed flags are kept (the tests' -O0 and elemental fusion emitters: compiles
  # several times faster, same numbers).
  XLA_FLAGS=$(grep -oE -- "--xla_(backend_optimization_level|cpu_use_fusion_emitters)=[a-z0-9]*" <<< "${XLA_FLAGS:-}" | tr "\n" " " || true)
  export XLA_FLAGS
  HARDWARE=CPU-host
  # llama_1b's family and layout at a size a CPU runs in seconds.
  SHAPE="--config.model.d_model=128 --config.model.num_layers=2 --config.model.num_heads=4 \
--config.model.num_kv_heads=2 --config.model.mlp_dim=256 --config.model.vocab_size=512 \
--config.model.seq_len=128 --config.train.global_batch=2 --config.mesh.fsdp=1"
  KERNELS="chunked xla"
  PEAK_N=256
  record install skipped '"reason": "rehearsal"'
else
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # the checks are for one GPU
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$OUT_DIR/nvidia_smi.txt" 2>&1
  if $PY -c "import jax, sys; sys.exit(jax.devices()[0].platform != 'gpu')" 2>/dev/null; then
    # jax with CUDA is there (the lent machine's image): add only what it lacks, from the
    # wheels scripts/accelerator/gpu_wheels.sh fetched (that machine reaches no registry).
    MISSING=$($PY -c "import importlib.util as u; print(' '.join(m for m in ('grain', 'ml_collections', 'tensorboardX') if not u.find_spec(m)))")
    if [ -n "$MISSING" ] && ls .whl/*.whl > /dev/null 2>&1; then
      run_check install 120 $PY -c "import subprocess, sys, json, glob; subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-index', '--no-deps', '--no-compile', '--target', '/tmp/jaxtrain_site', *glob.glob('.whl/*.whl')], check=True); print(json.dumps({'from': '.whl', 'missing': '$MISSING'}))"
      export PYTHONPATH="$PYTHONPATH:/tmp/jaxtrain_site"
    elif [ -n "$MISSING" ]; then
      record install error "\"reason\": \"missing $MISSING and no .whl/: run scripts/accelerator/gpu_wheels.sh where pip works\""
    else
      record install skipped '"reason": "jax sees a GPU and every dependency is there"'
    fi
  else  # a bare machine with a registry: the CUDA build of jax and everything else
    run_check install 300 $PY -c "import subprocess, sys, json; subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '-e', '.[cuda12]'], check=True); print(json.dumps({'from': 'pip'}))"
  fi
  HARDWARE=""
  SHAPE="--config.mesh.fsdp=1"
  KERNELS="cudnn pallas chunked xla"
  PEAK_N=8192
fi

run_check env 60 $PY -c "import jax, flax, optax, json; d=jax.devices()[0]; print(json.dumps({'jax': jax.__version__, 'flax': flax.__version__, 'optax': optax.__version__, 'device_kind': d.device_kind, 'platform': d.platform, 'devices': jax.device_count()}))"
run_check matmul_peak 60 $PY scripts/bench_matmul_peak.py --n $PEAK_N
bench() {  # name precision attention
  run_check "$1" 120 $PY scripts/bench_train.py --config configs/llama_1b.py --json --steps 3 \
    --config.model.attention="$3" --config.train.precision="$2" $SHAPE
}
FIRST=${KERNELS%% *}
bench "llama_1b bf16 $FIRST" bfloat16 "$FIRST"
bench "llama_1b fp8 $FIRST" fp8 "$FIRST"
for kernel in ${KERNELS#* }; do bench "llama_1b bf16 $kernel" bfloat16 "$kernel"; done
if [ "$REHEARSE" -eq 1 ]; then
  for kernel in cudnn pallas; do record "llama_1b bf16 $kernel" skipped '"reason": "needs a GPU"'; done
  record attention skipped '"reason": "needs a GPU"'
else
  run_check attention 90 $PY scripts/accelerator/attention_check.py --length 2048
fi
$PY scripts/accelerator/gpu_report.py --results "$RESULTS" --out "$OUT_DIR" ${HARDWARE:+--hardware $HARDWARE} -- $SHAPE
rc=$?
echo "gpu_check: $(( $(date +%s) - START )) s; results in $OUT_DIR/gpu_report.md"
exit $rc
