"""Triton kernels for the MLP activations, one launch each instead of two torch ops:

- `relu2(x)`: relu(x) ** 2 (NemotronH MLPs), rounded once to x's dtype as `torch.square(relu(x))`.
- `silu_and_mul(gate_up)`: silu(gate) * up for gate_up = [gate | up] along the last dim (SwiGLU),
  rounded like the torch chain: silu(gate) to the model dtype first, then the product.

Triton is imported guarded (hybrid/ops/triton_guard.py).
"""
from __future__ import annotations

import torch

from hybrid.ops.triton_guard import HAS_TRITON, pdl_options, require, tl, triton

BLOCK = 1024


def is_available() -> bool:
    return HAS_TRITON


if HAS_TRITON:
    from hybrid.ops.triton_guard import pdl_wait

    @triton.jit
    def relu2_values(x):
        """relu(x) ** 2 in x's dtype, rounded once (the square of a 16-bit value is exact in fp32); also
        inlined by triton_fp8's row quantization."""
        r = tl.maximum(x.to(tl.float32), 0.0)
        return (r * r).to(x.dtype)

    @triton.jit
    def silu_mul_values(gate, up):
        """silu(gate) * up in gate's dtype, rounded as the torch chain: silu(gate) to the dtype first, then the
        product; also inlined by triton_fp8's row quantization."""
        gf = gate.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype).to(tl.float32)
        return (act * up.to(tl.float32)).to(gate.dtype)

    @triton.jit
    def _relu2_kernel(x_ptr, out_ptr, s_x, s_o, width, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < width
        x = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0)
        tl.store(out_ptr + row * s_o + offs, relu2_values(x).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(g_ptr, out_ptr, s_g, s_o, width, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < width
        gate = tl.load(g_ptr + row * s_g + offs, mask=mask, other=0.0)
        up = tl.load(g_ptr + row * s_g + width + offs, mask=mask, other=0.0)
        tl.store(out_ptr + row * s_o + offs, silu_mul_values(gate, up).to(out_ptr.dtype.element_ty), mask=mask)


def relu2(x: torch.Tensor) -> torch.Tensor:
    require(__name__)
    T, width = x.shape
    assert x.stride(-1) == 1
    out = torch.empty_like(x)
    if T:
        _relu2_kernel[(T, triton.cdiv(width, BLOCK))](x, out, x.stride(0), out.stride(0), width, BLOCK=BLOCK,
                                                      num_warps=4, **pdl_options(x.device))
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    require(__name__)
    T, two_width = gate_up.shape
    assert gate_up.stride(-1) == 1 and two_width % 2 == 0
    width = two_width // 2
    out = torch.empty(T, width, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        _silu_and_mul_kernel[(T, triton.cdiv(width, BLOCK))](gate_up, out, gate_up.stride(0), out.stride(0), width,
                                                             BLOCK=BLOCK, num_warps=4, **pdl_options(gate_up.device))
    return out


def by_name(rows: torch.Tensor, act: str) -> torch.Tensor:
    """rows [T, width] through the MLP activation named `act`: "relu2" (relu2) or "silu_and_mul" (silu_and_mul,
    rows of [gate | up])."""
    if act == "relu2":
        return relu2(rows)
    if act == "silu_and_mul":
        return silu_and_mul(rows)
    raise ValueError(f"MLP activation {act!r}: relu2 or silu_and_mul")
