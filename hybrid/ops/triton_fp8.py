"""Triton kernels of the FP8 projection (hybrid/fp8_linear.py Fp8Linear) on CUDA.

Why: measured on the H200 (bench/bench_decode.py --fp8 pcpt, BENCHMARKS.md), the 8B shape in FP8
decoded slower than in bf16 at every batch size (155 against 219 tok/s at batch 1), although it
streams half the weight bytes: each projection was ~9 launches, the per-token activation scale
and the e4m3 rounding in separate torch ops around torch._scaled_mm.

- `quantize_rows` (the default before torch._scaled_mm): one launch writing each row's e4m3 values
  and fp32 scale. Alone on the H200 (bench/bench_fp8_gemv.py) it took 13-22 us off each 8B
  projection at batch 1 against the torch ops.
- `fp8_small_m_linear`, decode-sized steps (M <= MAX_ROWS rows): one launch. Alone it lost to
  quantize_rows + torch._scaled_mm at every 8B shape (e.g. 58 against 41 us for the Mamba in_proj at
  batch 1, 99 against 78 us for the MLP down_proj), so projections whose activations are quantized
  take it only when asked (HYBRID_FP8_DECODE_GEMM=triton); weight-only projections take it by
  default (their alternative dequantizes the whole weight each call). A program per
  BLOCK_N output columns streams its [BLOCK_N, K] e4m3 weight slab once (the first tile before the
  PDL wait: no kernel writes weights); with dynamic activation scales it first takes each row's
  absmax over K (the rows are a few KB, read from L2), then quantizes the rows to e4m3 as it goes.
  e4m3 values are exact in bf16 / fp16 and their products in fp32, so the dot on tiles widened to
  the activations' dtype with an fp32 accumulator computes what an e4m3 x e4m3 GEMM does, up to summation order; the scales
  are applied to the accumulator at the end. Weight-only projections (no activation scheme) take
  the bf16 rows as they are.

The rounding is the reference's (fp8_linear.fake_quantize / per_token_scale): x / scale in fp32
(IEEE division, as torch's; Triton's `/` is an approximate one on the GPU),
clamped to +-448, rounded to nearest e4m3; a row's scale is its absmax / 448, floored at
MIN_DYNAMIC_SCALE. quantize_rows on the GPU gets the same bytes with less arithmetic: the IEEE
quotient from the row's reciprocal and a fused-multiply-add correction (no division per value) and
the hardware's fp32 -> e4m3 cast (round to nearest even). CPU tests run the kernels through
Triton's interpreter (tests/test_triton_fp8.py; the correction with the interpreter's fma fused).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from hybrid.ops import triton_act, triton_gemv
from hybrid.ops.triton_guard import HAS_TRITON, arrival_counts, pdl_options, require, tl, triton
from hybrid.quantization import FP8_DTYPE, FP8_MAX, MIN_DYNAMIC_SCALE
from state_pool.util import cdiv

MAX_ROWS = 16  # tl.dot's smallest tile height: rows past M are masked
ACT_NONE, ACT_STATIC, ACT_DYNAMIC = 0, 1, 2

if HAS_TRITON:
    from hybrid.ops.triton_act import relu2_values, silu_mul_values
    from hybrid.ops.triton_gemv import _preload_slab
    from hybrid.ops.triton_guard import pdl_wait

    @triton.jit
    def _round_e4m3(v):
        """fp32 values in [-448, 448] rounded to the nearest e4m3 value (ties to even), in fp32. Done in
        arithmetic rather than by the cast, whose rounding Triton's CPU interpreter gets wrong where
        the mantissa carries into the exponent (31.9 -> 16); the GPU's cast agrees with this. a * 2^(3-e)
        is exact (e: the binade, at least -6, e4m3's subnormal spacing 2^-9), and adding and taking
        away 2^23 rounds it to an integer, ties to even."""
        a = tl.abs(v)
        e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(e, -6)
        up = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3-e)
        down = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e-3)
        r = ((a * up + 8388608.0) - 8388608.0) * down
        sign = (v.to(tl.int32, bitcast=True) >> 31) << 31  # v's sign bit (-0.0 stays -0.0, as torch's cast)
        return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3_values(x, scale):
        """x / scale (IEEE division) clamped to +-448 and rounded to e4m3, in fp32; `scale` broadcasts."""
        return _round_e4m3(tl.clamp(tl.div_rn(x.to(tl.float32), scale), -448.0, 448.0))

    @triton.jit
    def _dynamic_scale(amax, min_scale):
        """A row's dynamic scale from its absmax: amax / 448 (IEEE), floored at min_scale."""
        return tl.maximum(tl.div_rn(amax, 448.0), min_scale)

    @triton.jit
    def _quantized(x, x_scale, ACT: tl.constexpr):
        """Rows x [BLOCK_M, BLOCK_K] as the GEMM sees them, in x's dtype: rounded to e4m3 with their
        scale [BLOCK_M] (ACT static or dynamic), or as they are (ACT none)."""
        if ACT == 0:
            return x
        return _e4m3_values(x, x_scale[:, None]).to(x.dtype)  # exact: every e4m3 value is a 16-bit float

    @triton.jit(do_not_specialize=["M"])  # the step's rows: any value class at run time
    def _fp8_small_m_kernel(x_ptr, w_ptr, w_scale_ptr, in_scale_ptr, bias_ptr, y_ptr, M, N, K, s_xm, s_wn, s_ym,
                            min_scale, ACT: tl.constexpr, W_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PDL: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        mask_n = offs_n < N
        mask_m = offs_m < M
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn
        x_rows = x_ptr + offs_m[:, None] * s_xm
        offs_k = tl.arange(0, BLOCK_K)
        w_first = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0,
                          eviction_policy="evict_first")
        pdl_wait(PDL)
        if ACT == 2:  # dynamic: each row's absmax over K first
            amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + offs_k
                x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
                amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
            x_scale = _dynamic_scale(amax, min_scale)
        elif ACT == 1:
            x_scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(in_scale_ptr)
        else:
            x_scale = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        acc = tl.dot(_quantized(x, x_scale, ACT), tl.trans(w_first.to(x.dtype)))
        for k0 in range(BLOCK_K, K, BLOCK_K):
            ks = k0 + offs_k
            mask_k = ks < K
            x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            acc = tl.dot(_quantized(x, x_scale, ACT), tl.trans(w.to(x.dtype)), acc)
        if W_PER_ROW:
            w_scale = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
        else:
            w_scale = tl.load(w_scale_ptr)
        acc = acc * w_scale
        if ACT != 0:
            acc = acc * x_scale[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * s_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _ieee_quotient(x, s, r):
        """x / s (fp32) correctly rounded, as IEEE division, without a division per value: from
        r = RN(1 / s), q0 = RN(x r) is within an ulp of x / s, and Markstein's correction
        RN(q0 + (x - q0 s) r), with the residual exact in a fused multiply-add, is the correctly
        rounded quotient (valid where nothing over- or underflows: the caller keeps r in
        [2^-100, 2^100]; past 2^20 in magnitude, and for a zero x, q0 is kept, which the clamp to
        +-448 then saturates, or which keeps zero's sign)."""
        q0 = x * r
        q1 = tl.fma(tl.fma(-q0, s, x), r, q0)
        return tl.where((tl.abs(q0) > 1048576.0) | (q0 == 0.0), q0, q1)

    @triton.jit
    def _e4m3_row(x, s, FMA_QUOTIENT: tl.constexpr, HW_CAST: tl.constexpr):
        """Row values x rounded to e4m3 with the row's scale s: clamp(x / s, +-448) to the nearest
        e4m3 (ties to even). FMA_QUOTIENT: the IEEE quotient without a division per value
        (_ieee_quotient), for rows whose reciprocal scale is in range; HW_CAST: the rounding by
        the GPU's fp32 -> e4m3 conversion (round to nearest even, as torch's; Triton's CPU
        interpreter gets that cast wrong, so it runs the arithmetic rounding of _round_e4m3)."""
        xf = x.to(tl.float32)
        if FMA_QUOTIENT:
            r = tl.div_rn(1.0, s)
            if (r > 7.9e-31) & (r < 1.26e30):  # 2^-100 .. 2^100
                q = _ieee_quotient(xf, s, r)
            else:
                q = tl.div_rn(xf, s)
        else:
            q = tl.div_rn(xf, s)
        v = tl.clamp(q, -448.0, 448.0)
        if HW_CAST:
            return v.to(tl.float8e4nv)
        return _round_e4m3(v).to(tl.float8e4nv)  # exact: the value is an e4m3 value

    @triton.jit
    def static_scale(in_scale_ptr, QUANT: tl.constexpr):
        """round_row_into's `in_scale`: the static input scale (QUANT 2), else 1.0 (unused). No kernel writes it, so
        the kernels load it before their PDL wait (after it, it was one more dependent read from HBM)."""
        if QUANT == 2:
            return tl.load(in_scale_ptr).to(tl.float32)
        return 1.0

    @triton.jit
    def round_row_into(y, row, offs, mask, q_ptr, s_q, scale_ptr, in_scale, min_scale, QUANT: tl.constexpr,
                       FMA_QUOTIENT: tl.constexpr, HW_CAST: tl.constexpr):
        """A whole row y (in the dtype it is stored in) rounded to e4m3: QUANT 1, with the row's absmax / 448
        (dynamic); 2, with the static scale `in_scale` (static_scale). Stores the row's scale at scale_ptr[row]
        and its e4m3 values at q_ptr + row * s_q. quantize_rows' one-tile program, and a producer kernel rounding
        the row it stores (a norm: hybrid/ops/triton_norm.py) with the same code."""
        y = tl.where(mask, y, 0.0).to(y.dtype)
        if QUANT == 2:
            s = in_scale
        else:
            s = _dynamic_scale(tl.max(tl.abs(y.to(tl.float32)), axis=0), min_scale)
        tl.store(scale_ptr + row, s)
        tl.store(q_ptr + row * s_q + offs, _e4m3_row(y, s, FMA_QUOTIENT, HW_CAST), mask=mask)

    @triton.jit
    def _activated(x_row, ks, mask, K, ACT: tl.constexpr):
        """The row's columns ks as the projection takes them, in x's dtype: x (ACT 0); relu(x) ** 2 (1); silu(gate)
        * up (2), gate the row's first K columns and up the next K: triton_act's values."""
        x = tl.load(x_row + ks, mask=mask, other=0.0)
        if ACT == 1:
            x = relu2_values(x)
        if ACT == 2:
            x = silu_mul_values(x, tl.load(x_row + K + ks, mask=mask, other=0.0))
        return x

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, in_scale_ptr, K, s_xm, s_qm, min_scale,
                              STATIC: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
                              FMA_QUOTIENT: tl.constexpr, HW_CAST: tl.constexpr, ACT: tl.constexpr,
                              PDL: tl.constexpr):
        # ACT 1 / 2: the rows are the MLP activation of the loaded x (_activated: relu2, or SwiGLU of [gate | up]
        # rows 2K wide), a down_proj's input: the activation's launch and its output's round trip saved
        row = tl.program_id(0).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        in_scale = static_scale(in_scale_ptr, 2 if STATIC else 1)
        pdl_wait(PDL)
        if ONE_TILE:  # the whole row in one tile (BLOCK_K >= K): read once, no dependent loop steps
            mask = offs_k < K
            x = _activated(x_ptr + row * s_xm, offs_k, mask, K, ACT)
            round_row_into(x, row, offs_k, mask, q_ptr, s_qm, scale_ptr, in_scale, min_scale, 2 if STATIC else 1,
                           FMA_QUOTIENT, HW_CAST)
            return
        if STATIC:
            s = in_scale
        else:
            amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + offs_k
                x = _activated(x_ptr + row * s_xm, ks, ks < K, K, ACT)
                amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
            s = _dynamic_scale(tl.max(amax, axis=0), min_scale)
        tl.store(scale_ptr + row, s)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            x = _activated(x_ptr + row * s_xm, ks, ks < K, K, ACT)
            tl.store(q_ptr + row * s_qm + ks, _e4m3_row(x, s, FMA_QUOTIENT, HW_CAST), mask=ks < K)


    @triton.jit
    def _gemv_step(acc, w, x_ptr, s_xm, M, ks, mask_k, rows, M_P: tl.constexpr):
        """acc [M_P, BLOCK_N] plus the weight tile w [BLOCK_N, BLOCK_K] reduced against each row's columns ks."""
        wf = w.to(tl.float32)
        for m in tl.static_range(M_P):
            xm = tl.load(x_ptr + m * s_xm + ks, mask=mask_k & (m < M), other=0.0).to(tl.float32)
            part = tl.sum(wf * xm[None, :], axis=1)
            acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
        return acc

    @triton.jit
    def _gemv_step_quantizing(acc, w, x_ptr, s_xm, M, ks, mask_k, rows, x_scale, FMA_QUOTIENT: tl.constexpr,
                              HW_CAST: tl.constexpr, M_P: tl.constexpr):
        """_gemv_step on 16-bit rows rounded to e4m3 with their scales x_scale [M_P] as they are loaded:
        the values quantize_rows would write (the same _e4m3_row), so the same products and sums."""
        wf = w.to(tl.float32)
        for m in tl.static_range(M_P):
            s = tl.sum(tl.where(rows == m, x_scale, 0.0), axis=0)  # row m's scale (exact: one term)
            xm = tl.load(x_ptr + m * s_xm + ks, mask=mask_k & (m < M), other=0.0)
            xq = _e4m3_row(xm, s, FMA_QUOTIENT, HW_CAST).to(tl.float32)
            part = tl.sum(wf * xq[None, :], axis=1)
            acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
        return acc

    @triton.jit
    def _gemv_row_scales(x_ptr, in_scale_ptr, s_xm, M, K, min_scale, rows, QUANT: tl.constexpr,
                         M_P: tl.constexpr, BLOCK_K: tl.constexpr):
        """The rows' e4m3 scales [M_P] as quantize_rows takes them: the static input scale (QUANT 1), or
        each row's absmax over K / 448 floored at min_scale (QUANT 2; max is exact in any order)."""
        if QUANT == 1:
            return tl.zeros((M_P,), dtype=tl.float32) + tl.load(in_scale_ptr)
        offs_k = tl.arange(0, BLOCK_K)
        amax = tl.zeros((M_P,), dtype=tl.float32)
        for m in tl.static_range(M_P):
            a = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + offs_k
                x = tl.load(x_ptr + m * s_xm + ks, mask=(ks < K) & (m < M), other=0.0)
                a = tl.maximum(a, tl.abs(x.to(tl.float32)))
            amax = tl.where(rows == m, tl.max(a, axis=0), amax)
        return tl.where(rows < M, _dynamic_scale(amax, min_scale), 1.0)

    @triton.jit(do_not_specialize=["M"])
    def _fp8_gemv_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, y_ptr, M, N, K, s_xm, s_wn, s_ym,
                         min_scale, HAS_X_SCALE: tl.constexpr, QUANT: tl.constexpr, FMA_QUOTIENT: tl.constexpr,
                         HW_CAST: tl.constexpr, W_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                         M_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        # y[m, n] = sum_k x[m, k] w[n, k] * x_scale[m] * w_scale[n]: each program's [BLOCK_N, BLOCK_K] e4m3
        # weight tile is loaded once per K step and reduced against every row m in turn (no tl.dot:
        # with M <= 4 rows a 16-row tile would be mostly padding); products in fp32 (exact for e4m3
        # operands), sums in fp32. x: e4m3 rows with their scales (HAS_X_SCALE), 16-bit rows as they
        # are (weight-only), or 16-bit rows that every program rounds to e4m3 itself (QUANT 1: with
        # the static scale at x_scale_ptr, 2: with each row's dynamic scale), which is one launch
        # where quantize_rows and then this kernel are two, for the same bytes
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        rows = tl.arange(0, M_P)
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0,
                    eviction_policy="evict_first")  # no kernel writes weights: before the wait
        pdl_wait(PDL)
        acc = tl.zeros((M_P, BLOCK_N), dtype=tl.float32)
        if QUANT != 0:
            x_scale = _gemv_row_scales(x_ptr, x_scale_ptr, s_xm, M, K, min_scale, rows, QUANT, M_P, BLOCK_K)
            acc = _gemv_step_quantizing(acc, w, x_ptr, s_xm, M, offs_k, offs_k < K, rows, x_scale, FMA_QUOTIENT,
                                        HW_CAST, M_P)
        else:
            acc = _gemv_step(acc, w, x_ptr, s_xm, M, offs_k, offs_k < K, rows, M_P)
        for k0 in range(BLOCK_K, K, BLOCK_K):  # the first step peeled off: the loop's loads pipeline
            ks = k0 + offs_k
            mask_k = ks < K
            w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
            if QUANT != 0:
                acc = _gemv_step_quantizing(acc, w, x_ptr, s_xm, M, ks, mask_k, rows, x_scale, FMA_QUOTIENT,
                                            HW_CAST, M_P)
            else:
                acc = _gemv_step(acc, w, x_ptr, s_xm, M, ks, mask_k, rows, M_P)
        if W_PER_ROW:
            acc = acc * tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
        else:
            acc = acc * tl.load(w_scale_ptr)
        if QUANT != 0:
            acc = acc * x_scale[:, None]
        elif HAS_X_SCALE:
            acc = acc * tl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * s_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows < M)[:, None] & mask_n[None, :])


