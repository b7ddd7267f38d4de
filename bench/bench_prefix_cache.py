"""Time to first token with and without a prefix-cache hit, on the Nemotron-H-8B-shaped model with
random bf16 weights (built in memory as in bench_decode.py), on the GPU.

    python3 bench/bench_prefix_cache.py [--prompt 8192] [--follow 256] [--interval 0]

With `LLM(enable_prefix_caching=True)`: a "second turn" (a first prompt of `--prompt` random tokens
plus `--follow` new ones) is timed once when nothing cached starts like it (a full prefill, which
also shows what the caching points cost) and once after its first turn ran (it resumes after the
cached prefix). Best of 3 each, after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_decode import make_llm  # noqa: E402


def ttft(llm, prompt, sp) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate([prompt], sp, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--follow", type=int, default=256)
    ap.add_argument("--interval", type=int, default=0, help="LLM(prefix_cache_interval=...): caching points inside prompts")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="profile one more hit (host and device): op tables printed, chrome trace into DIR")
    ap.add_argument("--piecewise-ab", action="store_true",
                    help="the hit again with the piecewise graphs on and off (HYBRID_PIECEWISE_MAX_TOKENS), alternating")
    ap.add_argument("--cprofile", action="store_true",
                    help="one more hit under cProfile: the Python functions by own and by cumulative host time")
    args = ap.parse_args()
    from hybrid.sampling import SamplingParams

    g = torch.Generator().manual_seed(3)
    first = torch.randint(4, 100000, (args.prompt,), generator=g).tolist()
    extra = torch.randint(4, 100000, (args.follow,), generator=g).tolist()
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ns = argparse.Namespace(batches=[1], prompt=args.prompt + args.follow, ctx=0, util=0.9, ssm_dtype="bfloat16",
                            decode_kernels="triton", no_fused_ops=False)
    llm = make_llm(ns, enforce_eager=False, enable_prefix_caching=True, prefix_cache_interval=args.interval)
    miss, hit = [], []
    for i in range(4):  # the first pass warms up (JIT, autotune); fresh token ids each time
        turn1 = [(t + 7 * i) % 100000 + 4 for t in first]
        miss.append(ttft(llm, turn1 + extra, sp))  # nothing cached starts like it: a full prefill
        turn1b = [(t + 7 * i + 3) % 100000 + 4 for t in first]
        llm.generate([turn1b], sp, use_tqdm=False)  # the first turn, cached
        hit.append(ttft(llm, turn1b + extra, sp))  # the second turn resumes after it
    # where a hit's time goes: its steps (tokens each, device-synchronised wall time around
    # runner.execute) in one more hit, against the whole call
    steps = []
    execute = llm.runner.execute

    def timed(batch, *a, **k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = execute(batch, *a, **k)
        host = time.perf_counter() - t  # the host's time to issue the step (no sync inside: ~ the wall if launch-bound)
        torch.cuda.synchronize()
        steps.append({"tokens": int(getattr(batch, "num_tokens", 0)), "ms": (time.perf_counter() - t) * 1e3,
                      "host_ms": host * 1e3})
        return out

    turn1c = [(t + 101) % 100000 + 4 for t in first]
    llm.generate([turn1c], sp, use_tqdm=False)
    llm.runner.execute = timed
    try:
        timed_hit = ttft(llm, turn1c + extra, sp)
    finally:
        llm.runner.execute = execute
    result = dict(prompt=args.prompt, follow=args.follow, interval=args.interval, full_prefill_ttft_ms=min(miss[1:]) * 1e3,
                  cache_hit_ttft_ms=min(hit[1:]) * 1e3, hit_tokens=llm.engine.stats["prefix_cache_hit_tokens"],
                  hit_steps=steps, timed_hit_ms=timed_hit * 1e3)
    print("a hit's steps: " + ", ".join(f"{s['tokens']} tokens {s['ms']:.1f} ms (host {s['host_ms']:.1f})" for s in steps)
          + f" (the call: {timed_hit * 1e3:.1f} ms)", flush=True)
    print(f"second turn ({args.prompt} + {args.follow} tokens): full prefill {result['full_prefill_ttft_ms']:.1f} ms, "
          f"after a prefix-cache hit {result['cache_hit_ttft_ms']:.1f} ms", flush=True)
    if args.piecewise_ab:
        result["piecewise"] = piecewise_ab(llm, first, extra, sp)
    if args.profile:
        profile_hit(llm, [(t + 211) % 100000 + 4 for t in first], extra, sp, args.profile)
    if args.cprofile:
        cprofile_hit(llm, [(t + 307) % 100000 + 4 for t in first], extra, sp)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def piecewise_ab(llm, first, extra, sp) -> dict:
    """The hit again with the piecewise graphs (graphs/piecewise.py) and with its steps eager, alternating, best
    of 3 each, in this process."""
    runner = llm.runner
    pieces = runner.piecewise
    if pieces is None:
        print("piecewise A/B: no piecewise graphs (HYBRID_PIECEWISE_MAX_TOKENS)", flush=True)
        return {}
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(6):
        mode = "on" if i % 2 == 0 else "off"
        runner.piecewise = pieces if mode == "on" else None
        turn1 = [(t + 401 + 13 * i) % 100000 + 4 for t in first]
        llm.generate([turn1], sp, use_tqdm=False)
        times[mode].append(ttft(llm, turn1 + extra, sp))
    runner.piecewise = pieces
    out = {mode: min(t) * 1e3 for mode, t in times.items()}
    print(f"piecewise A/B, second turn after a prefix-cache hit: piecewise graphs {out['on']:.1f} ms, eager "
          f"{out['off']:.1f} ms (replays {runner.stats['piecewise_replays']})", flush=True)
    return out


def profile_hit(llm, turn1, extra, sp, out_dir: str) -> None:
    """One more hit under torch.profiler (host ops and kernels): the tables by self host time and by
    device time, and a chrome trace in out_dir."""
    from torch.profiler import ProfilerActivity, profile

    llm.generate([turn1], sp, use_tqdm=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False) as prof:
        ttft(llm, turn1 + extra, sp)
    os.makedirs(out_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out_dir, "prefix_hit_trace.json"))
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70), flush=True)
    print(ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70), flush=True)


def cprofile_hit(llm, turn1, extra, sp) -> None:
    """One more hit under cProfile: which Python functions its host time goes to (the step is bound by
    its host: Triton's launch path, torch dispatch, our own per-layer code), by own and cumulative time."""
    import cProfile
    import io
    import pstats

    llm.generate([turn1], sp, use_tqdm=False)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    ttft(llm, turn1 + extra, sp)
    prof.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(45)
        print(buf.getvalue(), flush=True)


if __name__ == "__main__":
    main()
