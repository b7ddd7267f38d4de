"""A Triton linear layer for decode-sized inputs: y = x @ w.T (+ bias) for x [M, K] with M <= 16 rows.

Why: at batch 1-16 a projection is a weight stream (every weight byte read once, M dot products per
row), and the small projections of the MoE hybrids (10-55 MB: Granite-4.0-H-Tiny's Mamba out_proj is
9.4 MB) are latency-bound under cuBLAS: on the H200 its kernels moved them at 1.4-3.3 TB/s of the
4.3 TB/s copy rate, some with a split-K reduction as a second launch. This kernel is one launch: a
program per BLOCK_N output columns streams its [BLOCK_N, K] weight slab once (evict-first: it is not
reused) and keeps the M x BLOCK_N accumulator in fp32 registers (tl.dot on a 16-row tile; rows past
M are masked to zero, so a row's result does not depend on the others). No split-K, so no second
launch and a fixed summation order.

With programmatic dependent launch (hybrid/ops/triton_guard.py) each program loads the first
PRE_K columns of its slab before waiting for the previous kernel (no kernel writes weights), so the
first weight fetch, the latency a projection of a few MB is bound by, overlaps the kernel before it.

The layers use it for steps of at most MAX_ROWS tokens when HYBRID_DECODE_LINEAR=triton (off by
default until bench/bench_moe.py --linear-ab has measured it in the model: bench/bench_gemv.py
measured it alone, tying cuBLAS). CPU tests run it through Triton's interpreter (tests/test_triton_gemv.py).
"""
from __future__ import annotations

import os

import torch

from hybrid.ops.triton_guard import HAS_TRITON, pdl_options, require, tl, triton
from state_pool.util import cdiv

MAX_ROWS = 16  # tl.dot's smallest tile height: rows past M are masked
PREFETCH_ELEMENTS = 16384  # the slab's first BLOCK_N x PRE_K weights (32 KB in bf16) load before the wait

if HAS_TRITON:
    from hybrid.ops.triton_guard import pdl_wait

    @triton.jit
    def _small_m_linear_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, s_xm, s_wn, s_ym,
                               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, PRE_K: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        mask_n = offs_n < N
        mask_m = offs_m < M
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn
        offs_k = tl.arange(0, PRE_K)
        mask_k = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                    eviction_policy="evict_first")
        pdl_wait(PDL)
        x = tl.load(x_ptr + offs_m[:, None] * s_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w))
        for k0 in range(PRE_K, K, BLOCK_K):
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


_enabled: bool | None = None


def enabled() -> bool:
    """Whether the layers use this kernel for decode-sized steps (HYBRID_DECODE_LINEAR=triton)."""
    global _enabled
    if _enabled is None:
        _enabled = os.environ.get("HYBRID_DECODE_LINEAR", "cublas") == "triton"
    return _enabled


def reset_switch() -> None:
    """Read HYBRID_DECODE_LINEAR again at the next call (benchmarks that compare both)."""
    global _enabled
    _enabled = None


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inputs this kernel serves in the layers: a decode-sized step of 16-bit activations on CUDA."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   out: torch.Tensor | None = None, block_n: int = 32, block_k: int = 256,
                   num_warps: int = 4, num_stages: int = 4, pre_k: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, last dim contiguous) @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype.
    `pre_k`: the columns each program loads before the PDL wait (a power of two; default: up to
    PREFETCH_ELEMENTS weights a program, at least block_k)."""
    require(__name__)
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"small_m_linear takes at most {MAX_ROWS} rows, got {M}")
    if weight.shape[1] != K or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"shapes/strides: x {tuple(x.shape)} {x.stride()}, weight {tuple(weight.shape)} {weight.stride()}")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if pre_k is None:
        pre_k = min(triton.next_power_of_2(K), max(block_k, PREFETCH_ELEMENTS // block_n))
    _small_m_linear_kernel[(cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, PRE_K=pre_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(x.device),
    )
    return out