if HAS_TRITON:

    @triton.jit
    def _preload_x_piece(x_ptr, k0, K, KP: tl.constexpr):
        """[KP] in x's dtype: the row's columns [k0, k0 + KP) (zero past K)."""
        offs_k = k0 + tl.arange(0, KP)
        return tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)

    @triton.jit
    def _preload_piece_dot(w, x, s, QUANT: tl.constexpr, FMA_QUOTIENT: tl.constexpr, HW_CAST: tl.constexpr):
        """fp32 [BLOCK_N]: a slab piece against the row's piece, the row rounded to e4m3 with its scale s
        (QUANT 1 / 2: as quantize_rows' _e4m3_row) or as it is (QUANT 0; 3: e4m3 already), a tree over the
        piece's columns."""
        if QUANT == 0 or QUANT == 3:  # as it is (weight-only), or already e4m3 (quantize_rows' row)
            xv = x.to(tl.float32)
        else:
            xv = _e4m3_row(x, s, FMA_QUOTIENT, HW_CAST).to(tl.float32)
        return tl.sum(w.to(tl.float32) * xv[None, :], axis=1)

    @triton.jit
    def _fp8_preload_kernel(x_ptr, w_ptr, w_scale_ptr, in_scale_ptr, bias_ptr, y_ptr, N, K, s_wn, min_scale,
                            QUANT: tl.constexpr, FMA_QUOTIENT: tl.constexpr, HW_CAST: tl.constexpr,
                            W_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                            K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr, PDL: tl.constexpr):
        # One token's FP8 projection, the program's whole e4m3 weight slab (BLOCK_N columns, all of K as
        # k_pieces) asked for before the PDL wait with its scales and bias (no kernel writes them), as
        # triton_gemv's preloading kernels do for 16-bit weights; after the wait the 16-bit row (a few KB,
        # from L2), its dynamic scale (absmax over K / 448) or the static one, the row rounded to e4m3 as
        # quantize_rows would, and the dot on CUDA cores: products exact in fp32, summed piece by piece.
        # QUANT 3: the row is quantize_rows' e4m3 output, its scale at in_scale_ptr (every program rounding
        # the whole row itself costs ~15 instructions a value: past a few thousand columns a program, as
        # the MLP down_proj's one column of K 21504, more than its weights take to stream)
        offs_n, mask_n, w1, w2, w3 = _preload_slab(w_ptr, N, K, s_wn, BLOCK_N, K1, K2, K3)
        if W_PER_ROW:
            w_scale = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)
        else:
            w_scale = tl.load(w_scale_ptr)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        s = 1.0
        if QUANT == 1:
            s = tl.load(in_scale_ptr)
        pdl_wait(PDL)
        x1 = _preload_x_piece(x_ptr, 0, K, K1)
        x2 = x1
        x3 = x1
        if K2 > 0:
            x2 = _preload_x_piece(x_ptr, K1, K, K2)
        if K3 > 0:
            x3 = _preload_x_piece(x_ptr, K1 + K2, K, K3)
        if QUANT == 3:  # the row's scale, written with it by quantize_rows (the kernel before)
            s = tl.load(in_scale_ptr)
        if QUANT == 2:  # (max is exact in any order: the row's scale as quantize_rows takes it)
            amax = tl.max(tl.abs(x1.to(tl.float32)), axis=0)
            if K2 > 0:
                amax = tl.maximum(amax, tl.max(tl.abs(x2.to(tl.float32)), axis=0))
            if K3 > 0:
                amax = tl.maximum(amax, tl.max(tl.abs(x3.to(tl.float32)), axis=0))
            s = _dynamic_scale(amax, min_scale)
        acc = _preload_piece_dot(w1, x1, s, QUANT, FMA_QUOTIENT, HW_CAST)
        if K2 > 0:
            acc += _preload_piece_dot(w2, x2, s, QUANT, FMA_QUOTIENT, HW_CAST)
        if K3 > 0:
            acc += _preload_piece_dot(w3, x3, s, QUANT, FMA_QUOTIENT, HW_CAST)
        acc = acc * w_scale
        if QUANT != 0:
            acc = acc * s
        if HAS_BIAS:
            acc += bias
        tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


