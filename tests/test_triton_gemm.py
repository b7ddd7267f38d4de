"""Our weight-streaming Triton matmul (hybrid/ops/triton_gemm.py) against F.linear, on CPU through
Triton's interpreter (fp32 and fp16: the interpreter has no bf16 dot; tests/gpu checks bf16), and the
switch that routes a model's projections to it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

tg = pytest.importorskip("hybrid.ops.triton_gemm")
if not tg.is_available():
    pytest.skip("triton is not installed", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 40, 96), (5, 70, 300), (17, 33, 64), (64, 16, 128)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_skinny_matmul(dtype, M, N, K, with_bias):
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if with_bias else None
    got = tg.skinny_matmul(x, w, b, config=(16, 64, 4, 2))  # several K steps, a masked last one
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (M, N)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(got.float(), ref, **tol)


def test_too_many_rows_is_refused():
    with pytest.raises(AssertionError):
        tg.skinny_matmul(torch.zeros(tg.MAX_M + 1, 8), torch.zeros(4, 8))


def test_use_triton_gemm_routes_16bit_linears(tiny_ckpt, make_llm):
    from hybrid.layers import Linear, use_triton_gemm

    llm = make_llm(tiny_ckpt("granite_dense"))
    assert use_triton_gemm(llm.model) == 0  # fp32 weights stay on torch's matmul
    layer = next(m for m in llm.model.modules() if isinstance(m, Linear))
    layer.weight = torch.nn.Parameter(layer.weight.half(), requires_grad=False)
    assert use_triton_gemm(llm.model, max_rows=8) == 1 and layer.skinny_max_rows == 8
    x = torch.randn(8, layer.weight.shape[1]).half()
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float()), atol=3e-3, rtol=3e-3)
    with pytest.raises(ValueError, match="max_rows"):
        use_triton_gemm(llm.model, max_rows=tg.MAX_M + 1)
