"""FP8 projections alone at decode sizes, Nemotron-H-8B shapes: bf16 cuBLAS against the FP8 paths of
hybrid/fp8_linear.py Fp8Linear with dynamic per-token activation scales and per-channel weight scales
(the `--fp8 pcpt` scheme of bench_decode.py):
- `triton`: the one-launch FP8 linear (hybrid/ops/triton_fp8.py fp8_small_m_linear; M <= 16), best
  of a few tilings (printed with it), and its default tiling;
- `scaled_mm`: the Triton row quantization and torch._scaled_mm (Fp8Linear.forward_scaled_mm);
- `torch_quant`: the per-token scale and the e4m3 rounding in torch ops, then torch._scaled_mm (what
  Fp8Linear ran before the Triton kernels);
- `gemv` (M <= 4): quantize_rows, then triton_fp8.fp8_gemv (a weight-streaming reduction without
  tl.dot; HYBRID_FP8_DECODE_GEMM=gemv), its default tiling with the quantization, and the kernel's
  best tiling alone;
- `scaled_mm_tensorwise_gemm`: torch._scaled_mm alone with per-tensor scales (a different cuBLASLt
  kernel from the row-wise one), and `quantize_rows` alone.

Each timing is one CUDA graph of back-to-back calls over distinct weight copies (>= 256 MB in all, so
the weights stream from HBM), divided by the number of calls; the bandwidth is weight bytes over
time. Each result is checked against the exact product of its e4m3 operands (relative error).

    python3 bench/bench_fp8_gemv.py [--json out.json] [--time-limit 120]
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

SHAPES = {  # (N, K) of each projection of the 8B shape (bench_decode.py CONFIG)
    "mamba.in_proj": (2 * 8192 + 2 * 8 * 128 + 128, 4096),
    "mamba.out_proj": (4096, 8192),
    "attn.qkv_proj": (32 * 128 + 2 * 8 * 128, 4096),
    "attn.o_proj": (4096, 32 * 128),
    "mlp.up_proj": (21504, 4096),
    "mlp.down_proj": (4096, 21504),
}
ROWS = (1, 4, 8, 16, 64)
TILINGS = [dict(block_n=bn, block_k=bk, num_warps=4, num_stages=s)
           for bn, bk, s in itertools.product((16, 32, 64), (128, 256, 512), (4,))]
GEMV_TILINGS = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=4)
                for bn, bk, w in itertools.product((8, 16, 32), (128, 256, 512), (4, 8))]


def _torch_quant_scaled_mm(layer, x):
    from hybrid.fp8_linear import per_token_scale
    from hybrid.quantization import FP8_DTYPE

    s = per_token_scale(x)
    xq = (x.float() / s).clamp(-448, 448).to(FP8_DTYPE)
    return torch._scaled_mm(xq, layer.weight.t(), scale_a=s, scale_b=layer._scale_b_row, out_dtype=torch.bfloat16)


def _best_tiling(tilings: list[dict], call, layers) -> tuple[float, dict] | None:
    """(us per call, tiling) of the fastest tiling of call(layer, tiling) over the weight copies;
    None if the compiler refused them all (each refusal printed)."""
    best = None
    for cfg in tilings:
        try:
            us = graph_us_per_call([lambda l=l, c=cfg: call(l, c) for l in layers])
        except Exception as e:  # noqa: BLE001 - a tiling the compiler refuses is skipped
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        if best is None or us < best[0]:
            best = (us, cfg)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--time-limit", type=float, default=120.0)
    args = ap.parse_args()
    from hybrid.fp8_linear import Fp8Linear
    from hybrid.ops import triton_fp8
    from hybrid.quantization import DYNAMIC, FP8_DTYPE

    t0 = time.time()
    dev = torch.device("cuda")
    rows_out = []
    for proj, (n, k) in SHAPES.items():
        if time.time() - t0 > args.time_limit:
            print("time limit reached", flush=True)
            break
        copies = max(4, -(-(256 << 20) // (n * k)))
        layers = []
        for _ in range(copies):
            w = torch.randn(n, k, device=dev) * k ** -0.5
            scale = (w.abs().amax(-1) / 448).float()
            layers.append(Fp8Linear((w / scale[:, None]).clamp(-448, 448).to(FP8_DTYPE), scale, None, DYNAMIC, None))
        bf16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(max(4, copies // 2))]
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            lay = layers[0]
            s = x.float().abs().amax(-1, keepdim=True) / 448
            exact = F.linear(((x.float() / s).clamp(-448, 448).to(FP8_DTYPE).double() * s.double()),
                             lay.weight.double() * lay.weight_scale.double()[:, None])

            def err(got):
                return ((got.double() - exact).norm() / exact.norm()).item()

            row = {"proj": proj, "N": n, "K": k, "M": m, "fp8_mb": n * k / 1e6}
            row["bf16_cublas_us"] = graph_us_per_call([lambda w=w: torch.matmul(x, w.t()) for w in bf16])
            row["scaled_mm_us"] = graph_us_per_call([lambda l=l: l.forward_scaled_mm(x) for l in layers])
            row["scaled_mm_err"] = err(lay.forward_scaled_mm(x))
            row["torch_quant_us"] = graph_us_per_call([lambda l=l: _torch_quant_scaled_mm(l, x) for l in layers])
            # per-tensor scales on both operands (cuBLASLt's tensor-wise kernel, not the row-wise one):
            # the quantization is timed apart, the GEMM alone here
            xq, _ = triton_fp8.quantize_rows(x)
            one = torch.ones((), device=dev)
            row["scaled_mm_tensorwise_gemm_us"] = graph_us_per_call([lambda l=l: torch._scaled_mm(
                xq, l.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16) for l in layers])
            row["quantize_rows_us"] = graph_us_per_call([lambda: triton_fp8.quantize_rows(x)] * 8)
            if m <= triton_fp8.MAX_ROWS:
                row["triton_default_us"] = graph_us_per_call([lambda l=l: l.forward_small_m(x) for l in layers])
                row["triton_err"] = err(lay.forward_small_m(x))
                best = _best_tiling(TILINGS, lambda l, c: triton_fp8.fp8_small_m_linear(
                    x, l.weight, l.weight_scale, triton_fp8.ACT_DYNAMIC, **c), layers)
                if best is not None:
                    row.update(triton_best_us=best[0], triton_best_cfg=best[1])
            if m <= triton_fp8.GEMV_MAX_ROWS:
                row["gemv_us"] = graph_us_per_call([lambda l=l: l.forward_gemv(x) for l in layers])
                row["gemv_err"] = err(lay.forward_gemv(x))
                xq, xs = triton_fp8.quantize_rows(x)
                best = _best_tiling(GEMV_TILINGS, lambda l, c: triton_fp8.fp8_gemv(
                    xq, xs, l.weight, l.weight_scale, **c), layers)
                if best is not None:
                    row.update(gemv_kernel_best_us=best[0], gemv_kernel_best_cfg=best[1])
            for key in ("bf16_cublas", "scaled_mm", "torch_quant", "scaled_mm_tensorwise_gemm", "triton_default",
                        "triton_best", "gemv", "gemv_kernel_best"):
                if f"{key}_us" in row:
                    mb = n * k * (2 if key == "bf16_cublas" else 1) / 1e6
                    row[f"{key}_tb_s"] = mb / row[f"{key}_us"]
            rows_out.append(row)
            print(json.dumps({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in row.items()}), flush=True)
        del layers, bf16
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
