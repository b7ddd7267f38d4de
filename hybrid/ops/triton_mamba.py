"""Triton kernels for the Mamba2 mixer: conv window update, selective state update, conv prefill.

Semantics are those of `hybrid.ops.mamba_torch.conv_decode` / `ssm_decode` (decode path: no dt clamp),
with all arithmetic in fp32 whatever the storage dtypes, and with padding rows skipped:

- `selective_state_update(state, x, dt, A, B, C, D, dt_bias, state_indices, ...)`
      state [S, H, P, N] fp32 or bf16 (loaded, updated in fp32, and rounded to its dtype after every
      token: one T-token launch equals T one-token launches bit for bit, states and outputs)
      x [b, H, P] (one token) or [b, T, H, P] (T tokens, speculative verify); dt [b, H] / [b, T, H];
      B, C [b, G, N] / [b, T, G, N]; A, D, dt_bias [H] (A = -exp(A_log); D, dt_bias may be None).
      Returns y [b, H, P] / [b, T, H, P] (dtype of x, or write into `out`).
      With `intermediate_states` [num_scratch, T, H, P, N] the state after every token is written to
      intermediate_states[intermediate_indices[i], t] (default index: the batch row i) and the slot
      is left untouched; without it the slot is updated in place with the state after the last token.
- `conv_state_update(x, conv_state, weight, bias, state_indices, activation="silu", ...)`
      x [b, C] or [b, T, C]; conv_state [S, C, K-1]; weight [C, K]; bias [C] or None.
      Returns silu(conv) with x's shape. `intermediate_states` [num_scratch, T, C, K-1]: the window
      after every token goes there and the slot is untouched (as above). Past tokens of the window
      are rounded to conv_state's dtype, as a one-token launch reads them back from the history.
- `conv_prefill(x, conv_state, slot, has_initial_state, weight, bias)`: one request's prefill chunk,
      x [L, C] rows (any row stride); as mamba_torch.conv_prefill: returns silu(conv) [L, C]
      (contiguous, x's dtype) over [slot history | x] (zero history for a first chunk) and stores the
      last K-1 inputs as the slot's new history. Token-major all the way: no transposes.

Padding: rows whose state index is < 0 (PAD_SLOT_ID) write no state and no scratch row; like the
torch reference they compute their output from a zero state / zero conv history (never a slot's).

Kernel design (memory bound: each state element is read once and written once):
- state update grid (cdiv(P, BLOCK_P), H, b); each program streams one [BLOCK_P, N] tile of one
  head of one slot (N whole, in registers; contiguous rows so loads/stores are 16-byte vectors),
  computes dA = exp(A[h] * softplus(dt + dt_bias)) once per head, state = state * dA + (dt*B) x,
  y = state @ C + D x, and stores the tile back (evict-first: the state is streamed, not reused).
  BLOCK_P is picked so that small batches still launch >= ~4 programs per SM (batch 1 at 128 heads x
  64: BLOCK_P 8 -> 1024 programs), larger batches use larger tiles (fewer, longer programs).
- conv update grid (cdiv(C, BLOCK_C), b): the window [C, K] is a 2-D register tile, gathered from
  the slot's K-1 history columns and the new token(s).
- a fused conv + state-update kernel was measured slower than these two launches (the per-group
  B/C conv recomputed by every head-block program; BENCHMARKS.md) and was removed.

Triton is imported guarded (hybrid/ops/triton_guard.py): importing this module without triton works;
calling a kernel raises.
Set TRITON_INTERPRET=1 before the first triton import to run the kernels on CPU tensors.
"""
from __future__ import annotations

import torch

from hybrid.ops.triton_guard import HAS_TRITON, arrival_counts, pdl_options, require, tl, triton
from state_pool.util import cdiv, sm_count

PAD_SLOT_ID = -1


def is_available() -> bool:
    return HAS_TRITON


