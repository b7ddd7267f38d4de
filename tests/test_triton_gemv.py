"""The decode-sized Triton linear (hybrid/ops/triton_gemv.py) against torch, on CPU through Triton's
interpreter (see tests/test_triton_kernels.py for why the interpreter is switched on here only)."""
import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU interpreter tests: run in their own process with TRITON_INTERPRET=1", allow_module_level=True)

from hybrid.ops.triton_gemv import MAX_ROWS, small_m_linear  # noqa: E402


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k,block_n,block_k", [(40, 96, 16, 32), (64, 100, 32, 64), (17, 33, 16, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch(m, n, k, block_n, block_k, bias):
    """Ragged N and K (masked tails), every row count up to the tile height, with and without bias."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    got = small_m_linear(x, w, b, block_n=block_n, block_k=block_k)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pre_k", [16, 32, 128])
def test_any_prefetched_slab(pre_k):
    """The columns loaded before the PDL wait (pre_k) and the loop after them cover K once: a
    short, an exact and a past-the-end first slab."""
    g = torch.Generator().manual_seed(pre_k)
    x = torch.randn(5, 100, generator=g)
    w = torch.randn(48, 100, generator=g) / 10
    got = small_m_linear(x, w, block_n=16, block_k=32, pre_k=pre_k)
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-4)


def test_layers_use_it_only_when_asked_and_eligible(monkeypatch):
    """Linear takes the kernel for fused modules, HYBRID_DECODE_LINEAR=triton and eligible inputs
    (CUDA, <= 16 rows, 16-bit): here on CPU it never applies, and the switch is read once."""
    from hybrid.ops import triton_gemv, triton_guard

    monkeypatch.setenv("HYBRID_DECODE_LINEAR", "triton")
    triton_guard.reset_switches()
    try:
        assert triton_guard.switch("decode_linear") and not triton_guard.switch("norm_router")
        x, w = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)
        assert not triton_gemv.eligible(x, w)  # not CUDA
        monkeypatch.setenv("HYBRID_DECODE_LINEAR", "cublas")
        assert triton_guard.switch("decode_linear")  # cached until reset_switches
    finally:
        triton_guard.reset_switches()
    assert not triton_guard.switch("decode_linear")


def test_strided_rows_and_out_buffer():
    """x may be a row-strided view (a slice of a wider activation); `out` is written in place."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 80, generator=g)
    x = wide[:, :48]
    w = torch.randn(32, 48, generator=g)
    out = torch.full((4, 32), float("nan"))
    assert small_m_linear(x, w, out=out, block_n=16, block_k=32) is out
    torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-4)


def test_refuses_what_it_does_not_handle():
    with pytest.raises(ValueError, match="at most 16 rows"):
        small_m_linear(torch.zeros(MAX_ROWS + 1, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="shapes/strides"):
        small_m_linear(torch.zeros(2, 8), torch.zeros(4, 6))


@pytest.mark.parametrize("m,k,n_groups,n", [(1, 96, 1, 40), (3, 128, 2, 64), (16, 256, 4, 33), (2, 512, 1, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_norm_linear_matches_the_two_launches(m, k, n_groups, n, bias):
    """gated_norm_linear == out_proj(gated_rms_norm(y, z)): group sizes that take one K step, several,
    and the prefetched slab; rows past M and columns past N masked."""
    from hybrid.ops import triton_norm
    from hybrid.ops.triton_gemv import gated_norm_block_k, gated_norm_linear

    g = torch.Generator().manual_seed(m * 100 + k + n_groups)
    y = torch.randn(m, k, generator=g)
    wide = torch.randn(m, k + 24, generator=g)
    z = wide[:, 8:8 + k]  # a strided view, as the layer's z is a slice of in_proj's output
    nw = 0.5 + torch.rand(k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    assert gated_norm_block_k(k // n_groups) is not None
    got = gated_norm_linear(y, z, nw, 1e-5, n_groups, w, b, block_n=16)
    ref = torch.nn.functional.linear(triton_norm.gated_rms_norm(y, z, nw, 1e-5, n_groups), w, b)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_gated_norm_linear_refuses_groups_it_cannot_step():
    from hybrid.ops.triton_gemv import gated_norm_block_k, gated_norm_linear

    assert gated_norm_block_k(3072) == 256 and gated_norm_block_k(512) == 256 and gated_norm_block_k(24) is None
    with pytest.raises(ValueError, match="gated_norm_linear"):
        gated_norm_linear(torch.zeros(1, 24), torch.zeros(1, 24), torch.ones(24), 1e-5, 1, torch.zeros(8, 24))
