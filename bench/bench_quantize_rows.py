"""triton_fp8.quantize_rows alone at prefill and decode sizes (the 8B shape's FP8 projections' inputs): its time
and bandwidth (16-bit rows read, e4m3 rows and scales written) at the default tiling and at other warps / tile
widths, next to a plain copy of the same rows (torch's clone: the bytes' floor on this card). In the 8K-prefill
profile of the 8B shape in FP8 its 104 launches took 10.7 ms of 134 (H200): this says whether that is its bytes.

    python3 bench/bench_quantize_rows.py [--json out.json] [--rows 8192 64]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.cuda_timing import graph_us_per_call  # noqa: E402

# (name, K of the projection, the activation quantize_rows applies, launches a step of the 8B shape)
INPUTS = [("in_proj / qkv / up_proj input", 4096, None, 52), ("o_proj input", 4096, None, 4),
          ("out_proj input", 8192, None, 24), ("down_proj input, relu2 inside", 21504, "relu2", 24),
          ("down_proj input", 21504, None, 0), ("SwiGLU down_proj input (K 4096)", 4096, "silu_and_mul", 0)]
VARIANTS = [dict(), dict(num_warps=4), dict(num_warps=8), dict(num_warps=16), dict(block_k=2048, num_warps=4),
            dict(block_k=4096, num_warps=8)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[8192, 64])
    args = ap.parse_args()
    from hybrid.ops import triton_fp8

    dev = torch.device("cuda")
    results = []
    for M in args.rows:
        for name, K, act, launches in INPUTS:
            width = 2 * K if act == "silu_and_mul" else K
            copies = max(1, (256 << 20) // (M * width * 2))  # distinct inputs past the L2
            xs = [torch.randn(M, width, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            moved = M * width * 2 + M * K + M * 4
            clone_us = graph_us_per_call([lambda x=x: x.clone() for x in xs])
            row = {"rows": M, "input": name, "K": K, "act": act, "launches_a_step": launches,
                   "bytes": moved, "clone_us": clone_us, "clone_gb_s": M * width * 4 / clone_us / 1e3}
            line = f"M {M:5d} {name:36s} clone {clone_us:8.1f} us ({row['clone_gb_s']:6.0f} GB/s) |"
            for v in VARIANTS:
                if v.get("block_k", 0) >= triton_fp8.triton.next_power_of_2(K):
                    continue
                try:
                    us = graph_us_per_call([lambda x=x: triton_fp8.quantize_rows(x, act=act, **v) for x in xs])
                except Exception as e:  # noqa: BLE001 - a variant that does not compile: say so, go on
                    print(f"  {v}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                key = ",".join(f"{k}={x}" for k, x in v.items()) or "default"
                row[key] = us
                line += f" {key} {us:7.1f} us ({moved / us / 1e3:5.0f} GB/s)"
            print(line, flush=True)
            results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
