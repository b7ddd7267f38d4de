"""End-to-end decode throughput through the engine (LLM's engine.step loop: scheduling, batch
building, graph replay, sampling, outputs), async scheduling on vs off, on the Nemotron-H-8B-shaped
model with random bf16 weights (built in memory as in bench_decode.py).

    python3 bench/bench_generate.py [--batches 1 64 256] [--prompt 512] [--tokens 128]

For each batch size: B requests of `--prompt` random tokens are prefilled, then the decode phase is
timed (from the first step in which every request decodes to the last token): generated tokens / s.
Next to it, the device-only time of one decode step at the same context (`runner.execute` on a
prebuilt batch, CUDA-graph replay), so the difference is what the host adds per step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_decode import decode_batch, make_llm, step_greedy, time_steps  # noqa: E402


def decode_phase(llm, batch: int, prompt_len: int, tokens: int, params) -> dict:
    """Prefill `batch` random prompts, then time the steps until every request has `tokens` tokens."""
    eng = llm.engine
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(4, 100000, (prompt_len,), generator=g).tolist()
        eng.add_request(f"b{batch}-{i}-{time.monotonic_ns()}", prompt, params, output_kind="final")
    # prefill (and the first token) until every request is decoding
    while eng.waiting or any(not s.is_decoding for s in eng.running):
        eng.step()
    torch.cuda.synchronize()
    start_tokens = eng.stats["generated_tokens"]
    t = time.perf_counter()
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    generated = eng.stats["generated_tokens"] - start_tokens
    return dict(tok_s=generated / dt, ms_per_step=dt / steps * 1e3, steps=steps, generated=generated)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ssm-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from hybrid.sampling import SamplingParams

    ns = argparse.Namespace(batches=args.batches, prompt=max(args.prompt, 2048), ctx=args.prompt + args.tokens,
                            util=0.9, ssm_dtype=args.ssm_dtype, decode_kernels="triton", no_fused_ops=False)
    llm = make_llm(ns, enforce_eager=False)
    eng = llm.engine
    rows = []
    for b in args.batches:
        # device-only step at the mid-generation context, on a prebuilt batch (slots taken and given back)
        slots = [llm.state_pool.allocate() for _ in range(b)]
        batch = decode_batch(llm, b, args.prompt + args.tokens // 2)
        device_ms = time_steps(lambda: step_greedy(llm.runner.execute(batch)), 10) * 1e3
        for s in slots:
            llm.state_pool.free(s)
        greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(max_tokens=args.tokens, temperature=0.8, top_p=0.95, ignore_eos=True)
        for mode, params in (("greedy", greedy), ("top-p sampled", sampled)):
            for overlap in (False, True):
                eng.async_scheduling = overlap
                r = decode_phase(llm, b, args.prompt, args.tokens, params)
                r.update(batch=b, sampling=mode, async_scheduling=overlap, device_ms_per_step=device_ms)
                rows.append(r)
                print(f"batch {b:4d} {mode:14s} async {str(overlap):5s}: {r['tok_s']:9.0f} tok/s, "
                      f"{r['ms_per_step']:6.2f} ms/step (device-only step {device_ms:6.2f} ms)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
