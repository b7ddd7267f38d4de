"""The fused MoE layer alone (hybrid/ops/triton_moe.py) on the GPU: each candidate kernel configuration,
and torch._grouped_mm as the alternative, timed by CUDA-graph replay (as decode runs it) at the expert
shapes of Nemotron-3-Nano-30B-A3B, Granite-4.0-H-Tiny and Granite-4.0-H-Small, next to the floor:
decode rows by the bytes of the experts the batch touches over the copy bandwidth, prefill rows by
their FLOPs over the bf16 matmul rate (both measured in the same run).

Decode rows also time (first GEMM, second GEMM) pairs of configurations and the model's own default
(config=None, whose column tiles narrow at few programs). --kernel-profile prints each kernel's
time in the default's replay (torch profiler). --no-sweep: the default alone.

Usage: python bench/bench_moe_kernels.py [--tokens 1 8 64 256 8192] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_decode import copy_bandwidth  # noqa: E402

# (E, top_k, hidden, expert width, gated)
SHAPES = {"nemotron3_nano": (128, 6, 2688, 1856, False), "granite4_tiny": (64, 6, 1536, 512, True),
          "granite4_small": (72, 10, 4096, 768, True)}
DECODE_CONFIGS = [(16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3), (16, 128, 128, 1, 4, 4),
                  (16, 64, 64, 1, 4, 6), (16, 32, 256, 1, 4, 4), (32, 64, 128, 1, 4, 4),
                  # narrower and thinner tiles for the few-pair steps (batch 1: 8 blocks; gemm 1 has 128
                  # programs at BLOCK_N 32, under one per SM): within 3% of the default (2026-12-02)
                  (16, 16, 128, 1, 4, 4), (16, 16, 256, 1, 4, 4), (16, 32, 128, 1, 2, 4), (16, 16, 128, 1, 2, 6),
                  # more loads in flight a program (8 warps), and whole short K in one or two steps (Granite's
                  # second GEMM has K = 512): not measured yet
                  (16, 64, 128, 1, 8, 4), (16, 128, 128, 1, 8, 4), (16, 64, 256, 1, 8, 3), (16, 32, 512, 1, 4, 1),
                  (16, 64, 512, 1, 8, 1), (16, 32, 256, 1, 4, 2)]
PREFILL_CONFIGS = [(64, 128, 64, 8, 4, 3), (128, 128, 64, 8, 8, 3), (64, 64, 64, 8, 4, 4), (128, 64, 64, 8, 4, 3),
                   (128, 256, 64, 8, 8, 3), (64, 128, 128, 8, 4, 3)]


def matmul_tflops(dev) -> float:
    import triton.testing

    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=200, return_mode="median")
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


def graph_ms(fn) -> float:
    import triton.testing

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=20, rep=100, return_mode="median")


def grouped_mm_experts(x, w_up, w_down, top_idx, top_w, gated):
    """torch._grouped_mm over the pairs sorted by expert (no padding)."""
    E = w_up.shape[0]
    k = top_idx.shape[1]
    flat = top_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    tok = order // k
    h = torch._grouped_mm(x[tok], w_up.transpose(1, 2), offs=offs)
    if gated:
        g, u = h.chunk(2, dim=-1)
        h = torch.nn.functional.silu(g) * u
    else:
        h = torch.relu(h).square()
    y = torch._grouped_mm(h, w_down.transpose(1, 2), offs=offs) * top_w.reshape(-1)[order, None].to(h.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)


def print_kernel_profile(fn, label: str, replays: int = 20) -> None:
    """Per-kernel device time (us per replay) of fn captured in a graph, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    print(f"  kernels of {label} (us per replay):")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            print(f"      {e.key[:70]:70s} {e.device_time_total / replays:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 8192])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--kernel-profile", action="store_true", help="each kernel's time in the default's replay")
    ap.add_argument("--fp8", action="store_true",
                    help="also the model's default with FP8 experts (e4m3, per-row scales: half the bytes)")
    ap.add_argument("--no-sweep", action="store_true",
                    help="only the model's default configuration, no candidate sweep")
    args = ap.parse_args()
    from hybrid.ops import triton_moe, triton_moe_align
    from hybrid.tools.quantize_fp8 import quantize_weight

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    tflops = matmul_tflops(dev)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
    rows = []
    for name in args.shapes:
        E, k, H, inter, gated = SHAPES[name]
        g = torch.Generator(device=dev).manual_seed(0)
        w_up = (torch.randn(E, 2 * inter if gated else inter, H, generator=g, device=dev) / H ** 0.5).bfloat16()
        w_down = (torch.randn(E, H, inter, generator=g, device=dev) / inter ** 0.5).bfloat16()
        expert_bytes = (w_up[0].numel() + w_down[0].numel()) * 2
        for T in args.tokens:
            x = torch.randn(T, H, device=dev, generator=g).bfloat16()
            top_idx = torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1)[1]
            top_w = torch.rand(T, k, device=dev, generator=g)
            touched = int(torch.unique(top_idx).numel())
            bytes_ms, compute_ms = touched * expert_bytes / bw * 1e3, 2 * T * k * expert_bytes / 2 / (tflops * 1e12) * 1e3
            floor_ms = max(bytes_ms, compute_ms)
            ref = triton_moe.fused_experts(x, w_up, w_down, top_idx, top_w, gated)
            res = {"shape": name, "tokens": T, "experts_touched": touched, "floor_ms": floor_ms}
            configs = DECODE_CONFIGS if T * k <= triton_moe_align.TRITON_ALIGN_MAX_PAIRS else PREFILL_CONFIGS
            default = (triton_moe.decode_tuned(T * k, E, H, inter, gated)
                       or triton_moe.CONFIGS[triton_moe.pick_config(T * k, E, gated)])
            timings = {}
            sweep = [] if args.no_sweep else [c for c in configs if c != default]
            candidates = [default] + sweep
            if T * k <= triton_moe_align.TRITON_ALIGN_MAX_PAIRS and not args.no_sweep:
                # per-GEMM pairs: each candidate for the first GEMM with the default second, and the
                # default first with each candidate second (same BLOCK_M: the alignment's)
                up0, down0 = triton_moe.gemm_configs(default)
                candidates += [(c, down0) for c in configs if c[0] == up0[0] and c != up0]
                candidates += [(up0, c) for c in configs if c[0] == up0[0] and c != down0]
            for cfg in candidates:
                try:
                    out = triton_moe.fused_experts(x, w_up, w_down, top_idx, top_w, gated, config=cfg)
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    ms = graph_ms(lambda: triton_moe.fused_experts(x, w_up, w_down, top_idx, top_w, gated, config=cfg))
                    timings[str(cfg)] = (ms, err)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    timings[str(cfg)] = (float("nan"), repr(e)[:80])
            # what the model runs: config=None (the default with its column narrowing at few programs)
            timings["model default (narrowed)"] = (
                graph_ms(lambda: triton_moe.fused_experts(x, w_up, w_down, top_idx, top_w, gated)), 0.0)
            if not args.no_sweep:
                try:
                    gm = grouped_mm_experts(x, w_up, w_down, top_idx, top_w, gated)
                    err = ((gm.float() - ref.float()).norm() / ref.float().norm()).item()
                    timings["torch._grouped_mm"] = (
                        graph_ms(lambda: grouped_mm_experts(x, w_up, w_down, top_idx, top_w, gated)), err)
                except Exception as e:  # noqa: BLE001
                    timings["torch._grouped_mm"] = (float("nan"), repr(e)[:80])
            if args.fp8:
                # FP8 experts as FP8 checkpoints load on CUDA (hybrid/moe.py Experts); their floor is half
                (up8, up_s), (down8, down_s) = (quantize_weight(w, True, torch.float32) for w in (w_up, w_down))
                up_s, down_s = up_s[..., 0], down_s[..., 0]  # [E, rows, 1] -> one scale per row
                out = triton_moe.fused_experts(x, up8, down8, top_idx, top_w, gated, up_scale=up_s, down_scale=down_s)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                ms = graph_ms(lambda: triton_moe.fused_experts(x, up8, down8, top_idx, top_w, gated, up_scale=up_s,
                                                               down_scale=down_s))
                timings["model default, FP8 experts"] = (ms, err)
                res["fp8_floor_ms"] = max(bytes_ms / 2, compute_ms)  # (bf16 MMAs: the widened weights)
                print(f"{name} T={T}: FP8 experts {ms:.4f} ms ({res['fp8_floor_ms'] / ms:.0%} of the FP8 floor "
                      f"{res['fp8_floor_ms']:.4f} ms), rel. error vs bf16 {err:.3g}", flush=True)
                del up8, down8
            res["timings"] = timings
            if args.kernel_profile:
                print_kernel_profile(lambda: triton_moe.fused_experts(x, w_up, w_down, top_idx, top_w, gated),
                                     f"{name} T={T} default")
            best = min((v[0], c) for c, v in timings.items() if v[0] == v[0])
            res["default_ms"] = timings[str(default)][0]
            res["best"] = best[1]
            res["best_ms"] = best[0]
            rows.append(res)
            print(f"{name} T={T}: touched {touched}/{E}, floor {floor_ms:.4f} ms; default {str(default)} "
                  f"{res['default_ms']:.4f} ms ({floor_ms / res['default_ms']:.0%} of floor); best {best[1]} "
                  f"{best[0]:.4f} ms", flush=True)
            for c, (ms, err) in sorted(timings.items(), key=lambda kv: kv[1][0] if kv[1][0] == kv[1][0] else 1e9):
                print(f"    {c:60s} {ms:8.4f} ms  err {err}")
        del w_up, w_down
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw_gbs": bw / 1e9, "matmul_tflops": tflops, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
