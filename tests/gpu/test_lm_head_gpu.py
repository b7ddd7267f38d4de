"""The LM head's fp32 output on CUDA (hybrid/layers.logits_fp32: cuBLAS writing its fp32 accumulator)
at real vocabulary sizes, eagerly and replayed from a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from hybrid.layers import _MM_OUT_DTYPE, logits_fp32


@pytest.mark.parametrize("rows,hidden,vocab", [(1, 2688, 131072), (64, 1536, 100352), (5, 4096, 131072)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_logits_at_real_sizes(rows, hidden, vocab, dtype):
    assert _MM_OUT_DTYPE, torch.__version__
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.05).to(dtype)
    out = logits_fp32(h, w)
    exact = (h.double() @ w.double().t()).float()
    rounded = torch.nn.functional.linear(h, w).float()
    assert out.dtype == torch.float32
    err, err_rounded = (out - exact).abs().max().item(), (rounded - exact).abs().max().item()
    assert err < err_rounded / 4, (err, err_rounded)


def test_fp32_logits_under_a_cuda_graph():
    h = torch.randn(8, 2688, device="cuda").bfloat16()
    w = torch.randn(4096, 2688, device="cuda").bfloat16()
    eager = logits_fp32(h, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        logits_fp32(h, w)  # warm-up on the side stream, as capture wants
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        out = logits_fp32(h, w)
    h.copy_(torch.randn_like(h))
    graph.replay()
    torch.cuda.synchronize()
    assert out.dtype == torch.float32
    assert torch.equal(out, logits_fp32(h, w)) and not torch.equal(out, eager)


def test_the_16bit_switch_gives_the_rounded_logits(monkeypatch):
    """HYBRID_16BIT_LOGITS=1 (the benchmarks' A/B of the fp32 head's cost): the old 16-bit logits."""
    from hybrid.ops import triton_guard

    h = torch.randn(4, 1536, device="cuda").bfloat16()
    w = torch.randn(8192, 1536, device="cuda").bfloat16()
    monkeypatch.setenv("HYBRID_16BIT_LOGITS", "1")
    triton_guard.reset_switches()
    try:
        assert torch.equal(logits_fp32(h, w), torch.nn.functional.linear(h, w).float())
    finally:
        monkeypatch.delenv("HYBRID_16BIT_LOGITS")
        triton_guard.reset_switches()
    assert not torch.equal(logits_fp32(h, w), torch.nn.functional.linear(h, w).float())


@pytest.mark.parametrize("vocab,hidden", [(100352, 1536), (131072, 2688)])
def test_the_preloading_head_of_a_one_token_step(vocab, hidden, monkeypatch):
    """By default a one-token step's logits come from the preloading linear's fp32 accumulator, within summation
    order of cuBLAS's (HYBRID_LM_HEAD_PRELOAD=0: the same fp32 sums, another order), replayed from a graph equal
    to eager; a step of two rows keeps cuBLAS's, bit for bit."""
    from hybrid.ops import triton_guard

    g = torch.Generator(device="cuda").manual_seed(vocab)
    h = torch.randn(2, hidden, generator=g, device="cuda").bfloat16()
    w = (torch.randn(vocab, hidden, generator=g, device="cuda") * hidden ** -0.5).bfloat16()
    monkeypatch.setenv("HYBRID_LM_HEAD_PRELOAD", "0")
    triton_guard.reset_switches()
    want = logits_fp32(h, w)
    want_one = logits_fp32(h[:1], w)
    monkeypatch.delenv("HYBRID_LM_HEAD_PRELOAD")
    triton_guard.reset_switches()
    try:
        one = logits_fp32(h[:1], w)
        assert one.dtype == torch.float32 and one.shape == (1, vocab)
        torch.testing.assert_close(one, want_one, rtol=1e-4, atol=1e-4)
        assert not torch.equal(one, want_one)  # (another kernel: another summation order)
        assert torch.equal(logits_fp32(h, w), want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = logits_fp32(h[:1], w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, one)
    finally:
        triton_guard.reset_switches()
