#!/usr/bin/env bash
# On the GPU device, from the project root, after `source .devkit/setup.sh`:
#   bash bench/run_device.sh [tests|bench|all|pending|final]
# Runs the GPU test suite (pytest -m gpu tests/gpu + the CPU padding tests) and/or the decode
# benchmark; logs and results go to $OUT (default /tmp/out).
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:-all}
rc=0
python3 -c "import torch; print(torch.cuda.get_device_name(0), torch.__version__)"
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -m gpu tests/gpu -q -rA -s -p no:cacheprovider --timeout=900 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
fi
if [[ $what == bench || $what == all ]]; then
  python3 bench/bench_decode.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || rc=1
fi
if [[ $what == pending ]]; then
  # what had not run on the device yet when the last session ended (see BENCHMARKS.md)
  python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/gpu/test_state_under_graphs.py \
      tests/gpu/test_triton_norms_gpu.py tests/gpu/test_kernels.py 2>&1 | tee "$OUT/gpu_pending_tests.log" || rc=1
  python3 bench/bench_decode.py --steps 10 --no-eager --no-prefill --profile 2>&1 | tee "$OUT/bench_fp32_triton.log" || rc=1
  python3 bench/bench_decode.py --steps 10 --no-eager --no-prefill --ssm-dtype bfloat16 --triton-norms --profile \
      2>&1 | tee "$OUT/bench_bf16_triton_norms.log" || rc=1
  python3 bench/bench_transformers_peer.py 2>&1 | tee "$OUT/bench_peer.log" || rc=1
fi
if [[ $what == final ]]; then
  # the whole GPU suite, then the decode/prefill benchmark (bf16 state with the kernel profile, fp32 state)
  timeout 420 python3 -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
  timeout 120 python3 bench/bench_decode.py --steps 10 --no-eager --ssm-dtype bfloat16 --profile \
      --json "$OUT/bench_bf16.json" 2>&1 | tee "$OUT/bench_bf16.log" || rc=1
  timeout 60 python3 bench/bench_decode.py --steps 10 --no-eager --no-prefill --json "$OUT/bench_fp32.json" \
      2>&1 | tee "$OUT/bench_fp32.log" || rc=1
fi
exit $rc
