"""Triton kernels for all of a step's prefill rows at once (varlen): the causal conv over each row's
[slot history | chunk], and the initial-state part of the chunked scan.

Why: a prefill row costs each Mamba layer a conv launch and a chunked-scan call (~0.5 ms of host time:
hybrid/ops/mamba_scan.py), so a step with many short prompts was bound by its host. With these, a
layer runs its R prefill rows as one conv launch, one varlen scan from zero states (mamba-ssm's
`seq_idx` path, which restarts at every row) and one launch that adds each row's initial state and
writes each row's final state. The SSM is linear in its state: from h0 instead of zero, token t of a row (its first
token at t0) gains y_t += exp(sum_{t0<=u<=t} A dt_u) * (C_t . h0), and the row's final state gains
exp(sum_{t0<=u<=end} A dt_u) * h0.

- `conv_prefill_varlen(x, conv_state, rows, weight, bias)`: x [T, C] the rows' tokens back to back
  (any row stride); rows = VarlenRows (device tensors: cu_seqlens [R+1], seq_of_token [T], slots [R],
  has_init [R]). Returns silu(conv) [T, C] (x's dtype); each row's slot keeps its last K-1 inputs. As
  triton_mamba.conv_prefill called row by row, bit for bit.
- A row whose slot is PAD_SLOT_ID (-1, or any negative) is padding: its tokens are computed as a row
  without history or initial state, and no slot is read or written for it (a fixed-shape step may carry
  such a row for its unused tokens; the other rows' results do not depend on it).
- `finish_rows(y, x, B, C, dt, A, ssm_state, rows)`: y [T, H, P] the zero-state scan's output (in place:
  + each row's initial-state part), x [T, H, P], B, C [T, G, N] the scan's inputs, dt [H, >= T] fp32 (the
  scan's dt after softplus and clamp, token-major per head), A [H]; writes each row's final state (from
  its initial state, or zero) to its slot in the state's dtype, computed here in fp32 by the chunk
  recurrence over blocks of the row's tokens (the scan's own per-row final states would come in the
  activations' dtype).
- Prefix-cache snapshots (`varlen_rows(..., snapshots=)`): a row may name points inside it whose state goes
  to other slots, as if the row had ended there: the conv's history there (by the history launch) and the
  SSM state there (finish_rows runs the row as segments ending at its points: no block straddles one). The
  row's outputs are those of the row without them (up to rounding); a single row with snapshots is one
  launch of each kernel a layer, where the row path runs a conv and a scan call a segment.

Semantics are hybrid/ops/mamba_torch.py's (tests/test_triton_mamba_varlen.py on CPU with
TRITON_INTERPRET=1). Triton is imported guarded (hybrid/ops/triton_guard.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.ops.triton_guard import HAS_TRITON, pdl_options, require, tl, triton
from state_pool.util import cdiv


@dataclass(frozen=True)
class VarlenRows:
    """A step's prefill rows (none of them padding) as device tensors, shared by every layer."""
    cu_seqlens: torch.Tensor  # [R + 1] int32: row r's tokens are [cu[r], cu[r + 1]) of the rows' tokens
    seq_of_token: torch.Tensor  # [T] int32: each token's row
    slots: torch.Tensor  # [R] int32: each row's Mamba slot (negative: a padding row, which touches no slot)
    has_init: torch.Tensor  # [R] int32: 1 where the row starts from its slot's state (a later chunk)
    max_len: int  # the longest row's tokens (host value)
    # prefix-cache snapshots: row r's are entries [snap_cu[r], snap_cu[r + 1]) of snap_pos / snap_slots; entry j
    # copies the state after the row's first snap_pos[j] tokens (conv history and SSM state) into snap_slots[j]
    snap_cu: torch.Tensor  # [R + 1] int32
    snap_pos: torch.Tensor  # [M] int32 (M >= 1: an unused zero where no row has one)
    snap_slots: torch.Tensor  # [M] int32

    @property
    def num_rows(self) -> int:
        return self.slots.shape[0]


