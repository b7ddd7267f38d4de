"""The MoE router of a decode step alone: router logits + top-k routing for T tokens, at the real
router shapes (Nemotron-3-Nano: H 2688, E 128, fp32 router; Granite-4.0-H-Tiny: H 1536, E 64, bf16),
through hybrid.ops.triton_moe_route.route_hidden with several split-K tilings, against the GEMM + route
path (what steps of more than ROUTER_FUSED_MAX_TOKENS tokens use). Kernel time by
triton.testing.do_bench (L2 flushed between runs, as in a real step where the router weight is cold).

    python3 bench/bench_router.py [--time-limit S]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=40.0)
    args = ap.parse_args()
    import triton.testing

    from hybrid.ops import triton_moe_route as tm

    start = time.time()
    shapes = [("nemotron-nano", 2688, 128, 6, torch.float32, True), ("granite-tiny", 1536, 64, 6, torch.bfloat16, False)]
    tilings = [(32, 128, 8), (16, 128, 64), (16, 64, 64), (32, 64, 64), (8, 64, 64)]  # (BLOCK_E, BLOCK_K, max splits)
    for name, H, E, k, dtype, sigmoid in shapes:
        w = torch.randn(E, H, device="cuda").to(dtype) * H ** -0.5
        bias = torch.randn(E, device="cuda") * 0.1 if sigmoid else None
        for T in (1, 8):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            kw = dict(logits_dtype=dtype, sigmoid=sigmoid, bias=bias, num_shared=2)
            gemm = lambda: tm.route(torch.nn.functional.linear(x.to(dtype), w), k, sigmoid=sigmoid, bias=bias,
                                    num_shared=2)
            row = [f"{name} T={T}: gemm+route {triton.testing.do_bench(gemm) * 1e3:.1f} us"]
            for be, bk, sp in tilings:
                if time.time() - start > args.time_limit:
                    break
                tm._ROUTER_BLOCK_E, tm._ROUTER_BLOCK_K, tm._ROUTER_SPLITS = be, bk, sp
                us = triton.testing.do_bench(lambda: tm.route_hidden(x, w, k, **kw)) * 1e3
                row.append(f"fused {be}x{bk}/{sp} {us:.1f} us")
            print("; ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
