"""What a dependency between two phases of a decode step costs on the GPU: a kernel boundary (two launches under
programmatic dependent launch, replayed from a CUDA graph) against a grid-wide barrier inside one persistent
kernel (every program arrives on a counter, then waits until all have).

    python3 bench/bench_sync_cost.py [--phases 200] [--programs 1 32 132]

Why: at batch 1 the MoE hybrids' decode step is its bytes plus a chain of ~10 dependent launches a layer
(BENCHMARKS.md, MoE section); fusing a layer's launches into one persistent kernel replaces each boundary with a
grid barrier. That pays only if a barrier is clearly cheaper than a boundary. Each phase does a token's worth of
dependent work: every program reads a value the previous phase wrote (another program's) and writes its own.
Printed: us per phase for each way and program count, the boundary's both with and without PDL.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cuda_timing import graph_us_per_call  # noqa: E402
from hybrid.ops.triton_guard import pdl_options, tl, triton  # noqa: E402

if triton is not None:
    from hybrid.ops.triton_guard import pdl_wait

    @triton.jit
    def _phase_kernel(buf_ptr, n, phase, PDL: tl.constexpr):
        # one phase as its own launch: read what another program wrote in the phase before, write our own
        pdl_wait(PDL)
        pid = tl.program_id(0)
        v = tl.load(buf_ptr + (phase % 2) * n + (pid + 1) % n)
        tl.store(buf_ptr + ((phase + 1) % 2) * n + pid, v + 1.0)

    @triton.jit
    def _persistent_kernel(buf_ptr, count_ptr, n, phases):
        # every phase in one launch: a grid-wide barrier (arrive on a counter with release, then spin with acquire
        # until every program of this phase has arrived) between phases; the counter only grows, so no reset
        pid = tl.program_id(0)
        for phase in range(phases):
            v = tl.load(buf_ptr + (phase % 2) * n + (pid + 1) % n, volatile=True)
            tl.store(buf_ptr + ((phase + 1) % 2) * n + pid, v + 1.0)
            tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
            target = (phase + 1) * n
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
            while seen < target:
                seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")


def boundaries(n: int, phases: int, pdl: bool) -> float:
    """us per phase: `phases` launches of _phase_kernel, replayed from one CUDA graph."""
    buf = torch.zeros(2 * n, device="cuda")
    opts = pdl_options(buf.device) if pdl else {"PDL": False}
    calls = [lambda p=p: _phase_kernel[(n,)](buf, n, p, num_warps=1, **opts) for p in range(phases)]
    return graph_us_per_call(calls, iters=20)


def barriers(n: int, phases: int) -> float:
    """us per phase: one launch of _persistent_kernel (n programs: at most one an SM, so all are resident),
    replayed from a CUDA graph with its counter's reset."""
    buf = torch.zeros(2 * n, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")

    def run():
        count.zero_()
        _persistent_kernel[(n,)](buf, count, n, phases, num_warps=1)

    us = graph_us_per_call([run], iters=20)
    assert int(count.item()) == n * phases
    return us / phases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", type=int, default=200)
    ap.add_argument("--programs", type=int, nargs="+", default=[1, 32, 132])
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs, {args.phases} phases; us per phase", flush=True)
    print(f"{'programs':>8} {'launch, PDL':>12} {'launch':>8} {'barrier':>8}", flush=True)
    for n in args.programs:
        n = min(n, sms)
        row = (boundaries(n, args.phases, True), boundaries(n, args.phases, False), barriers(n, args.phases))
        print(f"{n:>8} {row[0]:>12.2f} {row[1]:>8.2f} {row[2]:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
