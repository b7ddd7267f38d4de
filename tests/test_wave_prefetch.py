"""hybrid/ops/wave_prefetch.py on the CPU: the resident-program arithmetic the wave comes from, the wave a launch
passes before and after its compiled kernel is noted, and where the prefetch is never asked for (the kernels'
values with it on are a GPU test: tests/gpu/test_triton_fused_ops_gpu.py; its PTX a compile case)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybrid.ops import triton_guard, wave_prefetch


@pytest.mark.parametrize("n_regs,shared,warps,per_sm", [
    (122, 0, 4, 4),  # Granite-4.0-H-Tiny's in_proj + conv: 128 registers a thread as allocated, 4 blocks an SM
    (128, 0, 4, 4),
    (129, 0, 4, 3),  # past 128: 136 a thread, 3 blocks
    (139, 0, 4, 3),
    (216, 0, 4, 2),
    (32, 0, 4, 16),  # the SM's 64 warps
    (16, 0, 1, 32),  # its 32 blocks
    (64, 60 << 10, 4, 3),  # shared memory: 228 KB over 61 KB blocks
    (255, 0, 8, 1),
])
def test_resident_programs(n_regs, shared, warps, per_sm):
    assert wave_prefetch.resident_programs(n_regs, shared, warps, sms=132) == per_sm * 132


def test_the_wave_is_the_grid_until_noted(monkeypatch):
    monkeypatch.setattr(wave_prefetch, "sm_count", lambda device: 132)
    wave_prefetch.clear()
    key = ("preload_in_proj_conv", 0, "test")
    assert wave_prefetch.wave(key, 806) == 806  # nothing known: no program has a successor one wave on
    compiled = SimpleNamespace(n_regs=122, metadata=SimpleNamespace(shared=0, num_warps=4))
    wave_prefetch.note(key, compiled, torch.device("cpu"))
    assert wave_prefetch.wave(key, 806) == 528
    other = SimpleNamespace(n_regs=216, metadata=SimpleNamespace(shared=0, num_warps=4))
    wave_prefetch.note(key, other, torch.device("cpu"))  # (noted once: a key is one specialisation)
    assert wave_prefetch.wave(key, 806) == 528
    wave_prefetch.note(("none",), None, torch.device("cpu"))  # (a launch that returned no kernel)
    assert wave_prefetch.wave(("none",), 10) == 10
    wave_prefetch.clear()
    assert wave_prefetch.wave(key, 806) == 806


def test_never_on_the_cpu_nor_unless_switched_on(monkeypatch):
    w = torch.zeros(64, 1536, dtype=torch.bfloat16)
    monkeypatch.setenv("HYBRID_WAVE_PREFETCH", "1")
    triton_guard.reset_switches()
    try:
        assert not wave_prefetch.enabled(w, 1536 * 2, 8 * 1536 * 2)  # a CPU tensor
    finally:
        monkeypatch.delenv("HYBRID_WAVE_PREFETCH")
        triton_guard.reset_switches()
    assert not triton_guard.switch("wave_prefetch")  # off by default


@pytest.mark.parametrize("preload_call", ["linear", "in_proj_conv"])
def test_the_kernels_values_with_the_switch_on_under_the_interpreter(preload_call, monkeypatch):
    """The interpreter never prefetches (no inline PTX): with the switch on the launches take the same path and
    give the same values as the reference."""
    pytest.importorskip("triton")
    from hybrid.ops import triton_gemv

    monkeypatch.setenv("HYBRID_WAVE_PREFETCH", "1")
    triton_guard.reset_switches()
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 96, generator=g)
        w = torch.randn(40, 96, generator=g)
        if preload_call == "linear":
            y = triton_gemv.small_m_linear(x, w, preload=True)
            torch.testing.assert_close(y, x @ w.T, atol=1e-4, rtol=1e-4)
        else:
            cw = torch.randn(8, 4, generator=g)
            state = torch.randn(2, 8, 3, generator=g)
            y = triton_gemv.in_proj_conv(x, w, None, state, cw, None, torch.tensor([1], dtype=torch.int32), 4,
                                         preload=True)
            torch.testing.assert_close(y[:, :4], (x @ w.T)[:, :4], atol=1e-4, rtol=1e-4)
    finally:
        monkeypatch.delenv("HYBRID_WAVE_PREFETCH")
        triton_guard.reset_switches()
