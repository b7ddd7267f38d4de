#!/usr/bin/env bash
# Mamba decode kernels (hybrid/ops/triton_mamba.py) on the GPU device: tests + benchmark.
#
# From the project root on the device machine, with the device kit copied to .devkit/:
#     source .devkit/setup.sh && bash bench/run_kernels_device.sh
# Writes into $OUT (or ./kernels_out when OUT is unset):
#     SUMMARY.txt      exit codes of each step + the benchmark's summary table and target verdicts
#     env.txt          versions, GPU
#     pytest_gpu.log   tests/gpu/test_triton_kernels_gpu.py (compiled Triton vs the torch reference)
#     bench.log        bench/bench_mamba_kernels.py (ours vs mamba_ssm / causal_conv1d, + numerics)
#     pytest_cpu.log   tests/test_triton_kernels.py under TRITON_INTERPRET=1 with the GPU hidden
# Every step runs even when an earlier one fails; each has its own time limit so the whole run
# stays under ~9 minutes. Extra arguments are passed to the benchmark (e.g. --no-sweep, --batches 1,64).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/kernels_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

{
  date
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); print('gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NONE')"
  "$PY" -c "import mamba_ssm.ops.triton.selective_state_update" >/dev/null 2>&1 && echo "mamba_ssm importable directly" || echo "mamba_ssm: package __init__ not importable directly (the bench uses a shim)"
  "$PY" -c "import causal_conv1d; print('causal_conv1d', causal_conv1d.__version__)" 2>&1 | tail -1
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step() {  # step NAME LIMIT_S LOG CMD...
  local name=$1 limit=$2 log=$3; shift 3
  echo "=== $name (limit ${limit}s) ==="
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  tail -n 60 "$OUT/$log"
  local verdict="ok"
  [ $rc -ne 0 ] && verdict="FAILED"
  [ $rc -eq 124 ] && verdict="TIMED OUT"
  echo "$name: rc=$rc ($verdict) in $((SECONDS - t0))s, log $log" | tee -a "$OUT/SUMMARY.txt"
}

: > "$OUT/SUMMARY.txt"
step "gpu tests" 180 pytest_gpu.log "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/gpu/test_triton_kernels_gpu.py
step "benchmark" 330 bench.log "$PY" bench/bench_mamba_kernels.py "$@"
step "cpu interpreter tests" 90 pytest_cpu.log env CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_triton_kernels.py

{
  echo
  echo "--- benchmark summary (from bench.log) ---"
  sed -n '/== summary/,$p' "$OUT/bench.log"
} >> "$OUT/SUMMARY.txt"
echo
echo "=== SUMMARY ($OUT/SUMMARY.txt) ==="
cat "$OUT/SUMMARY.txt"
