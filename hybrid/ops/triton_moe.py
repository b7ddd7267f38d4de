"""Fused MoE experts (Triton): the routed (token, expert) pairs grouped by expert, one grouped-GEMM
launch per projection, the activation fused into the first and the routing weight into the second.

`fused_experts(x, w_up, w_down, top_idx, top_w, gated, add=None)` computes what the torch loop of
`hybrid.moe.Experts` (the CPU reference) does, up to rounding:
    x [T, H]; w_up [E, I, H] (relu2) or [E, 2I, H] ([gate | up] rows, SwiGLU); w_down [E, H, I];
    top_idx [T, k] (int); top_w [T, k] (any float dtype); add [T, H] or None (added before the one
    rounding to x.dtype: the shared expert's output).
    out[t] = sum_j top_w[t, j] * down_e(act(up_e(x[t])))  for e = top_idx[t, j]  (+ add[t])
(top_idx / top_w: the routing of hybrid/ops/triton_moe_route.py, or the torch router's.)

The n = T*k pairs are numbered p = t*k + j. Steps, every one a launch whose shape depends on T alone
(no host synchronisation, CUDA-graph capturable):
1. alignment (hybrid/ops/triton_moe_align.py): the pairs grouped by expert, each expert's group
   padded to a multiple of BLOCK_M with the sentinel n -> `pairs`, `block_expert` and the padded
   total; blocks past the total exit at once. (A step of one token with few pairs has each pair in its
   own block: no launch, and given the router's logits instead of top_idx / top_w, the first GEMM
   routes the token itself, so the routing launch goes too: `router`.)
2. GEMM 1: each block's rows x[p // k] against its expert's up rows -> h [n, I] in x.dtype, relu2
   or silu(gate) * up applied in fp32 in the epilogue (gate and up tiles of the same columns in one
   program).
3. GEMM 2: rows h[p] against the expert's down rows, times top_w[p] -> y [n, H] in x.dtype.
4. out[t] = sum_j y[t*k + j] (+ add[t]) in fp32, in a fixed order (no atomics: deterministic).
A row's result does not depend on which other rows share its blocks, so padding rows (graph
buckets) cannot change a real row's output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.ops import triton_gemv, triton_moe_align, triton_moe_route
from hybrid.ops.triton_guard import HAS_TRITON, pdl_options, require, switch, tl, triton
from state_pool.util import cdiv, sm_count

ACT_NONE, ACT_RELU2, ACT_SILU_MUL = 0, 1, 2


def is_available() -> bool:
    return HAS_TRITON


if HAS_TRITON:
    from hybrid.ops.triton_gemv import slab_dot, slab_pieces
    from hybrid.ops.triton_guard import pdl_wait
    from hybrid.ops.triton_moe_route import route_bias, route_token

    @triton.jit
    def _block_tile(pid, N, num_m_blocks, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(row block, column tile) of program `pid`: GROUP_M row blocks walk the column tiles
        together (L2 reuse)."""
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
        return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows

    @triton.jit
    def _routed_pair(r_ptr, rb_ptr, j, E, r_s_row, r_s_split, r_scale, TOP_K: tl.constexpr, KP: tl.constexpr,
                     EP: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                     SPLITS: tl.constexpr, ROUND: tl.constexpr):
        """(expert, routing weight) of the one token's column j, routed here from its router logits
        (triton_moe_route.route_token): the j-th chosen expert, or past the k the shared pseudo-expert
        E + j - k with weight 1, as the routing launch writes them."""
        top_idx, w = route_token(r_ptr, route_bias(rb_ptr, E, EP, HAS_BIAS), 0, E, r_s_row, r_s_split, r_scale, TOP_K, KP, EP, SIGMOID,
                                 HAS_BIAS, NORMALIZE, SPLITS, ROUND)
        ks = tl.arange(0, KP)
        routed = j < TOP_K
        expert = tl.where(routed, tl.sum(tl.where(ks == j, top_idx, 0), axis=0), E + j - TOP_K)
        weight = tl.where(routed, tl.sum(tl.where(ks == j, w, 0.0), axis=0), 1.0)
        return expert.to(tl.int64), weight

    @triton.jit
    def _block_operands(a_ptr, b_ptr, s_ptr, pairs_ptr, expert, pid_m, pid_n, N, num_pairs, a_div,
                        num_experts, s_am, s_be, s_bn, s_sn, s_se, s_up, HAS_SHARED: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The block's pairs and tile pointers for its expert: W_e is b + e*s_be (rows s_bn apart; gated:
        the up rows N rows below the gate rows), or for e >= num_experts the shared pseudo-expert
        s = e - num_experts: s_ptr + s*s_se (rows s_sn apart; up rows s_up further). K is contiguous."""
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pair < num_pairs
        a_row = (pair // a_div).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row[:, None] * s_am + offs_k[None, :]
        w_base, row_stride, up_off = _expert_rows(b_ptr, s_ptr, expert, N, num_experts, s_be, s_bn, s_sn, s_se, s_up,
                                                  HAS_SHARED)
        b_ptrs = w_base + offs_n[None, :].to(tl.int64) * row_stride + offs_k[:, None]
        return pair, row_ok, offs_n, n_ok, a_ptrs, b_ptrs, up_off

    @triton.jit
    def _expert_rows(b_ptr, s_ptr, expert, N, num_experts, s_be, s_bn, s_sn, s_se, s_up, HAS_SHARED: tl.constexpr):
        """(first row of W_e, row stride, up-row offset) of expert e: b + e*s_be (rows s_bn apart; gated: the up
        rows N rows below the gate rows), or for e >= num_experts the shared pseudo-expert s = e - num_experts:
        s_ptr + s*s_se (rows s_sn apart; up rows s_up further)."""
        w_base = b_ptr + expert * s_be
        row_stride = s_bn
        up_off = N * s_bn
        if HAS_SHARED:
            if expert >= num_experts:
                w_base = s_ptr + (expert - num_experts) * s_se
                row_stride = s_sn
                up_off = s_up
        return w_base, row_stride, up_off

    @triton.jit
    def _mma(a, b, acc, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _k_steps(a_ptrs, b_ptrs, up_off, row_ok, n_ok, k_first, K, acc, acc_up, ACT: tl.constexpr,
                 IEEE: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc (+ acc_up: the up rows, SwiGLU) += the K steps from k_first on (the pointers at k_first)."""
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(k_first, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(a_ptrs.dtype.element_ty)
            acc = _mma(a, b, acc, IEEE)
            if ACT == 2:
                b_up = tl.load(b_ptrs + up_off, mask=k_ok[:, None] & n_ok[None, :],
                               other=0.0).to(a_ptrs.dtype.element_ty)
                acc_up = _mma(a, b_up, acc_up, IEEE)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        return acc, acc_up

    @triton.jit
    def _store_block(acc, acc_up, expert, pair, row_ok, offs_n, n_ok, c_ptr, w_ptr, ws_ptr, N, s_cm, s_ws,
                     ACT: tl.constexpr, MUL_W: tl.constexpr, W_SCALE: tl.constexpr):
        """The epilogue: FP8 column scales, the activation, the routing weight, the store of C rows."""
        if W_SCALE:  # (FP8 experts never share a launch with the shared expert: fused_experts)
            ws = ws_ptr + expert * s_ws + offs_n
            acc = acc * tl.load(ws, mask=n_ok, other=1.0)[None, :]
            if ACT == 2:
                acc_up = acc_up * tl.load(ws + N, mask=n_ok, other=1.0)[None, :]
        if ACT == 1:
            acc = tl.maximum(acc, 0.0)
            acc = acc * acc
        if ACT == 2:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if MUL_W:
            acc = acc * tl.load(w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * s_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    # num_pairs, num_m_blocks: batch-dependent (specialising them compiles a kernel per value class
    # at run time); N, K, a_div, num_experts and the strides are fixed per model and stay specialised.
    @triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
    def _moe_gemm_kernel(a_ptr, b_ptr, s_ptr, c_ptr, w_ptr, pairs_ptr, block_expert_ptr, total_ptr,
                         ws_ptr, N, K, num_pairs, a_div, num_m_blocks, num_experts, s_am, s_be, s_bn, s_sn,
                         s_se, s_up, s_cm, s_ws, r_ptr, rb_ptr, r_s_row, r_s_split, r_scale, r_idx_ptr, r_w_ptr,
                         ACT: tl.constexpr, MUL_W: tl.constexpr,
                         HAS_SHARED: tl.constexpr, W_SCALE: tl.constexpr,
                         IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EARLY_B: tl.constexpr,
                         ROUTED: tl.constexpr, R_TOP_K: tl.constexpr, R_KP: tl.constexpr, R_EP: tl.constexpr,
                         R_SIGMOID: tl.constexpr, R_HAS_BIAS: tl.constexpr, R_NORMALIZE: tl.constexpr,
                         R_SPLITS: tl.constexpr, R_ROUND: tl.constexpr, PDL: tl.constexpr):
        # C[p, :N] = act(A[p // a_div] @ W_e.T) (* w[p]) for the pairs p of each block (expert e):
        # see _block_operands.
        # EARLY_B (the second GEMM): the blocks, pairs and routing weights were written before the
        # first GEMM, i.e. (under PDL) by kernels that are complete when this one starts, and nothing
        # writes W: they and the first W tile load before the wait; only A (the first GEMM's
        # output) waits. Otherwise the wait comes first.
        # W_SCALE (FP8 experts, weight-only): W holds e4m3 values, widened to A's dtype in registers
        # (exactly: every e4m3 value is a bf16 value), and output column n of expert e is multiplied by
        # ws[e, n] (its up column by ws[e, N + n]) in fp32 before the activation: the dequantized
        # weight's product, rounded once.
        # ROUTED (the first GEMM of a step of one token, each pair alone in its block: naive alignment):
        # no routing launch before it; each program routes the token from its router logits r
        # (triton_moe_route.RouterLogits, written by the kernel before this one) and takes its block's
        # column; the programs of the first column tile store the routing (r_idx, r_w), which the second
        # GEMM reads as block_expert and w after its wait, as it would the routing launch's.
        if not EARLY_B:
            pdl_wait(PDL)
        pid_m, pid_n = _block_tile(tl.program_id(0), N, num_m_blocks, BLOCK_N, GROUP_M)
        live = pid_m * BLOCK_M < tl.load(total_ptr)  # blocks past the padded total have no expert
        if not EARLY_B:
            if not live:
                return
        if ROUTED:  # (never EARLY_B)
            expert, route_w = _routed_pair(r_ptr, rb_ptr, pid_m, num_experts, r_s_row, r_s_split, r_scale, R_TOP_K,
                                           R_KP, R_EP, R_SIGMOID, R_HAS_BIAS, R_NORMALIZE, R_SPLITS, R_ROUND)
            if pid_n == 0:
                tl.store(r_idx_ptr + pid_m, expert.to(tl.int32))
                tl.store(r_w_ptr + pid_m, route_w)
        else:
            expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pair, row_ok, offs_n, n_ok, a_ptrs, b_ptrs, up_off = _block_operands(
            a_ptr, b_ptr, s_ptr, pairs_ptr, expert, pid_m, pid_n, N, num_pairs, a_div, num_experts,
            s_am, s_be, s_bn, s_sn, s_se, s_up, HAS_SHARED, BLOCK_M, BLOCK_N, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_first = 0
        if EARLY_B:  # (ACT_NONE: one W tile a step) the first K step peeled, its W tile before the wait
            k_ok = tl.arange(0, BLOCK_K) < K
            b = tl.load(b_ptrs, mask=live & k_ok[:, None] & n_ok[None, :], other=0.0).to(a_ptr.dtype.element_ty)
            pdl_wait(PDL)
            if not live:
                return
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _mma(a, b, acc, IEEE)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
            k_first = BLOCK_K
        acc, acc_up = _k_steps(a_ptrs, b_ptrs, up_off, row_ok, n_ok, k_first, K, acc, acc_up, ACT, IEEE, BLOCK_K)
        _store_block(acc, acc_up, expert, pair, row_ok, offs_n, n_ok, c_ptr, w_ptr, ws_ptr, N, s_cm, s_ws,
                     ACT, MUL_W, W_SCALE)

    @triton.jit
    def _one_token_experts_kernel(a_ptr, b_ptr, s_ptr, c_ptr, w_ptr, block_expert_ptr, N, K, a_div, num_experts,
                                  n_routed, s_am, s_be, s_bn, s_sn, s_se, s_up, s_cm, ACT: tl.constexpr,
                                  MUL_W: tl.constexpr, HAS_SHARED: tl.constexpr, EARLY: tl.constexpr,
                                  SHARED_EARLY: tl.constexpr, BLOCK_N: tl.constexpr,
                                  K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr, PDL: tl.constexpr):
        # A one-token step's grouped GEMM in the naive layout (pair m alone in block m, its expert
        # block_expert[m]): C[m, n] = act(A[m // a_div] @ W_e[n].T) (* w[m]) for BLOCK_N columns n, the
        # whole [BLOCK_N, K] slab of W_e (and its up rows, SwiGLU) asked for at once, the rows reduced on CUDA
        # cores as triton_gemv's preloading kernels do. EARLY (the second GEMM): the routing (block_expert,
        # w) was written before the first GEMM, and nothing writes W, so the slab loads before the PDL wait;
        # only A (the first GEMM's output) waits. Otherwise (the first GEMM: the routing is the kernel
        # before) the wait comes first and the slab right after it, except SHARED_EARLY (the first GEMM of the
        # one token, a_div = its row of pairs): the shared pseudo-experts' pairs (the row's last, from n_routed
        # on) have fixed ids, so their programs, launched first, ask for their slabs before the wait too.
        n_tiles = tl.cdiv(N, BLOCK_N)
        m = tl.program_id(0) // n_tiles
        offs_n = (tl.program_id(0) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        is_shared = m < 0  # (False)
        if SHARED_EARLY:
            m = (m + n_routed) % a_div  # programs 0.. take the shared pairs
            is_shared = m >= n_routed
            if is_shared == 0:
                pdl_wait(PDL)
            expert = tl.load(block_expert_ptr + m, mask=m < n_routed, other=0).to(tl.int64)
            expert = tl.where(is_shared, num_experts + (m - n_routed), expert)
        else:
            if not EARLY:
                pdl_wait(PDL)
            expert = tl.load(block_expert_ptr + m).to(tl.int64)
        w_base, row_stride, up_off = _expert_rows(b_ptr, s_ptr, expert, N, num_experts, s_be, s_bn, s_sn, s_se, s_up,
                                                  HAS_SHARED)
        w_rows = w_base + offs_n.to(tl.int64)[:, None] * row_stride
        g1, g2, g3 = slab_pieces(w_rows, K, mask_n, K1, K2, K3)
        u1, u2, u3 = g1, g2, g3
        if ACT == 2:
            u1, u2, u3 = slab_pieces(w_rows + up_off, K, mask_n, K1, K2, K3)
        route_w = 1.0
        if MUL_W:
            route_w = tl.load(w_ptr + m).to(tl.float32)
        if EARLY:
            pdl_wait(PDL)
        elif SHARED_EARLY:
            if is_shared:
                pdl_wait(PDL)
        a_row = a_ptr + (m // a_div).to(tl.int64) * s_am
        acc = slab_dot(a_row, g1, g2, g3, K, K1, K2, K3)
        if ACT == 1:
            acc = tl.maximum(acc, 0.0)
            acc = acc * acc
        if ACT == 2:
            acc = acc / (1.0 + tl.exp(-acc)) * slab_dot(a_row, u1, u2, u3, K, K1, K2, K3)
        if MUL_W:
            acc = acc * route_w
        tl.store(c_ptr + m.to(tl.int64) * s_cm + offs_n, acc.to(c_ptr.dtype.element_ty), mask=mask_n)

    @triton.jit
    def expert_sum(y_ptr, add_ptr, t, offs, mask, H, TOP_K: tl.constexpr, HAS_ADD: tl.constexpr):
        """Token t's sum over its TOP_K expert rows of y [T * TOP_K, H] (+ add [T, H]) at columns
        offs, in fp32 and in a fixed order (also inlined by triton_norm.sum_add_rms_norm)."""
        acc = tl.zeros(offs.shape, dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            acc += tl.load(y_ptr + (t * TOP_K + j) * H + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_ADD:
            acc += tl.load(add_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
        return acc

    @triton.jit
    def _sum_k_kernel(y_ptr, add_ptr, out_ptr, H, TOP_K: tl.constexpr, HAS_ADD: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        acc = expert_sum(y_ptr, add_ptr, t, offs, mask, H, TOP_K, HAS_ADD)
        tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Kernel configurations per regime: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages), one
# for both GEMMs, or a pair (first GEMM's, second GEMM's) with the same BLOCK_M (the alignment's).
# Decode (few rows per expert): weight streaming, narrow column tiles for enough programs in flight.
# Prefill: compute-bound tiles. bench/bench_moe_kernels.py sweeps alternatives on the device.
CONFIGS = {
    "decode": (16, 64, 128, 1, 4, 4),
    "decode_wide": (32, 64, 128, 1, 4, 4),
    "prefill": (128, 256, 64, 8, 8, 3),
    "prefill_gated": (128, 128, 64, 8, 8, 3),  # two B tiles: (128, 256) is over the shared memory
}


def gemm_configs(config: tuple) -> tuple[tuple, tuple]:
    """(first GEMM's, second GEMM's) configuration of a CONFIGS value or a `config` argument."""
    up, down = config if isinstance(config[0], tuple) else (config, config)
    if up[0] != down[0]:
        raise ValueError(f"the two GEMMs' configurations need the same BLOCK_M: {up} / {down}")
    return up, down


# Configurations tuned per released expert shape for the smallest decode steps (at most
# triton_moe_align.NAIVE_MAX_PAIRS pairs: batch 1 to 5 at top-6), used as they are (no column
# narrowing): (routed experts, hidden, expert width, gated) -> config. Measured on the H200 with
# bench/bench_moe_kernels.py in two runs (2026-12-02, bench/results/moe_tiles_7f55cf3_h200.log and
# moe_split_k_tried_h200.log): Nemotron-3-Nano's layer at batch 1 in 46.0 / 46.4 us against 48.9 /
# 49.6 us for the narrowed default (its first GEMM at 64-wide tiles, the second at BLOCK_K 64 with
# 6 stages), 132.7 against 133.3 us at batch 4; from batch 8 on the default is as fast or faster.
TUNED_DECODE = {
    (128, 2688, 1856, False): ((16, 64, 128, 1, 4, 4), (16, 64, 64, 1, 4, 6)),  # Nemotron-3-Nano-30B-A3B
}


def decode_tuned(num_pairs: int, num_experts: int, hidden: int, inter: int, gated: bool) -> tuple | None:
    """The TUNED_DECODE configuration of this expert shape at this step size, or None."""
    if num_pairs > triton_moe_align.NAIVE_MAX_PAIRS:
        return None
    return TUNED_DECODE.get((num_experts, hidden, inter, gated))


def pick_config(num_pairs: int, num_experts: int, gated: bool) -> str:
    # measured on the H200 (bench/bench_moe_kernels.py): 16-row blocks while an expert averages at
    # most 16 pairs, 32-row ones above that, the prefill tiles past the one-program alignment's range
    if num_pairs <= triton_moe_align.TRITON_ALIGN_MAX_PAIRS:
        return "decode" if num_pairs <= 16 * num_experts else "decode_wide"
    return "prefill_gated" if gated else "prefill"


_SMEM_BUDGET = 200 * 1024  # bytes of pipelined tiles per program (the H100/H200 limit is 227 KiB)


def launch_config(cfg: tuple, act: int, element_size: int, num_blocks: int, n_out: int, narrow: bool,
                  sms: int) -> tuple:
    """The (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages) one grouped GEMM launches with, from its
    configuration `cfg`: shared memory fitted to the operands' size, BLOCK_N narrowed (`narrow`) for a
    launch of few programs (see _grouped_gemm)."""
    bm, bn, bk, gm, warps, stages = cfg
    # fp32 operands (tests, fp32 models) take twice the shared memory of the bf16 tiles the configs
    # were tuned for: fewer pipeline stages, then shorter K steps, until the buffers fit
    tile_bytes = lambda: stages * (bm * bk + (2 if act == ACT_SILU_MUL else 1) * bk * bn) * element_size
    while stages > 2 and tile_bytes() > _SMEM_BUDGET:
        stages -= 1
    while bk > 32 and tile_bytes() > _SMEM_BUDGET:
        bk //= 2
    if narrow:  # (32: the narrowest tile measured on the H200, bench/bench_moe_kernels.py)
        while bn > 32 and num_blocks * cdiv(n_out, bn) < 2 * sms:
            bn //= 2
    return bm, bn, bk, gm, warps, stages


_NOT_ROUTED = dict(ROUTED=False, R_TOP_K=1, R_KP=1, R_EP=1, R_SIGMOID=False, R_HAS_BIAS=False, R_NORMALIZE=False,
                   R_SPLITS=1, R_ROUND=0)


def _grouped_gemm(a, w, shared, out, weights, pairs, block_expert, total, a_div, act, cfg, narrow: bool,
                  early_b: bool = False, w_scale: torch.Tensor | None = None,
                  routed: tuple | None = None) -> None:
    """One grouped GEMM launch. `shared`: (tensor, row stride, pseudo-expert stride, up-row offset)
    or None. `narrow`: halve BLOCK_N (down to 16) while the launch has under two programs per SM,
    so that a decode step with few pairs still streams the weights from every SM. `early_b`: the
    blocks were aligned before the previous launch (the second GEMM): see _moe_gemm_kernel.
    `w_scale` [E, rows of w] fp32: w is FP8 (e4m3) with these per-row scales. `routed` (a first GEMM only):
    (RouterLogits, top_idx, top_w) of a one-token step routed inside the kernel (ROUTED), which writes
    top_idx / top_w for the second."""
    n_out = out.shape[1]
    nb = block_expert.shape[0]
    bm, bn, bk, gm, warps, stages = launch_config(cfg, act, a.element_size(), nb, n_out, narrow, sm_count(a.device))
    s_t, s_sn, s_se, s_up = shared if shared is not None else (w, 0, 0, 0)
    if routed is not None:  # the router's arguments, then where the kernel writes the routing
        router, top_idx, top_w = routed
        r_args, consts = router.kernel_args()
        r_args, consts = (*r_args, top_idx, top_w), dict(consts, ROUTED=True)
    else:
        r_args, consts = (out, out, 0, 0, 1.0, block_expert, out), _NOT_ROUTED
    pdl = pdl_options(a.device)
    _moe_gemm_kernel[(nb * cdiv(n_out, bn),)](
        a, w, s_t, out, weights if weights is not None else out, pairs, block_expert, total,
        w_scale if w_scale is not None else out, n_out, a.shape[1], out.shape[0], a_div, nb, w.shape[0],
        a.stride(0), w.stride(0), w.stride(1), s_sn, s_se, s_up, out.stride(0),
        w_scale.stride(0) if w_scale is not None else 0, *r_args,
        ACT=act, MUL_W=weights is not None, HAS_SHARED=shared is not None, W_SCALE=w_scale is not None,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, EARLY_B=early_b and act == ACT_NONE, **consts,
        num_warps=warps, num_stages=stages, **pdl,
    )


# One-token steps' expert GEMMs on _one_token_experts_kernel (the "moe_preload" switch, on by default;
# HYBRID_MOE_PRELOAD=0 turns it off): this many weights a program, the gate and up slabs together (SwiGLU)
ONE_TOKEN_ELEMENTS = 16384


def one_token_preload(T: int, align_method: str, fp8: bool, routed: bool) -> bool:
    """Whether fused_experts runs this step's two GEMMs on the one-token preloading kernel: one token, pairs in
    the naive layout, experts that are not FP8 (16-bit ones in the models; fp32 ones too, e.g. on the CPU
    interpreter), routed by a routing launch (not inside the first GEMM), the switch on."""
    return T == 1 and align_method == "naive" and not fp8 and not routed and switch("moe_preload")


def one_token_tiles(K: int, swiglu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, K1, K2, K3) of a one-token expert GEMM over K (SwiGLU: the gate and up slabs share a program's
    ONE_TOKEN_ELEMENTS)."""
    return triton_gemv.preload_tiles(K, None, ONE_TOKEN_ELEMENTS // (2 if swiglu else 1))


def _one_token_gemm(a, w, shared, out, weights, block_expert, a_div, act, early: bool, num_shared: int) -> None:
    """One of a one-token step's grouped GEMMs on _one_token_experts_kernel (see one_token_preload):
    _grouped_gemm's arguments, the naive layout's block_expert (the pairs' experts, the last num_shared of
    them the shared pseudo-experts)."""
    n_out, K = out.shape[1], a.shape[1]
    block_n, k1, k2, k3 = one_token_tiles(K, act == ACT_SILU_MUL)
    s_t, s_sn, s_se, s_up = shared if shared is not None else (w, 0, 0, 0)
    # (the first GEMM with a shared expert: a_div is the token's row of pairs, the shared ones last)
    shared_early = shared is not None and not early and num_shared > 0 and switch("moe_shared_early")
    assert not shared_early or block_expert.shape[0] == a_div, "SHARED_EARLY takes one token's pairs"
    _one_token_experts_kernel[(block_expert.shape[0] * cdiv(n_out, block_n),)](
        a, w, s_t, out, weights if weights is not None else out, block_expert, n_out, K, a_div, w.shape[0],
        block_expert.shape[0] - num_shared, a.stride(0), w.stride(0), w.stride(1), s_sn, s_se, s_up, out.stride(0),
        ACT=act, MUL_W=weights is not None, HAS_SHARED=shared is not None, EARLY=early, SHARED_EARLY=shared_early,
        BLOCK_N=block_n, K1=k1, K2=k2, K3=k3, num_warps=4, **pdl_options(a.device),
    )


# The shared expert joins the expert launches only for steps of at most this many tokens: then each
# of its slices is one 16-row block, streamed once, and the step saves the shared MLP's three
# launches. Above it a slice would span several blocks, each streaming the slice's weights again
# (the shared MLP then runs on its own, through cuBLAS).
SHARED_FOLD_MAX_TOKENS = 16


def num_shared_pseudo_experts(shared_down: torch.Tensor | None, inter: int) -> int:
    """How many expert-wide slices the shared expert's down weight [H, S*I] makes (0: none)."""
    return 0 if shared_down is None else shared_down.shape[1] // inter


@dataclass
class ExpertRows:
    """The experts' weighted outputs before their sum over k: y [T * top_k, H] (row t * top_k + j:
    token t's j-th choice, already times its routing weight) and `add` [T, H] or None. `sum()` is
    what fused_experts returns; triton_norm.sum_add_rms_norm folds the same sum into the next
    layer's residual add and norm (one launch fewer a layer, the same rounding)."""

    y: torch.Tensor
    add: torch.Tensor | None
    top_k: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.y.shape[0] // self.top_k, self.y.shape[1]))

    def sum(self) -> torch.Tensor:
        T, H = self.shape
        out = torch.empty(T, H, dtype=self.y.dtype, device=self.y.device)
        if T:
            block = min(1024, triton.next_power_of_2(H))
            _sum_k_kernel[(T, cdiv(H, block))](self.y, self.add if self.add is not None else self.y, out, H,
                                                  TOP_K=self.top_k, HAS_ADD=self.add is not None, BLOCK=block,
                                                  num_warps=4, **pdl_options(self.y.device))
        return out


def _gemm_choice(T: int, top_k: int, E: int, S: int, H: int, inter: int, gated: bool, config=None,
                 align_method: str | None = None) -> tuple[tuple, tuple, str | None, bool]:
    """(first GEMM's config, second GEMM's, alignment method or None for align's own choice, narrow)
    of a fused_experts call of T tokens with top_k columns (S of them the shared expert's slices)."""
    n = T * top_k
    tuned = decode_tuned(n, E, H, inter, gated) if config is None else None
    cfg_up, cfg_down = gemm_configs(config or tuned or CONFIGS[pick_config(n, E + S, gated)])
    if align_method is None and S and T > 1 and n <= triton_moe_align.NAIVE_MAX_PAIRS:
        align_method = "triton"  # naive blocks would stream the shared slices once per token
    return cfg_up, cfg_down, align_method, config is None and tuned is None and cfg_up[0] == 16


def launch_plan(T: int, top_k: int, num_experts: int, num_shared: int, hidden: int, inter: int, gated: bool,
                element_size: int, sms: int, fp8: bool = False) -> tuple:
    """What a fused_experts call of T tokens compiles for (without `config` / `align_method`): the
    alignment method and both GEMMs' launch configurations (the one-token kernel's tiles, marked
    "one_token", where one_token_preload takes the step), and whether the shared expert joins.
    `top_k` counts the routed experts only; num_shared: the slices the shared expert joins as at this T
    (Experts.shared_slices). Steps with the same plan meet the same Triton specialisations."""
    k = top_k + num_shared
    n = T * k
    cfg_up, cfg_down, method, narrow = _gemm_choice(T, k, num_experts, num_shared, hidden, inter, gated)
    method = method or triton_moe_align.pick_method(n)
    if one_token_preload(T, method, fp8, routed=switch("moe_route_in_gemm")):
        up, down = one_token_tiles(hidden, gated), one_token_tiles(inter, False)
        return method, ("one_token", *up), ("one_token", *down), num_shared > 0
    nb = triton_moe_align.max_blocks(n, num_experts + num_shared, cfg_up[0])
    up = launch_config(cfg_up, ACT_SILU_MUL if gated else ACT_RELU2, element_size, nb, inter, narrow, sms)
    down = launch_config(cfg_down, ACT_NONE, element_size, nb, hidden, narrow, sms)
    return method, up, down, num_shared > 0


def fused_experts(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, top_idx: torch.Tensor | None,
                  top_w: torch.Tensor | None, gated: bool, add: torch.Tensor | None = None, *,
                  shared_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
                  config: tuple | tuple[tuple, tuple] | None = None, align_method: str | None = None,
                  defer_sum: bool = False, up_scale: torch.Tensor | None = None,
                  down_scale: torch.Tensor | None = None,
                  router: triton_moe_route.RouterLogits | None = None) -> torch.Tensor | ExpertRows:
    """The routed experts' output [T, H] in x.dtype (+ `add`); see the module docstring. With
    `defer_sum`, the ExpertRows that sum to it (for the next norm to add up: ExpertRows).

    `router` (with top_idx and top_w None): the step's router logits, not yet routed. With the
    "moe_route_in_gemm" switch (HYBRID_MOE_ROUTE_IN_GEMM=1), a step of one token whose pairs each get
    their own block (naive alignment) is routed inside the first GEMM, which writes the routing for the
    second (_moe_gemm_kernel's ROUTED: no routing launch); any other step launches the routing first.

    With shared_up [S*I or 2*S*I, H] ([gate | up] rows when gated) and shared_down [H, S*I] the
    shared expert (of S times the expert width) joins the same launches as S pseudo-experts
    E .. E+S-1, each an I-wide slice of it: top_idx / top_w then carry S more columns, ids E+s with
    weight 1 (`triton_moe_route.route(..., num_shared=S)` writes them). The slices' outputs add up to
    the shared MLP's. `config`: one kernel configuration or a (first GEMM, second GEMM) pair (CONFIGS);
    given, it is used as is (no narrowing); otherwise TUNED_DECODE's for this shape at the smallest
    steps, else CONFIGS' by step size (pick_config), narrowed at few programs.

    FP8 experts (weight-only): w_up / w_down in float8_e4m3fn with up_scale [E, I or 2I] and
    down_scale [E, H] (fp32, one per output row): the result of their dequantized weights
    (w.float() * scale) up to rounding. The shared expert then runs on its own (no shared_up)."""
    require(__name__)
    T, H = x.shape
    E, width, _ = w_up.shape
    inter = w_down.shape[2]
    routed = None
    if router is not None:
        assert top_idx is None and top_w is None and router.T == T and router.E == E, "router or top_idx / top_w"
        width_k = router.top_k + router.num_shared
        if (T == 1 and switch("moe_route_in_gemm")
                and (align_method or triton_moe_align.pick_method(width_k)) == "naive"):
            top_idx = torch.empty(1, width_k, dtype=torch.int32, device=x.device)  # written by the first GEMM
            top_w = torch.empty(1, width_k, dtype=torch.float32, device=x.device)
            routed = (router, top_idx, top_w)
        else:
            top_idx, top_w = router.route()
    top_k = top_idx.shape[1]
    assert x.stride(1) == 1 and w_up.stride(2) == 1 and w_down.stride(2) == 1
    assert width == (2 * inter if gated else inter)
    fp8 = w_up.dtype == torch.float8_e4m3fn
    assert fp8 == (w_down.dtype == torch.float8_e4m3fn) == (up_scale is not None) == (down_scale is not None), \
        "FP8 experts need both weights in float8_e4m3fn and both per-row scales"
    if fp8:
        assert shared_down is None, "FP8 experts do not share their launches with the shared expert"
        assert up_scale.shape == (E, width) and down_scale.shape == (E, H)
        assert up_scale.dtype == down_scale.dtype == torch.float32 and up_scale.stride(1) == down_scale.stride(1) == 1
    S = num_shared_pseudo_experts(shared_down, inter)
    up_shared = down_shared = None
    if S:
        s_width = S * inter
        assert shared_down.shape == (H, s_width) and shared_up.shape == ((2 if gated else 1) * s_width, H)
        assert shared_up.stride(1) == 1 and shared_down.stride(1) == 1
        up_shared = (shared_up, shared_up.stride(0), inter * shared_up.stride(0), s_width * shared_up.stride(0))
        down_shared = (shared_down, shared_down.stride(0), inter, 0)
    if T == 0:
        return torch.empty(T, H, dtype=x.dtype, device=x.device)
    n = T * top_k
    cfg_up, cfg_down, align_method, narrow = _gemm_choice(T, top_k, E, S, H, inter, gated, config, align_method)
    if config is None and one_token_preload(T, align_method or triton_moe_align.pick_method(n), fp8,
                                            routed is not None):
        h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
        block_expert = top_idx.reshape(-1)  # (the naive layout: pair p alone in block p)
        _one_token_gemm(x, w_up, up_shared, h, None, block_expert, top_k, ACT_SILU_MUL if gated else ACT_RELU2,
                        early=False, num_shared=S)
        y = torch.empty(n, H, dtype=x.dtype, device=x.device)
        _one_token_gemm(h, w_down, down_shared, y, top_w.reshape(-1).contiguous(), block_expert, 1, ACT_NONE,
                        early=True, num_shared=S)
    else:
        # (routed: the naive layout, which reads no ids; the first GEMM writes them into block_expert = top_idx)
        pairs, block_expert, total = triton_moe_align.align(top_idx.reshape(-1), E + S, cfg_up[0], align_method)
        h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w_up, up_shared, h, None, pairs, block_expert, total, top_k,
                      ACT_SILU_MUL if gated else ACT_RELU2, cfg_up, narrow, w_scale=up_scale, routed=routed)
        y = torch.empty(n, H, dtype=x.dtype, device=x.device)
        # (routed: the blocks' experts and weights come from the first GEMM, so the second reads them after its wait)
        _grouped_gemm(h, w_down, down_shared, y, top_w.reshape(-1).contiguous(), pairs, block_expert, total, 1,
                      ACT_NONE, cfg_down, narrow, early_b=routed is None, w_scale=down_scale)
    if add is not None:
        assert add.shape == (T, H) and add.stride(1) == 1 and add.stride(0) == H
    rows = ExpertRows(y, add, top_k)
    return rows if defer_sum else rows.sum()
