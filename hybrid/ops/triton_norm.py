"""Triton kernels for the two norms of the model, one launch each instead of a chain of small
torch ops (which, at decode batch sizes, cost more in launches than in bytes):

- `rms_norm(x, weight, eps, weight_in_fp32)`: RMSNorm of each row of x [T, H]. NemotronH multiplies
  by the weight in fp32 and casts once (weight_in_fp32=True); Granite / Bamba cast the normalised
  row to the model dtype first and multiply in it (weight_in_fp32=False). Output dtype: x's.
- `add_rms_norm(x, residual, weight, eps, weight_in_fp32, scale)`: the residual add fused with the
  next norm: residual += x * scale (in place, rounded to the residual's dtype as torch rounds
  `residual + x * scale`), then `rms_norm` of the updated residual. Returns the normed rows.
- `sum_add_rms_norm(rows, residual, ...)`: add_rms_norm of an MoE layer's outputs before their sum
  over k (triton_moe.ExpertRows), the sum folded in: one launch for the two.
- `gated_rms_norm(y, z, weight, eps, n_groups)`: the Mamba2 output norm, RMSNorm(y * silu(z)) over
  each contiguous group of I/G channels, in fp32, times the weight; output dtype: the weight's.
- `add_rms_norm_router(x, residual, ..., router_weight, top_k, ...)`: add_rms_norm then
  triton_moe_route.router_logits of its output, for steps of few tokens, with the add and norm inside the
  router's split-K launch (one launch fewer an MoE layer); the residual is returned out of place.
  `add_rms_norm_route` also routes (the routing launch).

Same math as hybrid.layers.RMSNorm / Mamba2Mixer.gated_norm (the reductions add in another order).
Triton is imported guarded (hybrid/ops/triton_guard.py).
"""
from __future__ import annotations

import torch

from hybrid.ops import triton_fp8, triton_moe_route
from hybrid.ops.triton_guard import HAS_TRITON, pdl_options, require, tl, triton


def is_available() -> bool:
    return HAS_TRITON


