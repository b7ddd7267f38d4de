"""Greedy tokens on CUDA: each logits row's argmax, and whether its maximum is finite, in two small launches.

Why: every decode step takes the argmax of its [R, V] fp32 logits (hybrid/sampling.py: sample_tokens), and
torch's argmax of one long row runs as one reduction kernel of ~22 us on the H200 at V 100352 (Granite-4.0-H's
vocabulary), batch 1 or 8 alike (the kernel profiles of bench/bench_moe.py): ~1% of a Granite-4.0-H-Tiny decode
step at batch 1. Here the row is split into chunks: the first launch takes each chunk's best (grid rows x
chunks, so a single row still spreads over tens of SMs), the second combines a row's chunks and also writes the
row's `finite` flag (torch's path: a gather and an isfinite after the argmax, two more launches).

The result is torch.argmax's, bit for bit: a NaN is the maximum (the first NaN of the row wins), otherwise
the largest value, ties to the lowest index (so a row of -inf gives 0). `finite` is False where the chosen
value is NaN or +-inf. Both launches use programmatic dependent launch (hybrid/ops/triton_guard.py).
CPU tests run the kernels through Triton's interpreter (tests/test_triton_greedy.py).
"""
from __future__ import annotations

import torch

from hybrid.ops.triton_guard import HAS_TRITON, pdl_options, require, tl, triton
from state_pool.util import cdiv

CHUNK = 2048  # columns a first-launch program reduces (8 KB of fp32 logits): V 100352 is 49 programs a row
MAX_CHUNKS = 128  # a row of more chunks takes wider ones (the second launch reduces at most this many)

if HAS_TRITON:
    from hybrid.ops.triton_guard import pdl_wait

    @triton.jit
    def _better(v, i, nan, best_v, best_i, best_nan):
        """Candidate (v, i, nan) against the running best: a NaN beats any number and the lower index wins
        between two NaNs or two equal numbers. Candidates come in increasing index order."""
        take = (nan & ~best_nan) | (~nan & ~best_nan & (v > best_v))
        return tl.where(take, v, best_v), tl.where(take, i, best_i), nan | best_nan

    @triton.jit
    def _tile_best(x, idx, valid):
        """A tile's (value, index, is NaN) by the same rule: the first NaN if any, else the first maximum."""
        big = 2147483647
        isnan = (x != x) & valid
        nan_idx = tl.min(tl.where(isnan, idx, big), axis=0)
        clean = tl.where(valid & ~isnan, x, float("-inf"))
        m = tl.max(clean, axis=0)
        m_idx = tl.min(tl.where(valid & ~isnan & (clean == m), idx, big), axis=0)
        # a tile of valid -infs (or of NaNs only): m is -inf, m_idx its first valid -inf (big if none)
        has_nan = nan_idx < big
        return tl.where(has_nan, float("nan"), m), tl.where(has_nan, nan_idx, m_idx), has_nan

    @triton.jit
    def _chunk_best_kernel(x_ptr, val_ptr, idx_ptr, V, s_xr, chunk, num_chunks, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        pdl_wait(PDL)
        start = c * chunk
        end = tl.minimum(start + chunk, V)
        # the chunk's first element is the best until a later one beats it (so a chunk of -infs gives its first)
        best_v = tl.full((), float("-inf"), tl.float32)
        best_i = tl.full((), 0, tl.int32) + start
        best_nan = tl.full((), 0, tl.int1)
        for k0 in range(start, end, BLOCK):
            idx = k0 + offs
            valid = idx < end
            x = tl.load(x_ptr + row * s_xr + idx, mask=valid, other=float("-inf")).to(tl.float32)
            v, i, nan = _tile_best(x, idx, valid)
            best_v, best_i, best_nan = _better(v, i, nan, best_v, best_i, best_nan)
        tl.store(val_ptr + row * num_chunks + c, best_v)
        tl.store(idx_ptr + row * num_chunks + c, best_i)

    @triton.jit
    def _combine_kernel(val_ptr, idx_ptr, token_ptr, finite_ptr, num_chunks, C_P: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, C_P)
        valid = offs < num_chunks
        pdl_wait(PDL)
        v = tl.load(val_ptr + row * num_chunks + offs, mask=valid, other=float("-inf"))
        i = tl.load(idx_ptr + row * num_chunks + offs, mask=valid, other=2147483647)
        # the chunks' bests by the same rule (chunks are in index order: a tie goes to the earlier one)
        best, token, has_nan = _tile_best(v, i, valid)
        finite = ~has_nan & (tl.abs(best) < float("inf"))
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(finite_ptr + row, finite.to(tl.int8))


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [R] int64, finite [R] bool) of logits [R, V] (last dim contiguous, any float dtype): each
    row's argmax as torch.argmax picks it, and whether the logit there is finite (see the module docstring)."""
    require(__name__)
    R, V = logits.shape
    if logits.stride(-1) != 1 or V == 0:
        raise ValueError(f"greedy_tokens: logits {tuple(logits.shape)} with strides {logits.stride()}: "
                         "a non-empty, contiguous last dim")
    dev = logits.device
    tokens = torch.empty(R, dtype=torch.int64, device=dev)
    finite = torch.empty(R, dtype=torch.bool, device=dev)
    if R == 0:
        return tokens, finite
    chunk = CHUNK
    while cdiv(V, chunk) > MAX_CHUNKS:
        chunk *= 2
    n = cdiv(V, chunk)
    vals = torch.empty(R, n, dtype=torch.float32, device=dev)
    idxs = torch.empty(R, n, dtype=torch.int32, device=dev)
    pdl = pdl_options(dev)
    _chunk_best_kernel[(R, n)](logits, vals, idxs, V, logits.stride(0), chunk, n, BLOCK=min(chunk, 1024),
                               num_warps=4, **pdl)
    _combine_kernel[(R,)](vals, idxs, tokens, finite.view(torch.int8), n, C_P=triton.next_power_of_2(n),
                          num_warps=1, **pdl)
    return tokens, finite
