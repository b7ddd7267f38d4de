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
                ref_out, ref_final = public(x, dt, A, B, C, chunk, D=D, z=None, dt_bias=dt_bias, initial_states=init,
                                            dt_softplus=True, dt_limit=dt_limit, return_final_states=True)
                for call in range(2):  # a layout's first call records its launches, the second is direct
                    out, final = scan(x, dt, A, B, C, chunk, D, dt_bias, init, dt_limit)
                    assert torch.equal(out, ref_out) and torch.equal(final, ref_final), (T, first, init is not None,
                                                                                         call)
    assert scan.lean is True  # the check passed: the lean path is what ran
    assert scan.plans is not None and scan.plans.plans  # ... through the planned launches (mamba_scan_plans.py)


@pytest.mark.parametrize("groups", [1, 8])
def test_planned_varlen_scan_equals_the_library_forward_bit_for_bit(scans, groups):
    """The varlen call (seq_idx: each token's row, every row from zero) through the planned launches, a layout's
    recording call and a direct one, against mamba-ssm's own forward with the same seq_idx."""
    scan, public = scans
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(10 + groups)
    nh, P, N, chunk = 16, 64, 128, 128
    width = nh * P + 2 * groups * N + nh
    A = -torch.rand(nh, device=dev, generator=g) - 0.5
    D = torch.randn(nh, device=dev, generator=g)
    dt_bias = torch.randn(nh, device=dev, generator=g) * 0.1
    x0, dt0, _, B0, C0 = _tiny(dev, nh, P, groups, N)
    scan(x0, dt0, A, B0, C0, chunk, D, dt_bias, None, (0.0, float("inf")))  # (the first-call check, if not run yet)
    for lengths in ([37, 1, 200], [128, 128], [5]):
        T = sum(lengths)
        zx = torch.randn(T, width, device=dev, dtype=torch.bfloat16, generator=g)
        x = zx[:, : nh * P].reshape(1, T, nh, P)
        B = zx[:, nh * P: nh * P + groups * N].reshape(1, T, groups, N)
        C = zx[:, nh * P + groups * N: nh * P + 2 * groups * N].reshape(1, T, groups, N)
        dt = zx[:, -nh:][None]
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths), device=dev, dtype=torch.int32),
                                          torch.tensor(lengths, device=dev))[None]
        ref = scan.forward(x, dt, A, B, C, chunk, D=D, z=None, dt_bias=dt_bias, initial_states=None, seq_idx=seq_idx,
                           dt_softplus=True, dt_limit=(0.0, float("inf")))
        for call in range(2):
            y, dt_out = scan.varlen(x, dt, A, B, C, chunk, D, dt_bias, (0.0, float("inf")), seq_idx)
            assert torch.equal(y, ref[0]) and torch.equal(dt_out, ref[2][0].reshape(ref[2].shape[1], -1)), (lengths,
                                                                                                             call)
    assert scan.plans is not None


def _tiny(dev, nh, P, groups, N, T=16):
    """x, dt, A, B, C of a short chunk (for the scan's first-call check)."""
    x = torch.randn(1, T, nh, P, device=dev, dtype=torch.bfloat16)
    B = torch.randn(1, T, groups, N, device=dev, dtype=torch.bfloat16)
    return x, torch.rand(1, T, nh, device=dev, dtype=torch.bfloat16), -torch.rand(nh, device=dev) - 0.5, B, B.clone()
