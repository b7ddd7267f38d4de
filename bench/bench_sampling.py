"""The sampler alone (hybrid/sampling.py sample_tokens) at decode batch sizes: greedy vs temperature,
top-p (its uncovered rows redone by the Triton kernel, or found with a host sync), top-k, min-p and
all three, next to the previous implementation (a full-vocabulary sort for
top-p and one exponential_ launch per row from a torch.Generator), on synthetic fp32 logits.

The prefilter's fallback depends on the logits: `peaked` rows (Gaussian logits, sd 5: a top-p 0.95
nucleus of ~200 tokens at a 131072 vocabulary) are covered by the candidates, `flat` rows (sd 1.3,
what random weights give: a nucleus of ~80K tokens) all take the full-sort fallback, `mixed` rows
(sd 2.5..6 per row) some. The table says how many rows fell back.

On CUDA each timing is CUDA events around `--reps` back-to-back calls (device time per call; the
calls are launched eagerly, as the engine does) plus the host's wall time per call; on CPU the wall
time. Runs on CPU with a small vocabulary:

    python3 bench/bench_sampling.py                       # CUDA if present: vocab 131072, batch 1/64/256
    python3 bench/bench_sampling.py --device cpu          # vocab 8192, batch 1/16/64
    python3 bench/bench_sampling.py --dist flat --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hybrid.sampling as sampling  # noqa: E402
from hybrid.sampling import (PREFILTER_CANDIDATES, SampleStream, SamplingParams, _cuts, _Knobs,  # noqa: E402
                             sample_tokens)

MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_p_0.95": SamplingParams(top_p=0.95),
    "top_k_50": SamplingParams(top_k=50),
    "min_p_0.05": SamplingParams(min_p=0.05),
    "k50_p0.95_minp0.05": SamplingParams(top_k=50, top_p=0.95, min_p=0.05),
    # the same top-p with the prefilter's uncovered rows found on the host (a sync) instead of the kernel
    "top_p_0.95_sync_fallback": SamplingParams(top_p=0.95),
}


def old_sample_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """The sampler before the prefilter (top-p and the exponential race as it was), for comparison."""
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    scaled = logits / temps[:, None]
    top_k = [p.top_k for p in params]
    if any(k != -1 and k < logits.shape[-1] for k in top_k):
        k_eff = [k if k != -1 and k < logits.shape[-1] else 0 for k in top_k]
        kth = torch.topk(scaled, max(k_eff), dim=-1).values
        kth = kth.gather(1, torch.tensor([max(k, 1) - 1 for k in k_eff], device=dev)[:, None])
        on = torch.tensor([k > 0 for k in k_eff], device=dev)
        scaled = scaled.masked_fill(on[:, None] & (scaled < kth), float("-inf"))
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        limit = torch.tensor(top_p, dtype=probs.dtype, device=dev)
        drop_sorted = (before >= limit[:, None]) & (limit < 1.0)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    min_p = [p.min_p for p in params]
    if any(p > 0.0 for p in min_p):
        probs = torch.softmax(scaled, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, dtype=probs.dtype, device=dev)[:, None]
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs)
    for j, g in enumerate(generators):
        noise[j].exponential_(1.0, generator=g)
    return torch.argmax(probs / noise, dim=-1)


def make_logits(dist: str, batch: int, vocab: int, dev: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(batch, vocab, generator=g, device=dev)
    if dist == "peaked":
        return x * 5.0
    if dist == "flat":
        return x * 1.3
    sd = torch.rand(batch, 1, generator=g, device=dev) * 3.5 + 2.5  # mixed
    return x * sd


def fallback_rows(logits: torch.Tensor, sp: SamplingParams) -> int:
    """How many rows the prefilter does not cover (they take the full sort)."""
    n, V = logits.shape
    if not ((1 <= sp.top_k < V) or sp.top_p < 1.0 or sp.min_p > 0.0) or sp.greedy:
        return 0
    k = sp.top_k if 1 <= sp.top_k < V else 0
    C = min(V, max(sampling.PREFILTER_CANDIDATES, k + 1))
    if C == V:
        return 0
    scaled = logits / sp.temperature
    vals, ids = torch.topk(scaled, C, dim=-1)
    knobs = _Knobs(torch.full((n,), k, device=logits.device) if k else None,
                   torch.full((n,), sp.top_p, dtype=torch.float64, device=logits.device) if sp.top_p < 1 else None,
                   torch.full((n,), sp.min_p, device=logits.device) if sp.min_p > 0 else None)
    probs = torch.softmax(scaled, dim=-1).gather(1, ids)
    covered = _cuts(vals, probs, knobs)[1]
    return int((~covered).sum())


def timed(fn, reps: int, dev: torch.device) -> tuple[float, float]:
    """(device ms per call, host wall ms per call); on CPU both are the wall time."""
    for _ in range(3):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        wall = (time.perf_counter() - t0) * 1e3 / reps  # launch-side cost (plus any sync the calls make)
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps, wall
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    ms = (time.perf_counter() - t0) * 1e3 / reps
    return ms, ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=None, help="default 131072 on CUDA, 8192 on CPU")
    ap.add_argument("--batches", default=None, help="comma separated; default 1,64,256 (CUDA), 1,16,64 (CPU)")
    ap.add_argument("--dist", default="peaked,mixed,flat")
    ap.add_argument("--modes", default=",".join(list(MODES) + ["old_top_p_0.95_full_sort", "old_temperature"]))
    ap.add_argument("--reps", type=int, default=None, help="default 50 on CUDA, 5 on CPU")
    ap.add_argument("--candidates", type=int, default=None, help=f"prefilter size (default {PREFILTER_CANDIDATES})")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.candidates:
        sampling.PREFILTER_CANDIDATES = args.candidates
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    vocab = args.vocab or (131072 if cuda else 8192)
    batches = [int(b) for b in (args.batches or ("1,64,256" if cuda else "1,16,64")).split(",")]
    reps = args.reps or (50 if cuda else 5)
    modes = args.modes.split(",")
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    print(f"# sample_tokens on {name}, vocab {vocab}, fp32 logits, prefilter {sampling.PREFILTER_CANDIDATES} candidates, "
          f"{reps} reps; ms per call (device time from CUDA events on CUDA; host wall per call)")
    print(f"{'dist':>7} {'batch':>5} {'mode':>26} {'device ms':>10} {'host ms':>9} {'fallback rows':>13}")
    results = []
    for dist in args.dist.split(","):
        for batch in batches:
            logits = make_logits(dist, batch, vocab, dev)
            for mode in modes:
                if mode.startswith("old_"):
                    sp = SamplingParams(top_p=0.95) if "top_p" in mode else SamplingParams(temperature=0.8)
                    gens = [torch.Generator(device=dev).manual_seed(i) for i in range(batch)]
                    fn = lambda: old_sample_tokens(logits, [sp] * batch, gens)  # noqa: E731
                    fb = None
                else:
                    sp = MODES[mode]
                    streams = [SampleStream(i) for i in range(batch)]
                    params = [None if sp.greedy else sp] * batch
                    fallback = "sync" if mode.endswith("_sync_fallback") else "kernel"

                    def fn(params=params, streams=streams, fallback=fallback):
                        sampling.FALLBACK = fallback
                        return sample_tokens(logits, params, streams)
                    fb = fallback_rows(logits, sp)
                device_ms, host_ms = timed(fn, reps, dev)
                print(f"{dist:>7} {batch:>5} {mode:>26} {device_ms:>10.3f} {host_ms:>9.3f} "
                      f"{'-' if fb is None else f'{fb}/{batch}':>13}", flush=True)
                results.append(dict(device=name, vocab=vocab, dist=dist, batch=batch, mode=mode, device_ms=device_ms,
                                    host_ms=host_ms, fallback_rows=fb, candidates=sampling.PREFILTER_CANDIDATES))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