# fp8_preload_gemv: this many e4m3 weights a program (32 KB, the bytes of triton_gemv's 16K 16-bit ones), and K of
# at most PRELOAD_MAX_K (the MLP down_proj's 21504 of the 8B shape: one column a program)
PRELOAD_ELEMENTS = 32768
PRELOAD_MAX_K = 32768


def _preload_round_max_k() -> int:
    """Rows of at most this many columns are rounded to e4m3 inside fp8_preload_gemv by every program, wider ones
    once by quantize_rows before it: 8192 (the 8B shape's in_proj, qkv, o_proj, up_proj and Mamba out_proj round
    inside, its MLP down_proj, K 21504, before), or HYBRID_FP8_PRELOAD_ROUND_MAX_K (0: every row before; the A/B)."""
    return int(os.environ.get("HYBRID_FP8_PRELOAD_ROUND_MAX_K", 8192))


def fp8_preload_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, *, quantize: int = ACT_NONE,
                     input_scale: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                     block_n: int | None = None, num_warps: int = 4, fma_quotient: bool | None = None,
                     hw_cast: bool | None = None, act: str | None = None) -> torch.Tensor:
    """One token's y [1, N] = (x [1, K] rounded to e4m3 per `quantize`, as fp8_gemv(quantize=...) and
    quantize_rows) @ (weight [N, K] e4m3 * weight_scale).T (+ bias), one launch whose programs ask for their
    whole weight slab before the PDL wait (the "fp8_preload" switch). `quantize`: ACT_NONE (weight-only: x as
    it is), ACT_STATIC (the 0-dim `input_scale`) or ACT_DYNAMIC (the row's absmax / 448). `weight_scale`:
    fp32, 0-dim or [N]. `block_n` default: PRELOAD_ELEMENTS weights a program (triton_gemv.preload_tiles).
    The same e4m3 values and products as fp8_gemv; the sums in another order (piece by piece). Rows of more
    than _preload_round_max_k() columns are rounded by quantize_rows first (the same values, one launch more).
    `act` (a down_proj's input): x is the MLP's pre-activation row (as quantize_rows' `act` takes it: [1, K],
    or [1, 2K] of [gate | up]); the activation runs in that quantize_rows launch where the row is rounded before,
    else in its own launch first."""
    require(__name__)
    M, K = x.shape[0], weight.shape[1]
    N = weight.shape[0]
    width = 2 * K if act == "silu_and_mul" else K
    if M != 1 or x.shape[1] != width or K > PRELOAD_MAX_K or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"fp8_preload_gemv: x {tuple(x.shape)} {x.stride()}, weight {tuple(weight.shape)}, act {act}"
                         f" (one row, K <= {PRELOAD_MAX_K}, last dims contiguous)")
    if x.dtype == FP8_DTYPE or (quantize == ACT_STATIC) != (input_scale is not None):
        raise ValueError("fp8_preload_gemv: 16-bit rows, and input_scale exactly when static")
    quant = quantize
    if quantize != ACT_NONE and K > _preload_round_max_k():  # the row rounded once, by quantize_rows
        x, x_scale = quantize_rows(x, input_scale, fma_quotient=fma_quotient, hw_cast=hw_cast, act=act)
        quant, input_scale = 3, x_scale
    elif act is not None:
        x = triton_act.by_name(x, act)
    block_n, k1, k2, k3 = triton_gemv.preload_tiles(K, block_n, PRELOAD_ELEMENTS)
    y = torch.empty(1, N, dtype=out_dtype, device=x.device)
    _fp8_preload_kernel[(cdiv(N, block_n),)](
        x, weight, weight_scale, input_scale if input_scale is not None else weight_scale,
        bias if bias is not None else weight_scale, y, N, K, weight.stride(0), MIN_DYNAMIC_SCALE, QUANT=quant,
        FMA_QUOTIENT=not _INTERPRETED if fma_quotient is None else fma_quotient,
        HW_CAST=not _INTERPRETED if hw_cast is None else hw_cast, W_PER_ROW=weight_scale.dim() == 1,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, K1=k1, K2=k2, K3=k3, num_warps=num_warps,
        **pdl_options(x.device),
    )
    return y


