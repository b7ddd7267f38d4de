"""Host time of one engine decode step (scheduling, batch building, sampling bookkeeping), without
the model: a fake runner returns fixed logits. On a GPU this host work is serialised with the
device step, so it adds to every decode step's latency.
Usage: python bench/bench_engine_overhead.py [--batches 1 64 256] [--context 2000]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention.kv_cache import PagedKVCache  # noqa: E402
from hybrid.engine import Engine  # noqa: E402
from hybrid.sampling import SamplingParams  # noqa: E402
from state_pool.pool import MambaStatePool, StateShapes  # noqa: E402

VOCAB = 1024  # small: the fake logits' argmax is not what is measured


class FixedLogits:
    """Stands in for the model runner: logits of the right shape, no compute."""

    def __init__(self) -> None:
        self.logits = torch.randn(1024, VOCAB)

    def execute(self, batch):
        return self.logits[: batch.logits_indices.shape[0]]

    def padded_batch(self, batch):
        return None


def measure(batch_size: int, context: int, steps: int = 20) -> tuple[float, float]:
    page = 16
    pool = MambaStatePool(StateShapes(1, 8, 3, 1, 1, 1), batch_size)
    kv = PagedKVCache(1, batch_size * (-(-(context + 100) // page)) + 1, page, 1, 8)
    eng = Engine(FixedLogits(), pool, kv, vocab_size=VOCAB, max_model_len=context + 100, max_num_seqs=batch_size,
                 max_num_batched_tokens=8192, eos_token_ids=set(), tokenizer=None)
    prompt = [1 + i % (VOCAB - 1) for i in range(context)]
    for i in range(batch_size):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True))
    while eng.waiting or any(not s.is_decoding for s in eng.running):
        eng.step()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    step = (time.perf_counter() - t) / steps
    t = time.perf_counter()
    for _ in range(steps):
        eng._build_batch(eng._schedule())
    build = (time.perf_counter() - t) / steps
    return step, build


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| batch | context | host time per decode step | of which schedule + batch build |")
    print("|---:|---:|---:|---:|")
    for b in args.batches:
        step, build = measure(b, args.context)
        print(f"| {b} | {args.context} | {step * 1e3:.2f} ms | {build * 1e3:.2f} ms |", flush=True)


if __name__ == "__main__":
    main()
