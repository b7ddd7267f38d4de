"""The chunked scan's lean launch path (hybrid/ops/mamba_scan.py) on the GPU: bit for bit what
mamba_chunk_scan_combined gives through its own autotuners, at the lengths and specialisation classes a
prefill chunk meets, with and without an initial state, one and several groups."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def scans():
    from hybrid.ops.mamba_cuda import load_kernels

    scan = load_kernels()[0]
    return scan, scan.public


@pytest.mark.parametrize("groups", [1, 8])
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.001, 0.1)])
def test_lean_scan_equals_the_public_function_bit_for_bit(scans, groups, dt_limit):
    scan, public = scans
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(groups)
    nh, P, N, chunk = 16, 64, 128, 128
    width = nh * P + 2 * groups * N + nh
    A = -torch.rand(nh, device=dev, generator=g) - 0.5
    D = torch.randn(nh, device=dev, generator=g)
    dt_bias = torch.randn(nh, device=dev, generator=g) * 0.1
    for T in (1, 16, 37, 128, 256, 300):
        for first in (0, 3):  # rows of an in_proj-shaped output, as the mixer's split gives them
            zx = torch.randn(first + T, width, device=dev, dtype=torch.bfloat16, generator=g)[first:]
            x = zx[:, : nh * P].reshape(1, T, nh, P)
            B = zx[:, nh * P: nh * P + groups * N].reshape(1, T, groups, N)
            C = zx[:, nh * P + groups * N: nh * P + 2 * groups * N].reshape(1, T, groups, N)
            dt = zx[:, -nh:][None]
            for init in (None, torch.randn(1, nh, P, N, device=dev, generator=g)):
                out, final = scan(x, dt, A, B, C, chunk, D, dt_bias, init, dt_limit)
                ref_out, ref_final = public(x, dt, A, B, C, chunk, D=D, z=None, dt_bias=dt_bias, initial_states=init,
                                            dt_softplus=True, dt_limit=dt_limit, return_final_states=True)
                assert torch.equal(out, ref_out) and torch.equal(final, ref_final), (T, first, init is not None)
    assert scan.lean is True  # the check passed: the lean path is what ran