def preload_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inputs fp8_preload_gemv serves in Fp8Linear: eligible(), one row of at most PRELOAD_MAX_K columns."""
    return eligible(x, weight) and x.shape[0] == 1 and x.shape[1] <= PRELOAD_MAX_K


GEMV_MAX_ROWS = 4  # fp8_gemv reduces the weight tile against each row in turn
# fp8_gemv's program walks all of K alone: measured on the H200 (bench/bench_fp8_gemv.py, 2026-12-02) it beat
# the tensor-wise _scaled_mm path on every 8B projection of K 4096 / 8192 (e.g. 19.6 against 23.6 + 3.4 us for
# the Mamba in_proj) and lost on the MLP down_proj's K 21504 (38.5 against 26.3 us for the GEMM alone), so
# Fp8Linear sends it the projections of K up to this many columns
GEMV_MAX_K = 8192


def fp8_gemv(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None, *, quantize: int = ACT_NONE, input_scale: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.bfloat16, block_n: int | None = None, block_k: int = 512,
             num_warps: int = 4, num_stages: int = 4, fma_quotient: bool | None = None,
             hw_cast: bool | None = None) -> torch.Tensor:
    """y [M, N] = (x [M, K] * x_scale) @ (weight [N, K] e4m3 * weight_scale).T (+ bias), M <= GEMV_MAX_ROWS:
    x is e4m3 rows with their scales [M, 1] (quantize_rows' output: a quantized-activation scheme) or
    16-bit rows with x_scale None (weight-only). `quantize` ACT_STATIC (with the 0-dim `input_scale`) or
    ACT_DYNAMIC: x is 16-bit rows (x_scale None) that the kernel rounds to e4m3 as quantize_rows would,
    in the same launch: the same bytes as quantize_rows then this, one launch fewer. `weight_scale`:
    fp32, 0-dim or [N]. The default tiling is the H200's best at one row over the 8B projections
    (bench/bench_fp8_gemv.py, 2026-12-02): 8 columns a program up to 8192 outputs, 16 up to 20480, 32
    above, K steps of 512 (2.0-3.9 TB/s, against 1.0-2.6 for the 16 x 256 it replaced), 4 warps (all of K
    in one tile, 8 warps, so that a slab loads before the PDL wait as triton_gemv's preloading kernels do,
    lost 21% on the FP8 8B at batch 1 on an H100: BENCHMARKS.md).
    `fma_quotient` / `hw_cast` (tests): as quantize_rows'."""
    require(__name__)
    M, K = x.shape
    N = weight.shape[0]
    if block_n is None:
        block_n = 8 if N <= 8192 else (16 if N <= 20480 else 32)
    if not 0 < M <= GEMV_MAX_ROWS or weight.shape[1] != K or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} {x.stride()}, weight {tuple(weight.shape)} "
                         f"(1 to {GEMV_MAX_ROWS} rows, last dims contiguous)")
    if x_scale is not None and (x_scale.numel() != M or not x_scale.is_contiguous()):
        raise ValueError(f"fp8_gemv: x_scale must hold one contiguous scale per row ({M}), got {tuple(x_scale.shape)}")
    if quantize != ACT_NONE and (x_scale is not None or x.dtype == FP8_DTYPE
                                 or (quantize == ACT_STATIC) != (input_scale is not None)):
        raise ValueError("fp8_gemv: quantize takes 16-bit rows without x_scale, and input_scale exactly when static")
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    scale_arg = x_scale if x_scale is not None else (input_scale if input_scale is not None else weight_scale)
    _fp8_gemv_kernel[(cdiv(N, block_n),)](
        x, scale_arg, weight, weight_scale, bias if bias is not None else weight_scale, y, M, N, K, x.stride(0),
        weight.stride(0), y.stride(0), MIN_DYNAMIC_SCALE, HAS_X_SCALE=x_scale is not None, QUANT=quantize,
        FMA_QUOTIENT=not _INTERPRETED if fma_quotient is None else fma_quotient,
        HW_CAST=not _INTERPRETED if hw_cast is None else hw_cast, W_PER_ROW=weight_scale.dim() == 1,
        HAS_BIAS=bias is not None, M_P=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(x.device),
    )
    return y


