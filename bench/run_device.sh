#!/usr/bin/env bash
# On the GPU device, from the project root, after `source .devkit/setup.sh`:
#   bash bench/run_device.sh tests|bench|profile|moe    (one per device call: each fits in its 10 minutes)
#   tests    the GPU test suite (pytest -m gpu tests/gpu: ~6 minutes on a fresh H200, FlashInfer JIT included)
#   bench    the one-command benchmark (bench/run_benchmark.py: fp32 and bf16 state, TTFT, peer; ~3.5 minutes)
#   profile  bench_decode.py with the kernel profile of every batch size and of the 8K prefill (bf16 state)
#   generate bench_generate.py: end-to-end decode through the engine, async scheduling on / off (~3 minutes)
#   prefix   bench_prefix_cache.py: second-turn TTFT with and without a prefix-cache hit (8K prompt)
#   gemm     bench_gemm.py: the model's projections under cuBLAS and cuBLASLt (~1 minute)
#   moe      bench_moe.py: decode tok/s at batch 1/8/64/256 and 8K TTFT of Nemotron-3-Nano-30B-A3B,
#            Granite-4.0-H-Tiny and -Small shapes next to their floors, graphs on/off, generate(), and
#            transformers' generate as the peer (each shape and peer its own process; <= ~9 minutes:
#            --time-budget splits 520 s between the six processes, each killed at its share)
#   moe-profile  the same for the two target shapes without the peer and eager runs, with the kernel
#            profile of one graph replay per batch size and of the 8K prefill
# Logs and results go to $OUT (default /tmp/out). Each step has a time limit, so that one stuck step
# cannot take the device call's whole 10 minutes.
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:-tests}
rc=0
python3 -c "import torch; print(torch.cuda.get_device_name(0), torch.__version__)"
if [[ $what == tests ]]; then
  timeout 480 python3 -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
fi
if [[ $what == bench ]]; then
  timeout 400 python3 bench/run_benchmark.py --out "$OUT" 2>&1 | tee "$OUT/run_benchmark.log" || rc=1
fi
if [[ $what == profile ]]; then
  timeout 300 python3 bench/bench_decode.py --steps 10 --no-eager --ssm-dtype bfloat16 --profile \
      --json "$OUT/bench_bf16.json" 2>&1 | tee "$OUT/bench_profile.log" || rc=1
fi
if [[ $what == generate ]]; then
  timeout 240 python3 bench/bench_generate.py --json "$OUT/generate.json" 2>&1 | tee "$OUT/generate.log" || rc=1
fi
if [[ $what == prefix ]]; then
  timeout 400 python3 bench/bench_prefix_cache.py --json "$OUT/prefix_cache.json" 2>&1 | tee "$OUT/prefix_cache.log" || rc=1
fi
if [[ $what == gemm ]]; then
  timeout 200 python3 bench/bench_gemm.py --json "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.log" || rc=1
fi
if [[ $what == moe ]]; then
  timeout 545 python3 bench/bench_moe.py --out "$OUT" --time-budget 520 2>&1 | tee "$OUT/bench_moe.log" || rc=1
fi
if [[ $what == moe-profile ]]; then
  timeout 545 python3 bench/bench_moe.py --shapes nemotron-nano granite-tiny --no-peer --no-eager --profile \
      --out "$OUT" --time-budget 520 2>&1 | tee "$OUT/bench_moe_profile.log" || rc=1
fi
exit $rc