def check_snapshot(k: int, snap_slot: int, done: int, length: int, slot: int, row: str) -> None:
    """A prefix-cache snapshot after the first k tokens of a row of `length` tokens on `slot` (the previous
    one, if any, at `done`): inside the row, ascending, from a live row into a slot of its own; else ValueError."""
    if not done < k < length or slot < 0 or snap_slot < 0 or snap_slot == slot:
        raise ValueError(f"state snapshot {(k, snap_slot)} of {row} ({length} tokens, slot {slot}): needs 0 < k < "
                         f"the row's tokens, ascending, and a slot of its own")


def varlen_rows(lengths: list[int], slots: list[int], has_init: list[bool], device: torch.device,
                snapshots: list[list[tuple[int, int]]] | None = None) -> VarlenRows:
    """VarlenRows of rows with these token counts, slots and initial-state flags (one upload); `snapshots`:
    per row, (tokens, slot) pairs, ascending, 0 < tokens < its length: the state after that many of the
    row's tokens is copied into that slot (a live row's, never the row's own)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    seq = [r for r, n in enumerate(lengths) for _ in range(n)]
    snap_cu, snap_pos, snap_slots = [0], [], []
    for r, points in enumerate(snapshots or [[] for _ in lengths]):
        done = 0
        for k, snap_slot in points:
            check_snapshot(k, snap_slot, done, lengths[r], slots[r], f"varlen row {r}")
            snap_pos.append(k)
            snap_slots.append(snap_slot)
            done = k
        snap_cu.append(len(snap_pos))
    if len(snap_cu) != len(lengths) + 1:
        raise ValueError(f"snapshots for {len(snap_cu) - 1} rows, but {len(lengths)} rows")
    # each part starts on a 16-byte boundary: Triton specialises pointers on that alignment, so parts at
    # offsets that follow the row and token counts would compile new variants of the kernels mid-serving
    parts = [cu, seq, list(slots), [int(h) for h in has_init], snap_cu, snap_pos or [0], snap_slots or [0]]
    values, starts = [], []
    for part in parts:
        starts.append(len(values))
        values += part + [0] * (-len(part) % 4)
    flat = torch.tensor(values, dtype=torch.int32)
    flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
    views = [flat[start:start + len(part)] for start, part in zip(starts, parts)]
    return VarlenRows(*views[:4], max(lengths, default=0), *views[4:])


if HAS_TRITON:
    from hybrid.ops.triton_guard import pdl_wait

    @triton.jit(do_not_specialize=["T"])
    def _conv_varlen_kernel(x_ptr, cs_ptr, w_ptr, bias_ptr, out_ptr, cu_ptr, seq_ptr, slot_ptr, init_ptr, T, CD,
                            s_x, s_o, s_cs_s, s_cs_c, s_cs_k, s_w_c,
                            K: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr,
                            HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
        # out[t] = silu(sum_k w[:, k] * ext_r[t + k] + b) with ext_r = [row r's history | its tokens];
        # a token t + k - (K-1) before its row's first token reads the row's history (zero without one)
        pdl_wait(PDL)
        offs_t = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_t = offs_t < T
        mask_c = offs_c < CD
        row = tl.load(seq_ptr + offs_t, mask=mask_t, other=0)
        first = tl.load(cu_ptr + row, mask=mask_t, other=0)
        slot = tl.load(slot_ptr + row, mask=mask_t, other=0).to(tl.int64)
        init = (tl.load(init_ptr + row, mask=mask_t, other=0) != 0) & (slot >= 0)  # (a padding row: no history)
        slot = tl.maximum(slot, 0)
        acc = tl.zeros((BLOCK_L, BLOCK_C), dtype=tl.float32)
        for k in tl.static_range(K):
            src = offs_t + (k - (K - 1))  # token index; < first: history column src - first + K - 1
            in_x = (src >= first) & mask_t
            xv = tl.load(x_ptr + tl.maximum(src, 0).to(tl.int64)[:, None] * s_x + offs_c[None, :],
                         mask=in_x[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
            in_h = (src < first) & mask_t & init
            col = tl.maximum(src - first + (K - 1), 0)
            hv = tl.load(cs_ptr + slot[:, None] * s_cs_s + offs_c[None, :] * s_cs_c + col[:, None] * s_cs_k,
                         mask=in_h[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs_c * s_w_c + k, mask=mask_c, other=0.0).to(tl.float32)
            acc += (xv + hv) * w[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
        acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * s_o + offs_c[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask_t[:, None] & mask_c[None, :])

    @triton.jit
    def _history_columns(x_ptr, cs_ptr, first, n, slot, init, offs_c, mask_c, s_x, s_cs_s, s_cs_c, s_cs_k,
                         W: tl.constexpr, WP: tl.constexpr):
        # the last W columns of [the slot's old history (zero without init) | the row's first n tokens]
        offs_w = tl.arange(0, WP)  # (WP: W rounded up to a power of two; columns >= W masked)
        mask_w = offs_w < W
        pos = n - W + offs_w  # position in the row's tokens; < 0: old history column pos + W
        from_x = pos >= 0
        xv = tl.load(x_ptr + (first + tl.maximum(pos, 0)).to(tl.int64)[:, None] * s_x + offs_c[None, :],
                     mask=(from_x & mask_w)[:, None] & mask_c[None, :], other=0.0)
        hv = tl.load(cs_ptr + slot * s_cs_s + offs_c[None, :] * s_cs_c + tl.maximum(pos + W, 0)[:, None] * s_cs_k,
                     mask=(~from_x & mask_w & init)[:, None] & mask_c[None, :], other=0.0)
        return tl.where(from_x[:, None], xv.to(cs_ptr.dtype.element_ty), hv), offs_w, mask_w

    @triton.jit
    def _conv_history_kernel(x_ptr, cs_ptr, cu_ptr, slot_ptr, init_ptr, snap_cu_ptr, snap_pos_ptr, snap_slot_ptr,
                             CD, s_x, s_cs_s, s_cs_c, s_cs_k,
                             W: tl.constexpr, WP: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
        # row r's new history: the last W = K-1 columns of [its old history | its tokens], and each of its
        # snapshots' the same after the snapshot's first tokens, into the snapshot's slot; the row's own
        # slot is written last, after every read of its old history (a row shorter than W keeps part of it)
        pdl_wait(PDL)
        r = tl.program_id(0)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_c = offs_c < CD
        first = tl.load(cu_ptr + r)
        n = tl.load(cu_ptr + r + 1) - first
        slot = tl.load(slot_ptr + r).to(tl.int64)
        live = slot >= 0  # a padding row writes no history (and has no snapshot)
        slot = tl.maximum(slot, 0)
        init = (tl.load(init_ptr + r) != 0) & live
        for j in range(tl.load(snap_cu_ptr + r), tl.load(snap_cu_ptr + r + 1)):
            snap = tl.load(snap_slot_ptr + j).to(tl.int64)
            new, offs_w, mask_w = _history_columns(x_ptr, cs_ptr, first, tl.load(snap_pos_ptr + j), slot, init,
                                                   offs_c, mask_c, s_x, s_cs_s, s_cs_c, s_cs_k, W, WP)
            tl.store(cs_ptr + snap * s_cs_s + offs_c[None, :] * s_cs_c + offs_w[:, None] * s_cs_k, new,
                     mask=mask_w[:, None] & mask_c[None, :])
        new, offs_w, mask_w = _history_columns(x_ptr, cs_ptr, first, n, slot, init, offs_c, mask_c,
                                               s_x, s_cs_s, s_cs_c, s_cs_k, W, WP)
        tl.store(cs_ptr + slot * s_cs_s + offs_c[None, :] * s_cs_c + offs_w[:, None] * s_cs_k, new,
                 mask=(mask_w & live)[:, None] & mask_c[None, :])

    @triton.jit(do_not_specialize=["s_dt_h"])  # the scan's dt rows are as long as the step's chunks
    def _row_states_kernel(y_ptr, x_ptr, b_ptr, c_ptr, dt_ptr, a_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr,
                           snap_cu_ptr, snap_pos_ptr, snap_slot_ptr, P, N, heads_per_group,
                           s_y_t, s_y_h, s_x_t, s_x_h, s_b_t, s_b_g, s_c_t, s_c_g, s_dt_h, s_st_s, s_st_h, s_st_p,
                           BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                           IEEE: tl.constexpr, PDL: tl.constexpr):
        # one program: row r, head h, BLOCK_P of its head dim. Over the row's tokens in blocks:
        #   y_t += exp(cum_t) * (C_t . h0)                         (cum_t: sum of A dt from the row's start)
        #   state = exp(sum of the block's A dt) * state + sum_t exp(A dt from t to the block's end) dt_t x_t B_t
        # from state = h0 (has_init) or 0; the slot gets the final state in its dtype. The row runs as segments
        # ending at its snapshots (blocks never straddle one): each snapshot's slot gets the state there.
        pdl_wait(PDL)
        r = tl.program_id(0)
        h = tl.program_id(1)
        offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        mask_p = offs_p < P
        mask_n = offs_n < N
        first = tl.load(cu_ptr + r)
        end = tl.load(cu_ptr + r + 1)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        live = slot >= 0  # a padding row: no initial state read, no final state written
        init = (tl.load(init_ptr + r) != 0) & live
        st_ptrs = state_ptr + tl.maximum(slot, 0) * s_st_s + h * s_st_h + offs_p[:, None] * s_st_p + offs_n[None, :]
        tile = mask_p[:, None] & mask_n[None, :]
        h0 = tl.load(st_ptrs, mask=tile & init, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]; 0 without one
        state = h0
        a = tl.load(a_ptr + h).to(tl.float32)
        g = h // heads_per_group
        carry = tl.sum(tl.zeros((BLOCK_T,), dtype=tl.float32), axis=0)
        snap_lo = tl.load(snap_cu_ptr + r)
        snap_hi = tl.load(snap_cu_ptr + r + 1)
        seg_start = first
        for j in range(snap_lo, snap_hi + 1):  # the segments before each snapshot, then the last one
            is_snap = j < snap_hi
            seg_end = tl.where(is_snap, first + tl.load(snap_pos_ptr + j, mask=is_snap, other=0), end)
            for t0 in range(seg_start, seg_end, BLOCK_T):
                offs_t = t0 + tl.arange(0, BLOCK_T)
                mask_t = offs_t < seg_end
                rows64 = offs_t.to(tl.int64)
                dt = tl.load(dt_ptr + h * s_dt_h + offs_t, mask=mask_t, other=0.0)
                dA = dt * a
                cum = tl.cumsum(dA, axis=0)  # within the block
                total = tl.sum(dA, axis=0)
                if init:  # the initial state's part of y
                    c = tl.load(c_ptr + rows64[:, None] * s_c_t + g * s_c_g + offs_n[None, :],
                                mask=mask_t[:, None] & mask_n[None, :], other=0.0)
                    if IEEE:
                        ch = tl.dot(c.to(tl.float32), tl.trans(h0), input_precision="ieee")  # [BLOCK_T, BLOCK_P]
                    else:
                        ch = tl.dot(c.to(tl.float32), tl.trans(h0))
                    y_ptrs = y_ptr + rows64[:, None] * s_y_t + h * s_y_h + offs_p[None, :]
                    ym = mask_t[:, None] & mask_p[None, :]
                    yv = tl.load(y_ptrs, mask=ym, other=0.0).to(tl.float32)
                    tl.store(y_ptrs, (yv + ch * tl.exp(carry + cum)[:, None]).to(y_ptr.dtype.element_ty), mask=ym)
                xv = tl.load(x_ptr + rows64[:, None] * s_x_t + h * s_x_h + offs_p[None, :],
                             mask=mask_t[:, None] & mask_p[None, :], other=0.0)  # [BLOCK_T, BLOCK_P]
                bv = tl.load(b_ptr + rows64[:, None] * s_b_t + g * s_b_g + offs_n[None, :],
                             mask=mask_t[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_T, BLOCK_N]
                w = tl.where(mask_t, tl.exp(total - cum) * dt, 0.0)  # decay from t to the block's end, times dt
                bw = bv.to(tl.float32) * w[:, None]
                # fp32 operands (tf32 on the tensor cores for 16-bit models: every bf16 x is exact in tf32)
                if IEEE:
                    contrib = tl.dot(tl.trans(xv.to(tl.float32)), bw, input_precision="ieee")  # [BLOCK_P, BLOCK_N]
                else:
                    contrib = tl.dot(tl.trans(xv.to(tl.float32)), bw)
                state = state * tl.exp(total) + contrib
                carry += total
            snap = tl.load(snap_slot_ptr + j, mask=is_snap, other=0).to(tl.int64)
            snap_ptrs = state_ptr + snap * s_st_s + h * s_st_h + offs_p[:, None] * s_st_p + offs_n[None, :]
            tl.store(snap_ptrs, state.to(state_ptr.dtype.element_ty), mask=tile & is_snap & live)
            seg_start = seg_end
        tl.store(st_ptrs, state.to(state_ptr.dtype.element_ty), mask=tile & live)


def conv_prefill_varlen(x: torch.Tensor, conv_state: torch.Tensor, rows: VarlenRows, weight: torch.Tensor,
                        bias: torch.Tensor | None, *, block_l: int = 64, block_c: int = 128) -> torch.Tensor:
    """All of a step's prefill rows through the causal conv (+ silu); see the module docstring."""
    require(__name__)
    T, CD = x.shape
    K = weight.shape[-1]
    W = K - 1
    assert weight.shape == (CD, K) and conv_state.shape[1:] == (CD, W) and x.stride(-1) == 1
    out = torch.empty(T, CD, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    pdl = pdl_options(x.device)
    cs = conv_state
    _conv_varlen_kernel[(cdiv(T, block_l), cdiv(CD, block_c))](
        x, cs, weight, bias if bias is not None else weight, out, rows.cu_seqlens, rows.seq_of_token, rows.slots,
        rows.has_init, T, CD, x.stride(0), out.stride(0), cs.stride(0), cs.stride(1), cs.stride(2), weight.stride(0),
        K=K, BLOCK_L=block_l, BLOCK_C=block_c, HAS_BIAS=bias is not None, num_warps=4, **pdl)
    # (after the conv, which read the old histories: stream order)
    _conv_history_kernel[(rows.num_rows, cdiv(CD, block_c))](
        x, cs, rows.cu_seqlens, rows.slots, rows.has_init, rows.snap_cu, rows.snap_pos, rows.snap_slots, CD,
        x.stride(0), cs.stride(0), cs.stride(1), cs.stride(2),
        W=W, WP=triton.next_power_of_2(W), BLOCK_C=block_c, num_warps=4, **pdl)
    return out


def finish_rows(y: torch.Tensor, x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor,
                A: torch.Tensor, ssm_state: torch.Tensor, rows: VarlenRows, *, block_t: int = 32,
                block_p: int = 32) -> None:
    """Each row's initial state into its tokens' y (in place), and each row's final state into its slot;
    see the module docstring."""
    require(__name__)
    T, H, P = y.shape
    G, N = C.shape[1], C.shape[2]
    R = rows.num_rows
    assert x.shape == (T, H, P) and B.shape == C.shape and C.shape[0] == T
    assert C.stride(-1) == 1 and B.stride(-1) == 1 and x.stride(-1) == 1 and y.stride(-1) == 1
    assert dt.shape[0] == H and dt.stride(1) == 1 and dt.dtype == torch.float32 and H % G == 0
    assert ssm_state.shape[1:] == (H, P, N) and ssm_state.stride(-1) == 1
    if R == 0:
        return
    bn = max(16, triton.next_power_of_2(N))
    bp = max(16, min(block_p, triton.next_power_of_2(P)))
    st = ssm_state
    _row_states_kernel[(R, H, cdiv(P, bp))](
        y, x, B, C, dt, A, st, rows.cu_seqlens, rows.slots, rows.has_init, rows.snap_cu, rows.snap_pos,
        rows.snap_slots, P, N, H // G,
        y.stride(0), y.stride(1), x.stride(0), x.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        dt.stride(0), st.stride(0), st.stride(1), st.stride(2),
        BLOCK_T=block_t, BLOCK_P=bp, BLOCK_N=bn, IEEE=x.dtype == torch.float32, num_warps=4,
        **pdl_options(y.device))