def gemv_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inputs fp8_gemv serves in Fp8Linear: eligible(), with at most GEMV_MAX_ROWS rows of at most GEMV_MAX_K."""
    return eligible(x, weight) and x.shape[0] <= GEMV_MAX_ROWS and x.shape[1] <= GEMV_MAX_K


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inputs fp8_small_m_linear serves: a decode-sized step of 16-bit rows (last dim contiguous) on a
    CUDA device with e4m3 (compute capability 8.9+), an e4m3 weight [N, K]."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == FP8_DTYPE and x.stride(-1) == 1 and weight.stride(-1) == 1
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def fp8_small_m_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, activation: int,
                       input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                       block_n: int | None = None, block_k: int = 256, num_warps: int = 4,
                       num_stages: int = 4) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ (weight [N, K] e4m3 * weight_scale).T (+ bias) -> [M, N] in x's dtype,
    with x rounded to e4m3 per `activation` (ACT_NONE, ACT_STATIC with the 0-dim fp32 `input_scale`,
    ACT_DYNAMIC: per row). `weight_scale`: fp32, 0-dim or [N]. `block_n` default: 32 columns a
    program for wide projections, 16 below 8192 outputs (more programs for the SMs)."""
    require(__name__)
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_ROWS or weight.shape[1] != K:
        raise ValueError(f"fp8_small_m_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)} (at most {MAX_ROWS} rows)")
    if activation == ACT_STATIC and input_scale is None:
        raise ValueError("fp8_small_m_linear: a static activation scheme needs input_scale")
    if block_n is None:
        block_n = 32 if N >= 8192 else 16
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _fp8_small_m_kernel[(cdiv(N, block_n),)](
        x, weight, weight_scale, input_scale if input_scale is not None else weight_scale,
        bias if bias is not None else weight_scale, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        MIN_DYNAMIC_SCALE, ACT=activation, W_PER_ROW=weight_scale.dim() == 1, HAS_BIAS=bias is not None,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        **pdl_options(x.device),
    )
    return y


