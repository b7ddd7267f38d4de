"""The Nemotron-H-8B-shaped model's projections (bf16 F.linear) under torch's two BLAS back ends,
cuBLAS and cuBLASLt, at decode and prefill batch sizes, on the GPU.

    python3 bench/bench_gemm.py [--batches 1 8 64 256 8192]

Each measurement replays a CUDA graph of calls that cycle over enough copies of the weight to
overflow L2 (>= 160 MB), and reports us per call, % of the measured copy bandwidth (weight bytes /
time) and TFLOP/s. It tells which back end `LLM(blas=...)` should default to.
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

from bench.bench_decode import copy_bandwidth  # noqa: E402

SHAPES = {  # name: (N, K)
    "mamba in_proj": (18560, 4096), "mamba out_proj": (4096, 8192), "mlp up": (21504, 4096),
    "mlp down": (4096, 21504), "attn qkv": (6144, 4096), "attn o": (4096, 4096), "lm_head": (131072, 4096),
}
BACKENDS = ("cublas", "cublaslt")


def time_graph(fns, reps: int = 5) -> float:
    """us per call of fns (a list cycled through), replayed in one CUDA graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(2):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / (reps * 2 * len(fns)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256, 8192])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s  torch {torch.__version__}")
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    totals = {(b, M): 0.0 for b in BACKENDS for M in args.batches}
    counts = {"mamba in_proj": 24, "mamba out_proj": 24, "mlp up": 24, "mlp down": 24, "attn qkv": 4,
              "attn o": 4, "lm_head": 1}
    for name, (N, K) in SHAPES.items():
        nbytes = N * K * 2
        copies = max(1, -(-160 * 2**20 // nbytes))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
        for M in args.batches:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
            outs = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in ws]
            line = f"{name:15s} M={M:5d}"
            ref = None
            for backend in BACKENDS:
                torch.backends.cuda.preferred_blas_library(backend)
                fns = [lambda w=w, o=o: torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)]
                us = time_graph(fns)
                got = F.linear(x, ws[0]).float()
                if ref is None:
                    ref = got
                err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                tflops = 2 * M * N * K / us / 1e6
                pct = nbytes / (us * 1e-6) / bw * 100
                totals[(backend, M)] += us * counts[name]
                line += f"  {backend:8s} {us:8.1f} us ({pct:4.0f}% bw, {tflops:5.0f} TF/s, err {err:.0e})"
                rows.append({"shape": name, "M": M, "backend": backend, "us": us, "pct_bw": pct, "tflops": tflops})
            print(line, flush=True)
        del ws
        torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library("cublas")
    print("per decode step (24 in/out/up/down, 4 qkv/o, lm_head), ms:")
    for M in args.batches:
        print(f"  M={M:5d}  " + "  ".join(f"{b} {totals[(b, M)] / 1e3:7.3f}" for b in BACKENDS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
