#!/usr/bin/env bash
# On the GPU device, from the project root, after `source .devkit/setup.sh`:
#   bash bench/run_device.sh tests|bench|profile|moe    (one per device call: each fits in its 10 minutes)
#   Every target is below, each with its comment; the MoE kernel sweeps (moe-tiles, moe-split,
#   moe-fp8-kernels), speculative, sampling, throughput and serving come after the list here.
#   tests    the FP8, graph, kernel, memory-plan and MoE files of the GPU suite (~8 minutes on a fresh H200)
#   tests-2  the rest of the GPU suite but the long-context and released-shape files (~4 minutes fresh)
#   tests-smoke  the first parametrization of every GPU test (HYBRID_SMOKE=1): every file in one call
#   tests-long / tests-released / tests-selected   those two files, and a list of node ids, in their own calls
#   attention  bench_decode_attention.py: decode attention alone (XQA by max_seq_len, FlashInfer decode)
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
#   moe-pdl  the two target shapes' decode (graphs) with programmatic dependent launch on and off
#            (--pdl-ab: recaptured with HYBRID_PDL=0) and with the decode projections on the Triton
#            linear (--linear-ab: HYBRID_DECODE_LINEAR=triton), with the norm before each MoE layer in its
#            router's launch (--norm-router-ab: HYBRID_NORM_ROUTER=1), with both (--all-ab) and with bf16
#            logits (--logits-ab: the fp32 LM head's cost), the kernel profile, TTFT and generate at batch 1
# Logs and results go to $OUT (default /tmp/out). Each step has a time limit, so that one stuck step
# cannot take the device call's whole 10 minutes.
set -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:-tests}
rc=0
# The JIT caches (Triton's, FlashInfer's) of an earlier call, carried in .jitcache/ (ignored by git; `carry`
# names it): a fresh machine then loads the kernels that call compiled instead of compiling them again (each
# call's start otherwise spends 1-3 minutes on it). JIT_SAVE=1 packs this call's caches into $OUT as
# jit.txz.* parts of at most 15 MiB (two of the 8 files a call brings back, and under what may travel beside
# the kit), or says why not; copy them into .jitcache/ for the next calls.
JIT_DIRS=("$HOME/.triton/cache" "$HOME/.cache/flashinfer")
if compgen -G ".jitcache/jit.txz.*" > /dev/null; then
  cat .jitcache/jit.txz.* | tar -xJf - -C / && echo "JIT caches loaded from .jitcache ($(du -sh .jitcache | cut -f1))"
elif compgen -G ".jitcache/jit.tgz.*" > /dev/null; then
  cat .jitcache/jit.tgz.* | tar -xzf - -C / && echo "JIT caches loaded from .jitcache ($(du -sh .jitcache | cut -f1))"
