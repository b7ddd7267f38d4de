"""Kernel timing for the device benchmarks: calls captured in one CUDA graph, so launch overhead on
the host is not what is measured (as in a decode step, which replays a graph)."""
from __future__ import annotations

import torch


def graph_us_per_call(calls, iters: int = 10, repeat: int = 1) -> float:
    """Mean microseconds of one call of `calls` (zero-argument callables), from `iters` replays of a
    CUDA graph that runs them in order `repeat` times. They run once on a side stream first (compile,
    autotune, allocations), as capture requires."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for c in calls:
                c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * repeat * len(calls))
