"""Decode-sized projections alone: cuBLAS (torch F.linear, bf16) against hybrid/ops/triton_gemv.py's
one-launch small-M linear, at the dense projection shapes of the MoE hybrids and the 8B shape, for
M = 1, 2, 4, 8, 16 rows (decode batches).

Each timing is one CUDA graph of back-to-back calls over distinct weight copies (>= 256 MB in all, so
the weights stream from HBM as in a real step, not from L2), divided by the number of calls. The
Triton column is the best of a small grid of tilings (printed with it); the bandwidth is weight bytes
over time. Also checks each Triton result against cuBLAS (relative error).

    python3 bench/bench_gemv.py [--json out.json] [--time-limit 150]
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

from bench.cuda_timing import graph_us_per_call  # noqa: E402

# (model, projection): (N, K)
SHAPES = {
    ("nemotron-nano", "mamba.in_proj"): (2 * 4096 + 2 * 8 * 128 + 64, 2688),
    ("nemotron-nano", "mamba.out_proj"): (2688, 4096),
    ("nemotron-nano", "attn.qkv"): ((32 + 2 * 2) * 128, 2688),
    ("granite-tiny", "mamba.in_proj"): (2 * 3072 + 2 * 128 + 48, 1536),
    ("granite-tiny", "mamba.out_proj"): (1536, 3072),
    ("granite-tiny", "attn.qkv"): ((12 + 2 * 4) * 128, 1536),
    ("granite-tiny", "attn.o_proj"): (1536, 1536),
    ("nemotron-h-8b", "mamba.out_proj"): (4096, 8192),
    ("nemotron-h-8b", "mlp.up_proj"): (21504, 4096),
}
ROWS = (1, 2, 4, 8, 16)
TILINGS = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
           for bn, bk, w, s in itertools.product((16, 32, 64), (128, 256), (4,), (4,))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--time-limit", type=float, default=150.0)
    args = ap.parse_args()
    from hybrid.ops.triton_gemv import small_m_linear

    t0 = time.time()
    dev = torch.device("cuda")
    rows_out = []
    for (model, proj), (n, k) in SHAPES.items():
        if time.time() - t0 > args.time_limit:
            print("time limit reached", flush=True)
            break
        nbytes = n * k * 2
        copies = max(4, -(-(256 << 20) // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in ws]
            cublas = graph_us_per_call([lambda w=w, o=o: torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)])
            ref = torch.nn.functional.linear(x.float(), ws[0].float())
            best = None
            for cfg in TILINGS:
                try:
                    got = small_m_linear(x, ws[0], **cfg)
                    err = ((got.float() - ref).norm() / ref.norm()).item()
                    us = graph_us_per_call([lambda w=w, o=o, c=cfg: small_m_linear(x, w, out=o, **c) for w, o in zip(ws, outs)])
                except Exception as e:  # noqa: BLE001 - a tiling the compiler refuses is skipped
                    print(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg, err)
            row = {"model": model, "proj": proj, "N": n, "K": k, "M": m, "mb": nbytes / 1e6,
                   "cublas_us": cublas, "cublas_tb_s": nbytes / cublas / 1e6}
            if best is not None:
                row.update(triton_us=best[0], triton_tb_s=nbytes / best[0] / 1e6, triton_cfg=best[1],
                           triton_rel_err=best[2], speedup=cublas / best[0])
            rows_out.append(row)
            print(json.dumps({k2: (round(v, 3) if isinstance(v, float) else v) for k2, v in row.items()}), flush=True)
        del ws
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