fi
save_jit() {
  [[ ${JIT_SAVE:-0} == 1 ]] || return 0
  local dirs=() d
  for d in "${JIT_DIRS[@]}"; do [[ -d $d ]] && dirs+=("${d#/}"); done
  (( ${#dirs[@]} )) || { echo "JIT_SAVE: no cache to save"; return 0; }
  # compiled kernels only: FlashInfer's object files and generated sources are rebuilt from nothing anyway
  # xz: a third of gzip's size on these caches (cubins compress well), so the cache and the kit fit the carry limit
  tar -cf - -C / --exclude='*.o' --exclude='*.cu' --exclude='*.ninja*' "${dirs[@]}" | xz -6 -T0 > /tmp/jit.txz
  local size; size=$(stat -c %s /tmp/jit.txz)
  if (( size > 26 * 1024 * 1024 )); then
    echo "JIT_SAVE: caches are $((size >> 20)) MiB packed, over the 26 MiB that may travel beside the kit: not saved"
    du -sh "${dirs[@]/#//}" 2>/dev/null
    return 0
  fi
  split -b 15m /tmp/jit.txz "$OUT/jit.txz." && echo "JIT_SAVE: $((size >> 20)) MiB in $OUT/jit.txz.*"
}
trap save_jit EXIT
# Pure-Python or abi3 packages of the CPU install that the device image lacks (llguidance, for the structured
# outputs the request-feature tests ask for), copied from a CPU venv's site-packages into .devextra/ (ignored by
# git; `carry` names it): `cp -r .venv/lib/python3*/site-packages/llguidance* .devextra/`
if [[ -d .devextra ]]; then export PYTHONPATH=$PWD/.devextra:$PYTHONPATH; fi
python3 -c "import torch; print(torch.cuda.get_device_name(0), torch.__version__)"
# REQUIRE_H200=1: the figures asked for are H200 figures, so on any other card stop here (a call that gets an H100
# then costs its start alone)
if [[ ${REQUIRE_H200:-0} == 1 ]] && ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "REQUIRE_H200: this machine has $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), not an H200: stopped"
  trap - EXIT
  exit 3
fi
# tests: one line per test (-v), so a run cut by its time limit still names what passed and failed;
# the tracebacks of failures print as they happen (tests/gpu/conftest.py), and again in -rfE's summary
# when the run completes. `tests` leaves out the long-context and
# released-shape files (`tests-long`, `tests-released`: their own calls). A list of node ids in
# .devkit/sel.txt (one per line) runs just those: `tests-selected`.
gpu_pytest() {  # $1: time limit, $2: log name, the rest: pytest arguments
  local limit=$1 log=$2; shift 2
  timeout "$limit" python3 -m pytest -m gpu -v --tb=short -rfE -p no:cacheprovider --durations=20 "$@" 2>&1 \
      | tee "$OUT/$log" | grep -E "PASSED|FAILED|ERROR|^E  " | cut -c1-240 || rc=1
}
# the rest of tests/gpu in two calls (one call of both ran past 540 s on a fresh H200)
TESTS_1="tests/gpu/test_fp8_gpu.py tests/gpu/test_graphs.py tests/gpu/test_kernels.py tests/gpu/test_memory_plan_gpu.py tests/gpu/test_moe_gpu.py"
if [[ $what == tests ]]; then
  gpu_pytest 540 gpu_tests.log $TESTS_1
fi
if [[ $what == tests-smoke ]]; then  # the first parametrization of every GPU test, long-context ones included
  HYBRID_SMOKE=1 gpu_pytest 540 gpu_tests_smoke.log tests/gpu
fi
if [[ $what == tests-2 ]]; then
  gpu_pytest 540 gpu_tests_2.log tests/gpu $(for f in $TESTS_1; do echo --ignore=$f; done) \
      --ignore=tests/gpu/test_long_context.py --ignore=tests/gpu/test_released_shapes.py
fi
if [[ $what == attention ]]; then
  timeout 200 python3 bench/bench_decode_attention.py --json "$OUT/decode_attention.json" 2>&1 \
      | tee "$OUT/decode_attention.log" || rc=1
fi
if [[ $what == tests-long ]]; then
  gpu_pytest 540 gpu_tests_long.log tests/gpu/test_long_context.py
fi
if [[ $what == tests-released ]]; then
  gpu_pytest 540 gpu_tests_released.log tests/gpu/test_released_shapes.py
fi
# tests-kernels  the fused-op, MoE and graph files (the kernel switches, the alignments, PDL)
if [[ $what == tests-kernels ]]; then
  gpu_pytest 540 gpu_tests_kernels.log tests/gpu/test_triton_fused_ops_gpu.py tests/gpu/test_moe_gpu.py \
      tests/gpu/test_graphs.py
fi
# tests-selected+released  both in one call: the node ids of .devkit/sel.txt (at most ${SEL_LIMIT:-300} s), then
#            the released shapes named in HYBRID_RELEASED (the rest of the call's 570 s)
if [[ $what == tests-selected+released ]]; then
  start=$SECONDS
  gpu_pytest "${SEL_LIMIT:-300}" gpu_tests_selected.log $(cat .devkit/sel.txt)
  gpu_pytest $((570 - (SECONDS - start))) gpu_tests_released.log tests/gpu/test_released_shapes.py
fi
if [[ $what == tests-selected ]]; then
  gpu_pytest 540 gpu_tests_selected.log $(cat .devkit/sel.txt)
fi
if [[ $what == bench ]]; then
  timeout 400 python3 bench/run_benchmark.py --out "$OUT" 2>&1 | tee "$OUT/run_benchmark.log" || rc=1
fi
if [[ $what == profile ]]; then
  timeout 300 python3 bench/bench_decode.py --steps 10 --no-eager --ssm-dtype bfloat16 --profile \
      --json "$OUT/bench_bf16.json" 2>&1 | tee "$OUT/bench_profile.log" || rc=1
fi
# fp8  the 8B shape in FP8 (per-channel weights, dynamic per-token activations; LM head bf16) next to
#      bf16 in the same call, bf16 SSM state, graphs only (issue 17 item 5; ~6 minutes), then the FP8 KV
#      cache on top of FP8 weights (decode only)
if [[ $what == fp8 ]]; then
  timeout 200 python3 bench/bench_decode.py --no-eager --ssm-dtype bfloat16 --json "$OUT/decode_bf16.json" 2>&1 \
      | tee "$OUT/decode_bf16.log" | grep -v Warn | tail -8 || rc=1
  timeout 200 python3 bench/bench_decode.py --no-eager --ssm-dtype bfloat16 --fp8 pcpt --json "$OUT/decode_fp8.json" 2>&1 \
      | tee "$OUT/decode_fp8.log" | grep -v Warn | tail -8 || rc=1
  timeout 120 python3 bench/bench_decode.py --no-eager --no-prefill --ssm-dtype bfloat16 --fp8 pcpt --kv-cache-dtype fp8 \
      --json "$OUT/decode_fp8_kv.json" 2>&1 | tee "$OUT/decode_fp8_kv.log" | grep -v Warn | tail -8 || rc=1
fi
# fp8-decode  the FP8 decode projections' A/B: the 8B shape in FP8 (pcpt), graphs, batch 1 / 8 / 64, with the
#            default (Triton row quantization, tensor-wise torch._scaled_mm, scales after it) and with fp8_gemv for
#            steps of <= 4 tokens and K <= 8192, the rows quantized inside its launch (HYBRID_FP8_DECODE_GEMM=gemv),
#            after the kernels' GPU tests
if [[ $what == fp8-decode ]]; then
  gpu_pytest 150 gpu_tests_fp8_decode.log tests/gpu/test_fp8_gpu.py \
      -k "decode_sized or quantize_rows or quantizing or misaligned or captured or switches"
  for gemm in scaled_mm gemv; do
    HYBRID_FP8_DECODE_GEMM=$gemm timeout 140 python3 bench/bench_decode.py --no-eager --no-prefill --ssm-dtype bfloat16 \
        --fp8 pcpt --batches 1 8 64 --json "$OUT/decode_fp8_$gemm.json" 2>&1 | tee "$OUT/decode_fp8_$gemm.log" \
        | grep -v Warn | grep -E "batch|tok/s|Error|error" | tail -8 || rc=1
  done
fi
# fp8-tensorwise  the FP8 decode path after the projection A/B above (<= 560 s on a fresh machine, most of it the
#            first memory plan's JIT): the 8B shape in FP8 (pcpt) at batch 1 / 8 / 64 / 256 and the 8K TTFT with the
#            default (tensor-wise GEMM + scales after it for steps of <= 64 tokens), the same decode with the row-wise
#            GEMM (HYBRID_FP8_DECODE_GEMM=rowwise) at batch 1 / 8 / 64, the per-tensor static scheme (ModelOpt's) at
#            batch 1 / 64, the kernel profile of the batch-1 replay and of the 8K prefill, the FP8 and warm-up GPU
#            tests, and the cold load alone (bench_throughput --load-only --cold-load) against the disk
if [[ $what == fp8-tensorwise ]]; then
  timeout 220 python3 bench/bench_decode.py --no-eager --ssm-dtype bfloat16 --fp8 pcpt --json "$OUT/decode_fp8.json" 2>&1 \
      | tee "$OUT/decode_fp8.log" | grep -E "^\{'batch|TTFT|ttft|rror" | cut -c1-160 || rc=1
  HYBRID_FP8_DECODE_GEMM=rowwise timeout 50 python3 bench/bench_decode.py --no-eager --no-prefill --ssm-dtype bfloat16 \
      --fp8 pcpt --batches 1 8 64 --json "$OUT/decode_fp8_rowwise.json" 2>&1 | grep -E "^\{'batch|rror" | cut -c1-160 || rc=1
  timeout 45 python3 bench/bench_decode.py --no-eager --no-prefill --ssm-dtype bfloat16 --fp8 static --batches 1 64 \
      --json "$OUT/decode_fp8_static.json" 2>&1 | grep -E "^\{'batch|rror" | cut -c1-160 || rc=1
  timeout 70 python3 bench/bench_decode.py --no-eager --ssm-dtype bfloat16 --fp8 pcpt --batches 1 --steps 5 --profile \
      > "$OUT/decode_fp8_profile.log" 2>&1 || rc=1
  gpu_pytest 100 gpu_tests_fp8_tensorwise.log tests/gpu/test_fp8_gpu.py tests/gpu/test_warmup_gpu.py \
      -k "tensorwise or quantize_rows or decode_sized or switches or captured or no_triton_compile or 8b_shapes or replay_equals_eager"
  timeout 75 python3 bench/bench_throughput.py --shape nemotron-h-8b --load-only --cold-load \
      --json "$OUT/cold_load.json" 2>&1 | grep -E "disk|load alone" || rc=1
fi
# fp8-gemv  bench_fp8_gemv.py: the 8B shape's FP8 projections alone at batch 1 / 8 / 16 / 64 (one-launch Triton,
#           Triton quantization + _scaled_mm, torch quantization + _scaled_mm, bf16 cuBLAS) (~1-2 minutes)
if [[ $what == fp8-gemv ]]; then
  timeout 200 python3 bench/bench_fp8_gemv.py --json "$OUT/fp8_gemv.json" 2>&1 | tee "$OUT/fp8_gemv.log" || rc=1
fi
if [[ $what == generate ]]; then
  timeout 240 python3 bench/bench_generate.py --json "$OUT/generate.json" 2>&1 | tee "$OUT/generate.log" || rc=1
fi
if [[ $what == prefix ]]; then
  timeout 400 python3 bench/bench_prefix_cache.py --json "$OUT/prefix_cache.json" 2>&1 | tee "$OUT/prefix_cache.log" || rc=1
fi
# scan-overhead  bench_scan_overhead.py: the host cost of one prefill chunk's chunked-scan call (and its cProfile)
if [[ $what == scan-overhead ]]; then
  timeout 200 python3 bench/bench_scan_overhead.py 2>&1 | tee "$OUT/scan_overhead.log" || rc=1
fi
# scan-lean  the selected GPU tests (.devkit/sel.txt, at most 170 s), bench_scan_overhead.py, then bench_prefix_cache.py
if [[ $what == scan-lean ]]; then
  if [[ -s .devkit/sel.txt ]]; then gpu_pytest "${SEL_LIMIT:-170}" gpu_tests_selected.log $(cat .devkit/sel.txt); fi
  timeout 70 python3 bench/bench_scan_overhead.py 2>&1 | tee "$OUT/scan_overhead.log" | grep -E "^\{|Error|error" || rc=1
  timeout 300 python3 bench/bench_prefix_cache.py --json "$OUT/prefix_cache.json" 2>&1 | tee "$OUT/prefix_cache.log" \
      | grep -E "steps|turn|rror" || rc=1
fi
# varlen  the varlen prefill path (HYBRID_VARLEN_PREFILL=1): its GPU test and the Mamba kernel tests, then
#            bench_prefill_rows.py (64 prompts of 16 / 128 / 512 tokens, rows one by one against varlen, one process)
if [[ $what == varlen ]]; then
  gpu_pytest 200 gpu_tests_varlen.log tests/gpu/test_kernels.py -k "varlen or mamba_kernels_vs_torch" tests/gpu/test_mamba_scan_gpu.py
  timeout 300 python3 bench/bench_prefill_rows.py --json "$OUT/prefill_rows.json" 2>&1 | tee "$OUT/prefill_rows.log" \
      | grep -E "^\{|rror" || rc=1
fi
# varlen-2  the varlen path's GPU test alone (the scan's seq_idx kernels autotune on first use: minutes on a fresh
#            machine), then the parity and state-under-graphs files with HYBRID_VARLEN_PREFILL=1
if [[ $what == varlen-2 ]]; then
  gpu_pytest 270 gpu_tests_varlen.log tests/gpu/test_kernels.py -k varlen
  HYBRID_VARLEN_PREFILL=1 gpu_pytest 270 gpu_tests_varlen_parity.log tests/gpu/test_parity.py \
      tests/gpu/test_state_under_graphs.py
fi
# varlen-3  bench/diag_varlen_noise.py (the varlen path's log-prob moves next to the bf16 noise floor), then the
#            varlen kernel tests (NEMO; the accuracy against rows) and the verify / preemption / sanitizer state tests
#            with it on
if [[ $what == varlen-3 ]]; then
  timeout 150 python3 bench/diag_varlen_noise.py 2>&1 | tee "$OUT/varlen_noise.log" | grep -E "^\{|rror" || rc=1
  HYBRID_VARLEN_PREFILL=1 gpu_pytest 330 gpu_tests_varlen_3.log "tests/gpu/test_kernels.py::test_varlen_prefill_vs_torch" \
      tests/gpu/test_state_under_graphs.py -k "verify_graphs or preemption or sanitizer or cfg2 or accurate"
fi
# varlen-default  the varlen prefill path on by default: its kernel tests and the Mamba kernel tests, then the
#            parity, state-under-graphs, graphs and warm-up files (engine-level: many prompts prefilled per step)
if [[ $what == varlen-default ]]; then
  gpu_pytest 200 gpu_tests_varlen_default_kernels.log tests/gpu/test_kernels.py -k "varlen or mamba_kernels_vs_torch or accurate"
  gpu_pytest 330 gpu_tests_varlen_default.log tests/gpu/test_parity.py tests/gpu/test_state_under_graphs.py \
      tests/gpu/test_warmup_gpu.py tests/gpu/test_graphs.py
fi
# prefix-snap  the GPU tests of prefix-cache snapshots inside prefill rows and of the varlen path's accuracy, then
#            bench_prefix_cache.py (a hit's second turn now runs as one step)
if [[ $what == prefix-snap ]]; then
  gpu_pytest 240 gpu_tests_prefix_snap.log tests/gpu/test_kernels.py -k "snapshots or accurate"
  timeout 300 python3 bench/bench_prefix_cache.py --json "$OUT/prefix_cache.json" 2>&1 | tee "$OUT/prefix_cache.log" \
      | grep -E "steps|turn|rror" || rc=1
fi
# prefix-varlen  the GPU tests of snapshots inside prefill rows (now one varlen launch of each kernel a Mamba layer
#            with our kernels, both step shapes), then bench_prefix_cache.py with the default and with
#            HYBRID_VARLEN_PREFILL=0 (the hit's row as one conv and one scan call a segment), each its own process
if [[ $what == prefix-varlen ]]; then
  gpu_pytest 200 gpu_tests_prefix_varlen.log tests/gpu/test_kernels.py -k "snapshots"
  timeout 180 python3 bench/bench_prefix_cache.py --json "$OUT/prefix_cache_varlen.json" 2>&1 \
      | tee "$OUT/prefix_cache_varlen.log" | grep -E "steps|turn|rror" || rc=1
  HYBRID_VARLEN_PREFILL=0 timeout 180 python3 bench/bench_prefix_cache.py --json "$OUT/prefix_cache_rows.json" 2>&1 \
      | tee "$OUT/prefix_cache_rows.log" | grep -E "steps|turn|rror" || rc=1
fi
# combined  one call for this session's unmeasured work, each step in what is left of ${COMBINED_LIMIT:-560} s: the
#            GPU tests of snapshots inside varlen prefill rows, the greedy launches, fp8_gemv quantizing its rows and
#            decode attention on the Triton split-KV kernel (<= 200 s); bench_prefix_cache.py (the hit's step, varlen
#            snapshots on by default; <= 150 s); Granite-Tiny decode at batch 1 / 8 with --greedy-ab and
#            --triton-decode-attention-ab and the kernel profile (what is left)
if [[ $what == combined ]]; then
  start=$SECONDS
  limit=${COMBINED_LIMIT:-560}
  gpu_pytest 200 gpu_tests_combined.log tests/gpu/test_kernels.py tests/gpu/test_sampler_gpu.py tests/gpu/test_fp8_gpu.py \
      tests/gpu/test_triton_prefill_attention_gpu.py -k "snapshots or greedy or quantizing or where_xqa"
  timeout 150 python3 bench/bench_prefix_cache.py --json "$OUT/prefix_cache_varlen.json" 2>&1 \
      | tee "$OUT/prefix_cache_varlen.log" | grep -E "steps|turn|rror" || rc=1
  left=$((limit - (SECONDS - start)))
  if (( left > 60 )); then
    timeout $left python3 bench/bench_moe.py --shapes granite-tiny --batches 1 8 --gen-batches 1 --no-peer --no-eager \
        --greedy-ab --triton-decode-attention-ab --profile --out /tmp/moe_out --time-budget $((left - 10)) 2>&1 \
        | tee "$OUT/bench_moe_greedy.log" | grep -E "decode \{|tok_s|rror" | cut -c1-300 || rc=1
    cp /tmp/moe_out/moe_benchmark.md "$OUT/" 2>/dev/null || true  # (at most 8 files come back: the rest stays)
  fi
fi
# preload   the preloading decode linear (HYBRID_GEMV_PRELOAD): its GPU tests and the engine with each setting (<= 150 s),
#           one Mamba layer op by op with its tiles (bench_mamba_decode_layer.py, batch 1 and 4, <= 120 s), then
#           Granite-Tiny decode at batch 1 and 8 with HYBRID_GEMV_PRELOAD=1 and =all against the default, recaptured
#           in one process (the rest of ${PRELOAD_LIMIT:-550} s)
if [[ $what == preload ]]; then
  start=$SECONDS
  gpu_pytest 150 gpu_tests_preload.log tests/gpu/test_triton_fused_ops_gpu.py -k "preload or small_m_linear or in_proj_conv"
  timeout 120 python3 bench/bench_mamba_decode_layer.py --batches 1 4 --json "$OUT/mamba_decode_layer_preload.json" 2>&1 \
      | tee "$OUT/mamba_decode_layer_preload.log" | grep -E "batch|rror" | cut -c1-3000 || rc=1
  left=$(( ${PRELOAD_LIMIT:-550} - (SECONDS - start) ))
  if (( left > 60 )); then
    timeout $left python3 bench/bench_moe.py --shapes ${PRELOAD_SHAPES:-granite-tiny} --batches 1 8 --gen-batches 1 \
        --no-peer --no-eager --gemv-preload-sites-ab --gemv-preload-off-ab --out /tmp/moe_out --time-budget $((left - 10)) 2>&1 \
        | tee "$OUT/bench_moe_preload.log" | grep -E "decode \{|tok_s|rror" | cut -c1-300 || rc=1
    cp /tmp/moe_out/moe_benchmark.md "$OUT/" 2>/dev/null || true
  fi
fi
# preload-default  the preloading linears as the default (one-token steps): their GPU tests, the FP8 GEMV's and the
#           engine with each setting (<= 120 s); the two MoE shapes at batch 1, default against HYBRID_GEMV_PRELOAD=0,
#           recaptured in one process; then the 8B shape at batch 1 in bf16, default and off, while
#           ${PRELOAD_LIMIT:-560} s last
if [[ $what == preload-default ]]; then
  start=$SECONDS
  gpu_pytest 120 gpu_tests_preload_default.log tests/gpu/test_triton_fused_ops_gpu.py tests/gpu/test_fp8_gpu.py \
      -k "preload or small_m_linear or in_proj_conv or decode_sized or quantizing or captured or switches"
  timeout 330 python3 bench/bench_moe.py --shapes granite-tiny nemotron-nano --batches 1 --gen-batches 1 --no-peer \
      --no-eager --gemv-preload-off-ab --out /tmp/moe_out --time-budget 320 2>&1 \
      | tee "$OUT/bench_moe_preload_default.log" | grep -E "decode \{|rror" | cut -c1-300 || rc=1
  cp /tmp/moe_out/moe_benchmark.md "$OUT/moe_preload_default.md" 2>/dev/null || true
  for preload in all 0; do
    left=$(( ${PRELOAD_LIMIT:-560} - (SECONDS - start) ))
    if (( left > 40 )); then
      HYBRID_GEMV_PRELOAD=$preload timeout $left python3 bench/bench_decode.py --no-eager --no-prefill --batches 1 \
          --json "$OUT/decode_8b_preload_$preload.json" 2>&1 | grep -v Warn | grep -E "batch|tok/s|rror" | tail -4 || rc=1
    fi
  done
fi
# moe-targets  the MoE targets' shapes at the batch sizes still short of them (Granite-Tiny and Nemotron-Nano, batch 1
#           and 8, graphs, the default kernels, generate at batch 1): one short call (~3-4 minutes on a fresh machine)
#           for an H200 figure when one is lent
if [[ $what == moe-targets ]]; then
  timeout 330 python3 bench/bench_moe.py --shapes granite-tiny nemotron-nano --batches 1 8 --gen-batches 1 --no-peer \
      --no-eager --out /tmp/moe_out --time-budget 320 2>&1 | tee "$OUT/bench_moe_targets.log" \
      | grep -E "decode \{|generate \{|rror" | cut -c1-300 || rc=1
  cp /tmp/moe_out/moe_benchmark.md "$OUT/moe_targets.md" 2>/dev/null || true
fi
# The two trees of a same-machine A/B (moe-base-ab, fp8-base-ab): BASE_DIR's copy (bench/make_base.sh), then this one
ab_trees() {
  local base=${BASE_DIR:-.abbase}
  [[ -d $base ]] || { echo "$what: no $base (bench/make_base.sh)" >&2; return 2; }
  echo "$base ."
}
ab_name() {  # $1: a tree of ab_trees
  if [[ $1 == . ]]; then echo head; else echo "base_$(cut -c1-7 "$1/COMMIT" 2>/dev/null)"; fi
}
# weights-early  the GPU tests of the small kernels that load their constants before the PDL wait (the norms'
#           weights, the SSM update's A / D / dt_bias, the routing bias; ~2 minutes fresh), then moe-base-ab
# moe-base-ab  the MoE shapes in AB_SHAPES (default granite-tiny) at batch 1 and 8 (graphs, generate at batch 1)
#           with the copy of an earlier commit in BASE_DIR (bench/make_base.sh; carried) and then with this tree,
#           AB_LIMIT seconds each (default 280). A bench_moe.py worker's startup alone takes 80-100 s with warm JIT
#           caches and minutes more after a kernel change (its specialisations compile again): at 2026-12-07 two
#           runs of 95 s a shape printed nothing. Run with JIT_SAVE=1 once after a kernel change and keep the caches.
if [[ $what == weights-early ]]; then
  gpu_pytest 170 gpu_tests_weights_early.log tests/gpu/test_triton_fused_ops_gpu.py tests/gpu/test_moe_gpu.py \
      tests/gpu/test_triton_kernels_gpu.py \
      -k "rms_norm_8b or gated_norm_8b or ssm_update or multi_token or route_kernel or route_hidden or engine_with_fused_ops or one_token_preloading"
fi
if [[ $what == moe-base-ab || $what == weights-early ]]; then
  trees=$(ab_trees) || exit 2
  limit=${AB_LIMIT:-280}
  for tree in $trees; do
    name=$(ab_name "$tree")
    # (--prompt 1024: the step budget and the TTFT prompt; the engine then warms up and compiles the prefill and
    # MoE specialisations up to 1,024 tokens, not 8,192, a shorter startup for a decode A/B)
    # shellcheck disable=SC2086
    timeout "$limit" python3 "$tree/bench/bench_moe.py" --shapes ${AB_SHAPES:-granite-tiny} --batches 1 8 \
        --prompt ${AB_PROMPT:-1024} --gen-batches 1 --no-peer --no-eager --out "/tmp/moe_ab_$name" \
        --time-budget $(( limit - 10 )) 2>&1 \
        | tee "$OUT/bench_moe_ab_$name.log" | grep -E "decode \{|generate \{|rror" | cut -c1-260 | sed "s/^/[$name] /" \
        || rc=1
    cp "/tmp/moe_ab_$name/moe_benchmark.md" "$OUT/moe_ab_$name.md" 2>/dev/null || true
  done
fi
# fp8-base-ab  the 8B shape in FP8 (pcpt, bf16 state, graphs) at batch 1 and 64 with the 8K TTFT, from the copy of
#           an earlier commit in BASE_DIR (bench/make_base.sh; carried) and then from this tree, same machine
if [[ $what == fp8-base-ab ]]; then
  trees=$(ab_trees) || exit 2
  for tree in $trees; do
    name=$(ab_name "$tree")
    timeout ${AB_LIMIT:-150} python3 "$tree/bench/bench_decode.py" --no-eager --ssm-dtype bfloat16 --fp8 pcpt \
        --batches 1 64 --steps 10 --json "$OUT/decode_fp8_ab_$name.json" 2>&1 | tee "$OUT/decode_fp8_ab_$name.log" \
        | grep -v Warn | grep -E "^\{|rror" | cut -c1-260 | sed "s/^/[$name] /" || rc=1
  done
fi
# moe-shared-early  the GPU tests of the one-token expert kernels (the shared expert's programs first, their slabs
#           before the PDL wait, the default) and the engine with HYBRID_MOE_SHARED_EARLY=0, then the two target
#           shapes at batch 1 and 8 (graphs) with and without it, same process (--moe-shared-early-off-ab)
if [[ $what == moe-shared-early ]]; then
  gpu_pytest 150 gpu_tests_shared_early.log tests/gpu/test_moe_gpu.py tests/gpu/test_triton_fused_ops_gpu.py \
      -k "one_token or shared_expert_folded or (engine_with_the_kernel_switches and (moe_shared or moe_preload))"
  timeout 410 python3 bench/bench_moe.py --shapes granite-tiny nemotron-nano --batches 1 8 --gen-batches 1 --no-peer \
      --no-eager --moe-shared-early-off-ab --out /tmp/moe_out --time-budget 400 2>&1 \
      | tee "$OUT/bench_moe_shared_early.log" | grep -E "decode \{|generate \{|rror" | cut -c1-300 || rc=1
  cp /tmp/moe_out/moe_benchmark.md "$OUT/moe_shared_early.md" 2>/dev/null || true
fi
# sampled  the throughput target's sampled-against-greedy part alone: the 8B shape from disk, 256 x (1024, 257), one
#           greedy run, then the same batch under each sampler setting (--sampled-ab), in ${SAMPLED_LIMIT:-540} s
if [[ $what == sampled ]]; then
  timeout ${SAMPLED_LIMIT:-540} python3 bench/bench_throughput.py --shape nemotron-h-8b --num-prompts 256 --input-len 1024 \
      --output-len 257 --max-num-seqs 256 --max-num-batched-tokens 8192 --mamba-ssm-dtype bfloat16 --repeat 1 \
      --sampled-ab --json "$OUT/throughput_sampled.json" 2>&1 | tee "$OUT/throughput_sampled.log" \
      | grep -v -E "^Loading|^Capturing" | tail -40 || rc=1
fi
# hit-check  a short call: the greedy launches' GPU tests (<= 60 s), bench_prefix_cache.py (the hit with varlen
#            snapshots, <= 200 s), then the snapshot GPU tests in what is left of ${HIT_CHECK_LIMIT:-320} s
if [[ $what == hit-check ]]; then
  start=$SECONDS
  gpu_pytest 60 gpu_tests_greedy.log tests/gpu/test_sampler_gpu.py -k greedy
  # (200 s: on a fresh machine the first LLM's warm-up tunes mamba-ssm's varlen scan; at 120 s 4f52fbe's run ended there)
  timeout 200 python3 bench/bench_prefix_cache.py --json "$OUT/prefix_cache_varlen.json" 2>&1 \
      | tee "$OUT/prefix_cache_varlen.log" | grep -E "steps|turn|rror" || rc=1
  left=$(( ${HIT_CHECK_LIMIT:-320} - (SECONDS - start) ))
  if (( left > 20 )); then gpu_pytest $left gpu_tests_snapshots.log tests/gpu/test_kernels.py -k snapshots; fi
fi
# prefix-profile  the selected GPU tests of .devkit/sel.txt (if any, at most 150 s), then bench_prefix_cache.py with
#            one more hit under torch.profiler (host ops and kernels: tables in the log, chrome trace in $OUT)
if [[ $what == prefix-profile ]]; then
  if [[ -s .devkit/sel.txt ]]; then gpu_pytest "${SEL_LIMIT:-150}" gpu_tests_selected.log $(cat .devkit/sel.txt); fi
  timeout 400 python3 bench/bench_prefix_cache.py --json "$OUT/prefix_cache.json" --profile "$OUT" 2>&1 \
      | tee "$OUT/prefix_cache.log" || rc=1
  gzip -f "$OUT/prefix_hit_trace.json" 2>/dev/null || true
fi
# scan-plans  the GPU tests of the chunked scan (planned launches: tests/gpu/test_mamba_scan_gpu.py) and of the varlen
#            prefill's snapshots, then bench_prefix_cache.py with the planned launches (default) and without
#            (HYBRID_SCAN_PLANS=0), each its own process on this machine
if [[ $what == scan-plans ]]; then
  gpu_pytest 200 gpu_tests_scan_plans.log tests/gpu/test_mamba_scan_gpu.py tests/gpu/test_kernels.py -k "scan or snapshots"
  timeout 170 python3 bench/bench_prefix_cache.py --json "$OUT/prefix_cache_plans.json" 2>&1 | grep -v Warn \
      | tee "$OUT/prefix_cache_plans.log" || rc=1
  HYBRID_SCAN_PLANS=0 timeout 170 python3 bench/bench_prefix_cache.py --json "$OUT/prefix_cache_no_plans.json" 2>&1 \
      | grep -v Warn | tee "$OUT/prefix_cache_no_plans.log" || rc=1
fi
# launch-sampler  the GPU tests of the sampler, the sampler's fallback kernel alone (old
#            against new, bench_sampler_kernel.py --device), bench_prefix_cache.py, then `sampled` (SAMPLED_LIMIT)
if [[ $what == launch-sampler ]]; then
  gpu_pytest 150 gpu_tests_launch_sampler.log tests/gpu/test_sampler_gpu.py
  timeout 90 python3 bench/bench_sampler_kernel.py --device 2>&1 | tee "$OUT/sampler_kernel.log" || rc=1
  timeout 150 python3 bench/bench_prefix_cache.py --json "$OUT/prefix_cache_launch.json" 2>&1 | grep -v Warn \
      | tee "$OUT/prefix_cache_launch.log" || rc=1
  bash "$0" sampled
fi
# sync-cost  bench_sync_cost.py: a phase boundary as two launches (graph, with and without PDL) against a grid-wide
#            barrier inside one persistent kernel (whether a persistent kernel per layer could shorten the MoE step)
if [[ $what == sync-cost ]]; then
  timeout 120 python3 bench/bench_sync_cost.py 2>&1 | tee "$OUT/sync_cost.log" || rc=1
fi
# cold-load  the GPU tests of the prefetching loader, then the cold load alone (bench_throughput --load-only
#            --cold-load: the disk measured first) without and with the prefetch thread (HYBRID_LOAD_PREFETCH=0 / 1,
#            the default), twice each, alternating (the 8B shape saved first if needed)
if [[ $what == cold-load ]]; then
  gpu_pytest 120 gpu_tests_load_prefetch.log tests/gpu/test_load_prefetch_gpu.py
  for i in 1 2; do
    for pf in 0 1; do
      HYBRID_LOAD_PREFETCH=$pf timeout 120 python3 bench/bench_throughput.py --shape nemotron-h-8b --load-only \
          --cold-load --json "$OUT/cold_load_prefetch${pf}_$i.json" 2>&1 \
          | grep -E "disk|cold|load alone|CUDA context|load prefetch|rror" | sed "s/^/prefetch=$pf: /" \
          | tee -a "$OUT/cold_load.log" || rc=1
    done
  done
fi
# fp8-profile  the 8B shape in FP8 (pcpt, bf16 state) at batch 1 and 64 with the kernel profile of each replay, and
#            the 8K TTFT (the defaults: the one-token preloading FP8 linear, the MLP activation in the row rounding)
if [[ $what == fp8-profile ]]; then
  timeout 240 python3 bench/bench_decode.py --no-eager --ssm-dtype bfloat16 --fp8 pcpt --batches 1 64 --steps 10 \
      --profile --json "$OUT/decode_fp8_profile.json" 2>&1 | tee "$OUT/decode_fp8_profile.log" | grep -v Warn \
      | grep -E "^\{|TTFT|ttft|rror" | cut -c1-300 || rc=1
  timeout 150 python3 bench/bench_quantize_rows.py --json "$OUT/quantize_rows.json" 2>&1 \
      | tee "$OUT/quantize_rows.log" | cut -c1-400 || rc=1
fi
# fp8-splitk  the GPU tests of the split-K FP8 GEMM and of quantize_rows' looped tiles (<= 100 s), then the 8B shape
#            in FP8 (pcpt, bf16 state) at batch 8 / 64 with the 8K TTFT by default and at batch 8 / 64 with
#            HYBRID_FP8_SPLITK=1, a process each
#            (FP8_SPLITK_LEAN=1: the split-K tests alone, batch 64 alone, no TTFT; FP8_SPLITK_ONLY=1: no default run)
if [[ $what == fp8-splitk ]]; then
  lean=${FP8_SPLITK_LEAN:-0}
  gpu_pytest ${FP8_SPLITK_TEST_LIMIT:-100} gpu_tests_fp8_splitk.log tests/gpu/test_fp8_gpu.py \
      -k "$([[ $lean == 1 ]] && echo splitk || echo 'splitk or mlp_activation_in_the_row')"
  for run in default splitk; do
    [[ $run == default && ${FP8_SPLITK_ONLY:-0} == 1 ]] && continue  # (=1: against an earlier default)
    extra=(--no-prefill); [[ $run == default && $lean != 1 ]] && extra=()
    HYBRID_FP8_SPLITK=$([[ $run == splitk ]] && echo 1 || echo 0) timeout 150 python3 bench/bench_decode.py \
        --no-eager --ssm-dtype bfloat16 --fp8 pcpt --batches $([[ $lean == 1 ]] && echo 64 || echo 8 64) --steps 10 \
        "${extra[@]}" \
        --json "$OUT/decode_fp8_splitk_$run.json" 2>&1 | tee "$OUT/decode_fp8_splitk_$run.log" | grep -v Warn \
        | grep -E "^\{|rror" | cut -c1-200 | sed "s/^/$run: /" || rc=1
  done
fi
fp8_8b_decode() {  # $1: the run's name; the rest: more bench_decode.py arguments; the environment: its switches
  local run=$1; shift
  timeout 150 python3 bench/bench_decode.py --no-eager --ssm-dtype bfloat16 --fp8 pcpt --batches 8 64 --steps 10 \
      "$@" --json "$OUT/decode_fp8_$run.json" 2>&1 | tee "$OUT/decode_fp8_$run.log" | grep -v Warn \
      | grep -E "^\{|rror" | cut -c1-200 | sed "s/^/$run: /" || rc=1
}
splitk_sweep() {  # bench_fp8_splitk.py in ${SWEEP_LIMIT:-240} s
  timeout ${SWEEP_LIMIT:-240} python3 bench/bench_fp8_splitk.py --json "$OUT/fp8_splitk_sweep.json" \
      --time-limit $(( ${SWEEP_LIMIT:-240} - 40 )) 2>&1 | tee "$OUT/fp8_splitk_sweep.log" | grep -v Warn | cut -c1-400 || rc=1
}
# fp8-next  the GPU tests of the split-K GEMM and of the norms' e4m3 rounding (<= 120 s), then the 8B shape in FP8
#           (pcpt, bf16 state, graphs) at batch 8 / 64 with the 8K TTFT, a process each: the default (the norms
#           round their rows for the FP8 projections), HYBRID_FP8_NORM_ROUNDING=0, and HYBRID_FP8_SPLITK=1 (no TTFT:
#           prefill steps never take it)
if [[ $what == fp8-next ]]; then
  gpu_pytest 120 gpu_tests_fp8_next.log tests/gpu/test_fp8_gpu.py -k "splitk or norm_rounding"
  fp8_8b_decode default
  HYBRID_FP8_NORM_ROUNDING=0 fp8_8b_decode norm_rounding_0
  HYBRID_FP8_SPLITK=1 fp8_8b_decode splitk_1 --no-prefill
fi
# fp8-splitk-sweep  bench_fp8_splitk.py: the 8B's FP8 projections at 64 rows, cuBLASLt's tensor-wise
#           GEMM against the split-K GEMM over a sweep of its tilings, each with the scales' launch (<= 240 s)
if [[ $what == fp8-splitk-sweep ]]; then
  splitk_sweep
fi
# fp8-splitk-2  the GPU tests of the one-launch split-K linear (<= 80 s), the sweep (SPLITK_LEAN=1: none), then the
#           8B shape in FP8 at batch 8 / 64 by default and with HYBRID_FP8_SPLITK=1 (one launch a projection now),
#           a process each
if [[ $what == fp8-splitk-2 ]]; then
  gpu_pytest 80 gpu_tests_fp8_splitk_2.log tests/gpu/test_fp8_gpu.py -k "splitk"
  [[ ${SPLITK_LEAN:-0} == 1 ]] || splitk_sweep
  fp8_8b_decode 2_default --no-prefill
  HYBRID_FP8_SPLITK=1 fp8_8b_decode 2_splitk_1 --no-prefill
fi
# request-features  the GPU tests of the request-level masks and gates (allowed_token_ids, bad_words under async
#           scheduling, a structured output after a token, truncate_prompt_tokens, include_stop_str_in_output;
#           the CPU's tokens on CUDA; <= 150 s)
if [[ $what == request-features ]]; then
  gpu_pytest 150 gpu_tests_request_features.log tests/gpu/test_request_features_gpu.py
fi
# latent   the GPU tests of LatentMoE (Nemotron 3 Super): the 512-expert top-22 latent experts against the float64
#          reference, the tiny LatentMoE checkpoint against the CPU reference (bf16 and FP8); <= 200 s
if [[ $what == latent ]]; then
  gpu_pytest 200 gpu_tests_latent.log tests/gpu/test_moe_gpu.py tests/gpu/test_parity.py tests/gpu/test_fp8_gpu.py \
      -k "latent or 512"
fi
# next     what this project's next session measures first: the first parametrization of every GPU test with the
#          piecewise graphs the default (tests-smoke, <= 540 s: the files not run with them yet, FP8, FP8 KV, request
#          features, fused ops, released shapes). Its second call (next-2): the issue targets on an H200 (their
#          capture at the MoE shapes included, ~8 minutes), piecewise-default on an H100; its third (next-3): the
#          prefix hit's host profile with the piecewise graphs (prefix-cprofile, <= 400 s)
if [[ $what == next ]]; then
  bash "$0" tests-smoke || rc=1
fi
if [[ $what == next-2 ]]; then
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    bash "$0" targets || rc=1
  else
    bash "$0" piecewise-default || rc=1
  fi
fi
if [[ $what == next-3 ]]; then
  bash "$0" prefix-cprofile || rc=1
fi
# fp8-preload  the 8B shape in FP8 (pcpt, bf16 state) decode at batch 1 by default and with HYBRID_FP8_PRELOAD=1 (each
#            its own process), the GPU tests of fp8_preload_gemv, then =1 with every row rounded before the kernel
#            (HYBRID_FP8_PRELOAD_ROUND_MAX_K=0)
if [[ $what == fp8-preload ]]; then
  fp8_b1() {  # $1: the run's name; the environment: its switches
    timeout 130 python3 bench/bench_decode.py --no-eager --no-prefill --ssm-dtype bfloat16 --fp8 pcpt --batches 1 \
        --json "$OUT/decode_fp8_$1.json" 2>&1 | tee "$OUT/decode_fp8_$1.log" | grep -v Warn \
        | grep -E "batch|tok/s|Error|error" | tail -3 | sed "s/^/$1: /" || rc=1
  }
  [[ ${FP8_PRELOAD_ONLY:-0} == 1 ]] || fp8_b1 default  # (=1: only the switch's run, against an earlier default)
  HYBRID_FP8_PRELOAD=1 fp8_b1 preload
  if [[ ${FP8_PRELOAD_LEAN:-0} != 1 ]]; then  # (=1: the A/B alone)
    gpu_pytest 120 gpu_tests_fp8_preload.log tests/gpu/test_fp8_gpu.py -k "preload_gemv"
    HYBRID_FP8_PRELOAD=1 HYBRID_FP8_PRELOAD_ROUND_MAX_K=0 fp8_b1 preload_round_before
  fi
fi
# targets  the open issues' target figures on whatever card this is, in one call (~8 minutes fresh): moe-targets,
#          then the 8B shape in FP8 (pcpt, bf16 state, graphs) at batch 1 / 8 / 64 with the 8K TTFT, the defaults
if [[ $what == targets ]]; then
  bash "$0" moe-targets || rc=1
  timeout 200 python3 bench/bench_decode.py --no-eager --ssm-dtype bfloat16 --fp8 pcpt --batches 1 8 64 --steps 10 \
      --json "$OUT/decode_fp8_targets.json" 2>&1 | tee "$OUT/decode_fp8_targets.log" | grep -v Warn \
      | grep -E "^\{|rror" | cut -c1-300 || rc=1
fi
# piecewise  the GPU tests of the piecewise graphs (graphs/piecewise.py; <= 130 s), bench_prefix_cache.py with them
#            (HYBRID_PIECEWISE_MAX_TOKENS=512) and the hit's A/B against eager steps in the same process
#            (--piecewise-ab; <= 250 s), then the long-context second turn after a prefix hit with them on (<= 150 s)
if [[ $what == piecewise ]]; then
  gpu_pytest 130 gpu_tests_piecewise.log tests/gpu/test_piecewise_gpu.py
  HYBRID_PIECEWISE_MAX_TOKENS=512 timeout 250 python3 bench/bench_prefix_cache.py --piecewise-ab \
      --json "$OUT/prefix_cache_piecewise.json" 2>&1 | tee "$OUT/prefix_cache_piecewise.log" | grep -v Warn \
      | grep -E "turn|steps|A/B|rror|captured" | cut -c1-300 || rc=1
  HYBRID_PIECEWISE_MAX_TOKENS=512 gpu_pytest 150 gpu_tests_piecewise_long.log tests/gpu/test_long_context.py \
      -k "second_turn or chunked"
fi
# piecewise-state  the state-corruption scenarios under graphs and the graph tests with the piecewise graphs on
#            (HYBRID_PIECEWISE_MAX_TOKENS=512: their prefill and mixed steps replay pieces; <= 400 s), before they
#            become the default; first the piecewise GPU tests (<= 100 s)
if [[ $what == piecewise-state ]]; then
  gpu_pytest 100 gpu_tests_piecewise.log tests/gpu/test_piecewise_gpu.py
  HYBRID_PIECEWISE_MAX_TOKENS=512 gpu_pytest 400 gpu_tests_piecewise_state.log tests/gpu/test_state_under_graphs.py \
      tests/gpu/test_graphs.py tests/gpu/test_parity.py
fi
# piecewise-default  the piecewise graphs as the default (no HYBRID_PIECEWISE_MAX_TOKENS): the prefix-hit A/B
#            (<= 200 s), then Granite-Tiny's decode and generate at batch 1 / 8 with them captured at its full
#            shape (<= 200 s)
if [[ $what == piecewise-default ]]; then
  timeout 200 python3 bench/bench_prefix_cache.py --piecewise-ab --json "$OUT/prefix_cache_piecewise_default.json" \
      2>&1 | tee "$OUT/prefix_cache_piecewise_default.log" | grep -v Warn \
      | grep -E "turn|steps|A/B|rror|captured" | cut -c1-300 || rc=1
  timeout 200 python3 bench/bench_moe.py --shapes granite-tiny --batches 1 8 --gen-batches 1 --no-peer --no-eager \
      --out /tmp/moe_out --time-budget 190 2>&1 | tee "$OUT/bench_moe_piecewise_default.log" \
      | grep -E "decode \{|generate \{|rror|piecewise|startup" | cut -c1-300 || rc=1
fi
# h200-targets  moe-targets, then prefix-cprofile in what is left of the call (PREFIX_LIMIT seconds)
# prefix-cprofile  bench_prefix_cache.py with one more hit under cProfile (the Python functions its host time goes to)
if [[ $what == prefix-cprofile || $what == h200-targets ]]; then
  # (the MoE targets are H200 figures: only where this machine is one)
  if [[ $what == h200-targets ]] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    bash "$0" moe-targets
  fi
  timeout ${PREFIX_LIMIT:-400} python3 bench/bench_prefix_cache.py --json "$OUT/prefix_cache.json" --cprofile 2>&1 \
      | tee "$OUT/prefix_cache_cprofile.log" || rc=1
fi
if [[ $what == gemm ]]; then
  timeout 200 python3 bench/bench_gemm.py --json "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.log" || rc=1
fi
if [[ $what == moe ]]; then
  timeout 545 python3 bench/bench_moe.py --out "$OUT" --time-budget 520 2>&1 | tee "$OUT/bench_moe.log" || rc=1
fi
# moe-roles  the GPU tests of the Mamba decode fusions (in_proj_conv, gated_out_proj, the engine with each) and of
#            small_m_linear (150 s), then Nemotron-Nano and Granite-Tiny decode at batch 1 and 8 (graphs), again with
#            each Mamba in_proj and conv in one launch (HYBRID_DECODE_IN_PROJ_CONV=1), with the gated norm in the SSM
#            update and out_proj (HYBRID_DECODE_GATED_OUT_PROJ=1), both, and each projection role alone on the
#            Triton linear (HYBRID_DECODE_LINEAR=plain:<role>): which win
if [[ $what == moe-roles ]]; then
  gpu_pytest 150 gpu_tests_decode_fusions.log tests/gpu/test_triton_fused_ops_gpu.py \
      -k "in_proj_conv or gated_out_proj or decode_fusions or small_m_linear"
  timeout 400 python3 bench/bench_moe.py --shapes nemotron-nano granite-tiny --batches 1 8 --gen-batches 1 --no-peer \
      --no-eager --in-proj-conv-ab --gated-out-proj-ab --decode-fusions-ab --linear-roles-ab --out "$OUT" \
      --time-budget 380 2>&1 \
      | tee "$OUT/bench_moe_roles.log" || rc=1
fi
if [[ $what == moe-profile ]]; then
  timeout 545 python3 bench/bench_moe.py --shapes nemotron-nano granite-tiny --no-peer --no-eager --profile \
      --out "$OUT" --time-budget 520 2>&1 | tee "$OUT/bench_moe_profile.log" || rc=1
fi
# linear   the 8B shape's decode (graphs, bf16 state, batch 1 / 8 / 16) with the projections on cuBLAS and then on
#          the Triton decode linear (HYBRID_DECODE_LINEAR=triton), each its own process (~3 minutes)
if [[ $what == linear ]]; then
  for impl in cublas triton; do
    HYBRID_DECODE_LINEAR=$impl timeout 200 python3 bench/bench_decode.py --no-eager --no-prefill --ssm-dtype bfloat16 \
        --batches 1 8 16 --json "$OUT/decode_linear_$impl.json" 2>&1 | tee "$OUT/decode_linear_$impl.log" \
        | grep -v Warn | tail -6 || rc=1
  done
fi
# fusions-8b  the 8B shape's decode (graphs, bf16 state, batch 1 / 8 / 16) as is, then with both Mamba decode fusions
#            (HYBRID_DECODE_IN_PROJ_CONV=1 HYBRID_DECODE_GATED_OUT_PROJ=1: two launches fewer a Mamba layer), each its
#            own process (~3 minutes)
if [[ $what == fusions-8b ]]; then
  for fused in 0 1; do
    HYBRID_DECODE_IN_PROJ_CONV=$fused HYBRID_DECODE_GATED_OUT_PROJ=$fused timeout 200 python3 bench/bench_decode.py \
        --no-eager --no-prefill --ssm-dtype bfloat16 --batches 1 8 16 --json "$OUT/decode_fusions_$fused.json" 2>&1 \
        | tee "$OUT/decode_fusions_$fused.log" | grep -v Warn | tail -6 || rc=1
  done
fi
# mamba-layer  bench_mamba_decode_layer.py: one Mamba layer's decode op by op and as chains (the old default, in_proj+conv
#            fused, that with out_proj on the Triton linear (today's default), the gated norm folded into the SSM
#            update and out_proj) at the MoE and 8B Mamba dims, batch 1 / 8; the 8B shape's decode (graphs, bf16
#            state, batch 1 / 8) with the defaults and as before them (HYBRID_DECODE_IN_PROJ_CONV=0
#            HYBRID_DECODE_LINEAR=cublas); Granite-Tiny's with the same A/B (bench_moe.py --mamba-unfused-ab); then
#            the graph and fused-op GPU tests with the defaults in what is left of 9 minutes
if [[ $what == mamba-layer ]]; then  # each step in what is left of ${MAMBA_LAYER_LIMIT:-560} s
  start=$SECONDS
  limit=${MAMBA_LAYER_LIMIT:-560}
  timeout 100 python3 bench/bench_mamba_decode_layer.py --json "$OUT/mamba_decode_layer.json" 2>&1 \
      | tee "$OUT/mamba_decode_layer.log" | grep -v Warn || rc=1
  for old in 0 1; do
    if [[ $old == 1 ]]; then export HYBRID_DECODE_IN_PROJ_CONV=0 HYBRID_DECODE_LINEAR=cublas; fi
    timeout 200 python3 -u bench/bench_decode.py --no-eager --no-prefill --ssm-dtype bfloat16 --batches 1 8 \
        --json "$OUT/decode_mamba_old_$old.json" 2>&1 | tee "$OUT/decode_mamba_old_$old.log" \
        | grep -E "^\{'batch|rror" | cut -c1-200 || rc=1
  done
  unset HYBRID_DECODE_IN_PROJ_CONV HYBRID_DECODE_LINEAR
  left=$((limit - (SECONDS - start)))
  if (( left > 30 )); then
    gpu_pytest $(( left < 120 ? left : 120 )) gpu_tests_mamba_defaults.log tests/gpu/test_triton_fused_ops_gpu.py \
        tests/gpu/test_graphs.py -k "engine or replay_equals_eager"
  fi
  left=$((limit - (SECONDS - start)))
  if (( left > 120 )); then
    timeout $left python3 bench/bench_moe.py --shapes granite-tiny --batches 1 8 --gen-batches 1 --no-peer --no-eager \
        --mamba-unfused-ab --out "$OUT" --time-budget $((left - 10)) 2>&1 | tee "$OUT/bench_moe_mamba_unfused.log" \
        | grep -E "^\[granite|^\||Error|error" | cut -c1-220 || rc=1
  fi
fi
# moe-route-ab  Nemotron-Nano and Granite-Tiny decode at batch 1 / 8 (graphs) with the defaults, with
#            HYBRID_MOE_ROUTE_IN_GEMM=1 (--route-in-gemm-ab) and with it and HYBRID_NORM_ROUTER=1 (an MoE layer in
#            three launches: --moe-three-launches-ab) (<= 340 s), then the GPU tests of those switches (the
#            routing inside the first expert GEMM, the engine with them, the graph tests) in what is left of 560 s
if [[ $what == moe-route-ab ]]; then
  start=$SECONDS
  timeout 340 python3 -u bench/bench_moe.py --shapes granite-tiny nemotron-nano --batches 1 8 --gen-batches 1 --no-peer \
      --no-eager --route-in-gemm-ab --moe-three-launches-ab --out "$OUT" --time-budget 330 2>&1 \
      | tee "$OUT/bench_moe_next.log" | grep -E "^\[|^\||^graphs|Error|error" | cut -c1-220 || rc=1
  left=$((560 - (SECONDS - start)))
  if (( left > 30 )); then
    gpu_pytest $left gpu_tests_moe_next.log tests/gpu/test_moe_gpu.py tests/gpu/test_triton_fused_ops_gpu.py \
        tests/gpu/test_graphs.py -k "routed_inside or route_in_gemm or moe_three or norm_router or replay_equals_eager"
  fi
fi
# moe-timeline  Granite-Tiny alone (its own time share: the fresh machine's compiles cut it from moe-next), batch
#            1 / 8, graphs, with the kernel profile of each batch-1 replay: per kernel its span and its marginal time
#            (what it adds to the step: bench_decode.marginal_times), for the default, HYBRID_MOE_ROUTE_IN_GEMM=1
#            and that with HYBRID_NORM_ROUTER=1 (~5-8 minutes fresh)
if [[ $what == moe-timeline ]]; then
  timeout 560 python3 -u bench/bench_moe.py --shapes granite-tiny --batches 1 8 --gen-batches 1 --no-peer --no-eager \
      --profile --route-in-gemm-ab --moe-three-launches-ab --out "$OUT" --time-budget 550 2>&1 \
      | tee "$OUT/bench_moe_timeline.log" | grep -E "^\[|^\||^graphs|^profile|Error|error" | cut -c1-220 || rc=1
fi
# speculative  bench_speculative.py: a verify step (K=3) next to a decode step on the 8B shape, eager and
#            replayed from the verify graphs (the default), batch 1 / 4 / 16, then generate with
#            n-gram speculation (~3 minutes)
if [[ $what == speculative ]]; then
  timeout 400 python3 bench/bench_speculative.py --json "$OUT/speculative.json" 2>&1 | tee "$OUT/speculative.log" || rc=1
fi
# moe-tiles  bench_moe_kernels.py at the decode sizes of the two target shapes: every candidate tile
#            configuration, per-GEMM pairs, and the model's default (~2-4 minutes)
if [[ $what == moe-tiles ]]; then
  timeout 400 python3 bench/bench_moe_kernels.py --tokens 1 8 64 --shapes granite4_tiny nemotron3_nano \
      --json "$OUT/moe_tiles.json" 2>&1 | tee "$OUT/moe_tiles.log" || rc=1
fi
# moe-split  bench_moe_kernels.py at batch 1 / 4 / 8 with the per-kernel profile of the default (the split-K
#            candidates it once timed were reverted: BENCHMARKS.md) (~2-3 minutes)
if [[ $what == moe-split ]]; then
  timeout 300 python3 bench/bench_moe_kernels.py --tokens 1 4 8 --shapes granite4_tiny nemotron3_nano --kernel-profile \
      --json "$OUT/moe_split.json" 2>&1 | tee "$OUT/moe_split.log" || rc=1
fi
# sampling  bench_sampling.py: the sampler alone at batch 1 / 64 / 256 over a 131072 vocabulary (greedy,
#          temperature, top-p / top-k / min-p, peaked / mixed / flat logits), next to the old full sort (~1 minute)
if [[ $what == sampling ]]; then
  timeout 200 python3 bench/bench_sampling.py --json "$OUT/sampling.json" 2>&1 | tee "$OUT/sampling.log" || rc=1
fi
# moe-fp8-kernels  bench_moe_kernels.py at batch 1 / 8 / 64 / 256 with FP8 experts next to bf16 (~2 minutes)
if [[ $what == moe-fp8-kernels ]]; then
  timeout 300 python3 bench/bench_moe_kernels.py --tokens 1 8 64 256 --shapes granite4_tiny nemotron3_nano granite4_small \
      --fp8 --json "$OUT/moe_fp8_kernels.json" 2>&1 | tee "$OUT/moe_fp8_kernels.log" | grep -E "T=" || rc=1
fi
# moe-fp8  the two target shapes' decode (graphs) and TTFT with the routed experts in FP8 (--fp8-experts:
#          e4m3 weights with per-row scales, weight-only, as FP8 checkpoints load), floors from FP8 bytes
if [[ $what == moe-fp8 ]]; then
  timeout 545 python3 bench/bench_moe.py --shapes nemotron-nano granite-tiny --no-peer --no-eager --fp8-experts \
      --gen-batches 1 --out "$OUT" --time-budget 520 2>&1 | tee "$OUT/bench_moe_fp8.log" || rc=1
fi
# moe-logits  the two target shapes' graph decode with fp32 logits (the default) against 16-bit logits
#            (HYBRID_16BIT_LOGITS=1) in the same process, generate at batch 1 (~3 minutes)
if [[ $what == moe-logits ]]; then
  timeout 400 python3 bench/bench_moe.py --shapes nemotron-nano granite-tiny --no-peer --no-eager --logits-ab \
      --gen-batches 1 --out "$OUT" --time-budget 380 2>&1 | tee "$OUT/bench_moe_logits.log" || rc=1
fi
# ctx-buckets  decode graphs per context bucket: XQA alone at max_seq_len 2K..128K (batch 1 and 8, page 16), the
#            selected GPU tests of .devkit/sel.txt (if any), then Nemotron-3-Nano's graph decode at batch 1 / 8 with
#            the buckets on (default) and off (--context-buckets-ab, recaptured), at the benchmark's max_model_len
#            (8256) and at 131072, generate at batch 1
if [[ $what == ctx-buckets ]]; then
  timeout 150 python3 bench/bench_decode_attention.py --max-lens 2048 4096 8256 32768 131072 --pages 16 --batches 1 8 \
      --no-wrapper --json "$OUT/decode_attention_max_len.json" 2>&1 | tee "$OUT/decode_attention_max_len.log" || rc=1
  if [[ -s .devkit/sel.txt ]]; then gpu_pytest "${SEL_LIMIT:-150}" gpu_tests_selected.log $(cat .devkit/sel.txt); fi
  timeout 200 python3 bench/bench_moe.py --shapes nemotron-nano --no-peer --no-eager --context-buckets-ab \
      --batches 1 8 --gen-batches 1 --prompt 2048 --max-model-len 8256 --out "$OUT/ctx8k" --time-budget 190 2>&1 | tee "$OUT/bench_moe_ctx8k.log" \
      | grep -E "tok/s|rror" | cut -c1-200 || rc=1
  timeout 150 python3 bench/bench_moe.py --shapes nemotron-nano --no-peer --no-eager --context-buckets-ab \
      --batches 1 8 --gen-batches 1 --prompt 2048 --max-model-len 131072 --out "$OUT/ctx128k" --time-budget 140 2>&1 \
      | tee "$OUT/bench_moe_ctx128k.log" | grep -E "tok/s|rror" | cut -c1-200 || rc=1
fi
if [[ $what == moe-pdl ]]; then
  timeout 545 python3 bench/bench_moe.py --shapes nemotron-nano granite-tiny --no-peer --no-eager --profile --pdl-ab --linear-ab --norm-router-ab --all-ab --logits-ab \
      --gen-batches 1 --out "$OUT" --time-budget 520 2>&1 | tee "$OUT/bench_moe_pdl.log" || rc=1
fi
# throughput  bench_throughput.py: offline LLM.generate throughput of a checkpoint saved from the shape
#            ${2:-nemotron-h-8b} with transformers (built on the GPU, saved sharded to /tmp, reused while the
#            machine stays warm), 256 x (1024 in, 257 out), max_num_seqs 256, 8192 batched tokens, bf16 SSM
#            state, greedy, the same batch twice (first after startup vs second); startup and the
#            prefill / decode / host split and each run's Triton compiles in the JSON, the disk's read speed
#            and the cold load (--cold-load), then a second start of the same checkpoint with a small first
#            batch, then (8B shape) the synthetic device step at the offline decode's mean context. --sampled-ab:
#            the same batch sampled (top-p / top-k / min-p, per-request seeds) against greedy.
#            `throughput nemotron-nano-9b-v2` for the Nano shape
#            (64 x (1024, 129), as in issue 15). ~4-6 minutes on a fresh machine (most of it JIT at startup)
if [[ $what == throughput ]]; then
  shape=${2:-nemotron-h-8b}
  if [[ $shape == nemotron-nano-9b-v2 ]]; then n=64; olen=129; else n=256; olen=257; fi
  timeout 460 python3 bench/bench_throughput.py --shape "$shape" --num-prompts $n --input-len 1024 --output-len $olen \
      --max-num-seqs 256 --max-num-batched-tokens 8192 --mamba-ssm-dtype bfloat16 --repeat 2 --cold-load --sampled-ab \
      --json "$OUT/throughput_$shape.json" 2>&1 | tee "$OUT/throughput_$shape.log" | grep -v -E "^Loading|^Capturing" || rc=1
  # a second start on the same machine (JIT caches on disk, files in the page cache) and its first batch
  timeout 90 python3 bench/bench_throughput.py --shape "$shape" --num-prompts 16 --input-len 128 --output-len 16 \
      --max-num-seqs 256 --max-num-batched-tokens 8192 --mamba-ssm-dtype bfloat16 \
      --json "$OUT/throughput_second_start_$shape.json" 2>&1 | grep -v -E "^Loading|^Capturing" | tail -6 || rc=1
  # the synthetic device step at batch $n and the offline decode's mean context (input + half the output):
  # the offline decode phase against the device-step rate (issue 15: within 5%)
  if [[ $shape == nemotron-h-8b ]]; then
    timeout 120 python3 bench/bench_decode.py --no-eager --no-prefill --ssm-dtype bfloat16 --batches $n \
        --ctx $((1024 + olen / 2)) --json "$OUT/decode_step_at_offline_ctx.json" 2>&1 | grep -v Warn | tail -4 || rc=1
  fi
fi
# serving  bench_serving.py: `hybrid serve` on 127.0.0.1 driven by the openai client (streamed completions,
#            1024 in / 256 out) at concurrency 1, 8, 64, 256, then the offline LLM.generate figure per level in
#            a second process; JSON, server log and serving_throughput.png (matplotlib is on the device image)
#            in $OUT/serving. The device image has no openai / fastapi / uvicorn: carry their wheels in
#            .whl/serve (made on the dev machine, ~6 MB, see BENCHMARKS.md), installed here into /tmp/serve_site.
#            ~5-8 minutes on a fresh machine (two startups)
if [[ $what == serving ]]; then
  shape=${2:-nemotron-h-8b}
  if ! python3 -c "import openai, fastapi, uvicorn" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/serve_site \
        .whl/serve/*.whl && export PYTHONPATH=/tmp/serve_site${PYTHONPATH:+:$PYTHONPATH}
  fi
  timeout 555 python3 bench/bench_serving.py --shape "$shape" --concurrency 1 8 64 256 --input-len 1024 \
      --output-len 256 --max-num-batched-tokens 8192 --mamba-ssm-dtype bfloat16 --startup-timeout 300 \
      --level-timeout 150 --time-budget 540 --out-dir "$OUT/serving" 2>&1 | tee "$OUT/serving.log" || rc=1
fi
exit $rc
