"""Triton kernels for the MLP activations, one launch each instead of two torch ops:

- `relu2(x)`: relu(x) ** 2 (NemotronH MLPs), rounded once to x's dtype as `torch.square(relu(x))`.
- `silu_and_mul(gate_up)`: silu(gate) * up for gate_up = [gate | up] along the last dim (SwiGLU),
  rounded like the torch chain: silu(gate) to the model dtype first, then the product.

Both take `quantize=True` (and a static `input_scale`) when their output feeds an FP8 projection
that quantizes its input (hybrid/layers.py): the same launch then also writes the output's e4m3 rows
and scales, quantize_rows' bytes (hybrid/ops/triton_fp8.py QuantizedRows).

Triton is imported guarded (hybrid/ops/triton_guard.py).
"""
from __future__ import annotations

import torch

from hybrid.ops.triton_fp8 import ONE_TILE_MAX_K, QuantizedRows, fused_quant_args
from hybrid.ops.triton_guard import HAS_TRITON, pdl_options, require, tl, triton

BLOCK = 1024


def is_available() -> bool:
    return HAS_TRITON


if HAS_TRITON:
    from hybrid.ops.triton_fp8 import quantize_stored_row
    from hybrid.ops.triton_guard import pdl_wait

    @triton.jit
    def _relu2_tile(x_ptr, out_ptr, row, offs, s_x, s_o, width):
        mask = offs < width
        x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
        r = tl.maximum(x.to(tl.float32), 0.0)
        tl.store(out_ptr + row * s_o + offs, (r * r).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_and_mul_tile(g_ptr, out_ptr, row, offs, s_g, s_o, width):
        mask = offs < width
        gate = tl.load(g_ptr + row * s_g + offs, mask=mask, other=0.0)
        up = tl.load(g_ptr + row * s_g + width + offs, mask=mask, other=0.0).to(tl.float32)
        gf = gate.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * s_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)

    # Without QUANT a program per (row, BLOCK columns): grid (T, cdiv(width, BLOCK)). With QUANT a program
    # per row (grid (T,); the row's scale needs all of it): its tiles in turn, then its e4m3 values and
    # scale (triton_fp8.quantize_stored_row). Elementwise: a value does not depend on the tiling.

    @triton.jit
    def _relu2_kernel(x_ptr, out_ptr, s_x, s_o, width, q_ptr, q_scale_ptr, q_in_scale_ptr, s_q, q_min_scale,
                      BLOCK: tl.constexpr, QUANT: tl.constexpr, Q_STATIC: tl.constexpr, Q_BLOCK: tl.constexpr,
                      Q_ONE_TILE: tl.constexpr, Q_FMA: tl.constexpr, Q_HW_CAST: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        if QUANT:
            for start in range(0, width, BLOCK):
                _relu2_tile(x_ptr, out_ptr, row, start + tl.arange(0, BLOCK), s_x, s_o, width)
            quantize_stored_row(out_ptr, row, width, s_o, q_ptr, q_scale_ptr, q_in_scale_ptr, s_q, q_min_scale, QUANT,
                                Q_STATIC, Q_BLOCK, Q_ONE_TILE, Q_FMA, Q_HW_CAST)
        else:
            _relu2_tile(x_ptr, out_ptr, row, tl.program_id(1) * BLOCK + tl.arange(0, BLOCK), s_x, s_o, width)

    @triton.jit
    def _silu_and_mul_kernel(g_ptr, out_ptr, s_g, s_o, width, q_ptr, q_scale_ptr, q_in_scale_ptr, s_q, q_min_scale,
                             BLOCK: tl.constexpr, QUANT: tl.constexpr, Q_STATIC: tl.constexpr,
                             Q_BLOCK: tl.constexpr, Q_ONE_TILE: tl.constexpr, Q_FMA: tl.constexpr,
                             Q_HW_CAST: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        if QUANT:
            for start in range(0, width, BLOCK):
                _silu_and_mul_tile(g_ptr, out_ptr, row, start + tl.arange(0, BLOCK), s_g, s_o, width)
            quantize_stored_row(out_ptr, row, width, s_o, q_ptr, q_scale_ptr, q_in_scale_ptr, s_q, q_min_scale, QUANT,
                                Q_STATIC, Q_BLOCK, Q_ONE_TILE, Q_FMA, Q_HW_CAST)
        else:
            _silu_and_mul_tile(g_ptr, out_ptr, row, tl.program_id(1) * BLOCK + tl.arange(0, BLOCK), s_g, s_o, width)


def _launch(kernel, src: torch.Tensor, out: torch.Tensor, width: int, quantize: bool,
            input_scale: torch.Tensor | None) -> torch.Tensor | QuantizedRows:
    """Launch an activation kernel over the rows of src into out [T, width]. With `quantize`, a program
    per row with the warps quantize_rows gives a row of this width (its tiles as wide as the row's
    quantization tile), returning QuantizedRows (see triton_norm.rms_norm)."""
    T = out.shape[0]
    if quantize:
        q_block = min(triton.next_power_of_2(width), ONE_TILE_MAX_K)
        warps = max(4, min(32, q_block // 1024))
        qargs, rows = fused_quant_args(out, True, input_scale, warps)
        grid, block = (T,), qargs["Q_BLOCK"]
    else:
        qargs, rows = fused_quant_args(out, False, None, 4)
        grid, block, warps = (T, triton.cdiv(width, BLOCK)), BLOCK, 4
    if T:
        kernel[grid](src, out, src.stride(0), out.stride(0), width, **qargs, BLOCK=block, num_warps=warps,
                     **pdl_options(src.device))
    return rows if quantize else out


def relu2(x: torch.Tensor, *, quantize: bool = False,
          input_scale: torch.Tensor | None = None) -> torch.Tensor | QuantizedRows:
    require(__name__)
    T, width = x.shape
    assert x.stride(-1) == 1
    return _launch(_relu2_kernel, x, torch.empty_like(x), width, quantize, input_scale)


def silu_and_mul(gate_up: torch.Tensor, *, quantize: bool = False,
                 input_scale: torch.Tensor | None = None) -> torch.Tensor | QuantizedRows:
    require(__name__)
    T, two_width = gate_up.shape
    assert gate_up.stride(-1) == 1 and two_width % 2 == 0
    width = two_width // 2
    out = torch.empty(T, width, dtype=gate_up.dtype, device=gate_up.device)
    return _launch(_silu_and_mul_kernel, gate_up, out, width, quantize, input_scale)
