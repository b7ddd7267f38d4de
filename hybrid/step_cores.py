"""The batch-dependent middles of the layers ("cores"), where a piecewise graph capture splits a step.

A Mamba mixer's core is its conv, scan and state writes (every path that moves Mamba state: decode, prefill,
verify, replay, prefix snapshots); an attention layer's is its rope, KV write and attention. Everything else a
step runs (the embedding, norms, projections, MLPs, experts) depends on the step's token count alone.
graphs/piecewise.py captures those token-count-only pieces as CUDA graphs per token bucket and runs the cores
between them eagerly, on the real batch.

The layers call run_core for their core. With no boundary installed (every eager step, every full-graph capture)
it just calls the core; graphs/piecewise.py installs a boundary while it captures or runs a padded step.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

# (batch, *token-major tensors) -> a token-major tensor: one row per token of the batch
Core = Callable[..., torch.Tensor]


class CoreBoundary(Protocol):
    def __call__(self, core: Core, batch, tokens: tuple[torch.Tensor, ...], out_tail: tuple[int, ...],
                 out_dtype: torch.dtype) -> torch.Tensor: ...


_boundary: list[CoreBoundary] = []  # the installed boundary (at most one), innermost last


def run_core(core: Core, batch, tokens: tuple[torch.Tensor, ...], out_tail: tuple[int, ...],
             out_dtype: torch.dtype) -> torch.Tensor:
    """core(batch, *tokens): a tensor [tokens, *out_tail] of `out_dtype`. `tokens` are the core's token-major
    inputs (their first dimension the step's tokens); everything else it reads is bound into `core`. Under an
    installed boundary the boundary runs (or records) the core and returns its output."""
    if not _boundary:
        return core(batch, *tokens)
    return _boundary[-1](core, batch, tokens, tuple(out_tail), out_dtype)


@contextlib.contextmanager
def core_boundary(boundary: CoreBoundary) -> Iterator[None]:
    """Route run_core through `boundary` inside the block."""
    _boundary.append(boundary)
    try:
        yield
    finally:
        _boundary.pop()
