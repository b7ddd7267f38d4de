"""hybrid/ops/triton_launch.py on the GPU: a layout's repeat goes straight to the kept compiled kernel, and gives
what Triton's own launch path gives, bit for bit (norms, activations, at aligned and unaligned rows)."""
from __future__ import annotations

import pytest
import torch

from hybrid.ops import triton_act, triton_launch, triton_norm

pytestmark = pytest.mark.gpu


def _calls(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    H = 4096

    def rows(first: int, T: int = 37, width: int = H) -> torch.Tensor:
        return torch.randn(first + T, width, device=dev, dtype=torch.bfloat16, generator=g)[first:]

    w = torch.randn(H, device=dev, dtype=torch.bfloat16, generator=g)
    for first in (0, 3):
        x, res = rows(first), rows(first)
        y, z = rows(first, width=8192), rows(first, width=8192)
        wg = torch.randn(8192, device=dev, dtype=torch.bfloat16, generator=g)
        gu = rows(first, width=2 * H)
        yield "rms_norm", lambda: triton_norm.rms_norm(x, w, 1e-5, False)
        yield "add_rms_norm", lambda: (lambda r: (triton_norm.add_rms_norm(x, r, w, 1e-5, True, 0.5), r))(res.clone())
        yield "gated_rms_norm", lambda: triton_norm.gated_rms_norm(y, z, wg, 1e-5, 8)
        yield "relu2", lambda: triton_act.relu2(x)
        yield "silu_and_mul", lambda: triton_act.silu_and_mul(gu)


def _flat(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, tuple) else (out,))]


def test_direct_launches_equal_tritons_path_bit_for_bit(monkeypatch):
    dev = torch.device("cuda")
    for name, call in _calls(dev):
        monkeypatch.setattr(triton_launch, "_ENABLED", False)
        ref = _flat(call())
        monkeypatch.setattr(triton_launch, "_ENABLED", True)
        triton_launch.forget()
        first = _flat(call())  # Triton's path, the layout kept
        kept = len(triton_launch._kept)
        second = _flat(call())  # straight to the kept compiled kernel
        assert kept >= 1 and len(triton_launch._kept) == kept, name
        for a, b, c in zip(ref, first, second):
            assert torch.equal(a, b) and torch.equal(a, c), name