# Rows of at most this many elements are quantized from one register tile (read once). On the H200
# the 1024-wide loop took 11.6 us for one 21504-wide row (bench/bench_fp8_gemv.py): two passes of 21
# dependent loads each, against 3.3 us for a 4096-wide row.
ONE_TILE_MAX_K = 32768
# Many wide rows (a prefill's down_proj inputs, K 21504) loop over the row in tiles of LOOPED_BLOCK_K at LOOPED_WARPS
# instead: measured on an H100 (bench/bench_quantize_rows.py, 8192 rows) 231 against 279 us (relu2 inside: 236
# against 286), where one 32-warp program a row held the row in registers; at 64 rows the one tile wins (4.5
# against 5.8 us). Rows of K <= 8192 read at the copy rate either way.
LOOPED_MIN_ROWS = 1024
LOOPED_MIN_K = 8192
LOOPED_BLOCK_K = 4096
LOOPED_WARPS = 8


# quantize_rows on the GPU: the quotients without a division per value and the rounding by the
# hardware cast (its arithmetic was 23 ms of the 8B shape's 8K FP8 prefill on the H200: an IEEE
# division and the arithmetic e4m3 rounding for each of 7.5 G values, e776d08). Under Triton's CPU
# interpreter the division and the arithmetic rounding (its cast is wrong; its fma is not fused).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


ACTIVATIONS = {None: 0, "relu2": 1, "silu_and_mul": 2}  # quantize_rows' `act`, as its kernel's ACT


ROUND_NONE, ROUND_DYNAMIC, ROUND_STATIC = 0, 1, 2  # round_row_into's QUANT


@dataclass(frozen=True)
class RowRounding:
    """Rows' e4m3 rounding written by the kernel that produced them (a norm: hybrid/ops/triton_norm), as
    quantize_rows would write it: q [M, K] e4m3 and scales [M, 1] fp32; `input_scale` the static scale they were
    rounded with (the consumer's own tensor), or None (each row's absmax / 448)."""
    q: torch.Tensor
    scales: torch.Tensor
    input_scale: torch.Tensor | None


