"""Does an L2 prefetch ahead of a decode-sized projection pay (hybrid/ops/triton_prefetch.py)?

At batch 1 the projections and expert GEMMs are latency-bound: cuBLAS moves Granite-4.0-H-Tiny's
9.4 MB Mamba out_proj at ~1.2 TB/s. This measures, in CUDA graphs over distinct weight copies (well
past the 50 MB L2, so each call streams from HBM as in a step):
- `cold`: the projection alone, after `SMALL` small kernels (a norm each, as a Mamba layer's conv, SSM
  update and gated norm come before its out_proj);
- `hot`: the same weight every call (L2-resident): the most a prefetch could give;
- `prefetch`: the weight's prefetch launched before the small kernels, then the projection;
- for the experts (Granite-Tiny's and Nemotron-Nano's shapes, one token, top-k): `cold`, and the
  chosen experts' rows prefetched (prefetch on the routing) before one small kernel, as the
  route kernel would.
Microseconds per (small kernels + projection), and the projection's weight bytes over that time.

    python3 bench/bench_l2_prefetch.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.cuda_timing import graph_us_per_call  # noqa: E402
from hybrid.ops import triton_moe, triton_norm, triton_prefetch  # noqa: E402

LINEARS = {
    "granite-tiny mamba.in_proj": (2 * 3072 + 2 * 128 + 48, 1536),
    "granite-tiny mamba.out_proj": (1536, 3072),
    "nemotron-nano mamba.in_proj": (2 * 4096 + 2 * 8 * 128 + 64, 2688),
    "nemotron-nano mamba.out_proj": (2688, 4096),
}
# (experts, hidden, width, gated, top_k)
EXPERTS = {"granite-tiny": (64, 1536, 512, True, 6), "nemotron-nano": (128, 2688, 1856, False, 6)}


def copies_for(nbytes: int, at_least: int = 512 << 20) -> int:
    return max(4, -(-at_least // nbytes))


def small_kernels(n: int, dev) -> list:
    x = torch.randn(1, 3072, device=dev, dtype=torch.bfloat16)
    w = torch.ones(3072, device=dev, dtype=torch.bfloat16)
    return [lambda: triton_norm.rms_norm(x, w, 1e-5, False) for _ in range(n)]


def bench_linear(name: str, n: int, k: int, small: int, dev, rows: int = 1) -> dict:
    nbytes = n * k * 2
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies_for(nbytes))]
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    pre = small_kernels(small, dev)
    out = {}
    for variant in ("cold", "hot", "prefetch", "prefetch_just_before"):
        calls = []
        for i, w in enumerate(ws):
            w = ws[0] if variant == "hot" else w
            table = triton_prefetch.region_table([w], [], dev)
            if variant == "prefetch":
                calls.append(lambda table=table: triton_prefetch.prefetch(table, nbytes))
            calls.extend(pre)
            if variant == "prefetch_just_before":
                calls.append(lambda table=table: triton_prefetch.prefetch(table, nbytes))
            calls.append(lambda w=w: F.linear(x, w))
        us = graph_us_per_call(calls, iters=20) * len(calls) / len(ws)
        out[variant] = dict(us=round(us, 2), tb_s=round(nbytes / us / 1e6, 2))
    print(f"{name} M={rows} ({nbytes / 1e6:.1f} MB, {small} small kernels before): "
          + ", ".join(f"{v} {r['us']} us ({r['tb_s']} TB/s)" for v, r in out.items()), flush=True)
    return out


def bench_experts(name: str, e: int, h: int, inter: int, gated: bool, top_k: int, dev) -> dict:
    width = 2 * inter if gated else inter
    per_copy = e * (width + inter) * h * 2
    copies = copies_for(per_copy, 1 << 30)
    ups = [torch.randn(e, width, h, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    downs = [torch.randn(e, h, inter, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    gen = torch.Generator(device="cpu").manual_seed(0)
    idx = [torch.randperm(e, generator=gen)[:top_k].view(1, top_k).to(dev, torch.int32) for _ in range(copies)]
    top_w = torch.full((1, top_k), 1.0 / top_k, device=dev, dtype=torch.float32)
    pre = small_kernels(1, dev)
    moved = top_k * (width + inter) * h * 2
    out = {}
    for variant in ("cold", "hot", "prefetch_rows"):
        calls = []
        for i in range(copies):
            j = 0 if variant == "hot" else i
            table = triton_prefetch.region_table([], [ups[j], downs[j]], dev)
            if variant == "prefetch_rows":
                calls.append(lambda j=j, table=table: triton_prefetch.prefetch(table, width * h * 2, idx[j].view(-1)))
            calls.extend(pre)
            calls.append(lambda j=j: triton_moe.fused_experts(x, ups[j], downs[j], idx[j], top_w, gated))
        us = graph_us_per_call(calls, iters=20) * len(calls) / copies
        out[variant] = dict(us=round(us, 2), tb_s=round(moved / us / 1e6, 2))
    print(f"{name} experts T=1 top-{top_k} ({moved / 1e6:.1f} MB): "
          + ", ".join(f"{v} {r['us']} us ({r['tb_s']} TB/s)" for v, r in out.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev), "L2", torch.cuda.get_device_properties(dev).L2_cache_size >> 20, "MiB")
    results = {"linears": {}, "experts": {}}
    for name, (n, k) in LINEARS.items():
        for small in (0, 3):
            results["linears"][f"{name} small{small}"] = bench_linear(name, n, k, small, dev)
        results["linears"][f"{name} M8 small3"] = bench_linear(name, n, k, 3, dev, rows=8)
    for name, shape in EXPERTS.items():
        results["experts"][name] = bench_experts(name, *shape, dev)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
