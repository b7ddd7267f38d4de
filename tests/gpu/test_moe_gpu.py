"""The fused MoE path on the GPU (hybrid/ops/triton_moe*.py): against the float64 torch loop at model-like
sizes and every regime (naive / one-program alignment / torch alignment; decode and prefill tiles),
the alignment kernel against its torch reference, padding rows that cannot change a real row, and a
captured CUDA graph replayed on new routings."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.moe_reference import ROUTINGS, check_fused_experts, routing, tolerance  # noqa: E402

# a Nemotron-3-Nano-like (E 128, top-6, relu2) and a Granite-4.0-H-like (E 64, top-6, SwiGLU) layer,
# narrower than the real ones to keep the float64 reference quick
SHAPES = {"nemotron": dict(E=128, H=1024, inter=512, top_k=6, gated=False),
          "granite": dict(E=64, H=768, inter=256, top_k=6, gated=True)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("T", [1, 3, 8, 64, 256, 1500])  # naive, naive, one-program, ..., torch alignment
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_experts_vs_reference(shape, T, kind, dtype):
    s = dict(SHAPES[shape])
    gated = s.pop("gated")
    check_fused_experts(kind, gated, None, T=T, dtype=dtype, device="cuda", with_add=T % 2 == 0, seed=T, **s)


# Nemotron-3-Super's LatentMoE experts: 512 of them, top-22, reading and writing the 1024-wide latent (their
# width narrowed from 2688 for the float64 reference), no shared expert in their launches
LATENT = dict(E=512, H=1024, inter=512, top_k=22, gated=False)


@pytest.mark.parametrize("T", [1, 3, 8, 64, 1500])
def test_latent_experts_vs_reference(T):
    s = dict(LATENT)
    gated = s.pop("gated")
    check_fused_experts("random", gated, None, T=T, dtype=torch.bfloat16, device="cuda", with_add=False, seed=T, **s)


@pytest.mark.parametrize("shape", list(SHAPES) + ["latent"])
@pytest.mark.parametrize("T", [1, 8, 64, 1500])
@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_experts_vs_dequantized_reference(shape, T, per_row):
    """FP8 (e4m3) experts, weight-only, bf16 activations: against the float64 loop over the
    dequantized weights, decode and prefill tiles (and LatentMoE's 512 experts, top-22)."""
    s = dict(LATENT if shape == "latent" else SHAPES[shape])
    E, H, inter, top_k, gated = s["E"], s["H"], s["inter"], s["top_k"], s["gated"]
    from hybrid.ops import triton_moe

    g = torch.Generator(device="cuda").manual_seed(T)
    width = 2 * inter if gated else inter

    def quantize(w):  # as the tools quantize checkpoints, the scales per row as the loader keeps them
        from hybrid.fp8_linear import row_scales
        from hybrid.tools.quantize_fp8 import quantize_weight

        q, scale = quantize_weight(w, per_row, torch.float32)
        return q, row_scales(q, scale)

    up8, up_s = quantize(torch.randn(E, width, H, device="cuda", generator=g) / H ** 0.5)
    down8, down_s = quantize(torch.randn(E, H, inter, device="cuda", generator=g) / inter ** 0.5)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    top_idx, top_w = routing("random", T, E, top_k, T + 1, "cuda")
    up_d, down_d = up8.double() * up_s.double()[..., None], down8.double() * down_s.double()[..., None]
    ref = torch.zeros(T, H, dtype=torch.float64, device="cuda")
    for e in torch.unique(top_idx).tolist():
        tok, j = torch.where(top_idx == e)
        h = x[tok].double() @ up_d[e].T
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:] if gated else torch.relu(h) ** 2
        ref.index_add_(0, tok, (h @ down_d[e].T) * top_w[tok, j, None].double())
    out = triton_moe.fused_experts(x, up8, down8, top_idx, top_w, gated, up_scale=up_s, down_scale=down_s)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < tolerance(torch.bfloat16), err


@pytest.mark.parametrize("method", ["naive", "triton", "torch"])
def test_every_alignment_on_decode_tiles(method):
    check_fused_experts("random", True, method, T=24, dtype=torch.bfloat16, device="cuda", E=64, H=768, inter=256,
                        top_k=6)


@pytest.mark.parametrize("n_tokens,method", [(5, "triton"), (200, "triton"), (680, "triton"), (5, "counting"),
                                             (680, "counting"), (8192, "counting")])
