"""Speculative verify steps on the GPU: what one costs next to a decode step, eager and replayed from
the verify graphs (the default, graphs/runner.py), on the Nemotron-H-8B shape of
bench/bench_decode.py (random bf16 weights built in memory), at a 2K context.

A verify step of B rows scores K+1 tokens a row (the last sampled token and K drafts); speculation
pays when the tokens a verify step emits (1 + the accepted drafts) outweigh its cost in decode
steps, so the break-even acceptance is printed too. Synthetic steps through `runner.execute`, as
bench_decode.py times decode; then `LLM.generate` with n-gram speculation on repeating prompts, for
the public path (a random model accepts few drafts: that row is for the host path, not acceptance).

Usage (on the device): python3 bench/bench_speculative.py [--batches 1 4 16] [--k 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_decode import decode_batch, make_llm, time_steps  # noqa: E402


def verify_batch(llm, n: int, ctx: int, q_len: int):
    """n verify rows of q_len tokens each over a ctx-token history (slots 0 .. n-1, scratch rows 0 .. n-1)."""
    from hybrid.batch import StepBatch

    ps = llm.kv_cache.page_size
    width = llm.engine.max_pages_per_seq
    per = -(-(ctx + q_len) // ps)
    dev = llm.device
    table = torch.zeros(n, width, dtype=torch.int32)
    for i in range(n):
        table[i, :per] = torch.arange(1 + i * per, 1 + (i + 1) * per, dtype=torch.int32)
    pos = torch.arange(ctx, ctx + q_len).repeat(n)
    rows = torch.arange(n).repeat_interleave(q_len)
    loc = table[rows, pos // ps].long() * ps + pos % ps
    t = n * q_len
    return StepBatch(
        input_ids=torch.randint(0, min(1000, llm.config.vocab_size), (t,), device=dev), positions=pos.to(dev),
        query_start_loc=torch.arange(0, t + 1, q_len, dtype=torch.int32, device=dev),
        seq_lens=torch.full((n,), ctx + q_len, dtype=torch.int32, device=dev), page_table=table.to(dev),
        kv_write_loc=loc.to(dev), state_slot=torch.arange(n, device=dev),
        has_initial_state=torch.ones(n, dtype=torch.bool, device=dev), logits_indices=torch.arange(t, device=dev),
        num_decodes=0, num_prefills=0, query_lens_cpu=[q_len] * n, seq_lens_cpu=[ctx + q_len] * n,
        state_slot_cpu=list(range(n)), has_initial_state_cpu=[True] * n, num_verify=n,
        scratch_index=torch.arange(n, device=dev), scratch_index_cpu=list(range(n)),
        state_scratch=llm.state_pool.spec_scratch,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # bench_decode.make_llm's other knobs, at their defaults
    args.prompt, args.util, args.ssm_dtype, args.decode_kernels, args.no_fused_ops = 4096, 0.9, "bfloat16", "triton", False
    os.environ.pop("HYBRID_VERIFY_GRAPHS", None)  # (the default: verify graphs on)
    t0 = time.perf_counter()
    llm = make_llm(args, enforce_eager=False,
                   speculative_config={"method": "ngram", "num_speculative_tokens": args.k})
    runner = llm.runner
    print(f"startup {time.perf_counter() - t0:.0f} s; verify graphs {sorted(runner.verify_graphs)} "
          f"(on: {runner.verify_graphs_on})", flush=True)
    rows = []
    for n in args.batches:
        d = decode_batch(llm, n, args.ctx)
        v = verify_batch(llm, n, args.ctx, args.k + 1)
        decode_ms = time_steps(lambda: runner.execute(d), args.steps) * 1e3
        replays = runner.stats["verify_graph_replays"]
        graph_ms = time_steps(lambda: runner.execute(v), args.steps) * 1e3
        replayed = runner.stats["verify_graph_replays"] > replays
        runner.pad_verify = False  # the unpadded eager verify step, as without verify graphs
        eager_ms = time_steps(lambda: runner.execute(v), args.steps) * 1e3
        runner.pad_verify = runner.verify_graphs_on
        row = {"batch": n, "k": args.k, "decode_ms": decode_ms, "verify_graph_ms": graph_ms,
               "verify_graph_replayed": replayed, "verify_eager_ms": eager_ms,
               # accepted drafts a verify step needs to emit as many tokens per ms as decode steps
               "break_even_accepted": graph_ms / decode_ms - 1, "break_even_accepted_eager": eager_ms / decode_ms - 1}
        rows.append(row)
        print(f"batch {n}: decode {decode_ms:.2f} ms; verify of {args.k + 1} tokens a row: graph {graph_ms:.2f} ms "
              f"(replayed: {replayed}), eager {eager_ms:.2f} ms; break-even accepted drafts a row: "
              f"{row['break_even_accepted']:.2f} (graph), {row['break_even_accepted_eager']:.2f} (eager)", flush=True)
    # the public path: n-gram speculation on repeating prompts through LLM.generate
    from hybrid import SamplingParams

    prompts = [[(7 * i + j) % 997 + 3 for j in range(16)] * 8 for i in range(max(args.batches))]
    sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    gen = {}
    for n in args.batches:
        for key in llm.engine.stats:
            llm.engine.stats[key] = 0
        t = time.perf_counter()
        out = llm.generate(prompts[:n], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in out)
        st = llm.engine.stats
        gen[n] = {"tok_s": toks / dt, "verify_rows": st["spec_verify_rows"], "drafts": st["spec_draft_tokens"],
                  "accepted": st["spec_accepted_tokens"]}
        print(f"generate batch {n}: {toks / dt:.0f} tok/s, {st['spec_accepted_tokens']} of {st['spec_draft_tokens']} "
              f"drafts accepted, {st['spec_verify_rows']} verify rows", flush=True)
    print(f"runner stats {runner.stats}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "generate": gen, "runner_stats": runner.stats}, f, indent=1)


if __name__ == "__main__":
    main()