def rounding_outputs(rows: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[RowRounding, dict]:
    """For a producer kernel writing rows [M, K] that also rounds them (round_row_into): the RowRounding its launch
    fills, and the launch's keywords (q_ptr, s_q, scale_ptr, in_scale_ptr, min_scale, QUANT, FMA_QUOTIENT, HW_CAST)."""
    M, K = rows.shape
    out = RowRounding(torch.empty(M, K, dtype=FP8_DTYPE, device=rows.device),
                      torch.empty(M, 1, dtype=torch.float32, device=rows.device), input_scale)
    args = dict(q_ptr=out.q, s_q=out.q.stride(0), scale_ptr=out.scales,
                in_scale_ptr=input_scale if input_scale is not None else out.scales, min_scale=MIN_DYNAMIC_SCALE,
                QUANT=ROUND_STATIC if input_scale is not None else ROUND_DYNAMIC,
                FMA_QUOTIENT=not _INTERPRETED, HW_CAST=not _INTERPRETED)
    return out, args


def no_rounding(rows: torch.Tensor) -> dict:
    """A producer launch's keywords for round_row_into when it does not round its rows (QUANT 0: compiled out)."""
    return dict(q_ptr=rows, s_q=0, scale_ptr=rows, in_scale_ptr=rows, min_scale=0.0, QUANT=ROUND_NONE,
                FMA_QUOTIENT=False, HW_CAST=False)


# The rounding rides on the rows tensor itself (a Python attribute): whatever reshapes or copies the rows drops it,
# and the consumer then rounds them itself, so a rounding can only ever be taken with the rows it was made from.
_ROUNDING_ATTR = "_hybrid_e4m3_rounding"


def attach_rounding(rows: torch.Tensor, rounding: RowRounding) -> torch.Tensor:
    setattr(rows, _ROUNDING_ATTR, rounding)
    return rows


def rounding_of(rows: torch.Tensor, input_scale: torch.Tensor | None) -> RowRounding | None:
    """The rounding attached to these rows (attach_rounding) if it was made with this scheme: the same static
    scale tensor, or dynamic scales for a dynamic consumer; else None."""
    r = getattr(rows, _ROUNDING_ATTR, None)
    if r is None or r.input_scale is not input_scale:
        return None
    return r


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                  block_k: int | None = None, *, fma_quotient: bool | None = None,
                  hw_cast: bool | None = None, act: str | None = None,
                  num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) rounded to e4m3: (q [M, K] e4m3, scales [M, 1] fp32), each row with
    its own absmax / 448 scale, or with the 0-dim fp32 `input_scale` (static) for every row.
    `block_k` (tests): loop over the row in tiles of this width; default: one tile up to ONE_TILE_MAX_K.
    `fma_quotient` / `hw_cast` (tests): see _e4m3_row; default: on, off under the interpreter.
    `act` (an MLP's down_proj input, the activation in this launch): "relu2", the rows rounded are relu(x) ** 2
    (as triton_act.relu2 writes them); "silu_and_mul", x is [M, 2K] rows of [gate | up] and the rows rounded are
    silu(gate) * up (as triton_act.silu_and_mul writes them). `num_warps` (benchmarks): a program's warps; default
    one per 1024 columns of its tile, 4 to 32."""
    require(__name__)
    if act not in ACTIVATIONS:
        raise ValueError(f"quantize_rows: act {act!r}, one of {sorted(a for a in ACTIVATIONS if a)} or None")
    M, K = x.shape
    if act == "silu_and_mul":
        if K % 2:
            raise ValueError(f"quantize_rows: silu_and_mul takes [gate | up] rows of an even width, got {K}")
        K //= 2
    if x.stride(-1) != 1:
        raise ValueError(f"quantize_rows: the rows' last dim must be contiguous, got strides {x.stride()}")
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        width = triton.next_power_of_2(K)
        wide_many = M >= LOOPED_MIN_ROWS and K > LOOPED_MIN_K
        if block_k is None:
            block_k = LOOPED_BLOCK_K if wide_many else width if width <= ONE_TILE_MAX_K else 1024
        block_k = min(block_k, width)
        one_tile = block_k >= K
        # at most 32 values a thread (the row stays live in registers)
        warps = num_warps or (LOOPED_WARPS if wide_many and block_k == LOOPED_BLOCK_K else
                              max(4, min(32, block_k // 1024)))
        _quantize_rows_kernel[(M,)](
            x, q, scales, input_scale if input_scale is not None else scales, K, x.stride(0), q.stride(0),
            MIN_DYNAMIC_SCALE, STATIC=input_scale is not None, BLOCK_K=block_k, ONE_TILE=one_tile,
            FMA_QUOTIENT=not _INTERPRETED if fma_quotient is None else fma_quotient,
            HW_CAST=not _INTERPRETED if hw_cast is None else hw_cast, ACT=ACTIVATIONS[act], num_warps=warps,
            **pdl_options(x.device),
        )
    return q, scales


if HAS_TRITON:

    @triton.jit(do_not_specialize=["s_as"])  # (M x N between the split-K partials: follows the step's rows)
    def _scale_accumulator_kernel(acc_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, y_ptr, N, s_am, s_ym, splits, s_as,
                                  W_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                                  PDL: tl.constexpr):
        # y[m, n] = acc[m, n] * x_scale[m] * w_scale[n] (+ bias[n]), rounded once to y's dtype; acc the sum of
        # `splits` partial products (fp8_splitk_gemm's, added in split order) a row s_as apart
        m = tl.program_id(0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = offs_n < N
        if W_PER_ROW:  # weight scales and bias are written by no kernel: loaded before the wait
            w_scale = tl.load(w_scale_ptr + offs_n, mask=mask, other=0.0)
        else:
            w_scale = tl.load(w_scale_ptr)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
        pdl_wait(PDL)
        acc = tl.load(acc_ptr + m * s_am + offs_n, mask=mask, other=0.0)
        for split in range(1, splits):
            acc += tl.load(acc_ptr + split * s_as + m * s_am + offs_n, mask=mask, other=0.0)
        y = acc * tl.load(x_scale_ptr + m) * w_scale
        if HAS_BIAS:
            y += bias
        tl.store(y_ptr + m * s_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask)


def scale_accumulator(acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The fp32 product acc [M, N] of e4m3 operands (a unit-scaled torch._scaled_mm) times each row's
    scale x_scale [M, 1] and each column's weight_scale (0-dim or [N]), plus bias [N], rounded once to
    out_dtype: what a row-wise scaled GEMM writes, in one launch after the tensor-wise one. acc may also be
    [S, M, N], S partial products over slices of K (fp8_splitk_gemm's): their sum in slice order."""
    require(__name__)
    parts = acc if acc.dim() == 3 else acc.unsqueeze(0)
    _, M, N = parts.shape
    if parts.dtype != torch.float32 or parts.stride(-1) != 1 or x_scale.numel() != M or not x_scale.is_contiguous():
        raise ValueError(f"scale_accumulator: acc {tuple(acc.shape)} {acc.dtype} {acc.stride()}, "
                         f"x_scale {tuple(x_scale.shape)}: an fp32 accumulator and one contiguous scale per row")
    y = torch.empty(M, N, dtype=out_dtype, device=acc.device)
    if M:
        block = min(1024, triton.next_power_of_2(N))
        _scale_accumulator_kernel[(M, cdiv(N, block))](
            parts, x_scale, weight_scale, bias if bias is not None else weight_scale, y, N, parts.stride(1),
            y.stride(0), parts.shape[0], parts.stride(0), W_PER_ROW=weight_scale.dim() == 1,
            HAS_BIAS=bias is not None, BLOCK_N=block, num_warps=4, **pdl_options(acc.device),
        )
    return y


if HAS_TRITON:

    @triton.jit(do_not_specialize=["M", "s_ps"])  # the step's rows, and M x N between the partials
    def _fp8_splitk_kernel(x_ptr, w_ptr, p_ptr, M, N, k_per_split, s_xm, s_wn, s_ps, s_pm,
                           count_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, y_ptr, s_ym,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           REDUCE: tl.constexpr, W_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        # partial[split, m, n] = sum over k in the split's slice of K of x[m, k] * w[n, k], e4m3 x e4m3 on the
        # tensor cores: each K step's product in its own accumulator added to the fp32 sum
        # (max_num_imprecise_acc = BLOCK_K), as cuBLASLt's FP8 GEMM without fast accumulation. The slice is whole
        # K steps (the caller's split), so only rows past M and columns past N are masked
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        k_lo = tl.program_id(1) * k_per_split
        mask_m = offs_m < M
        mask_n = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None] * s_xm + (k_lo + offs_k)[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn + (k_lo + offs_k)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        pdl_wait(PDL)  # (x: quantize_rows' launch just before)
        for _ in range(0, k_per_split, BLOCK_K):
            a = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        mask = mask_m[:, None] & mask_n[None, :]
        p_tile = p_ptr + offs_m[:, None] * s_pm + offs_n[None, :]
        tl.store(p_tile + tl.program_id(1) * s_ps, acc, mask=mask)
        if REDUCE:
            # The column tile's last program to finish adds the S partials in split order and applies the scales, as
            # _scale_accumulator_kernel does (the same values, bit for bit): no launch of its own. The count is
            # taken after every thread's store (barrier, then a release / acquire at GPU scope) and set back to 0 by
            # that last program, ready for the next launch (a graph replays it)
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(1) - 1:
                tl.atomic_xchg(count_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")
                total = tl.load(p_tile, mask=mask, other=0.0, cache_modifier=".cg")
                for split in range(1, tl.num_programs(1)):
                    total += tl.load(p_tile + split * s_ps, mask=mask, other=0.0, cache_modifier=".cg")
                if W_PER_ROW:
                    w_scale = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)
                else:
                    w_scale = tl.load(w_scale_ptr)
                y = total * tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None] * w_scale
                if HAS_BIAS:
                    y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptr + offs_m[:, None] * s_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


# fp8_splitk_gemm's tiles: BLOCK_N output columns a program, K steps of BLOCK_K, at most SPLITK_MAX_ROWS rows (one
# tl.dot tile high); splits chosen so that there are about SPLITK_PROGRAMS programs
SPLITK_BLOCK_N = 64
SPLITK_BLOCK_K = 128
SPLITK_MAX_ROWS = 64
SPLITK_PROGRAMS = 264


@functools.lru_cache(maxsize=None)  # (a weight's shape: asked by every decode step's projection)
def splitk_splits(N: int, K: int, block_n: int = SPLITK_BLOCK_N, block_k: int = SPLITK_BLOCK_K,
                  programs: int = SPLITK_PROGRAMS) -> int:
    """How many slices of K fp8_splitk_gemm cuts a [N, K] weight into: the most whole-K-step divisor of K's steps
    that keeps the programs (column tiles x slices) at about SPLITK_PROGRAMS (two an SM of an H100 / H200).
    The tiling and program count: the defaults, or a benchmark's sweep (bench/bench_fp8_splitk.py)."""
    steps, tiles = K // block_k, cdiv(N, block_n)
    want = max(1, programs // tiles)
    return max(d for d in range(1, min(steps, want) + 1) if steps % d == 0)


def splitk_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inputs fp8_splitk_gemm serves: e4m3 rows [M <= SPLITK_MAX_ROWS, K] and weight [N, K], K whole K steps,
    both row-major."""
    return (x.dim() == 2 and weight.dim() == 2 and x.dtype == FP8_DTYPE and weight.dtype == FP8_DTYPE
            and 1 <= x.shape[0] <= SPLITK_MAX_ROWS and x.shape[1] == weight.shape[1]
            and x.shape[1] % SPLITK_BLOCK_K == 0 and x.stride(1) == 1 and weight.stride(1) == 1)


def fp8_splitk_gemm(xq: torch.Tensor, weight: torch.Tensor, splits: int | None = None, *,
                    block_n: int = SPLITK_BLOCK_N, block_k: int = SPLITK_BLOCK_K, num_warps: int = 4,
                    num_stages: int = 4) -> torch.Tensor:
    """The unscaled products of e4m3 rows xq [M, K] (M <= SPLITK_MAX_ROWS) with an e4m3 weight [N, K], as S partial
    sums over slices of K: fp32 [S, M, N], for scale_accumulator (which adds them in order). Why: at decode sizes
    cuBLASLt's tensor-wise FP8 GEMM tiles N = 4096 into ~30-45 programs and streams the weight at 1.0-2.3 TB/s
    (the 8B shape's out_proj and down_proj at batch 64, H100); split over K there are ~256 programs.
    `block_n`, `block_k`, `num_warps`, `num_stages` (benchmarks): the tiling; K must be whole steps of block_k."""
    parts = _splitk_partials(xq, weight, splits, block_k, block_n, "fp8_splitk_gemm")
    _launch_splitk(xq, weight, parts, None, block_n, block_k, num_warps, num_stages)
    return parts


def _splitk_partials(xq: torch.Tensor, weight: torch.Tensor, splits: int | None, block_k: int, block_n: int,
                     caller: str) -> torch.Tensor:
    """The fp32 partials buffer [S, M, N] of a split-K launch, after checking its operands and split count."""
    require(__name__)
    if not splitk_eligible(xq, weight) or xq.shape[1] % block_k:
        raise ValueError(f"{caller}: x {tuple(xq.shape)} {xq.dtype} {xq.stride()}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}: e4m3 rows (1 to {SPLITK_MAX_ROWS}) and weight, K a multiple of "
                         f"{block_k}, row-major")
    M, K = xq.shape
    N = weight.shape[0]
    splits = splits or splitk_splits(N, K, block_n, block_k)
    if (K // block_k) % splits:
        raise ValueError(f"{caller}: {splits} splits do not cut K {K} into whole steps of {block_k}")
    return torch.empty(splits, M, N, dtype=torch.float32, device=xq.device)


def _launch_splitk(xq: torch.Tensor, weight: torch.Tensor, parts: torch.Tensor, reduce: tuple | None, block_n: int,
                   block_k: int, num_warps: int, num_stages: int) -> None:
    """_fp8_splitk_kernel over parts [S, M, N]; `reduce`: (x_scale, weight_scale, bias, y) for the last program of
    each column tile to sum the partials and scale them into y (fp8_splitk_linear), or None (the partials alone)."""
    splits, M, N = parts.shape
    K = xq.shape[1]
    if reduce is None:  # (the reduce's arguments unused: any pointer)
        count = x_scale = w_scale = bias = y = parts
        has_bias, s_ym = False, 0
    else:
        x_scale, w_scale, bias, y = reduce
        count = _tile_counts(xq.device, cdiv(N, block_n))
        has_bias, s_ym = bias is not None, y.stride(0)
        bias = bias if has_bias else w_scale
    _fp8_splitk_kernel[(cdiv(N, block_n), splits)](
        xq, weight, parts, M, N, K // splits, xq.stride(0), weight.stride(0), parts.stride(0), parts.stride(1),
        count, x_scale, w_scale, bias, y, s_ym,
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, REDUCE=reduce is not None,
        W_PER_ROW=reduce is not None and w_scale.dim() == 1, HAS_BIAS=has_bias,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(xq.device),
    )


def _tile_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """The arrival counts of fp8_splitk_linear's column tiles on `device` (triton_guard.arrival_counts), at least
    1024 so that the widths of one model share one buffer."""
    return arrival_counts("fp8_splitk_linear", device, max(1024, tiles))


def fp8_splitk_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, *, out_dtype: torch.dtype = torch.bfloat16,
                      splits: int | None = None, block_n: int = SPLITK_BLOCK_N, block_k: int = SPLITK_BLOCK_K,
                      num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """scale_accumulator(fp8_splitk_gemm(xq, weight), x_scale, weight_scale, bias) in one launch: the last program of
    each column tile to finish adds the partials (in split order) and applies the scales, so the values are those of
    the two launches, bit for bit. x_scale [M, 1] fp32 contiguous; weight_scale 0-dim or [N]; bias [N] or None."""
    parts = _splitk_partials(xq, weight, splits, block_k, block_n, "fp8_splitk_linear")
    _, M, N = parts.shape
    if x_scale.numel() != M or not x_scale.is_contiguous() or x_scale.dtype != torch.float32:
        raise ValueError(f"fp8_splitk_linear: x_scale {tuple(x_scale.shape)}: one contiguous fp32 scale per row")
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    _launch_splitk(xq, weight, parts, (x_scale, weight_scale, bias, y), block_n, block_k, num_warps, num_stages)
    return y


assert FP8_MAX == 448.0  # the kernels clamp to the e4m3 range as a literal