@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_align_kernel_equals_torch(n_tokens, block_m, method):
    """The one-program alignment (decode sizes) and the counting sort (the default past 4096 pairs:
    an 8192-token prefill chunk at top-6) lay the pairs out as the stable sort does."""
    from hybrid.ops import triton_moe_align

    for kind in ROUTINGS:
        ids = routing(kind, n_tokens, 128, 6, seed=n_tokens, device="cuda")[0].reshape(-1)
        ref = triton_moe_align.align_torch(ids, 128, block_m)
        got = triton_moe_align.align(ids, 128, block_m, method=method)
        total = int(ref[2][0])
        assert int(got[2][0]) == total
        assert torch.equal(got[0][:total], ref[0][:total])
        assert torch.equal(got[1][: total // block_m], ref[1][: total // block_m])


def _layer(E=128, H=1024, inter=512, gated=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w_up = torch.randn(E, 2 * inter if gated else inter, H, generator=g, device="cuda").div(H ** 0.5).bfloat16()
    w_down = torch.randn(E, H, inter, generator=g, device="cuda").div(inter ** 0.5).bfloat16()
    return w_up, w_down


def test_padding_rows_do_not_change_real_rows():
    """Real rows computed with extra (padding) rows routed anywhere are bit-identical (same tiles)."""
    from hybrid.ops import triton_moe

    w_up, w_down = _layer()
    x = torch.randn(40, 1024, device="cuda").bfloat16()
    idx, w = routing("random", 40, 128, 6, seed=1, device="cuda")
    cfg = triton_moe.CONFIGS["decode"]
    real = triton_moe.fused_experts(x[:29], w_up, w_down, idx[:29], w[:29], False, config=cfg, align_method="triton")
    for pad_idx in (idx[29:], torch.zeros_like(idx[29:]), idx[:11]):  # random / all on expert 0 / real rows' experts
        padded = triton_moe.fused_experts(x, w_up, w_down, torch.cat([idx[:29], pad_idx]), w, False, config=cfg,
                                          align_method="triton")
        assert torch.equal(padded[:29], real)


@pytest.mark.parametrize("T", [1, 64])
def test_graph_replay_equals_eager(T):
    from hybrid.ops import triton_moe

    w_up, w_down = _layer(gated=True, E=64, H=768, inter=256)
    x = torch.randn(T, 768, device="cuda").bfloat16()
    idx, w = routing("random", T, 64, 6, seed=2, device="cuda")
    w = w.bfloat16()
    add = torch.randn(T, 768, device="cuda").bfloat16()
    for _ in range(2):  # warm-up: JIT outside the capture
        triton_moe.fused_experts(x, w_up, w_down, idx, w, True, add)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.fused_experts(x, w_up, w_down, idx, w, True, add)
    for seed in (3, 4, 5):  # new tokens and new routings in the same buffers
        new_idx, new_w = routing(["random", "one_expert", "few_experts"][seed - 3], T, 64, 6, seed=seed, device="cuda")
        idx.copy_(new_idx)
        w.copy_(new_w)
        x.normal_()
        graph.replay()
        eager = triton_moe.fused_experts(x, w_up, w_down, idx, w, True, add)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("E,top_k", [(128, 6), (64, 6), (72, 10), (512, 22)])  # (512, 22): Nemotron-3-Super
def test_route_kernel_vs_torch(E, top_k):
    from hybrid.ops import triton_moe_route

    g = torch.Generator(device="cuda").manual_seed(E + top_k)
    logits = torch.randn(300, E, generator=g, device="cuda") * 2
    bias = torch.randn(E, generator=g, device="cuda") * 0.1
    idx, w = triton_moe_route.route(logits, top_k, sigmoid=True, bias=bias, normalize=True, scale=2.5)
    scores = logits.sigmoid()
    ref_idx = torch.topk(scores + bias, top_k, dim=-1)[1]
    ref_w = scores.gather(1, ref_idx)
    assert torch.equal(idx.long(), ref_idx)
    torch.testing.assert_close(w, ref_w / ref_w.sum(-1, keepdim=True) * 2.5, rtol=1e-5, atol=1e-6)
    idx, w = triton_moe_route.route(logits, top_k, sigmoid=False)
    top, ref_idx = logits.topk(top_k, dim=-1)
    assert torch.equal(idx.long(), ref_idx)
    torch.testing.assert_close(w, torch.softmax(top, dim=-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("H,E,top_k,dtype", [(2688, 128, 6, torch.float32), (1536, 64, 6, torch.bfloat16),
                                               (4096, 72, 10, torch.bfloat16), (4096, 512, 22, torch.float32)])
@pytest.mark.parametrize("T", [1, 3, 16, 64])
def test_route_hidden_vs_router_gemm(H, E, top_k, dtype, T):
    """Router logits from split-K partials (T <= 16) or a GEMM, then routing: NemotronH's fp32 router
    picks exactly what the fp32 GEMM does; with bf16 logits (Granite) a choice may differ only where
    two logits are within a bf16 rounding step, and the weights by that much."""
    from hybrid.ops import triton_moe_route

    g = torch.Generator(device="cuda").manual_seed(T * E)
    x = torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(E, H, generator=g, device="cuda") * H ** -0.5).to(dtype)
    bias = torch.randn(E, generator=g, device="cuda") * 0.1
    sigmoid = dtype == torch.float32
    kw = dict(bias=bias, normalize=True, scale=2.5) if sigmoid else {}
    logits = torch.nn.functional.linear(x.to(dtype), weight)
    ref_idx, ref_w = triton_moe_route.route(logits, top_k, sigmoid=sigmoid, num_shared=2, **kw)
    idx, w = triton_moe_route.route_hidden(x, weight, top_k, logits_dtype=dtype, sigmoid=sigmoid, num_shared=2, **kw)
    if sigmoid:
        assert torch.equal(idx, ref_idx)
        torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
        return
    exact = torch.nn.functional.linear(x.float(), weight.float())
    kth = exact.topk(top_k, dim=-1)[0][:, -1:]
    chosen = exact.gather(1, idx[:, :top_k].long())
    assert bool((chosen >= kth - 2e-2 * kth.abs().clamp(min=1)).all()), "a choice beyond a rounding step"
    same = (idx == ref_idx).all(-1)
    torch.testing.assert_close(w[same], ref_w[same], rtol=0, atol=1e-2)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("T", [1, 4, 64, 1500])
def test_shared_expert_folded_in(shape, T):
    """The shared MLP (two expert widths, as in Nemotron-3-Nano and Granite-4.0-H) inside the expert launches."""
    s = dict(SHAPES[shape])
    gated = s.pop("gated")
    check_fused_experts("random", gated, None, T=T, dtype=torch.bfloat16, device="cuda", shared_slices=2, seed=T, **s)


def test_memory_plan_names_the_resident_experts(tiny_ckpt):
    from hybrid import LLM
    from hybrid.moe import Experts

    llm = LLM(tiny_ckpt("granite_moe"), device="cuda", max_num_seqs=4, max_model_len=64, gpu_memory_utilization=0.3)
    experts = sum(p.numel() * p.element_size() for m in llm.model.modules() if isinstance(m, Experts)
                  for p in m.parameters())
    plan = llm.memory_plan
    assert experts > 0 and plan.expert_bytes == experts and plan.weight_bytes > experts
    assert "routed experts" in plan.summary(4, 64, llm.kv_cache.page_size)
    assert llm.runner.use_graphs and all(m.fused for m in llm.model.modules() if isinstance(m, Experts))


@pytest.mark.parametrize("shape", ["nemotron-nano", "granite-tiny", "granite-small"])
def test_one_token_routed_inside_the_gemms(shape, monkeypatch):
    """A one-token step given the router's logits routes inside the first expert GEMM (no routing launch),
    at the released routers and expert shapes (with the shared expert's slices): the output (bf16) of the
    routing launch then fused_experts, eagerly and from a captured graph replayed on new tokens (the
    second GEMM reads the routing the first wrote)."""
    from hybrid.ops import triton_guard, triton_moe, triton_moe_route

    monkeypatch.setenv("HYBRID_MOE_ROUTE_IN_GEMM", "1")
    monkeypatch.setenv("HYBRID_MOE_PRELOAD", "0")  # (the launched routing's GEMMs the same tiled ones)
    triton_guard.reset_switches()
    E, H, inter, top_k, gated, shared, sigmoid = {
        "nemotron-nano": (128, 2688, 1856, 6, False, 2, True), "granite-tiny": (64, 1536, 512, 6, True, 2, False),
        "granite-small": (72, 4096, 768, 10, True, 1, False)}[shape]
    g = torch.Generator(device="cuda").manual_seed(E)
    w_up, w_down = _layer(gated=gated, E=E, H=H, inter=inter)
    s_up = (torch.randn((2 if gated else 1) * shared * inter, H, generator=g, device="cuda") * H ** -0.5).bfloat16()
    s_down = (torch.randn(H, shared * inter, generator=g, device="cuda") * inter ** -0.5).bfloat16()
    r_weight = torch.randn(E, H, generator=g, device="cuda") * H ** -0.5
    kw = dict(logits_dtype=torch.float32, sigmoid=True, bias=torch.randn(E, generator=g, device="cuda") * 0.1,
              normalize=True, scale=2.5) if sigmoid else dict(logits_dtype=torch.bfloat16, sigmoid=False)
    r_weight = r_weight.to(kw["logits_dtype"])
    x = torch.randn(1, H, generator=g, device="cuda").bfloat16()

    def routed():
        x_r = x.float() if sigmoid else x
        router = triton_moe_route.router_logits(x_r, r_weight, top_k, num_shared=shared, **kw)
        return triton_moe.fused_experts(x, w_up, w_down, None, None, gated, shared_up=s_up, shared_down=s_down,
                                        router=router)

    def launched():
        x_r = x.float() if sigmoid else x
        idx, w = triton_moe_route.route_hidden(x_r, r_weight, top_k, num_shared=shared, **kw)
        return triton_moe.fused_experts(x, w_up, w_down, idx, w, gated, shared_up=s_up, shared_down=s_down)

    # (the routing weights are the same fp32 sums, possibly reduced in another order: one bf16 step at most)
    torch.testing.assert_close(routed(), launched(), rtol=1e-2, atol=1e-3)
    for _ in range(2):
        routed()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed()
    for _ in range(3):
        x.normal_()
        graph.replay()
        eager = routed()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        torch.testing.assert_close(out, launched(), rtol=1e-2, atol=1e-3)
    monkeypatch.delenv("HYBRID_MOE_ROUTE_IN_GEMM")
    triton_guard.reset_switches()


@pytest.mark.parametrize("shape", ["nemotron-nano", "granite-tiny", "granite-small"])
def test_one_token_preloading_experts(shape, monkeypatch):
    """A one-token step's two expert GEMMs on the one-token kernel (the default: whole expert slabs at once, the
    second GEMM's before its PDL wait) at the released expert shapes with the shared expert's slices: the tiled
    kernels' output (HYBRID_MOE_PRELOAD=0) in bf16 up to summation order, and a captured graph replayed on new
    tokens and new routings (written by a kernel before the GEMMs, as the routing launch writes them) equal
    to eager, bit for bit."""
    from hybrid.ops import triton_guard, triton_moe

    E, H, inter, top_k, gated, shared = {
        "nemotron-nano": (128, 2688, 1856, 6, False, 2), "granite-tiny": (64, 1536, 512, 6, True, 2),
        "granite-small": (72, 4096, 768, 10, True, 1)}[shape]
    g = torch.Generator(device="cuda").manual_seed(E + 1)
    w_up, w_down = _layer(gated=gated, E=E, H=H, inter=inter)
    s_up = (torch.randn((2 if gated else 1) * shared * inter, H, generator=g, device="cuda") * H ** -0.5).bfloat16()
    s_down = (torch.randn(H, shared * inter, generator=g, device="cuda") * inter ** -0.5).bfloat16()
    x = torch.randn(1, H, generator=g, device="cuda").bfloat16()
    idx, w = routing("random", 1, E, top_k, seed=7, device="cuda")
    idx = torch.cat([idx, torch.arange(E, E + shared, device="cuda")[None, :]], 1).int()
    w = torch.cat([w, torch.ones(1, shared, device="cuda")], 1)
    new_idx, new_w = idx.clone(), w.clone()

    def step():
        idx.copy_(new_idx)  # (a kernel before the GEMMs writes the routing, as the routing launch does)
        w.copy_(new_w)
        return triton_moe.fused_experts(x, w_up, w_down, idx, w, gated, shared_up=s_up, shared_down=s_down)

    monkeypatch.setenv("HYBRID_MOE_PRELOAD", "0")
    triton_guard.reset_switches()
    tiled = step()
    monkeypatch.delenv("HYBRID_MOE_PRELOAD")
    triton_guard.reset_switches()
    try:
        got = step()
        rel = ((got.float() - tiled.float()).norm() / tiled.float().norm()).item()
        assert rel < 1e-2, rel
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for seed in (8, 9, 10):
            x.normal_()
            r_idx, r_w = routing(["random", "one_expert", "few_experts"][seed - 8], 1, E, top_k, seed=seed,
                                 device="cuda")
            new_idx[:, :top_k] = r_idx
            new_w[:, :top_k] = r_w
            graph.replay()
            eager = step()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)
    finally:
        triton_guard.reset_switches()
