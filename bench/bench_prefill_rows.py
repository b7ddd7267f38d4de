"""Prefill steps of many prompts: the Mamba layers' prefill rows one by one (HYBRID_VARLEN_PREFILL=0) against
the varlen path (the default, hybrid/ops/triton_mamba_varlen.py), in one process, on the Nemotron-H-8B-shaped
model with random bf16 weights (built in memory as in bench_decode.py).

    python3 bench/bench_prefill_rows.py [--prompts 64] [--lengths 16 128 512 2048] [--json FILE]

Per prompt length: `LLM.generate` of --prompts prompts with max_tokens=1 (prefill-bound: the engine packs
them into steps of up to max_num_batched_tokens), best of 3 per path, and the first token's agreement
between the two paths (random weights: near-tied logits may flip on rounding).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ["HYBRID_VARLEN_PREFILL"] = "1"  # at startup, so that the warm-up meets both paths' kernels

from bench.bench_decode import make_llm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 512, 2048])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from hybrid.ops import triton_guard
    from hybrid.sampling import SamplingParams

    ns = argparse.Namespace(batches=[args.prompts], prompt=8192, ctx=0, util=0.9, ssm_dtype="bfloat16",
                            decode_kernels="triton", no_fused_ops=False)
    llm = make_llm(ns, enforce_eager=False)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    results = []
    for n in args.lengths:
        prompts = [torch.randint(4, 100000, (n,), generator=g).tolist() for _ in range(args.prompts)]
        row = {"prompts": args.prompts, "length": n}
        firsts = {}
        for path, env in (("rows", "0"), ("varlen", "1"), ("rows", "0"), ("varlen", "1")):
            os.environ["HYBRID_VARLEN_PREFILL"] = env
            triton_guard.reset_switches()
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t)
            row[f"{path}_ms"] = min(row.get(f"{path}_ms", float("inf")), best * 1e3)
            firsts[path] = [o.outputs[0].token_ids[0] for o in outs]
        row["first_tokens_agree"] = sum(a == b for a, b in zip(firsts["rows"], firsts["varlen"])) / args.prompts
        row["speedup"] = row["rows_ms"] / row["varlen_ms"]
        print(row, flush=True)
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