if HAS_TRITON:
    import inspect

    from hybrid.ops.triton_guard import pdl_wait

    # The decode kernels' token count T: 1 (decode), K+1 (verify) or any count (replay of a readmitted
    # sequence). T == 1 stays specialised (see _ssm_update_kernel), but not "a multiple of 16", so a
    # replay length compiles nothing a verify or other replay did not (on a Triton without the
    # option, T keeps both classes).
    T_KEEPS_ONLY_ONE = ({"do_not_specialize_on_alignment": ["T"]}
                        if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters else {})

    @triton.jit
    def _softplus(v):
        # torch.nn.functional.softplus (beta 1, threshold 20) with an accurate log1p (Goldberg).
        u = tl.exp(v)
        w = 1.0 + u
        lp = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
        return tl.where(v > 20.0, v, lp)

    # T=1 (decode) compiles its own specialisation (not specialising T costs bf16 decodes ~40% on
    # the H200); its per-token arithmetic is the loop body's, and tests/gpu checks that T tokens in
    # one launch equal T decodes bit for bit on the compiled kernels.
    @triton.jit(**T_KEEPS_ONLY_ONE)
    def _ssm_update_kernel(
        state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, out_ptr, idx_ptr,
        inter_ptr, inter_idx_ptr, z_ptr, sq_ptr,
        T, P, N, heads_per_group,
        s_st_slot, s_st_h, s_st_p,
        s_x_b, s_x_t, s_x_h,
        s_dt_b, s_dt_t, s_dt_h,
        s_B_b, s_B_t, s_B_g,
        s_C_b, s_C_t, s_C_g,
        s_o_b, s_o_t, s_o_h,
        s_i_slot, s_i_t, s_i_h, s_i_p,
        s_z_b, s_z_h, s_sq_b,
        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, HAS_INTER: tl.constexpr, HAS_INTER_IDX: tl.constexpr,
        HAS_GATE_SQ: tl.constexpr, PDL: tl.constexpr,
    ):
        pid_p = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        mask_p = offs_p < P
        mask_n = offs_n < N
        mask = mask_p[:, None] & mask_n[None, :]
        out_base = out_ptr + b.to(tl.int64) * s_o_b + h * s_o_h + offs_p

        slot = tl.load(idx_ptr + b).to(tl.int64)
        valid = slot >= 0  # padding row: zero state in, nothing stored (as mamba_torch.ssm_decode)
        smask = mask & valid
        tile = h * s_st_h + offs_p[:, None] * s_st_p + offs_n[None, :]
        st_ptrs = state_ptr + tl.maximum(slot, 0) * s_st_slot + tile
        state = tl.load(st_ptrs, mask=smask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        # the slot's state (and the slot ids, copied in before the step) is written by no earlier
        # kernel of the step, and no kernel writes the layer's parameters: read before the wait, so
        # their latency (the parameters' from HBM) overlaps the previous kernel's tail
        A = tl.load(A_ptr + h).to(tl.float32)
        if HAS_D:
            Dh = tl.load(D_ptr + h).to(tl.float32)
        if HAS_DT_BIAS:
            dtb = tl.load(dt_bias_ptr + h).to(tl.float32)
        pdl_wait(PDL)

        g = h // heads_per_group
        if HAS_INTER:
            if HAS_INTER_IDX:
                irow = tl.maximum(tl.load(inter_idx_ptr + b).to(tl.int64), 0)
            else:
                irow = b.to(tl.int64)
            i_ptrs = inter_ptr + irow * s_i_slot + h * s_i_h + offs_p[:, None] * s_i_p + offs_n[None, :]

        x_base = x_ptr + b.to(tl.int64) * s_x_b + h * s_x_h + offs_p
        dt_base = dt_ptr + b.to(tl.int64) * s_dt_b + h * s_dt_h
        B_base = B_ptr + b.to(tl.int64) * s_B_b + g * s_B_g + offs_n
        C_base = C_ptr + b.to(tl.int64) * s_C_b + g * s_C_g + offs_n
        for t in range(T):
            x = tl.load(x_base + t * s_x_t, mask=mask_p, other=0.0).to(tl.float32)
            dt = tl.load(dt_base + t * s_dt_t).to(tl.float32)
            Bv = tl.load(B_base + t * s_B_t, mask=mask_n, other=0.0, eviction_policy="evict_last").to(tl.float32)
            Cv = tl.load(C_base + t * s_C_t, mask=mask_n, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if HAS_DT_BIAS:
                dt = dt + dtb
            dt = _softplus(dt)
            dA = tl.exp(dt * A)
            dB = Bv * dt  # [N]: (dt * B) * x as in the reference
            state = state * dA + x[:, None] * dB[None, :]
            y = tl.sum(state * Cv[None, :], axis=1)
            if HAS_D:
                y = y + x * Dh
            tl.store(out_base + t * s_o_t, y.to(out_ptr.dtype.element_ty), mask=mask_p)
            if HAS_GATE_SQ:  # (one token) this block's part of the gated norm's sum of squares
                yr = y.to(out_ptr.dtype.element_ty).to(tl.float32)  # as the norm reads y back
                zv = tl.load(z_ptr + b.to(tl.int64) * s_z_b + h * s_z_h + offs_p, mask=mask_p, other=0.0).to(tl.float32)
                hg = yr * (zv / (1.0 + tl.exp(-zv)))
                tl.store(sq_ptr + b.to(tl.int64) * s_sq_b + h * tl.num_programs(0) + pid_p,
                         tl.sum(tl.where(mask_p, hg * hg, 0.0), axis=0))
            # The contract: the state carried to the next token is what a one-token decode would have
            # stored, rounded to the slot's dtype (y above comes from the unrounded state, as there).
            state = state.to(state_ptr.dtype.element_ty).to(tl.float32)
            if HAS_INTER:
                tl.store(i_ptrs + t * s_i_t, state.to(inter_ptr.dtype.element_ty), mask=smask,
                         eviction_policy="evict_first")
        if not HAS_INTER:
            tl.store(st_ptrs, state.to(state_ptr.dtype.element_ty), mask=smask, eviction_policy="evict_first")

    @triton.jit
    def _ext_tile(cs_row, x_row, offs_c, mask_c, start, s_cs_c, s_cs_k, s_x_t, valid,
                  K: tl.constexpr, KP: tl.constexpr, NCOLS: tl.constexpr):
        """[BLOCK_C, KP] tile: column j holds ext[start + j] (j < NCOLS) of the extended sequence
        ext = [history col 0 .. K-2, token 0, token 1, ...], zero elsewhere (and a zero history
        when not `valid`: padding rows). fp32."""
        cols = tl.arange(0, KP)
        i = start + cols  # index into ext
        in_hist = (i < K - 1) & (cols < NCOLS) & valid
        in_x = (i >= K - 1) & (cols < NCOLS)
        hist = tl.load(cs_row + offs_c[:, None] * s_cs_c + tl.where(in_hist, i, 0)[None, :] * s_cs_k,
                       mask=mask_c[:, None] & in_hist[None, :], other=0.0).to(tl.float32)
        xt = tl.load(x_row + tl.where(in_x, i - (K - 1), 0)[None, :] * s_x_t + offs_c[:, None],
                     mask=mask_c[:, None] & in_x[None, :], other=0.0).to(tl.float32)
        # Columns before the last are history: a one-token decode would read those tokens back from
        # the conv state, rounded to its dtype (the contract: state rounded after every token). A
        # compile-time branch: with the engine's conv state in x's dtype this is the identity.
        if cs_row.dtype.element_ty != x_row.dtype.element_ty:
            xt = tl.where((cols < K - 1)[None, :], xt.to(cs_row.dtype.element_ty).to(tl.float32), xt)
        return hist + xt

    @triton.jit
    def _conv_window_out(cs_row, x_row, w_ptr, bias_ptr, offs_c, mask_c, t, s_cs_c, s_cs_k, s_x_t, s_w_c, valid,
                         K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
        """Conv output (fp32, [BLOCK_C]) of token t: sum_k w[c, k] * ext[t + k] (+ bias), silu."""
        cols = tl.arange(0, KP)
        win = _ext_tile(cs_row, x_row, offs_c, mask_c, t, s_cs_c, s_cs_k, s_x_t, valid, K, KP, K)
        w = tl.load(w_ptr + offs_c[:, None] * s_w_c + cols[None, :],
                    mask=mask_c[:, None] & (cols < K)[None, :], other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        acc = tl.sum(win * w, axis=1)
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        return acc

    @triton.jit(**T_KEEPS_ONLY_ONE)
    def _conv_update_kernel(
        x_ptr, cs_ptr, w_ptr, bias_ptr, out_ptr, idx_ptr, inter_ptr, inter_idx_ptr,
        T, CD,
        s_x_b, s_x_t,
        s_cs_slot, s_cs_c, s_cs_k,
        s_w_c,
        s_o_b, s_o_t,
        s_i_slot, s_i_t, s_i_c, s_i_k,
        K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr,
        HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_INTER: tl.constexpr, HAS_INTER_IDX: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        pid_c = tl.program_id(0)
        b = tl.program_id(1)
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_c = offs_c < CD
        cols = tl.arange(0, KP)
        out_base = out_ptr + b.to(tl.int64) * s_o_b + offs_c
        slot = tl.load(idx_ptr + b).to(tl.int64)
        valid = slot >= 0  # padding row: zero history in, nothing stored (as mamba_torch.conv_decode)
        cs_row = cs_ptr + tl.maximum(slot, 0) * s_cs_slot
        x_row = x_ptr + b.to(tl.int64) * s_x_b
        if HAS_INTER:
            if HAS_INTER_IDX:
                irow = tl.maximum(tl.load(inter_idx_ptr + b).to(tl.int64), 0)
            else:
                irow = b.to(tl.int64)
            i_ptrs = inter_ptr + irow * s_i_slot + offs_c[:, None] * s_i_c + cols[None, :] * s_i_k
        for t in range(T):
            acc = _conv_window_out(cs_row, x_row, w_ptr, bias_ptr, offs_c, mask_c, t, s_cs_c, s_cs_k, s_x_t,
                                   s_w_c, valid, K, KP, HAS_BIAS, SILU)
            tl.store(out_base + t * s_o_t, acc.to(out_ptr.dtype.element_ty), mask=mask_c)
            if HAS_INTER:
                win = _ext_tile(cs_row, x_row, offs_c, mask_c, t + 1, s_cs_c, s_cs_k, s_x_t, valid, K, KP, K - 1)
                tl.store(i_ptrs + t * s_i_t, win.to(inter_ptr.dtype.element_ty),
                         mask=mask_c[:, None] & (cols < K - 1)[None, :] & valid)
        if not HAS_INTER:
            new = _ext_tile(cs_row, x_row, offs_c, mask_c, T, s_cs_c, s_cs_k, s_x_t, valid, K, KP, K - 1)
            tl.debug_barrier()  # every thread has read the old history before any of it is overwritten
            tl.store(cs_row + offs_c[:, None] * s_cs_c + cols[None, :] * s_cs_k, new.to(cs_ptr.dtype.element_ty),
                     mask=mask_c[:, None] & (cols < K - 1)[None, :] & valid)

    @triton.jit(do_not_specialize=["L"])  # the chunk length: a new compile per value class otherwise
    def _conv_prefill_kernel(x_ptr, hist_ptr, w_ptr, bias_ptr, out_ptr, L, CD,
                             s_x, s_o, s_h_c, s_h_k, s_w_c,
                             K: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr,
                             HAS_HIST: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # One program: BLOCK_L tokens x BLOCK_C channels. out[t] = silu(sum_k w[:, k] * ext[t + k] + b)
        # where ext = [history (K-1 columns) | x]; tokens t + k - (K-1) < 0 read the history.
        offs_t = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_t = offs_t < L
        mask_c = offs_c < CD
        acc = tl.zeros((BLOCK_L, BLOCK_C), dtype=tl.float32)
        for k in tl.static_range(K):
            src = offs_t + (k - (K - 1))  # token index into x; < 0: history column src + K - 1
            in_x = (src >= 0) & mask_t
            xv = tl.load(x_ptr + tl.maximum(src, 0).to(tl.int64)[:, None] * s_x + offs_c[None, :],
                         mask=in_x[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
            if HAS_HIST:
                in_h = (src < 0) & mask_t
                hv = tl.load(hist_ptr + offs_c[None, :] * s_h_c + tl.maximum(src + (K - 1), 0)[:, None] * s_h_k,
                             mask=in_h[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
                xv = xv + hv
            w = tl.load(w_ptr + offs_c * s_w_c + k, mask=mask_c, other=0.0).to(tl.float32)
            acc += xv * w[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
        acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * s_o + offs_c[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask_t[:, None] & mask_c[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def default_ssm_config(batch: int, heads: int, head_dim: int, state_size: int, state_dtype: torch.dtype,
                       device: torch.device) -> tuple[int, int]:
    """(BLOCK_P, num_warps): the largest tile that still gives >= 4 programs per SM, at most 16 KiB."""
    sms = sm_count(device)
    bn = _next_pow2(state_size)
    elt = torch.empty((), dtype=state_dtype).element_size()
    bp = min(_next_pow2(head_dim), max(1, 16384 // (bn * elt)))
    while bp > 1 and batch * heads * cdiv(head_dim, bp) < 4 * sms:
        bp //= 2
    bp = max(bp, 1)
    return bp, _ssm_warps(bp * bn)


def _ssm_warps(tile: int) -> int:
    return 8 if tile >= 4096 else (4 if tile >= 1024 else 2)


GATE_PARTS = 256  # the most sums of squares a row selective_state_update_gated writes (see there)


def _indices(state_indices: torch.Tensor) -> torch.Tensor:
    if state_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError("state_indices must be int32 or int64")
    return state_indices if state_indices.is_contiguous() else state_indices.contiguous()


def _last_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def selective_state_update_gated(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                                 B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
                                 dt_bias: torch.Tensor | None, state_indices: torch.Tensor, z: torch.Tensor, *,
                                 block_p: int | None = None,
                                 num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """selective_state_update of one token a row (x [b, H, P]) that also returns, for the Mamba2 gated norm
    after it, each program's sum of squares of y * silu(z) over its head-dim block (y as stored): sq
    [b, H, blocks] fp32, blocks = the launch's head-dim blocks (P / BLOCK_P, at most GATE_PARTS / H unless
    block_p says otherwise); z [b, H, P], last dim contiguous. A group's mean square is then the sum of its
    heads' parts over its channels (triton_gemv.gated_out_proj), with no launch of its own."""
    if x.dim() != 3 or z.shape != x.shape or z.stride(-1) != 1:
        raise ValueError(f"selective_state_update_gated: one token a row, z like x: x {tuple(x.shape)}, "
                         f"z {tuple(z.shape)} {z.stride()}")
    return _ssm_update(state, x, dt, A, B, C, D, dt_bias, state_indices, None, None, None, block_p, num_warps, z)


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
                           state_indices: torch.Tensor, *, out: torch.Tensor | None = None,
                           intermediate_states: torch.Tensor | None = None,
                           intermediate_indices: torch.Tensor | None = None,
                           block_p: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Mamba2 decode recurrence (see the module docstring for shapes). Returns y like x.

    dt is softplus(dt + dt_bias) (no clamp); dA = exp(dt * A[h]); state = state * dA + dt * B x;
    y = state . C + D x. state_indices[i] < 0 marks a padding row (zero state in, nothing stored).
    The state contract, for every T: after each token the state is rounded to state.dtype (y is
    taken before that rounding), so T tokens in one launch equal T one-token launches bit for bit.
    """
    return _ssm_update(state, x, dt, A, B, C, D, dt_bias, state_indices, out, intermediate_states,
                       intermediate_indices, block_p, num_warps, None)[0]


def _ssm_update(state, x, dt, A, B, C, D, dt_bias, state_indices, out, intermediate_states, intermediate_indices,
                block_p, num_warps, z) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The launch of both: (y, the gated norm's sums of squares a block, or None without z)."""
    require(__name__)
    single = x.dim() == 3
    if single:
        x, dt, B, C = x.unsqueeze(1), dt.unsqueeze(1), B.unsqueeze(1), C.unsqueeze(1)
    batch, T, H, P = x.shape
    G, N = B.shape[-2], B.shape[-1]
    assert state.dim() == 4 and state.shape[1:] == (H, P, N), (state.shape, x.shape, B.shape)
    assert dt.shape == (batch, T, H) and B.shape == (batch, T, G, N) and C.shape == B.shape
    assert H % G == 0 and state_indices.shape == (batch,)
    assert state.stride(-1) == 1, "state must be contiguous along the state dim"
    x, B, C = _last_contig(x), _last_contig(B), _last_contig(C)
    idx = _indices(state_indices)
    if out is None:
        out = torch.empty(batch, T, H, P, dtype=x.dtype, device=x.device)
    else:
        out = out.view(batch, T, H, P) if single else out
        assert out.shape == (batch, T, H, P) and out.stride(-1) == 1
    if intermediate_states is not None:
        inter = intermediate_states
        assert inter.dim() == 5 and inter.shape[1:] == (T, H, P, N) and inter.stride(-1) == 1, inter.shape
        if intermediate_indices is None:
            assert inter.shape[0] >= batch
        inter_strides = (inter.stride(0), inter.stride(1), inter.stride(2), inter.stride(3))
    else:
        inter = state  # unused dummy pointer
        inter_strides = (0, 0, 0, 0)
    ii = _indices(intermediate_indices) if intermediate_indices is not None else idx
    A = A.contiguous()
    bp_default, nw_default = default_ssm_config(batch, H, P, N, state.dtype, state.device)
    bp = block_p or bp_default
    if z is not None and block_p is None:
        # at most GATE_PARTS sums a row: gated_out_proj reads a row's all at once (fewer, larger programs
        # here than the default's at small batches)
        bp = max(bp, min(_next_pow2(P), _next_pow2(cdiv(H * P, GATE_PARTS))))
        nw_default = _ssm_warps(bp * _next_pow2(N))
    nw = num_warps or nw_default
    grid = (cdiv(P, bp), H, batch)
    sq = torch.empty(batch, H, grid[0], dtype=torch.float32, device=x.device) if z is not None else None
    _ssm_update_kernel[grid](
        state, x, dt, A, B, C,
        D.contiguous() if D is not None else A, dt_bias.contiguous() if dt_bias is not None else A,
        out, idx, inter, ii, z if z is not None else x, sq if sq is not None else A,
        T, P, N, H // G,
        state.stride(0), state.stride(1), state.stride(2),
        x.stride(0), x.stride(1), x.stride(2),
        dt.stride(0), dt.stride(1), dt.stride(2),
        B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *inter_strides,
        z.stride(0) if z is not None else 0, z.stride(1) if z is not None else 0, sq.stride(0) if sq is not None else 0,
        BLOCK_P=bp, BLOCK_N=_next_pow2(N),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
        HAS_INTER=intermediate_states is not None, HAS_INTER_IDX=intermediate_indices is not None,
        HAS_GATE_SQ=z is not None, num_warps=nw, **pdl_options(x.device),
    )
    return (out[:, 0] if single else out), sq


def conv_state_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      state_indices: torch.Tensor, activation: str | None = "silu", *,
                      out: torch.Tensor | None = None, intermediate_states: torch.Tensor | None = None,
                      intermediate_indices: torch.Tensor | None = None, block_c: int = 256,
                      num_warps: int = 4) -> torch.Tensor:
    """Depthwise causal conv decode step(s) with the slot's K-1 history (causal_conv1d_update equivalent).

    x [b, C] or [b, T, C]; conv_state [S, C, K-1]; weight [C, K]; bias [C] or None;
    activation "silu"/"swish" or None. Returns the conv output like x (dtype of x, or `out`).
    Padding rows (state_indices < 0) see a zero history and store nothing.
    """
    require(__name__)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    single = x.dim() == 2
    if single:
        x = x.unsqueeze(1)
    x = _last_contig(x)
    batch, T, CD = x.shape
    K = weight.shape[-1]
    assert weight.shape == (CD, K) and conv_state.shape[1:] == (CD, K - 1), (weight.shape, conv_state.shape)
    assert state_indices.shape == (batch,)
    idx = _indices(state_indices)
    if out is None:
        out = torch.empty(batch, T, CD, dtype=x.dtype, device=x.device)
    else:
        out = out.view(batch, T, CD) if single else out
        assert out.shape == (batch, T, CD) and out.stride(-1) == 1
    if intermediate_states is not None:
        inter = intermediate_states
        assert inter.dim() == 4 and inter.shape[1:] == (T, CD, K - 1), inter.shape
        inter_strides = tuple(inter.stride())
    else:
        inter = conv_state
        inter_strides = (0, 0, 0, 0)
    ii = _indices(intermediate_indices) if intermediate_indices is not None else idx
    grid = (cdiv(CD, block_c), batch)
    _conv_update_kernel[grid](
        x, conv_state, weight, bias if bias is not None else weight, out, idx, inter, ii,
        T, CD,
        x.stride(0), x.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight.stride(0),
        out.stride(0), out.stride(1),
        *inter_strides,
        K=K, KP=_next_pow2(K), BLOCK_C=block_c,
        HAS_BIAS=bias is not None, SILU=activation is not None,
        HAS_INTER=intermediate_states is not None, HAS_INTER_IDX=intermediate_indices is not None,
        num_warps=num_warps, **pdl_options(x.device),
    )
    return out[:, 0] if single else out


def conv_prefill(x: torch.Tensor, conv_state: torch.Tensor, slot: int, has_initial_state: bool,
                 weight: torch.Tensor, bias: torch.Tensor | None, *, block_l: int = 64,
                 block_c: int = 128) -> torch.Tensor:
    """One request's prefill chunk through the causal conv (+ silu); see the module docstring."""
    require(__name__)
    L, CD = x.shape
    K = weight.shape[-1]
    width = K - 1
    assert weight.shape == (CD, K) and conv_state.shape[1:] == (CD, width) and x.stride(-1) == 1
    out = torch.empty(L, CD, dtype=x.dtype, device=x.device)
    history = conv_state[slot]  # [C, K-1]
    if L:
        _conv_prefill_kernel[(cdiv(L, block_l), cdiv(CD, block_c))](
            x, history, weight, bias if bias is not None else weight, out, L, CD,
            x.stride(0), out.stride(0), history.stride(0), history.stride(1), weight.stride(0),
            K=K, BLOCK_L=block_l, BLOCK_C=block_c, HAS_HIST=has_initial_state, HAS_BIAS=bias is not None,
            num_warps=4, **pdl_options(x.device),
        )
    # the new history: the last K-1 inputs of [history | x] (read before it is overwritten)
    if L >= width:
        conv_state[slot] = x[L - width:].t()
    else:
        old = history if has_initial_state else torch.zeros_like(history)
        conv_state[slot] = torch.cat([old, x.t().to(old.dtype)], dim=-1)[:, -width:]
    return out
