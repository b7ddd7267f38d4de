"""The fused MoE kernels (hybrid/ops/triton_moe.py, the alignment of triton_moe_align.py, the routing
of triton_moe_route.py) vs the torch loop of moe.Experts, on CPU through Triton's interpreter (see
tests/test_triton_kernels.py for why the variable is set here).

Routings: random (some experts unused), every expert hit, no pair on most experts, all tokens on
one expert; every alignment method (naive, the one-program kernel, the counting sort, torch ops);
relu2 and SwiGLU;
with and without the shared-expert add. GPU runs of the same checks: tests/gpu/test_moe_gpu.py.
"""
import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU interpreter tests: run in their own process with TRITON_INTERPRET=1", allow_module_level=True)

from hybrid.ops import triton_moe  # noqa: E402
from hybrid.ops import triton_moe_align as talign  # noqa: E402
from hybrid.ops import triton_moe_route as troute  # noqa: E402
from tests.moe_reference import ROUTINGS, check_fused_experts, routing  # noqa: E402

E, H, INTER, TOP_K = 8, 32, 16, 2


def _check_layout(ids: torch.Tensor, pairs, block_expert, total, block_m: int) -> None:
    """Every pair exactly once, in a block of its own expert; the rest of each block is the sentinel."""
    n = ids.numel()
    total = int(total[0])
    assert total % block_m == 0 and total <= pairs.numel()
    seen = []
    for b in range(total // block_m):
        rows = pairs[b * block_m:(b + 1) * block_m].tolist()
        real = [p for p in rows if p < n]
        assert all(p == n for p in rows[len(real):]), "sentinels only after a block's pairs"
        assert all(int(ids[p]) == int(block_expert[b]) for p in real)
        seen += real
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("block_m", [16, 32])
def test_align_methods_agree(kind, block_m):
    top_idx, _ = routing(kind, 37, E, TOP_K, seed=3)
    ids = top_idx.reshape(-1)
    ref = talign.align_torch(ids, E, block_m)
    _check_layout(ids, *ref, block_m)
    out = talign.align(ids, E, block_m, method="triton")
    _check_layout(ids, *out, block_m)
    assert torch.equal(out[2], ref[2])
    blocks = int(ref[2][0]) // block_m
    assert torch.equal(out[1][:blocks], ref[1][:blocks])
    assert torch.equal(out[0][: int(ref[2][0])], ref[0][: int(ref[2][0])]), "both keep pair order per expert"
    _check_layout(ids, *talign.align(ids, E, block_m, method="naive"), block_m)
    out = talign.align(ids, E, block_m, method="counting")
    _check_layout(ids, *out, block_m)
    assert torch.equal(out[2], ref[2]) and torch.equal(out[1][:blocks], ref[1][:blocks])
    assert torch.equal(out[0], ref[0]), "the counting sort lays the pairs out as the stable sort does"


@pytest.mark.parametrize("n_tokens,num_experts", [(3000, 8), (5000, 66), (700, 130)])
def test_counting_alignment_at_prefill_sizes(n_tokens, num_experts):
    """The prefill chunks' alignment (over talign.TRITON_ALIGN_MAX_PAIRS pairs by default): many
    programs, the last one's slice partial, experts padded to a power of two (66: Granite's 64 with
    two shared slices); the same layout as the stable sort, pair for pair."""
    g = torch.Generator().manual_seed(n_tokens)
    ids = torch.randint(0, num_experts, (n_tokens * 2,), generator=g, dtype=torch.int32)
    ids[: n_tokens // 3] = 1  # a crowded expert, spanning several programs
    ref = talign.align_torch(ids, num_experts, 64)
    method = "counting" if ids.numel() <= talign.TRITON_ALIGN_MAX_PAIRS else None
    out = talign.align(ids, num_experts, 64, method=method)
    blocks = int(ref[2][0]) // 64
    assert torch.equal(out[2], ref[2]) and torch.equal(out[1][:blocks], ref[1][:blocks])
    assert torch.equal(out[0], ref[0])


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("method", ["naive", "triton", "counting", "torch"])
def test_fused_experts_match_torch_loop(kind, gated, method):
    check_fused_experts(kind, gated, method, T=13, E=E, H=H, inter=INTER, top_k=TOP_K, dtype=torch.float32,
                        device="cpu", config=(16, 16, 16, 2, 1, 1))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("method", ["naive", "triton", "torch"])
def test_shared_expert_as_pseudo_experts(gated, method):
    # the shared MLP (3 expert widths) inside the expert launches == the MLP run on its own
    check_fused_experts("random", gated, method, T=7, E=E, H=H, inter=INTER, top_k=TOP_K, dtype=torch.float32,
                        device="cpu", config=(16, 16, 16, 2, 1, 1), shared_slices=3, with_add=True)


@pytest.mark.parametrize("gated", [False, True])
def test_per_gemm_configs(gated):
    # a (first GEMM, second GEMM) pair of tile configurations, column tiles of different widths
    check_fused_experts("random", gated, "triton", T=9, E=E, H=H, inter=INTER, top_k=TOP_K, dtype=torch.float32,
                        device="cpu", config=((16, 16, 16, 2, 1, 1), (16, 32, 16, 1, 1, 1)), shared_slices=2,
                        with_add=True)
    with pytest.raises(ValueError, match="same BLOCK_M"):
        triton_moe.gemm_configs(((16, 16, 16, 1, 1, 1), (32, 16, 16, 1, 1, 1)))


@pytest.mark.parametrize("kind", ["random", "every_expert", "one_expert"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("config", [(16, 16, 16, 2, 1, 1), (64, 32, 16, 2, 1, 1)])
def test_fp8_experts_match_the_dequantized_loop(kind, gated, per_row, config):
    # FP8 (e4m3) expert weights with one scale per expert or per expert row: the kernel widens W in
    # registers and scales each output column; the reference is the loop over the dequantized weights
    g = torch.Generator().manual_seed(11)
    T, width = 21, 2 * INTER if gated else INTER

    def quantize(w):  # as the tools quantize checkpoints, the scales per row as the loader keeps them
        from hybrid.fp8_linear import row_scales
        from hybrid.tools.quantize_fp8 import quantize_weight

        q, scale = quantize_weight(w, per_row, torch.float32)
        return q, row_scales(q, scale)

    up8, up_s = quantize(torch.randn(E, width, H, generator=g) / H ** 0.5)
    down8, down_s = quantize(torch.randn(E, H, INTER, generator=g) / INTER ** 0.5)
    x = torch.randn(T, H, generator=g)
    top_idx, top_w = routing(kind, T, E, TOP_K, seed=4)
    up_d, down_d = up8.double() * up_s.double()[..., None], down8.double() * down_s.double()[..., None]
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(TOP_K):
            e = int(top_idx[t, j])
            h = up_d[e] @ x[t].double()
            h = torch.nn.functional.silu(h[:INTER]) * h[INTER:] if gated else torch.relu(h) ** 2
            ref[t] += float(top_w[t, j]) * (down_d[e] @ h)
    out = triton_moe.fused_experts(x, up8, down8, top_idx, top_w, gated, config=config, up_scale=up_s,
                                   down_scale=down_s)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(AssertionError, match="per-row scales"):
        triton_moe.fused_experts(x, up8, down8, top_idx, top_w, gated, config=config, up_scale=up_s)


@pytest.mark.parametrize("gated", [False, True])
def test_tuned_decode_configs_apply_to_their_shape_at_the_smallest_steps(gated, monkeypatch):
    # a TUNED_DECODE entry for this expert shape is used as it is (no narrowing) while the step has at
    # most NAIVE_MAX_PAIRS pairs, and the results are still the torch loop's
    tuned = ((16, 16, 16, 1, 1, 1), (16, 32, 16, 1, 1, 1))
    monkeypatch.setattr(triton_moe, "TUNED_DECODE", {(E, H, INTER, gated): tuned})
    seen = []
    real = triton_moe._grouped_gemm

    def spy(*args, **kwargs):
        seen.append((args[10], args[11]))  # (cfg, narrow)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_moe, "_grouped_gemm", spy)
    for T, want in ((3, True), (talign.NAIVE_MAX_PAIRS // TOP_K + 1, False)):
        seen.clear()
        check_fused_experts("random", gated, None, T=T, E=E, H=H, inter=INTER, top_k=TOP_K, dtype=torch.float32,
                            device="cpu")
        assert (seen == [(tuned[0], False), (tuned[1], False)]) == want, seen
    assert triton_moe.decode_tuned(6, E, H, INTER, gated) == tuned
    assert triton_moe.decode_tuned(6, E, H, INTER + 16, gated) is None
    assert triton_moe.decode_tuned(6, 128, 2688, 1856, False) is None  # (patched out here)


def test_fused_experts_prefill_config_and_add():
    # the prefill tiles (BLOCK_M 64, grouped ordering) over more tokens than one block holds
    check_fused_experts("random", True, "torch", T=70, E=E, H=H, inter=INTER, top_k=TOP_K, dtype=torch.float32,
                        device="cpu", config=(64, 32, 16, 2, 1, 1), with_add=True)


@pytest.mark.parametrize("top_k,num_experts", [(k, e) for k in (1, 2, 3, 6) for e in (8, 20)]
                         + [(22, 512)])  # (Nemotron-3-Super's router)
def test_route_kernel_matches_torch(top_k, num_experts):
    """The one-launch router: NemotronH's sigmoid + correction bias (normalised, scaled) and Granite's
    softmax over the top-k logits, against the torch ops of moe.NemotronMoE / GraniteMoE."""
    g = torch.Generator().manual_seed(top_k * 100 + num_experts)
    logits = torch.randn(9, num_experts, generator=g) * 2
    bias = torch.randn(num_experts, generator=g) * 0.5
    idx, w = troute.route(logits, top_k, sigmoid=True, bias=bias, normalize=True, scale=2.5)
    scores = logits.sigmoid()
    ref_idx = torch.topk(scores + bias, top_k, dim=-1)[1]
    ref_w = scores.gather(1, ref_idx)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True) * 2.5
    assert torch.equal(idx.long(), ref_idx)  # both in descending order of choice
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    idx, w = troute.route(logits, top_k, sigmoid=False)
    top, ref_idx = logits.topk(top_k, dim=-1)
    assert torch.equal(idx.long(), ref_idx)
    torch.testing.assert_close(w, torch.softmax(top, dim=-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 5, troute.ROUTER_FUSED_MAX_TOKENS, troute.ROUTER_FUSED_MAX_TOKENS + 1])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_route_hidden_matches_router_gemm(T, logits_dtype):
    """The router logits computed in split-K partials and summed by the routing launch (few tokens),
    or by a GEMM (more): the same choice and weights as the reference's GEMM in logits_dtype (fp32
    for NemotronH, the model dtype for Granite: one rounding of the fp32 sum), then route()."""
    g = torch.Generator().manual_seed(T)
    H, n_exp, top_k = 300, 20, 3  # H: several K splits, the last one partial
    x = torch.randn(T, H, generator=g).to(logits_dtype)
    weight = (torch.randn(n_exp, H, generator=g) * H ** -0.5).to(logits_dtype)
    bias = torch.randn(n_exp, generator=g) * 0.1
    logits = torch.nn.functional.linear(x.float(), weight.float()).to(logits_dtype)
    for sigmoid, kw in ((True, dict(bias=bias, normalize=True, scale=2.0)), (False, {})):
        ref_idx, ref_w = troute.route(logits, top_k, sigmoid=sigmoid, num_shared=2, **kw)
        idx, w = troute.route_hidden(x, weight, top_k, logits_dtype=logits_dtype, sigmoid=sigmoid, num_shared=2, **kw)
        assert torch.equal(idx, ref_idx)
        # bf16: the fp32 sums differ in order, so a logit may round one bf16 step the other way
        tol = dict(rtol=1e-5, atol=1e-6) if logits_dtype == torch.float32 else dict(rtol=0, atol=1e-2)
        torch.testing.assert_close(w, ref_w, **tol)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("shared", [0, 2])
@pytest.mark.parametrize("T", [1, 2])
def test_one_token_routed_inside_the_gemms(monkeypatch, gated, shared, T):
    """fused_experts given the router's logits (triton_moe_route.router_logits): with HYBRID_MOE_ROUTE_IN_GEMM=1
    a one-token step routes inside the first GEMM, with no routing launch, and gives the output (and writes the routing) of the
    routing launch then fused_experts; a longer step launches the routing. NemotronH's router (sigmoid, correction
    bias, normalised, scaled, fp32 split-K partials) and Granite's (softmax of model-dtype logits)."""
    g = torch.Generator().manual_seed(T * 10 + shared + gated)
    n_exp, top_k, dtype = 12, 3, torch.float32
    Hd = 300  # several K splits of the router, the last one partial
    x = torch.randn(T, Hd, generator=g).to(dtype)
    w_up = torch.randn(n_exp, (2 if gated else 1) * INTER, Hd, generator=g) * Hd ** -0.5
    w_down = torch.randn(n_exp, Hd, INTER, generator=g) * INTER ** -0.5
    s_up = torch.randn((2 if gated else 1) * shared * INTER, Hd, generator=g) * Hd ** -0.5 if shared else None
    s_down = torch.randn(Hd, shared * INTER, generator=g) * INTER ** -0.5 if shared else None
    r_weight = torch.randn(n_exp, Hd, generator=g) * Hd ** -0.5
    bias = torch.randn(n_exp, generator=g) * 0.1
    from hybrid.ops import triton_guard

    monkeypatch.setenv("HYBRID_MOE_ROUTE_IN_GEMM", "1")
    monkeypatch.setenv("HYBRID_MOE_PRELOAD", "0")  # (the reference on the same tiled GEMMs, the same sums)
    triton_guard.reset_switches()
    launches = []
    real_route = troute.RouterLogits.route
    monkeypatch.setattr(troute.RouterLogits, "route", lambda self: launches.append(1) or real_route(self))
    for sigmoid, kw in ((True, dict(bias=bias, normalize=True, scale=2.5)), (False, {})):
        router = troute.router_logits(x, r_weight, top_k, logits_dtype=dtype, sigmoid=sigmoid, num_shared=shared, **kw)
        idx, w = router.route()
        want = triton_moe.fused_experts(x, w_up, w_down, idx, w, gated, shared_up=s_up, shared_down=s_down)
        launches.clear()
        rows = triton_moe.fused_experts(x, w_up, w_down, None, None, gated, shared_up=s_up, shared_down=s_down,
                                        router=router, defer_sum=True)
        assert launches == ([] if T == 1 else [1])
        torch.testing.assert_close(rows.sum(), want, rtol=1e-6, atol=1e-6)
        assert rows.top_k == top_k + shared
        if T == 1:  # the first GEMM wrote the routing, as the launch would have
            got_idx, got_w = router_written(monkeypatch, x, w_up, w_down, gated, s_up, s_down, router)
            assert torch.equal(got_idx, idx) and torch.allclose(got_w, w, rtol=1e-6, atol=1e-7)
    monkeypatch.setenv("HYBRID_MOE_ROUTE_IN_GEMM", "0")  # off: the routing launch, at one token too
    triton_guard.reset_switches()
    launches.clear()
    triton_moe.fused_experts(x, w_up, w_down, None, None, gated, shared_up=s_up, shared_down=s_down, router=router)
    assert launches == [1]
    monkeypatch.delenv("HYBRID_MOE_ROUTE_IN_GEMM")
    triton_guard.reset_switches()


def router_written(monkeypatch, x, w_up, w_down, gated, s_up, s_down, router):
    """The (top_idx, top_w) buffers a routed fused_experts call's first GEMM filled (the second GEMM, not
    routed, reads them)."""
    seen = []
    real = triton_moe._grouped_gemm

    def spy(*args, routed=None, **kw):
        seen.append(routed)
        return real(*args, routed=routed, **kw)
    monkeypatch.setattr(triton_moe, "_grouped_gemm", spy)
    triton_moe.fused_experts(x, w_up, w_down, None, None, gated, shared_up=s_up, shared_down=s_down, router=router)
    monkeypatch.setattr(triton_moe, "_grouped_gemm", real)
    assert len(seen) == 2 and seen[0] is not None and seen[1] is None
    return seen[0][1], seen[0][2]


def _small_layer(g, T: int, gated: bool, shared: int, kind: str, route_seed: int):
    """A small expert layer for the one-token kernels' tests (12 experts, top-3, K = 300 = 256 + 32 + 12 in three
    pieces, 40 wide): x [T, 300], the weights, an add, a routing with the shared slices' columns (weight 1), and
    the shared expert's slices as fused_experts' keywords."""
    n_exp, top_k, Hd, inter = 12, 3, 300, 40
    x = torch.randn(T, Hd, generator=g)
    w_up = torch.randn(n_exp, (2 if gated else 1) * inter, Hd, generator=g) * Hd ** -0.5
    w_down = torch.randn(n_exp, Hd, inter, generator=g) * inter ** -0.5
    s_up = torch.randn((2 if gated else 1) * shared * inter, Hd, generator=g) * Hd ** -0.5 if shared else None
    s_down = torch.randn(Hd, shared * inter, generator=g) * inter ** -0.5 if shared else None
    add = torch.randn(T, Hd, generator=g)
    idx, w = routing(kind, T, n_exp, top_k, seed=route_seed)
    if shared:
        idx = torch.cat([idx, torch.arange(n_exp, n_exp + shared).expand(T, shared)], 1)
        w = torch.cat([w, torch.ones(T, shared)], 1)
    return x, w_up, w_down, add, idx, w, dict(shared_up=s_up, shared_down=s_down)


@pytest.mark.parametrize("kind", ["random", "one_expert"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("shared", [0, 2])
def test_one_token_preloading_experts(monkeypatch, kind, gated, shared):
    """By default a one-token step's two GEMMs run on the one-token kernel (whole expert slabs at once, K in three
    pieces: 300 = 256 + 32 + 16 of 12) and give the tiled kernels' output (HYBRID_MOE_PRELOAD=0) up to summation
    order, with and without the shared expert's slices and the add; a two-token step keeps the tiled kernels
    (and so does an explicit config)."""
    from hybrid.ops import triton_guard

    g = torch.Generator().manual_seed(shared * 10 + gated)
    x, w_up, w_down, add, idx, w, kw = _small_layer(g, 2, gated, shared, kind, shared + 3)
    monkeypatch.setenv("HYBRID_MOE_PRELOAD", "0")
    triton_guard.reset_switches()
    try:
        want = [triton_moe.fused_experts(x[:t], w_up, w_down, idx[:t], w[:t], gated, add[:t], **kw) for t in (1, 2)]
    finally:
        monkeypatch.delenv("HYBRID_MOE_PRELOAD")
        triton_guard.reset_switches()
    calls = []
    real = triton_moe._one_token_gemm
    monkeypatch.setattr(triton_moe, "_one_token_gemm", lambda *a, **k: calls.append(k["early"]) or real(*a, **k))
    try:
        got = triton_moe.fused_experts(x[:1], w_up, w_down, idx[:1], w[:1], gated, add[:1], **kw)
        assert calls == [False, True]
        two = triton_moe.fused_experts(x, w_up, w_down, idx, w, gated, add, **kw)
        triton_moe.fused_experts(x[:1], w_up, w_down, idx[:1], w[:1], gated, add[:1], config=(16, 16, 16, 2, 1, 1),
                                 **kw)
        assert calls == [False, True]
    finally:
        monkeypatch.undo()
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(two, want[1])
    # the shared expert's programs first, their slabs before the wait ("moe_shared_early", the default): the same
    # sums as with every program in pair order
    monkeypatch.setenv("HYBRID_MOE_SHARED_EARLY", "0")
    triton_guard.reset_switches()
    try:
        in_order = triton_moe.fused_experts(x[:1], w_up, w_down, idx[:1], w[:1], gated, add[:1], **kw)
    finally:
        monkeypatch.delenv("HYBRID_MOE_SHARED_EARLY")
        triton_guard.reset_switches()
    assert torch.equal(got, in_order)