if HAS_TRITON:
    from hybrid.ops.triton_fp8 import round_row_into, static_scale
    from hybrid.ops.triton_guard import pdl_wait
    from hybrid.ops.triton_moe import expert_sum
    from hybrid.ops.triton_moe_route import router_split

    @triton.jit
    def _norm_weight(w_ptr, offs, mask):
        """The norm weight at columns offs, in fp32. No kernel writes a weight, so the kernels load it before
        their PDL wait: loaded after the row's reduction (where the compiler keeps it, past the barrier) it
        was a dependent read from HBM (a layer's norm weight is long out of L2 by its next use)."""
        return tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _normalised_cols(hf, like, w, rms, W_FP32: tl.constexpr):
        """weight w (fp32, _norm_weight) * hf / rms at hf's columns (rms: the row's, a scalar); without W_FP32
        the normalised values are rounded to like's dtype first."""
        r = hf / rms
        if W_FP32:
            y = w * r
        else:
            y = w * r.to(like.dtype).to(tl.float32)
        return y

    @triton.jit
    def _normalised_row(hf, like, w, H, eps, W_FP32: tl.constexpr):
        """weight w (fp32, _norm_weight) * RMS-normalised fp32 row hf; without W_FP32 the row is rounded to
        like's dtype first."""
        return _normalised_cols(hf, like, w, tl.sqrt(tl.sum(hf * hf, axis=0) / H + eps), W_FP32)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, s_x, s_o, H, eps, q_ptr, s_q, scale_ptr, in_scale_ptr, min_scale,
                         BLOCK: tl.constexpr, W_FP32: tl.constexpr, QUANT: tl.constexpr, FMA_QUOTIENT: tl.constexpr,
                         HW_CAST: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        w = _norm_weight(w_ptr, offs, mask)
        in_scale = static_scale(in_scale_ptr, QUANT)  # (FP8 static: before the wait too)
        pdl_wait(PDL)
        x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
        y = _normalised_row(x.to(tl.float32), x, w, H, eps, W_FP32)
        stored = y.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * s_o + offs, stored, mask=mask)
        if QUANT != 0:  # the stored row rounded to e4m3 for an FP8 projection (triton_fp8.round_row_into)
            round_row_into(stored, row, offs, mask, q_ptr, s_q, scale_ptr, in_scale, min_scale, QUANT,
                           FMA_QUOTIENT, HW_CAST)

    @triton.jit
    def _plus_residual(x, res_ptr, row, offs, mask, s_r, scale, SCALED: tl.constexpr):
        """residual + x * scale at columns offs of a row, in the residual's dtype (torch rounds x * scale
        to x's dtype before the add)."""
        res = tl.load(res_ptr + row * s_r + offs, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        if SCALED:
            xf = (xf * scale).to(x.dtype).to(tl.float32)
        return (res.to(tl.float32) + xf).to(res.dtype)

    @triton.jit
    def _added_row(x_ptr, res_ptr, row, offs, mask, s_x, s_r, scale, SCALED: tl.constexpr):
        """_plus_residual of x's row `row`."""
        x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
        return _plus_residual(x, res_ptr, row, offs, mask, s_r, scale, SCALED)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, s_x, s_r, s_o, H, eps, scale, q_ptr, s_q, scale_ptr,
                             in_scale_ptr, min_scale, BLOCK: tl.constexpr, W_FP32: tl.constexpr, SCALED: tl.constexpr,
                             QUANT: tl.constexpr, FMA_QUOTIENT: tl.constexpr, HW_CAST: tl.constexpr,
                             PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        w = _norm_weight(w_ptr, offs, mask)
        in_scale = static_scale(in_scale_ptr, QUANT)  # (FP8 static: before the wait too)
        pdl_wait(PDL)
        h = _added_row(x_ptr, res_ptr, row, offs, mask, s_x, s_r, scale, SCALED)
        tl.store(res_ptr + row * s_r + offs, h, mask=mask)
        y = _normalised_row(h.to(tl.float32), h, w, H, eps, W_FP32)
        stored = y.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * s_o + offs, stored, mask=mask)
        if QUANT != 0:  # the stored row rounded to e4m3 for an FP8 projection (triton_fp8.round_row_into)
            round_row_into(stored, row, offs, mask, q_ptr, s_q, scale_ptr, in_scale, min_scale, QUANT,
                           FMA_QUOTIENT, HW_CAST)

    @triton.jit
    def _sum_add_rms_norm_kernel(y_ptr, add_ptr, res_ptr, w_ptr, out_ptr, s_r, s_o, H, eps, scale, q_ptr, s_q,
                                 scale_ptr, in_scale_ptr, min_scale, TOP_K: tl.constexpr, HAS_ADD: tl.constexpr,
                                 BLOCK: tl.constexpr, W_FP32: tl.constexpr, SCALED: tl.constexpr,
                                 QUANT: tl.constexpr, FMA_QUOTIENT: tl.constexpr, HW_CAST: tl.constexpr,
                                 PDL: tl.constexpr):
        # _sum_k_kernel (hybrid/ops/triton_moe.py) then _add_rms_norm_kernel, in one program a row,
        # rounding where they round: the sum over k in fp32, stored in y's dtype; then the add
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        w = _norm_weight(w_ptr, offs, mask)
        in_scale = static_scale(in_scale_ptr, QUANT)  # (FP8 static: before the wait too)
        pdl_wait(PDL)
        x = expert_sum(y_ptr, add_ptr, row, offs, mask, H, TOP_K, HAS_ADD).to(y_ptr.dtype.element_ty)
        h = _plus_residual(x, res_ptr, row, offs, mask, s_r, scale, SCALED)
        tl.store(res_ptr + row * s_r + offs, h, mask=mask)
        y = _normalised_row(h.to(tl.float32), h, w, H, eps, W_FP32)
        stored = y.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * s_o + offs, stored, mask=mask)
        if QUANT != 0:  # the stored row rounded to e4m3 for an FP8 projection (triton_fp8.round_row_into)
            round_row_into(stored, row, offs, mask, q_ptr, s_q, scale_ptr, in_scale, min_scale, QUANT,
                           FMA_QUOTIENT, HW_CAST)

    @triton.jit(do_not_specialize=["T"])  # the step's token count: a new compile per value class otherwise
    def _add_rms_norm_router_kernel(x_ptr, res_ptr, nw_ptr, normed_ptr, new_res_ptr, rw_ptr, partial_ptr,
                                    T, E, H, s_x, s_r, s_rw, eps, scale, k_per_split,
                                    BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                                    W_FP32: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr):
        # Program (t, e block, split) of the router's split-K launch (triton_moe_route.route_hidden) over the
        # normed row of _add_rms_norm_kernel. Each program takes the whole row's mean square (a few KB
        # read), program (t, 0, 0) stores the updated residual and the normed row (into new buffers:
        # the other programs still read the old residual), and each normalises only its K slice, as
        # _normalised_row does, for its partial dot with the router weight [E, H].
        t = tl.program_id(0).to(tl.int64)
        split = tl.program_id(2)
        offs_e, e_ok, k_begin, k_end, w_rows, wv = router_split(rw_ptr, s_rw, E, H, k_per_split, BLOCK_E, BLOCK_K)
        pdl_wait(PDL)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        h = _added_row(x_ptr, res_ptr, t, offs, mask, s_x, s_r, scale, SCALED)
        hf = h.to(tl.float32)
        rms = tl.sqrt(tl.sum(hf * hf, axis=0) / H + eps)
        if (tl.program_id(1) == 0) & (split == 0):
            tl.store(new_res_ptr + t * H + offs, h, mask=mask)
            y = _normalised_row(hf, h, _norm_weight(nw_ptr, offs, mask), H, eps, W_FP32)
            tl.store(normed_ptr + t * H + offs, y.to(normed_ptr.dtype.element_ty), mask=mask)
        acc = tl.zeros([BLOCK_E], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_end
            if k0 > k_begin:
                wv = tl.load(w_rows + offs_k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            hk = _added_row(x_ptr, res_ptr, t, offs_k, k_ok, s_x, s_r, scale, SCALED)
            xv = _normalised_cols(hk.to(tl.float32), hk, _norm_weight(nw_ptr, offs_k, k_ok), rms, W_FP32)
            xv = xv.to(normed_ptr.dtype.element_ty).to(tl.float32)  # the router reads the stored row
            acc += tl.sum(wv * xv[None, :], axis=1)
        tl.store(partial_ptr + (split * T + t) * E + offs_e, acc, mask=e_ok)

    @triton.jit
    def _gated_rms_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, s_y, s_z, s_o, GROUP, eps,
                               BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        mask = offs < GROUP
        col = g * GROUP + offs
        w = tl.load(w_ptr + col, mask=mask, other=0.0)  # before the wait: see _norm_weight
        pdl_wait(PDL)
        y = tl.load(y_ptr + row * s_y + col, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + row * s_z + col, mask=mask, other=0.0).to(tl.float32)
        h = y * (z / (1.0 + tl.exp(-z)))
        r = h / tl.sqrt(tl.sum(h * h, axis=0) / GROUP + eps)
        out = w.to(tl.float32) * r.to(w.dtype).to(tl.float32)
        tl.store(out_ptr + row * s_o + col, out.to(out_ptr.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    return 8 if block >= 4096 else 4 if block >= 1024 else 2


class RoundFor:
    """Ask a norm launch to round its output rows to e4m3 for an FP8 projection too (triton_fp8.round_row_into),
    with each row's absmax (`input_scale` None) or with that static scale: the rows come back with the rounding
    attached (triton_fp8.attach_rounding), and hybrid/fp8_linear.Fp8Linear takes it instead of launching its own
    quantize_rows."""

    def __init__(self, input_scale: torch.Tensor | None) -> None:
        self.input_scale = input_scale


def _rounding(out: torch.Tensor, round_for: RoundFor | None) -> tuple[triton_fp8.RowRounding | None, dict]:
    if round_for is None:
        return None, triton_fp8.no_rounding(out)
    return triton_fp8.rounding_outputs(out, round_for.input_scale)


def _with_rounding(out: torch.Tensor, rounding: triton_fp8.RowRounding | None) -> torch.Tensor:
    return triton_fp8.attach_rounding(out, rounding) if rounding is not None else out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool,
             round_for: RoundFor | None = None) -> torch.Tensor:
    """RMSNorm of each row of x [T, H] (x's dtype); `round_for`: also the rows' e4m3 rounding (RoundFor)."""
    require(__name__)
    T, H = x.shape
    assert weight.shape == (H,) and x.stride(-1) == 1
    out = torch.empty_like(x)
    rounding, rargs = _rounding(out, round_for)
    if T:
        block = triton.next_power_of_2(H)
        _rms_norm_kernel[(T,)](x, weight, out, x.stride(0), out.stride(0), H, eps, **rargs,
                               BLOCK=block, W_FP32=weight_in_fp32, num_warps=_warps(block), **pdl_options(x.device))
    return _with_rounding(out, rounding)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 weight_in_fp32: bool, scale: float = 1.0, round_for: RoundFor | None = None) -> torch.Tensor:
    """residual += x * scale in place; returns the RMSNorm of the updated residual (residual's dtype);
    `round_for`: also the rows' e4m3 rounding (RoundFor)."""
    require(__name__)
    T, H = residual.shape
    assert x.shape == (T, H) and weight.shape == (H,) and x.stride(-1) == 1 and residual.stride(-1) == 1
    out = torch.empty_like(residual)
    rounding, rargs = _rounding(out, round_for)
    if T:
        block = triton.next_power_of_2(H)
        _add_rms_norm_kernel[(T,)](x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), H, eps,
                                   float(scale), **rargs, BLOCK=block, W_FP32=weight_in_fp32, SCALED=scale != 1.0,
                                   num_warps=_warps(block), **pdl_options(x.device))
    return _with_rounding(out, rounding)


def sum_add_rms_norm(rows, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool,
                     scale: float = 1.0, round_for: RoundFor | None = None) -> torch.Tensor:
    """add_rms_norm(rows.sum(), residual, ...) for triton_moe.ExpertRows `rows`, in one launch:
    the same values, bit for bit (residual updated in place); `round_for`: as add_rms_norm's."""
    require(__name__)
    T, H = residual.shape
    y, add = rows.y, rows.add
    assert rows.shape == (T, H) and y.is_contiguous() and residual.stride(-1) == 1 and weight.shape == (H,)
    assert add is None or add.is_contiguous()
    out = torch.empty_like(residual)
    rounding, rargs = _rounding(out, round_for)
    if T:
        block = triton.next_power_of_2(H)
        _sum_add_rms_norm_kernel[(T,)](y, add if add is not None else y, residual, weight, out, residual.stride(0),
                                       out.stride(0), H, eps, float(scale), **rargs, TOP_K=rows.top_k,
                                       HAS_ADD=add is not None, BLOCK=block, W_FP32=weight_in_fp32,
                                       SCALED=scale != 1.0, num_warps=_warps(block), **pdl_options(y.device))
    return _with_rounding(out, rounding)


def add_rms_norm_router(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        weight_in_fp32: bool, scale: float, router_weight: torch.Tensor, top_k: int, *,
                        logits_dtype: torch.dtype, sigmoid: bool, bias: torch.Tensor | None = None,
                        normalize: bool = False, route_scale: float = 1.0, num_shared: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor, triton_moe_route.RouterLogits]:
    """add_rms_norm(x, residual, ...) and triton_moe_route.router_logits of its output for a step of at
    most triton_moe_route.ROUTER_FUSED_MAX_TOKENS tokens, the add and norm inside the router's split-K
    launch: (normed, new residual, the router logits not yet routed), the same values as the two calls.
    The residual is not updated in place: the new one is returned."""
    require(__name__)
    T, H = residual.shape
    E = router_weight.shape[0]
    assert 0 < T <= triton_moe_route.ROUTER_FUSED_MAX_TOKENS and x.shape == (T, H) and weight.shape == (H,)
    assert x.stride(-1) == 1 and residual.stride(-1) == 1 and router_weight.stride(-1) == 1 and top_k <= E
    normed = torch.empty(T, H, dtype=residual.dtype, device=residual.device)
    new_res = torch.empty_like(normed)
    block = triton.next_power_of_2(H)
    bk, be, splits, k_per_split = triton_moe_route.router_tiling(H, E)
    partial = torch.empty(splits, T, E, dtype=torch.float32, device=x.device)
    _add_rms_norm_router_kernel[(T, triton.cdiv(E, be), splits)](
        x, residual, weight, normed, new_res, router_weight, partial, T, E, H, x.stride(0), residual.stride(0),
        router_weight.stride(0), eps, float(scale), k_per_split, BLOCK=block, BLOCK_E=be, BLOCK_K=bk,
        W_FP32=weight_in_fp32, SCALED=scale != 1.0, num_warps=_warps(block), **pdl_options(x.device))
    router = triton_moe_route.partials_router(partial, T, E, top_k, logits_dtype=logits_dtype, sigmoid=sigmoid,
                                              bias=bias, normalize=normalize, scale=route_scale,
                                              num_shared=num_shared)
    return normed, new_res, router


def add_rms_norm_route(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       weight_in_fp32: bool, scale: float, router_weight: torch.Tensor, top_k: int, *,
                       logits_dtype: torch.dtype, sigmoid: bool, bias: torch.Tensor | None = None,
                       normalize: bool = False, route_scale: float = 1.0, num_shared: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rms_norm_router, then the routing launch: (normed, new residual, top_idx, top_w)."""
    normed, new_res, router = add_rms_norm_router(
        x, residual, weight, eps, weight_in_fp32, scale, router_weight, top_k, logits_dtype=logits_dtype,
        sigmoid=sigmoid, bias=bias, normalize=normalize, route_scale=route_scale, num_shared=num_shared)
    idx, w = router.route()
    return normed, new_res, idx, w


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, n_groups: int) -> torch.Tensor:
    require(__name__)
    T, inner = y.shape
    assert z.shape == (T, inner) and weight.shape == (inner,) and inner % n_groups == 0
    assert y.stride(-1) == 1 and z.stride(-1) == 1
    out = torch.empty(T, inner, dtype=weight.dtype, device=y.device)
    if T:
        group = inner // n_groups
        block = triton.next_power_of_2(group)
        _gated_rms_norm_kernel[(T, n_groups)](y, z, weight, out, y.stride(0), z.stride(0), out.stride(0), group, eps,
                                              BLOCK=block, num_warps=_warps(block), **pdl_options(y.device))
    return out
