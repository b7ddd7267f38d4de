"""The FP8 projections of a decode step alone (Nemotron-H-8B shapes, 64 rows by default): cuBLASLt's
tensor-wise FP8 GEMM against the split-K Triton GEMM (hybrid/ops/triton_fp8.py fp8_splitk_gemm) over a sweep of
its tilings, each followed by the scales' launch (scale_accumulator, which also adds the split-K partials), and as
one launch (fp8_splitk_linear: each column tile's last program sums and scales).

Why: in the 8B model at batch 64 the split-K GEMM lost 2.4% against cuBLASLt (BENCHMARKS.md, 2026-12-06): its 56
launches streamed the weights at ~2.1 TB/s and the partials' pass cost more than it saved. This says, per
projection and row count, which tiling streams fastest and whether any beats cuBLASLt with the pass included.

Each timing is one CUDA graph of back-to-back calls over distinct weight copies (>= 256 MB in all, so the weights
stream from HBM), divided by the number of calls; TB/s is the e4m3 weight bytes over that time. Each result is
checked against the exact product of the e4m3 operands.

    python3 bench/bench_fp8_splitk.py [--rows 8 64] [--json out.json] [--time-limit 150]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.cuda_timing import graph_us_per_call  # noqa: E402

SHAPES = {  # (N, K) of the 8B shape's projections, in the order they matter at batch 64 (the profile's time):
    # N 4096 (cuBLASLt: 29-43 programs), then the wide ones (tiles of 96 / 144 columns: 1.5 waves of 132 SMs)
    "mamba.out_proj": (4096, 8192),
    "mlp.down_proj": (4096, 21504),
    "mamba.in_proj": (2 * 8192 + 2 * 8 * 128 + 128, 4096),
    "mlp.up_proj": (21504, 4096),
    "attn.qkv_proj": (6144, 4096),
    "attn.o_proj": (4096, 4096),
}
# (block_n, block_k, num_warps, num_stages, programs): the kernel's tiles and how many programs its splits aim for
# (the wide projections split only at the larger targets)
_TILES = [(64, 128, 4), (64, 256, 4), (128, 128, 4), (128, 128, 8)]
SWEEP = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st, programs=p)
         for (bn, bk, w), st, p in itertools.product(_TILES, (3, 5), (264, 528, 1056))]
SWEEP += [dict(block_n=128, block_k=256, num_warps=8, num_stages=3, programs=p) for p in (264, 528, 1056)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[64])
    ap.add_argument("--json", default=None)
    ap.add_argument("--time-limit", type=float, default=150.0)
    ap.add_argument("--dry-run", action="store_true", help="print the sweep and exit (no GPU)")
    args = ap.parse_args()
    if args.dry_run:
        print(json.dumps({"shapes": SHAPES, "sweep": SWEEP, "rows": args.rows}))
        return 0
    from hybrid.ops import triton_fp8
    from hybrid.quantization import FP8_DTYPE

    t0 = time.time()
    dev = torch.device("cuda")
    one = torch.ones((), device=dev)
    results = []
    for proj, (n, k) in SHAPES.items():
        copies = max(4, -(-(256 << 20) // (n * k)))
        weights, scales = [], []
        for _ in range(copies):
            w = torch.randn(n, k, device=dev) * k ** -0.5
            s = (w.abs().amax(-1) / 448).float()
            weights.append((w / s[:, None]).clamp(-448, 448).to(FP8_DTYPE))
            scales.append(s)
        for m in args.rows:
            if time.time() - t0 > args.time_limit:
                print("time limit reached", flush=True)
                break
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = triton_fp8.quantize_rows(x)
            exact = F.linear(xq.double() * xs.double(), weights[0].double() * scales[0].double()[:, None])

            def err(got):
                return ((got.double() - exact).norm() / exact.norm()).item()

            def cublas(w, s):
                acc = torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
                return triton_fp8.scale_accumulator(acc, xs, s, None, out_dtype=torch.bfloat16)

            row = {"proj": proj, "N": n, "K": k, "M": m, "fp8_mb": n * k / 1e6}
            row["cublas_us"] = graph_us_per_call([lambda w=w, s=s: cublas(w, s) for w, s in zip(weights, scales)])
            row["cublas_err"] = err(cublas(weights[0], scales[0]))
            row["cublas_gemm_us"] = graph_us_per_call([lambda w=w: torch._scaled_mm(
                xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32) for w in weights])
            best = None
            for cfg in SWEEP:
                if k % cfg["block_k"]:
                    continue
                if time.time() - t0 > args.time_limit:
                    row["sweep_cut"] = True  # (the rest of the sweep did not fit the time limit)
                    break
                kw = {key: v for key, v in cfg.items() if key != "programs"}
                splits = triton_fp8.splitk_splits(n, k, cfg["block_n"], cfg["block_k"], cfg["programs"])

                def splitk(w, s, kw=kw, splits=splits):
                    parts = triton_fp8.fp8_splitk_gemm(xq, w, splits, **kw)
                    return triton_fp8.scale_accumulator(parts, xs, s, None, out_dtype=torch.bfloat16)

                def fused(w, s, kw=kw, splits=splits):
                    return triton_fp8.fp8_splitk_linear(xq, xs, w, s, None, splits=splits, **kw)

                try:
                    us = graph_us_per_call([lambda w=w, s=s: splitk(w, s) for w, s in zip(weights, scales)])
                    fused_us = graph_us_per_call([lambda w=w, s=s: fused(w, s) for w, s in zip(weights, scales)])
                    gemm_us = graph_us_per_call([lambda w=w: triton_fp8.fp8_splitk_gemm(xq, w, splits, **kw)
                                                 for w in weights])
                    e = err(splitk(weights[0], scales[0]))
                    same = torch.equal(fused(weights[0], scales[0]), splitk(weights[0], scales[0]))
                except Exception as exc:  # (a tiling past the shared memory of an SM: named, the sweep goes on)
                    print(f"{proj} M={m} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                entry = dict(cfg, splits=splits, us=us, fused_us=fused_us, fused_equal=same, gemm_us=gemm_us,
                             gemm_tb_s=n * k / 1e6 / gemm_us, err=e)
                row.setdefault("splitk", []).append(entry)
                if best is None or min(us, fused_us) < min(best["us"], best["fused_us"]):
                    best = entry
            row["splitk_best"] = best
            row["cublas_gemm_tb_s"] = n * k / 1e6 / row["cublas_gemm_us"]
            results.append(row)
            if args.json:  # (after every row: a run cut by its caller's timeout keeps what it measured)
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
            b = best or {}
            print(f"{proj} M={m}: cublas {row['cublas_us']:.1f} us (GEMM {row['cublas_gemm_us']:.1f}, "
                  f"{row['cublas_gemm_tb_s']:.2f} TB/s) | split-K best {b.get('us', float('nan')):.1f} us, one launch "
                  f"{b.get('fused_us', float('nan')):.1f} us (equal {b.get('fused_equal')}) "
                  f"(GEMM {b.get('gemm_us', float('nan')):.1f}, {b.get('gemm_tb_s', float('nan')):.2f} TB/s, err "
                  f"{b.get('err', float('nan')):.1e}) {({key: b[key] for key in ('block_n', 'block_k', 'num_warps', 'num_stages', 'splits')} if b else '')}",
                  flush=True)
        del weights, scales
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
