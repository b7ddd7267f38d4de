"""Helpers of the GPU tests."""
import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error; NaN/inf anywhere is an infinite error (NaN never passes)."""
    if not torch.isfinite(out).all():
        return float("inf")
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


# fp32: mamba-ssm's Triton SSD kernels use TF32 dot products
TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}
