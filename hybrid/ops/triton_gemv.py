"""A Triton linear layer for decode-sized inputs: y = x @ w.T (+ bias) for x [M, K] with M <= 16 rows.

Why: at batch 1-16 a projection is a weight stream (every weight byte read once, M dot products per
row), and the small projections of the MoE hybrids (10-55 MB: Granite-4.0-H-Tiny's Mamba out_proj is
9.4 MB) are latency-bound under cuBLAS: on the H200 its kernels moved them at 1.4-3.3 TB/s of the
4.3 TB/s copy rate, some with a split-K reduction as a second launch. This kernel is one launch: a
program per BLOCK_N output columns streams its [BLOCK_N, K] weight slab once (evict-first: it is not
reused) and keeps the M x BLOCK_N accumulator in fp32 registers (tl.dot on a 16-row tile; rows past
M are masked to zero). No split-K, so no second launch and a fixed summation order.

Not wired into the layers yet: `bench/bench_gemv.py` compares it with cuBLAS at the models' shapes
first. CPU tests run it through Triton's interpreter (tests/test_triton_gemv.py).
"""
from __future__ import annotations

import torch

from hybrid.ops.triton_guard import HAS_TRITON, require, tl, triton
from state_pool.util import cdiv

MAX_ROWS = 16  # tl.dot's smallest tile height: rows past M are masked

if HAS_TRITON:

    @triton.jit
    def _small_m_linear_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, s_xm, s_wn, s_ym,
                               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        mask_n = offs_n < N
        mask_m = offs_m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * s_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * s_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   out: torch.Tensor | None = None, block_n: int = 32, block_k: int = 256,
                   num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, last dim contiguous) @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype."""
    require(__name__)
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"small_m_linear takes at most {MAX_ROWS} rows, got {M}")
    if weight.shape[1] != K or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"shapes/strides: x {tuple(x.shape)} {x.stride()}, weight {tuple(weight.shape)} {weight.stride()}")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _small_m_linear_kernel[(cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
