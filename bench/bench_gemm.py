"""Decode-sized projections of the Nemotron-H-8B-shaped model: cuBLAS (F.linear) vs our weight-streaming
Triton matmul (hybrid/ops/triton_gemm.py), bf16, on the GPU.

    python3 bench/bench_gemm.py [--batches 1 8 32 64] [--sweep]

Each measurement replays a CUDA graph of calls that cycle over 3 copies of the weight (each >= 32 MB,
so together they overflow L2) and reports us per call and % of the measured copy bandwidth
(weight bytes / time). --sweep also times a grid of (BLOCK_N, BLOCK_K, warps, stages) configs and
prints the best per shape, to choose triton_gemm.default_config from.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.ops import triton_gemm as tg  # noqa: E402

SHAPES = {  # name: (N, K)
    "mamba in_proj": (18560, 4096), "mamba out_proj": (4096, 8192), "mlp up": (21504, 4096),
    "mlp down": (4096, 21504), "attn qkv": (6144, 4096), "attn o": (4096, 4096), "lm_head": (131072, 4096),
}
SWEEP = [(bn, bk, nw, 4) for bn in (16, 32, 64) for bk in (256, 512) for nw in (4, 8)]


def copy_bandwidth() -> float:
    a = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - t)


def time_graph(fns, reps: int = 5) -> float:
    """us per call of fns (a list cycled through), replayed in one CUDA graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(4):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / (reps * 4 * len(fns)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(3)]
        nbytes = N * K * 2
        for M in args.batches:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
            ref = F.linear(x, ws[0])
            got = tg.skinny_matmul(x, ws[0])
            err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            t_cublas = time_graph([lambda w=w: F.linear(x, w) for w in ws])
            t_ours = time_graph([lambda w=w: tg.skinny_matmul(x, w) for w in ws])
            row = dict(shape=name, N=N, K=K, M=M, cublas_us=t_cublas, ours_us=t_ours,
                       cublas_bw=nbytes / (t_cublas * 1e-6) / bw, ours_bw=nbytes / (t_ours * 1e-6) / bw,
                       default=tg.default_config(M, N, K, x.device), rel_err=err)
            if args.sweep:
                best = None
                for cfg in SWEEP:
                    try:
                        t = time_graph([lambda w=w, cfg=cfg: tg.skinny_matmul(x, w, config=cfg) for w in ws], reps=3)
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a config
                        print(f"  {name} M={M} {cfg}: {type(e).__name__}")
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                row.update(best_us=best[0], best_cfg=best[1], best_bw=nbytes / (best[0] * 1e-6) / bw)
            rows.append(row)
            print(f"{name:15s} M={M:3d} cuBLAS {t_cublas:7.1f} us ({row['cublas_bw']:4.0%})  ours {t_ours:7.1f} us "
                  f"({row['ours_bw']:4.0%}) cfg {row['default']}"
                  + (f"  best {row['best_us']:7.1f} us ({row['best_bw']:4.0%}) {row['best_cfg']}" if args.sweep else "")
                  + f"  rel.err {err:.1e}", flush=True)
        del ws
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_bw=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
