"""A weight-streaming matmul for decode-sized batches: out[M, N] = x[M, K] @ W[N, K]^T (+ bias).

At decode batch sizes a projection is a read of its weight matrix and little else; the kernel gives
each program BLOCK_N output columns (BLOCK_N rows of W) over the whole K, so the grid is N / BLOCK_N
programs that each stream one contiguous band of W, with an fp32 accumulator and one rounding at
the end. No split-K: narrow N takes small BLOCK_N instead, which keeps the grid at >= ~2 programs
per SM without a second reduction kernel. x rows are padded to BLOCK_M (>= 16, tl.dot's minimum);
the padded rows cost compute, not bytes.

`skinny_matmul(x, weight, bias=None, config=None)`: config (BLOCK_N, BLOCK_K, num_warps, num_stages)
or None for `default_config`. Triton is imported guarded, as in triton_norm.
"""
from __future__ import annotations

import torch

try:  # guarded: hybrid must import on machines without triton
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False

MAX_M = 64  # larger batches are GEMMs proper: cuBLAS


def is_available() -> bool:
    return HAS_TRITON


if HAS_TRITON:

    @triton.jit
    def _skinny_mm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, s_xm, s_wn, s_om,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr):
        pid_n = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None] * s_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first")
            acc += tl.dot(x, tl.trans(w))
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * s_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(M: int, N: int, K: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): the widest band that still gives >= 2 programs per SM."""
    sms = _sm_count(device)
    block_n = 16
    for bn in (64, 32):
        if N // bn >= 2 * sms:
            block_n = bn
            break
    return block_n, 256, 4, 4


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    if not HAS_TRITON:
        raise RuntimeError("hybrid.ops.triton_gemm needs triton, which is not importable here")
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape == (N, K) and M <= MAX_M, (x.shape, weight.shape)
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    block_n, block_k, num_warps, num_stages = config or default_config(M, N, K, x.device)
    block_m = max(16, triton.next_power_of_2(M))
    _skinny_mm_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
