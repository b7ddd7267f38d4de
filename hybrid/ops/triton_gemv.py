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

The layers use it for steps of at most MAX_ROWS tokens by role (triton_guard.decode_linear_plain): by
default each Mamba out_proj, and each Mamba in_proj as in_proj_conv (the causal conv in the same launch, for
in_projs up to IN_PROJ_CONV_MAX_BYTES); measured faster than cuBLAS there (BENCHMARKS.md). Every projection with
HYBRID_DECODE_LINEAR=plain; with =triton also the gated norm inside out_proj (gated_norm_linear), which
lost 37-45% at batch 1, as did gated_out_proj (its sums of squares from the SSM update) by 2-5x in the model
and 8-40x alone. Why, from the compiled code (its loads are pipelined, nothing spills): every program, one per
32 output columns, computes the whole normalised activation itself, silu(z) * y / rms * w over all K columns
of 16 rows (the dot's tile height, whatever M is) with an exp and two IEEE divisions an element, so the
elementwise work is N/32 times what the gated norm's own launch does, on the path of every weight tile. A
fused gated norm would have to split that work between programs, which needs a grid-wide sum first: the
norm stays its own launch. CPU tests run them through Triton's interpreter (tests/test_triton_gemv.py).
"""
from __future__ import annotations

import os

import torch

from hybrid.ops.triton_guard import HAS_TRITON, pdl_options, require, switch, tl, triton
from state_pool.util import cdiv, sm_count

MAX_ROWS = 16  # tl.dot's smallest tile height: rows past M are masked
MAX_GATE_PARTS = 1024  # gated_out_proj's register tile of sums of squares: MAX_ROWS x this many floats
# in_proj_conv takes Mamba in_projs of at most this many weight bytes: on the H200 (2026-12-05,
# bench/bench_mamba_decode_layer.py, bench/results/mamba_decode_layer_9fff566_h200.log) it tied or beat cuBLAS's
# in_proj plus the conv's own launch on Granite-4.0-H-Tiny's 19.8 MB in_proj (batch 1: 10.1 vs 10.1 us; in
# the model +4.5%), and lost at batch 8 on Nemotron-3-Nano's 55 MB (22.1 vs 20.0 us) and the 8B's 152 MB
# (51.4 vs 45.8 us), where cuBLAS streams the weight faster than this kernel.
IN_PROJ_CONV_MAX_BYTES = 32 << 20


def in_proj_conv_max_rows() -> int:
    """The most tokens a decode step may have for in_proj_conv: MAX_ROWS, or HYBRID_IN_PROJ_CONV_MAX_ROWS (an A/B:
    alone, on the H200 and on an H100, in_proj_conv ties cuBLAS + the conv launch at one row and loses by 1.3-1.6 us
    at 8 on Granite-4.0-H-Tiny's in_proj, where the model A/B at 8 was within noise; bench_moe.py
    --in-proj-conv-rows-ab times 4). Read at each call: a captured graph keeps what its capture read."""
    return int(os.environ.get("HYBRID_IN_PROJ_CONV_MAX_ROWS", MAX_ROWS))
PREFETCH_ELEMENTS = 16384  # the slab's first BLOCK_N x PRE_K weights (32 KB in bf16) load before the wait
# The preloading variant (one-token steps, the "gemv_preload" switch): a program's whole slab, about
# PRELOAD_ELEMENTS weights (32 KB in bf16, 64 registers a thread at 4 warps), is asked for before the PDL wait
# and held in registers; the row is a dot product on CUDA cores (no tensor-core tile of 16 rows). Measured on an
# H100 (bench/bench_mamba_decode_layer.py, 2026-12-06): at one row Granite-4.0-H-Tiny's out_proj 7.1 -> 4.0 us,
# in_proj_conv 12.0 -> 8.5, the 8B's 152 MB in_proj 56.2 (cuBLAS) -> 49.0 (the card's copy rate). With each x row
# read after the wait in turn, 4 rows lost (Granite's in_proj_conv 16.8 against 12.5 us), so the layers send them
# one-token steps only; the kernels now read a step's rows together (ROWS > 1), which HYBRID_GEMV_PRELOAD_ROWS=4
# takes for steps of up to 4 tokens (preload_max_rows: the A/B; in the model at batch 4 it lost 5.6% on
# Granite-4.0-H-Tiny and 7.2% on Nemotron-3-Nano on an H100, so it stays off).
PRELOAD_MAX_ROWS = 1
PRELOAD_ROWS_CAP = 4  # the kernels' most rows (a [rows, K] tile of x a piece)
PRELOAD_ELEMENTS = 16384


def preload_max_rows() -> int:
    """The most tokens a step may have for the preloading kernels: PRELOAD_MAX_ROWS, or HYBRID_GEMV_PRELOAD_ROWS
    (2 or 4, at most 4: the A/B of steps of more rows, whose activation rows are read together after the wait).
    Read at each call: a captured graph keeps what its capture read."""
    value = os.environ.get("HYBRID_GEMV_PRELOAD_ROWS")
    return min(PRELOAD_ROWS_CAP, max(1, int(value))) if value else PRELOAD_MAX_ROWS


def preload_applies(rows: int) -> bool:
    """Whether a decode projection of `rows` tokens on the Triton linears takes the preloading kernels."""
    # (the cap first: every eager projection asks, and a prefill step's rows answer at once)
    return rows <= PRELOAD_ROWS_CAP and rows <= preload_max_rows() and switch("gemv_preload")


def preload_everywhere(rows: int) -> bool:
    """Whether every projection of a step of `rows` tokens (and each Mamba in_proj with its conv, of any size)
    goes to the preloading kernels (the default; HYBRID_GEMV_PRELOAD=1 keeps them to the Triton linear's sites)."""
    return preload_applies(rows) and not switch("gemv_preload_sites")


def k_pieces(K: int) -> tuple[int, int, int]:
    """K as the preloading kernels hold it: two powers of two (the largest that fit) and a third rounded up
    (masked past K), e.g. 3072 = 2048 + 1024, 2688 = 2048 + 512 + 128, 1600 -> 1024 + 512 + 64 (of which 64)."""
    if K < 1:
        raise ValueError(f"k_pieces: K = {K}")
    k1 = 1 << (K.bit_length() - 1)
    rest = K - k1
    k2 = 1 << (rest.bit_length() - 1) if rest else 0
    rest -= k2
    k3 = 1 << (rest - 1).bit_length() if rest else 0
    return k1, k2, k3


def preload_block_n(K: int, elements: int = PRELOAD_ELEMENTS) -> int:
    """Output columns a preloading program takes: the largest power of two (1 to 64) whose slab of
    k_pieces(K) columns holds at most `elements` weights (at least one column)."""
    return preload_tiles(K, None, elements)[0]


def preload_tiles(K: int, block_n: int | None = None, elements: int = PRELOAD_ELEMENTS) -> tuple[int, int, int, int]:
    """(BLOCK_N, K1, K2, K3) of a preloading launch over K: `block_n` if given, else the widest that holds at
    most `elements` weights a program (preload_block_n), and K's pieces (k_pieces)."""
    pieces = k_pieces(K)
    if block_n is None:
        block_n = 1
        while block_n < 64 and 2 * block_n * sum(pieces) <= elements:
            block_n *= 2
    return (block_n, *pieces)


if HAS_TRITON:
    from hybrid.ops.triton_guard import pdl_wait

    @triton.jit
    def _program_slab(w_ptr, M, N, K, s_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRE_K: tl.constexpr):
        """This program's BLOCK_N output columns: (offs_n, mask_n, offs_m, mask_m, w_rows, offs_pk,
        mask_pk, w_first), w_first the first PRE_K columns of its weight slab, loaded at once (no
        kernel writes weights: before the PDL wait)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        mask_n = offs_n < N
        mask_m = offs_m < M
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn
        offs_pk = tl.arange(0, PRE_K)
        mask_pk = offs_pk < K
        w_first = _weight_tile(w_rows, offs_pk, mask_n, mask_pk)
        return offs_n, mask_n, offs_m, mask_m, w_rows, offs_pk, mask_pk, w_first

    @triton.jit
    def _weight_tile(w_rows, offs_k, mask_n, mask_k):
        """[BLOCK_N, len(offs_k)] of the weight slab (evict-first: streamed once)."""
        return tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                       eviction_policy="evict_first")

    @triton.jit
    def _store_rows(acc, bias_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, s_o, HAS_BIAS: tl.constexpr):
        """acc (+ bias) into the M x BLOCK_N output tile, in the output's dtype."""
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * s_o + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _rows_times_slab(x_ptr, w_rows, w_first, offs_m, mask_m, offs_pk, mask_pk, mask_n, K, s_xm,
                         BLOCK_K: tl.constexpr, PRE_K: tl.constexpr):
        """fp32 [BLOCK_M, BLOCK_N]: the rows of x against this program's weight slab (w_first: its
        first PRE_K columns, already loaded), K in steps of BLOCK_K after them."""
        x_first = tl.load(x_ptr + offs_m[:, None] * s_xm + offs_pk[None, :], mask=mask_m[:, None] & mask_pk[None, :],
                          other=0.0)
        acc = tl.dot(x_first, tl.trans(w_first))
        for k0 in range(PRE_K, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * s_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0)
            w = _weight_tile(w_rows, offs_k, mask_n, mask_k)
            acc = tl.dot(x, tl.trans(w), acc)
        return acc

    @triton.jit(do_not_specialize=["M"])  # the step's row count: a new compile per value class otherwise
    def _small_m_linear_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, s_xm, s_wn, s_ym,
                               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, PRE_K: tl.constexpr, PDL: tl.constexpr):
        offs_n, mask_n, offs_m, mask_m, w_rows, offs_pk, mask_pk, w_first = _program_slab(
            w_ptr, M, N, K, s_wn, BLOCK_M, BLOCK_N, PRE_K)
        pdl_wait(PDL)
        acc = _rows_times_slab(x_ptr, w_rows, w_first, offs_m, mask_m, offs_pk, mask_pk, mask_n, K, s_xm,
                               BLOCK_K, PRE_K)
        _store_rows(acc, bias_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, s_ym, HAS_BIAS)

    @triton.jit(do_not_specialize=["M"])
    def _in_proj_conv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, cs_ptr, cw_ptr, cb_ptr, idx_ptr, M, N, K, C0, CD,
                             s_xm, s_wn, s_ym, s_cs_slot, s_cs_c, s_cs_k, s_cw_c,
                             HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, KW: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             PRE_K: tl.constexpr, PDL: tl.constexpr):
        # A Mamba decode step's in_proj, with the depthwise causal conv (width KW, + silu) of its xBC
        # columns [C0, C0 + CD) and their conv-state update done on the program's own columns: a
        # channel's conv needs only that channel's history, so no other program reads what one writes.
        # Row m is one token of the request in slot idx[m] (< 0: padding, zero history, nothing stored).
        offs_n, mask_n, offs_m, mask_m, w_rows, offs_pk, mask_pk, w_first = _program_slab(
            w_ptr, M, N, K, s_wn, BLOCK_M, BLOCK_N, PRE_K)
        # Before the PDL wait, besides the slab's first tile: the history's part of the conv and the history's
        # shift. A layer's conv state is read and written only by this layer's own kernels, never by the kernel
        # before (the one a PDL launch overlaps), and no kernel writes the conv weights or the biases.
        is_conv = mask_n & (offs_n >= C0) & (offs_n < C0 + CD)
        c = tl.where(is_conv, offs_n - C0, 0)
        slot = tl.load(idx_ptr + offs_m, mask=mask_m, other=-1).to(tl.int64)
        live = (mask_m & (slot >= 0))[:, None] & is_conv[None, :]
        hist_ptrs = cs_ptr + tl.maximum(slot, 0)[:, None] * s_cs_slot + c[None, :] * s_cs_c
        conv = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # the window [history 0 .. KW-2, this token], summed in that order; each history column is read
        # before it is overwritten by the next one (the state advances by this token)
        h_prev = tl.load(hist_ptrs, mask=live, other=0.0)
        for k in tl.static_range(KW - 1):
            wk = tl.load(cw_ptr + c * s_cw_c + k, mask=is_conv, other=0.0).to(tl.float32)
            conv += h_prev.to(tl.float32) * wk[None, :]
            if k + 1 < KW - 1:
                h_next = tl.load(hist_ptrs + (k + 1) * s_cs_k, mask=live, other=0.0)
                tl.debug_barrier()  # every thread has read column k + 1 before column k is overwritten
                tl.store(hist_ptrs + k * s_cs_k, h_next, mask=live)
                h_prev = h_next
        w_last = tl.load(cw_ptr + c * s_cw_c + (KW - 1), mask=is_conv, other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_CONV_BIAS:
            conv_bias = tl.load(cb_ptr + c, mask=is_conv, other=0.0).to(tl.float32)
        pdl_wait(PDL)
        acc = _rows_times_slab(x_ptr, w_rows, w_first, offs_m, mask_m, offs_pk, mask_pk, mask_n, K, s_xm,
                               BLOCK_K, PRE_K)
        if HAS_BIAS:
            acc += bias[None, :]
        v = acc.to(y_ptr.dtype.element_ty)  # the in_proj output, as the unfused projection stores it
        conv += v.to(tl.float32) * w_last[None, :]
        tl.store(hist_ptrs + (KW - 2) * s_cs_k, v.to(cs_ptr.dtype.element_ty), mask=live)
        if HAS_CONV_BIAS:
            conv += conv_bias[None, :]
        conv = conv / (1.0 + tl.exp(-conv))
        out = tl.where(is_conv[None, :], conv.to(y_ptr.dtype.element_ty), v)
        tl.store(y_ptr + offs_m[:, None] * s_ym + offs_n[None, :], out, mask=mask_m[:, None] & mask_n[None, :])

    # ---- the preloading variant (decode steps of at most PRELOAD_MAX_ROWS tokens: see preload_applies) ----

    @triton.jit
    def _slab_piece(w_rows, k0, K, mask_n, KP: tl.constexpr):
        """[BLOCK_N, KP] of the weight slab from column k0 (evict-first: streamed once)."""
        offs_k = k0 + tl.arange(0, KP)
        return tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0,
                       eviction_policy="evict_first")

    @triton.jit
    def slab_pieces(w_rows, K, mask_n, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr):
        """The weight slab of rows w_rows [BLOCK_N, 1] (pointers), all of K as up to three power-of-two pieces
        of K1, K2, K3 columns (K2, K3 may be 0: then the piece is K1's again, unused), loads issued at once
        (also used by triton_moe's one-token experts)."""
        w1 = _slab_piece(w_rows, 0, K, mask_n, K1)
        w2 = w1
        w3 = w1
        if K2 > 0:
            w2 = _slab_piece(w_rows, K1, K, mask_n, K2)
        if K3 > 0:
            w3 = _slab_piece(w_rows, K1 + K2, K, mask_n, K3)
        return w1, w2, w3

    @triton.jit
    def slab_dot(x_row, w1, w2, w3, K, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr):
        """fp32 [BLOCK_N]: one row of x (pointer x_row, K contiguous) against slab_pieces' slab, summed piece by
        piece, each a tree over its columns (a fixed order)."""
        r = _piece_dot(x_row, w1, 0, K, K1)
        if K2 > 0:
            r += _piece_dot(x_row, w2, K1, K, K2)
        if K3 > 0:
            r += _piece_dot(x_row, w3, K1 + K2, K, K3)
        return r

    @triton.jit
    def _preload_slab(w_ptr, N, K, s_wn, BLOCK_N: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                      K3: tl.constexpr):
        """This program's BLOCK_N output columns and their whole weight slab (slab_pieces)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        w1, w2, w3 = slab_pieces(w_ptr + offs_n.to(tl.int64)[:, None] * s_wn, K, mask_n, K1, K2, K3)
        return offs_n, mask_n, w1, w2, w3

    @triton.jit
    def _piece_dot(x_row, w, k0, K, KP: tl.constexpr):
        """fp32 [BLOCK_N]: one row of x at columns [k0, k0 + KP) against a slab piece."""
        offs_k = k0 + tl.arange(0, KP)
        x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        return tl.sum(w.to(tl.float32) * x[None, :], axis=1)

    @triton.jit
    def _rows_piece(x_ptr, s_xm, M, w, k0, K, ROWS: tl.constexpr, KP: tl.constexpr):
        """fp32 [ROWS, BLOCK_N]: rows m < M of x at columns [k0, k0 + KP) against a slab piece, the rows' loads
        issued together (rows past M: no load, zero)."""
        offs_m = tl.arange(0, ROWS)
        offs_k = k0 + tl.arange(0, KP)
        x = tl.load(x_ptr + offs_m[:, None] * s_xm + offs_k[None, :],
                    mask=(offs_m < M)[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
        return tl.sum(w.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)

    @triton.jit
    def _preloaded_rows(x_ptr, s_xm, M, K, w1, w2, w3, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                        K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr):
        """fp32 [ROWS, BLOCK_N]: rows m < M of x against the preloaded slab (each row's sum in a fixed order:
        piece by piece, each a tree over its columns; rows past M are zero). ROWS > 1: every row's x is read at
        once after the wait, and the pieces reduced as [ROWS, BLOCK_N, KP] products."""
        if ROWS == 1:
            acc = slab_dot(x_ptr, w1, w2, w3, K, K1, K2, K3)[None, :]
        else:
            acc = _rows_piece(x_ptr, s_xm, M, w1, 0, K, ROWS, K1)
            if K2 > 0:
                acc += _rows_piece(x_ptr, s_xm, M, w2, K1, K, ROWS, K2)
            if K3 > 0:
                acc += _rows_piece(x_ptr, s_xm, M, w3, K1 + K2, K, ROWS, K3)
        return acc

    @triton.jit(do_not_specialize=["M"])
    def _preload_linear_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, s_xm, s_wn, s_ym, HAS_BIAS: tl.constexpr,
                               ROWS: tl.constexpr, BLOCK_N: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                               K3: tl.constexpr, PDL: tl.constexpr):
        # the whole weight slab is asked for before the PDL wait (no kernel writes weights): the stream
        # starts while the previous kernel runs, and after the wait only x (a few KB, from L2) is read
        offs_n, mask_n, w1, w2, w3 = _preload_slab(w_ptr, N, K, s_wn, BLOCK_N, K1, K2, K3)
        pdl_wait(PDL)
        acc = _preloaded_rows(x_ptr, s_xm, M, K, w1, w2, w3, ROWS, BLOCK_N, K1, K2, K3)
        offs_m = tl.arange(0, ROWS)
        _store_rows(acc, bias_ptr, y_ptr, offs_m, offs_n, offs_m < M, mask_n, s_ym, HAS_BIAS)

    @triton.jit(do_not_specialize=["M"])
    def _preload_in_proj_conv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, cs_ptr, cw_ptr, cb_ptr, idx_ptr, M, N, K, C0,
                                     CD, s_xm, s_wn, s_ym, s_cs_slot, s_cs_c, s_cs_k, s_cw_c,
                                     HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, KW: tl.constexpr,
                                     KWP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                                     K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr, PDL: tl.constexpr):
        # _in_proj_conv_kernel's work with _preload_linear_kernel's slab: before the wait also the slots'
        # histories (a layer's conv state is written only by this layer's own kernels: not by the kernel
        # before), the conv weights and the biases; after it, x, then the stores
        offs_n, mask_n, w1, w2, w3 = _preload_slab(w_ptr, N, K, s_wn, BLOCK_N, K1, K2, K3)
        offs_m = tl.arange(0, ROWS)
        mask_m = offs_m < M
        is_conv = mask_n & (offs_n >= C0) & (offs_n < C0 + CD)
        c = tl.where(is_conv, offs_n - C0, 0)
        taps = tl.arange(0, KWP)
        slot = tl.load(idx_ptr + offs_m, mask=mask_m, other=-1).to(tl.int64)
        live = (mask_m & (slot >= 0))[:, None] & is_conv[None, :]
        hist_ptrs = (cs_ptr + tl.maximum(slot, 0)[:, None, None] * s_cs_slot + c[None, :, None] * s_cs_c
                     + taps[None, None, :] * s_cs_k)
        hist = tl.load(hist_ptrs, mask=live[:, :, None] & (taps < KW - 1)[None, None, :], other=0.0)
        cw = tl.load(cw_ptr + c[:, None] * s_cw_c + taps[None, :], mask=is_conv[:, None] & (taps < KW)[None, :],
                     other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_CONV_BIAS:
            conv_bias = tl.load(cb_ptr + c, mask=is_conv, other=0.0).to(tl.float32)
        pdl_wait(PDL)
        acc = _preloaded_rows(x_ptr, s_xm, M, K, w1, w2, w3, ROWS, BLOCK_N, K1, K2, K3)
        if HAS_BIAS:
            acc += bias[None, :]
        v = acc.to(y_ptr.dtype.element_ty)  # the in_proj output, as the unfused projection stores it
        # the window [history 0 .. KW-2, this token], summed in that order (as _in_proj_conv_kernel does);
        # a tap is taken out of its tile by a masked sum of zeros and itself: exact
        conv = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k in tl.static_range(KW - 1):
            h_k = tl.sum(tl.where(taps[None, None, :] == k, hist.to(tl.float32), 0.0), axis=2)
            conv += h_k * tl.sum(tl.where(taps[None, :] == k, cw, 0.0), axis=1)[None, :]
        conv += v.to(tl.float32) * tl.sum(tl.where(taps[None, :] == KW - 1, cw, 0.0), axis=1)[None, :]
        # the history advances by this token: tap k takes tap k + 1 (all read before the wait), the last v. The
        # barrier: every thread's read of the tile (some threads hold copies of an element) is done before any
        # thread overwrites it, however late a warp ran its loads
        tl.debug_barrier()
        tl.store(hist_ptrs - s_cs_k, hist,
                 mask=live[:, :, None] & ((taps >= 1) & (taps < KW - 1))[None, None, :])
        tl.store(cs_ptr + tl.maximum(slot, 0)[:, None] * s_cs_slot + c[None, :] * s_cs_c + (KW - 2) * s_cs_k,
                 v.to(cs_ptr.dtype.element_ty), mask=live)
        if HAS_CONV_BIAS:
            conv += conv_bias[None, :]
        conv = conv / (1.0 + tl.exp(-conv))
        out = tl.where(is_conv[None, :], conv.to(y_ptr.dtype.element_ty), v)
        tl.store(y_ptr + offs_m[:, None] * s_ym + offs_n[None, :], out, mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _gated_rows(y_ptr, z_ptr, offs_m, offs_k, mask_m, mask_k, s_y, s_z):
        """h = y * silu(z) in fp32 for rows offs_m, columns offs_k (triton_norm's gated norm's h)."""
        mask = mask_m[:, None] & mask_k[None, :]
        y = tl.load(y_ptr + offs_m[:, None] * s_y + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs_m[:, None] * s_z + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        return y * (z / (1.0 + tl.exp(-z)))

    @triton.jit
    def _gated_normed(y_ptr, z_ptr, nw_ptr, offs_m, offs_k, mask_m, mask_k, s_y, s_z, ms_eps):
        """The gated norm's output at these columns, rounded where triton_norm.gated_rms_norm rounds
        (r to the norm weight's dtype, the product stored in it); ms_eps [BLOCK_M]: the group's mean
        square plus eps."""
        h = _gated_rows(y_ptr, z_ptr, offs_m, offs_k, mask_m, mask_k, s_y, s_z)
        r = h / tl.sqrt(ms_eps)[:, None]
        nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0)
        return (nw.to(tl.float32)[None, :] * r.to(nw.dtype).to(tl.float32)).to(nw.dtype)

    @triton.jit(do_not_specialize=["M"])  # the step's row count: a new compile per value class otherwise
    def _gated_norm_linear_kernel(y_ptr, z_ptr, nw_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, G, eps,
                                  s_y, s_z, s_wn, s_o, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE_K: tl.constexpr,
                                  GP: tl.constexpr, PDL: tl.constexpr):
        # out = gated_rms_norm(y, z) @ w.T (+ bias): every program first takes each row's mean square
        # per group (G columns; BLOCK_K and PRE_K divide G, so a K step lies in one group), then
        # feeds the normalised columns to the dot as _small_m_linear_kernel does.
        offs_n, mask_n, offs_m, mask_m, w_rows, offs_pk, mask_pk, w_first = _program_slab(
            w_ptr, M, N, K, s_wn, BLOCK_M, BLOCK_N, PRE_K)
        pdl_wait(PDL)
        groups = tl.arange(0, GP)
        sum_sq = tl.zeros((BLOCK_M, GP), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            h = _gated_rows(y_ptr, z_ptr, offs_m, offs_k, mask_m, offs_k < K, s_y, s_z)
            sum_sq += tl.where(groups[None, :] == k0 // G, tl.sum(h * h, axis=1)[:, None], 0.0)
        acc = _gated_normed_dot(y_ptr, z_ptr, nw_ptr, w_rows, w_first, sum_sq / G + eps, offs_m, mask_m, offs_pk,
                                mask_pk, mask_n, K, G, s_y, s_z, BLOCK_K, PRE_K, GP)
        _store_rows(acc, bias_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, s_o, HAS_BIAS)

    @triton.jit
    def _gated_normed_dot(y_ptr, z_ptr, nw_ptr, w_rows, w_first, ms_eps, offs_m, mask_m, offs_pk, mask_pk, mask_n,
                          K, G, s_y, s_z, BLOCK_K: tl.constexpr, PRE_K: tl.constexpr, GP: tl.constexpr):
        """fp32 [BLOCK_M, BLOCK_N]: the gated norm's output (each row's group mean squares plus eps in
        ms_eps [BLOCK_M, GP]) against this program's weight slab, a K step lying in one group."""
        groups = tl.arange(0, GP)
        a_first = _gated_normed(y_ptr, z_ptr, nw_ptr, offs_m, offs_pk, mask_m, mask_pk, s_y, s_z,
                                tl.sum(tl.where(groups[None, :] == 0, ms_eps, 0.0), axis=1))
        acc = tl.dot(a_first.to(w_first.dtype), tl.trans(w_first))
        for k0 in range(PRE_K, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = _gated_normed(y_ptr, z_ptr, nw_ptr, offs_m, offs_k, mask_m, mask_k, s_y, s_z,
                              tl.sum(tl.where(groups[None, :] == k0 // G, ms_eps, 0.0), axis=1))
            w = _weight_tile(w_rows, offs_k, mask_n, mask_k)
            acc = tl.dot(a.to(w.dtype), tl.trans(w), acc)
        return acc

    @triton.jit(do_not_specialize=["M", "HB_G", "HB", "s_sq"])  # (the SSM update's blocks follow the batch)
    def _gated_out_proj_kernel(y_ptr, z_ptr, nw_ptr, sq_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, G, HB_G, HB, eps,
                               s_y, s_z, s_sq, s_wn, s_o, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE_K: tl.constexpr,
                               GP: tl.constexpr, HBP: tl.constexpr, PDL: tl.constexpr):
        # _gated_norm_linear_kernel with each group's sum of squares from the SSM update's parts (sq [M, HB]:
        # HB_G consecutive parts a group), so no program reads the whole of y and z before its dot
        offs_n, mask_n, offs_m, mask_m, w_rows, offs_pk, mask_pk, w_first = _program_slab(
            w_ptr, M, N, K, s_wn, BLOCK_M, BLOCK_N, PRE_K)
        pdl_wait(PDL)
        offs_h = tl.arange(0, HBP)
        parts = tl.load(sq_ptr + offs_m[:, None] * s_sq + offs_h[None, :],
                        mask=mask_m[:, None] & (offs_h < HB)[None, :], other=0.0)
        groups = tl.arange(0, GP)
        sum_sq = tl.zeros((BLOCK_M, GP), dtype=tl.float32)
        for g in tl.static_range(GP):
            part_g = tl.sum(tl.where((offs_h // HB_G == g)[None, :], parts, 0.0), axis=1)
            sum_sq += tl.where(groups[None, :] == g, part_g[:, None], 0.0)
        acc = _gated_normed_dot(y_ptr, z_ptr, nw_ptr, w_rows, w_first, sum_sq / G + eps, offs_m, mask_m, offs_pk,
                                mask_pk, mask_n, K, G, s_y, s_z, BLOCK_K, PRE_K, GP)
        _store_rows(acc, bias_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, s_o, HAS_BIAS)


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inputs this kernel serves in the layers: a decode-sized step of 16-bit activations on CUDA."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   out: torch.Tensor | None = None, block_n: int | None = None, block_k: int = 256,
                   num_warps: int = 4, num_stages: int = 4, pre_k: int | None = None,
                   preload: bool | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, last dim contiguous) @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype.
    `block_n`: output columns a program (default: default_block_n, or preload_block_n when preloading).
    `pre_k`: the columns each program loads before the PDL wait (a power of two; default: up to
    PREFETCH_ELEMENTS weights a program, at least block_k). `preload` (default: preload_applies(M)): the
    preloading kernel, whole slab before the wait (M <= PRELOAD_MAX_ROWS)."""
    require(__name__)
    M, K = x.shape
    N = weight.shape[0]
    if preload is None:
        preload = preload_applies(M)
    limit = preload_max_rows() if preload else MAX_ROWS
    if M > limit:
        raise ValueError(f"small_m_linear{' (preloading)' if preload else ''} takes at most {limit} rows, got {M}")
    if weight.shape[1] != K or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"shapes/strides: x {tuple(x.shape)} {x.stride()}, weight {tuple(weight.shape)} {weight.stride()}")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if preload:
        block_n, k1, k2, k3 = preload_tiles(K, block_n)
        _preload_linear_kernel[(cdiv(N, block_n),)](
            x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0), weight.stride(0),
            out.stride(0), HAS_BIAS=bias is not None, ROWS=triton.next_power_of_2(M), BLOCK_N=block_n,
            K1=k1, K2=k2, K3=k3, num_warps=num_warps, **pdl_options(x.device),
        )
        return out
    if block_n is None:
        block_n = default_block_n(N, x.device)
    if pre_k is None:
        pre_k = min(triton.next_power_of_2(K), max(block_k, PREFETCH_ELEMENTS // block_n))
    _small_m_linear_kernel[(cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, PRE_K=pre_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(x.device),
    )
    return out


def default_block_n(N: int, device: torch.device) -> int:
    """32 output columns a program, or 16 on a GPU where 32 would leave more than half its SMs idle: a decode
    projection streams its weight at the rate of the SMs that read it (Granite-4.0-H-Tiny's out_proj, N 1536:
    48 programs of 32 on 132 SMs; at 16 a column, 7.0 -> 6.1 us a call on the H200, BENCHMARKS.md). Each
    column's K loop is the same at either width, so the values are too. HYBRID_GEMV_NARROW=0 keeps 32."""
    if switch("gemv_narrow") and 2 * cdiv(N, 32) <= sm_count(device):
        return 16
    return 32


def in_proj_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                 conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, state_indices: torch.Tensor,
                 conv_start: int, *, block_n: int | None = None, block_k: int = 256, num_warps: int = 4,
                 num_stages: int = 4, preload: bool | None = None) -> torch.Tensor:
    """A Mamba decode step's in_proj and causal conv in one launch: x [M, K] (one token a row, M <= MAX_ROWS)
    @ weight [N, K].T (+ bias), then columns [conv_start, conv_start + C) (C = conv_weight's channels) replaced
    by the depthwise causal conv of [slot history | this token] with conv_weight [C, W] (+ conv_bias) and silu,
    and each live row's slot history (conv_state [S, C, W-1]) advanced by its token, as
    triton_mamba.conv_state_update does on small_m_linear's output. Rows with state_indices < 0 (padding) see
    a zero history and store nothing. Returns [M, N] in x's dtype. Summation order: the conv's taps in window
    order, then the bias (the unfused kernel sums the window as one reduction: equal up to fp32 rounding).
    `preload` (default: preload_applies(M)): the projection as small_m_linear's preloading kernel does it, the
    histories, conv weights and biases also read before the PDL wait; `block_n` defaults to its kernel's."""
    require(__name__)
    M, K = x.shape
    N = weight.shape[0]
    C, W = conv_weight.shape
    if preload is None:
        preload = preload_applies(M)
    if (M > (preload_max_rows() if preload else MAX_ROWS) or weight.shape[1] != K or x.stride(-1) != 1
            or weight.stride(-1) != 1):
        raise ValueError(f"in_proj_conv: x {tuple(x.shape)} {x.stride()}, "
                         f"weight {tuple(weight.shape)} {weight.stride()}")
    if (W < 2 or conv_state.shape[1:] != (C, W - 1) or not 0 <= conv_start <= N - C or state_indices.shape != (M,)
            or conv_weight.stride(1) != 1):
        raise ValueError(f"in_proj_conv: conv_state {tuple(conv_state.shape)}, conv_weight {tuple(conv_weight.shape)}, "
                         f"conv_start {conv_start} of {N} columns, state_indices {tuple(state_indices.shape)}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if preload:
        block_n, k1, k2, k3 = preload_tiles(K, block_n)
        _preload_in_proj_conv_kernel[(cdiv(N, block_n),)](
            x, weight, bias if bias is not None else weight, out, conv_state, conv_weight,
            conv_bias if conv_bias is not None else conv_weight, state_indices, M, N, K, conv_start, C,
            x.stride(0), weight.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1),
            conv_state.stride(2), conv_weight.stride(0), HAS_BIAS=bias is not None,
            HAS_CONV_BIAS=conv_bias is not None, KW=W, KWP=triton.next_power_of_2(W),
            ROWS=triton.next_power_of_2(M), BLOCK_N=block_n, K1=k1, K2=k2, K3=k3, num_warps=num_warps,
            **pdl_options(x.device),
        )
        return out
    block_n = block_n or 32
    pre_k = min(triton.next_power_of_2(K), max(block_k, PREFETCH_ELEMENTS // block_n))
    _in_proj_conv_kernel[(cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, out, conv_state, conv_weight,
        conv_bias if conv_bias is not None else conv_weight, state_indices, M, N, K, conv_start, C,
        x.stride(0), weight.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        conv_weight.stride(0), HAS_BIAS=bias is not None, HAS_CONV_BIAS=conv_bias is not None, KW=W,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, PRE_K=pre_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(x.device),
    )
    return out


def gated_norm_block_k(group: int, block_k: int = 256) -> int | None:
    """The K step of gated_norm_linear for groups of `group` channels: the largest power of two
    <= block_k that divides the group (>= 16, tl.dot's smallest), or None (not fusable)."""
    bk = block_k
    while bk >= 16 and group % bk:
        bk //= 2
    return bk if bk >= 16 else None


def _gated_pre_k(group: int, bk: int, block_n: int) -> int:
    """The columns a gated program loads before its PDL wait: a power of two times bk that divides the
    group (so the first slab lies in group 0), up to PREFETCH_ELEMENTS weights."""
    pre_k = bk
    while pre_k * 2 <= group and pre_k * 2 * block_n <= PREFETCH_ELEMENTS:
        pre_k *= 2
    return pre_k if group % pre_k == 0 else bk


def gated_out_proj(y: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float, n_groups: int,
                   sq: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, block_n: int = 32,
                   block_k: int = 256, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """gated_norm_linear whose group mean squares come from the SSM update's sums of squares (sq [M, H, blocks]
    from triton_mamba.selective_state_update_gated, the heads of a group consecutive): one launch for the
    gated norm and out_proj with no pass over y and z before the dot. Equal to the two launches up to the
    order of the sum of squares."""
    require(__name__)
    M, K = y.shape
    N = weight.shape[0]
    group = K // n_groups
    bk = gated_norm_block_k(group, block_k)
    if (M > MAX_ROWS or z.shape != (M, K) or weight.shape[1] != K or K % n_groups or bk is None or sq.dim() != 3
            or sq.shape[0] != M or sq.shape[1] % n_groups or K % sq.shape[1] or sq.stride(-1) != 1
            or sq.stride(1) != sq.shape[2]):
        raise ValueError(f"gated_out_proj: y {tuple(y.shape)}, z {tuple(z.shape)}, sq {tuple(sq.shape)}, "
                         f"weight {tuple(weight.shape)}, {n_groups} groups")
    if y.stride(-1) != 1 or z.stride(-1) != 1 or weight.stride(-1) != 1 or norm_weight.stride(-1) != 1:
        raise ValueError("gated_out_proj needs y, z, norm_weight and weight contiguous along K")
    parts = sq.shape[1] * sq.shape[2]
    if parts > MAX_GATE_PARTS:
        raise ValueError(f"gated_out_proj reads a row's sums at once: {parts} of them, at most {MAX_GATE_PARTS}")
    out = torch.empty(M, N, dtype=weight.dtype, device=y.device)
    _gated_out_proj_kernel[(cdiv(N, block_n),)](
        y, z, norm_weight, sq, weight, bias if bias is not None else weight, out, M, N, K, group,
        parts // n_groups, parts, eps, y.stride(0), z.stride(0), sq.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=bk,
        PRE_K=_gated_pre_k(group, bk, block_n), GP=triton.next_power_of_2(n_groups),
        HBP=triton.next_power_of_2(parts), num_warps=num_warps, num_stages=num_stages, **pdl_options(y.device),
    )
    return out


def gated_norm_linear(y: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float, n_groups: int,
                      weight: torch.Tensor, bias: torch.Tensor | None = None, *, block_n: int = 32,
                      block_k: int = 256, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """weight-projection of the Mamba2 gated norm in one launch: small_m_linear(
    triton_norm.gated_rms_norm(y, z, norm_weight, eps, n_groups).to(weight.dtype), weight, bias)
    for y, z [M, K] (M <= MAX_ROWS, last dim contiguous), K split in n_groups groups whose size
    gated_norm_block_k accepts. Output [M, N] in weight's dtype."""
    require(__name__)
    M, K = y.shape
    N = weight.shape[0]
    group = K // n_groups
    bk = gated_norm_block_k(group, block_k)
    if M > MAX_ROWS or z.shape != (M, K) or weight.shape[1] != K or K % n_groups or bk is None:
        raise ValueError(f"gated_norm_linear: y {tuple(y.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}, "
                         f"{n_groups} groups")
    if y.stride(-1) != 1 or z.stride(-1) != 1 or weight.stride(-1) != 1 or norm_weight.stride(-1) != 1:
        raise ValueError("gated_norm_linear needs y, z, norm_weight and weight contiguous along K")
    pre_k = _gated_pre_k(group, bk, block_n)
    out = torch.empty(M, N, dtype=weight.dtype, device=y.device)
    _gated_norm_linear_kernel[(cdiv(N, block_n),)](
        y, z, norm_weight, weight, bias if bias is not None else weight, out, M, N, K, group, eps,
        y.stride(0), z.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=bk, PRE_K=pre_k, GP=triton.next_power_of_2(n_groups),
        num_warps=num_warps, num_stages=num_stages, **pdl_options(y.device),
    )
    return out
