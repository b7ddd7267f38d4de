"""The decode benchmark of the Nemotron-H-8B-shaped model in one command (on the GPU device):

    python3 bench/run_benchmark.py [--out DIR] [--greedy 256]

runs, each in its own process (so every run gets the whole GPU): bench_decode.py with an fp32 and
with a bf16 SSM state (decode tok/s at batch 1, 8, 64, 256 at a 2K context next to the bandwidth
floor measured in the same run, 8K-prompt TTFT, and greedy tokens for 4 fixed prompts), then
transformers' own generate() on the same model at batch 1 (bench_transformers_peer.py). Prints one
markdown table with the results, the bf16-state greedy agreement with the fp32-state run, and the
issue's targets; the raw JSON of every run goes to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = {("float32", 64): 8000, ("bfloat16", 1): 235, ("bfloat16", 64): 10000, ("bfloat16", 256): 18000}
TTFT_TARGET_MS = 200


def run(cmd: list[str]) -> int:
    print("$", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def agreement(a: list[int], b: list[int]) -> tuple[int, float]:
    """(first position where the two greedy runs differ, share of equal positions)."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return first, sum(x == y for x, y in zip(a, b)) / max(1, len(b))


def table(results: dict, peer: dict | None) -> str:
    lines = ["| SSM state | batch | ms/step | tok/s | floor tok/s | % of floor | target |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for dtype, res in results.items():
        for row in res["decode"]:
            target = TARGETS.get((dtype, row["batch"]))
            lines.append(f"| {dtype} | {row['batch']} | {row['graph_ms']:.2f} | {row['graph_tok_s']:,.0f} | "
                         f"{row['floor_tok_s']:,.0f} | {row['graph_tok_s'] / row['floor_tok_s']:.0%} | "
                         + (f">= {target:,} ({row['graph_tok_s'] / target - 1:+.0%})" if target else "") + " |")
    out = ["\n".join(lines), ""]
    for dtype, res in results.items():
        if "prefill" in res:
            p = res["prefill"]
            out.append(f"8K-prompt TTFT ({dtype} state): {p['ttft_ms']:.1f} ms, {p['prefill_tok_s']:,.0f} tok/s "
                       f"(target <= {TTFT_TARGET_MS} ms: {p['ttft_ms'] / TTFT_TARGET_MS - 1:+.1%})")
    if peer:
        out.append(f"transformers generate, batch 1: {peer['decode_ms_per_step']:.1f} ms/step, "
                   f"{peer['decode_tok_s']:.1f} tok/s")
    if "greedy" in results.get("float32", {}) and "greedy" in results.get("bfloat16", {}):
        for i, (a, b) in enumerate(zip(results["bfloat16"]["greedy"], results["float32"]["greedy"])):
            first, share = agreement(a, b)
            out.append(f"greedy, prompt {i}: bf16 state vs fp32 state: first difference at token {first} "
                       f"of {len(b)}, {share:.0%} of positions equal")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--greedy", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rc = 0
    results = {}
    for dtype in ("float32", "bfloat16"):
        path = os.path.join(args.out, f"decode_{dtype}.json")
        rc |= run([sys.executable, os.path.join(HERE, "bench_decode.py"), "--ssm-dtype", dtype, "--no-eager",
                   "--steps", str(args.steps), "--greedy", str(args.greedy), "--json", path])
        if os.path.exists(path):
            with open(path) as f:
                results[dtype] = json.load(f)
    peer_path = os.path.join(args.out, "peer.json")
    rc |= run([sys.executable, os.path.join(HERE, "bench_transformers_peer.py"), "--json", peer_path])
    peer = None
    if os.path.exists(peer_path):
        with open(peer_path) as f:
            peer = json.load(f)
    report = table(results, peer)
    print(report)
    with open(os.path.join(args.out, "benchmark.md"), "w") as f:
        f.write(report + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
