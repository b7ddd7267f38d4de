"""Triton, imported guarded: hybrid must import, and run its torch path, on machines without it.
The kernel modules (triton_mamba, triton_norm, triton_act) take `triton`, `tl` and `HAS_TRITON`
from here and define their kernels only when HAS_TRITON."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False


def require(module: str) -> None:
    """Raise a clear error when a kernel of `module` is called without triton."""
    if not HAS_TRITON:
        raise RuntimeError(f"{module} needs triton, which is not importable here")
