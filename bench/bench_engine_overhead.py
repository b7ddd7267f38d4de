"""Host time of one engine decode step (scheduling, batch building, sampling bookkeeping, outputs),
without the model: a fake runner returns fixed logits. On a GPU this host work is serialised with
the device step, so it adds to every decode step's latency.
Usage: python bench/bench_engine_overhead.py [--batches 1 64 256] [--context 2000]
       python bench/bench_engine_overhead.py --batches 256 --context 200 --generated 0 1000 2000 \
           --output-kinds cumulative delta final     # the cost of the outputs as generations grow
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
from hybrid.engine_config import engine_config  # noqa: E402
from hybrid.sampling import SamplingParams  # noqa: E402
from state_pool.pool import MambaStatePool, StateShapes  # noqa: E402

VOCAB = 1024  # small: the fake logits' argmax is not what is measured


class FixedLogits:
    """Stands in for the model runner: logits of the right shape, no compute."""

    def __init__(self) -> None:
        self.logits = torch.randn(1024, VOCAB)

    ctx = None  # no attention backend (so no workspace regions for the sanitizer)

    def execute(self, batch):
        self.ran = batch
        return self.logits[: batch.logits_indices.shape[0]]

    def inputs_that_ran(self):
        return self.ran


def measure(batch_size: int, context: int, steps: int = 20, generated: int = 0,
            output_kind: str = "cumulative") -> tuple[float, float]:
    """(host seconds per decode step, of which schedule + batch build) once every request has
    `generated` output tokens."""
    page = 16
    room = generated + steps + 40
    pool = MambaStatePool(StateShapes(1, 8, 3, 1, 1, 1), batch_size)
    kv = PagedKVCache(1, batch_size * (-(-(context + room) // page)) + 1, page, 1, 8)
    config = engine_config(device="cpu", max_model_len=context + room, max_num_seqs=batch_size,
                           max_num_batched_tokens=8192, page_size=page)
    eng = Engine(FixedLogits(), pool, kv, config, vocab_size=VOCAB, eos_token_ids=set(), tokenizer=None)
    prompt = [1 + i % (VOCAB - 1) for i in range(context)]
    for i in range(batch_size):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True),
                        output_kind=output_kind)
    while eng.waiting or any(not s.is_decoding for s in eng.running):
        eng.step()
    while len(eng.running[0].output_token_ids) < generated:
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
    ap.add_argument("--generated", type=int, nargs="+", default=[0], help="output tokens already generated")
    ap.add_argument("--output-kinds", nargs="+", default=["final"], help="Engine output_kind(s) to measure")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| batch | context | generated | output kind | host time per decode step | of which schedule + batch build |")
    print("|---:|---:|---:|---|---:|---:|")
    for b in args.batches:
        for gen in args.generated:
            for kind in args.output_kinds:
                step, build = measure(b, args.context, generated=gen, output_kind=kind)
                print(f"| {b} | {args.context} | {gen} | {kind} | {step * 1e3:.2f} ms | {build * 1e3:.2f} ms |",
                      flush=True)


if __name__ == "__main__":
    main()
