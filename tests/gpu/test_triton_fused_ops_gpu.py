"""The fused Triton ops on the GPU (compiled), at Nemotron-H-8B dims, against the torch layers; and an
engine run with them (the CUDA default) against one with LLM(fused_ops=False)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from hybrid.layers import RMSNorm
from hybrid.ops import triton_act as ta
from hybrid.ops import triton_norm as tn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_util import GREEDY, assert_greedy_under_reference  # noqa: E402

DEV = "cuda"


@pytest.mark.parametrize("weight_in_fp32", [True, False])
def test_rms_norm_8b_dims(weight_in_fp32):
    g = torch.Generator(device=DEV).manual_seed(0)
    norm = RMSNorm(4096, 1e-5, weight_in_fp32)
    norm.weight = torch.nn.Parameter((0.5 + torch.rand(4096, generator=g, device=DEV)).bfloat16(), requires_grad=False)
    x = torch.randn(64, 4096, generator=g, device=DEV).bfloat16()
    ref, got = norm(x), tn.rms_norm(x, norm.weight, 1e-5, weight_in_fp32)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("scale", [1.0, 0.22])
def test_add_rms_norm_8b_dims(scale):
    g = torch.Generator(device=DEV).manual_seed(2)
    norm = RMSNorm(4096, 1e-5, True)
    norm.weight = torch.nn.Parameter((0.5 + torch.rand(4096, generator=g, device=DEV)).bfloat16(), requires_grad=False)
    x = torch.randn(64, 4096, generator=g, device=DEV).bfloat16()
    res = torch.randn(64, 4096, generator=g, device=DEV).bfloat16()
    ref, ref_res = norm.add_norm(x, res.clone(), scale)
    got = tn.add_rms_norm(x, res, norm.weight, 1e-5, True, scale)
    assert torch.equal(res, ref_res)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=1.6e-2)


def test_activations_8b_dims():
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(64, 21504, generator=g, device=DEV).bfloat16()
    assert torch.equal(ta.relu2(x), torch.square(torch.relu(x)))
    gate_up = torch.randn(64, 2 * 4096, generator=g, device=DEV).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ta.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=2e-2,
                               rtol=1.6e-2)


def test_gated_norm_8b_dims():
    g = torch.Generator(device=DEV).manual_seed(1)
    inner, groups = 8192, 8
    y = torch.randn(64, inner, generator=g, device=DEV).bfloat16()
    z = torch.randn(64, 2 * inner, generator=g, device=DEV).bfloat16()[:, :inner]
    w = (0.5 + torch.rand(inner, generator=g, device=DEV)).bfloat16()
    h = y.float() * torch.nn.functional.silu(z.float())
    h = h.view(64, groups, -1)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = w * h.view(64, -1).to(w.dtype)
    got = tn.gated_rms_norm(y, z, w, 1e-5, groups)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=1.6e-2)


def test_engine_with_fused_ops(tiny_ckpt):
    from hybrid import LLM, SamplingParams

    path = tiny_ckpt("granite_dense")
    sp = SamplingParams(max_tokens=16, **GREEDY)
    prompts = [[5, 6, 7, 8, 9], [11], list(range(20, 50))]
    kw = dict(device="cuda", max_num_seqs=4, max_model_len=128, gpu_memory_utilization=0.3)
    llm = LLM(path, **kw)  # fused ops are the CUDA default
    assert llm.model.layers[0].input_norm.fused and llm.model.layers[0].mlp.fused
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert llm.runner.stats["graph_replays"] > 0
    # every token is the torch-op engine's greedy choice given the same prefix (or a bf16 near-tie)
    assert_greedy_under_reference(LLM(path, fused_ops=False, **kw), prompts, got)


@pytest.mark.parametrize("m,preload", [(1, False), (3, False), (16, False), (1, True), (2, True), (4, True)])
@pytest.mark.parametrize("n,k", [(6448, 1536), (1536, 3072), (2688, 4096), (10304, 2688), (4096, 8192),
                                 (4096, 21504)])  # the MoE hybrids' projections, the 8B's out_proj and down_proj
def test_small_m_linear_real_shapes(m, preload, n, k, monkeypatch):
    """The decode-sized Triton linear, tiled (prefetched first slab, PDL) and preloading (whole slab before the
    PDL wait, rows on CUDA cores, a step's rows read together; one row by default, up to 4 with
    HYBRID_GEMV_PRELOAD_ROWS), against cuBLAS in bf16, rows independent (the tiled kernel's row alone gives its
    bits; the preloading one's other rows change no row's bits), and a chain of two (the second reads the
    first's output) replayed from a CUDA graph equal to eager, bit for bit: the weight read before the wait must
    not let an input be read early."""
    from hybrid.ops import triton_gemv
    from hybrid.ops.triton_gemv import small_m_linear

    monkeypatch.setattr(triton_gemv, "PRELOAD_MAX_ROWS", 4)
    g = torch.Generator(device=DEV).manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g, device=DEV).bfloat16()
    w1 = (torch.randn(n, k, generator=g, device=DEV) * k ** -0.5).bfloat16()
    w2 = (torch.randn(k, n, generator=g, device=DEV) * n ** -0.5).bfloat16()
    y = small_m_linear(x, w1, preload=preload)
    ref = torch.nn.functional.linear(x, w1)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    if not preload:  # the tiled kernel: a row alone gives its bits
        for i in range(m):
            assert torch.equal(small_m_linear(x[i:i + 1], w1, preload=preload), y[i:i + 1])
    elif m > 1:  # the preloading one reads a step's rows together: other rows' values change no row's bits
        other = x.clone()
        other[1:] = torch.randn(m - 1, k, generator=g, device=DEV).bfloat16()
        assert torch.equal(small_m_linear(other, w1, preload=True)[0], y[0])
    eager = small_m_linear(small_m_linear(x, w1, preload=preload), w2, preload=preload)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_m_linear(small_m_linear(x, w1, preload=preload), w2, preload=preload)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("m,preload", [(1, False), (3, False), (16, False), (1, True), (4, True)])
@pytest.mark.parametrize("hidden,inner,conv_dim,nh,conv_dtype", [
    (1536, 3072, 3328, 48, torch.bfloat16),  # Granite-4.0-H-Tiny's Mamba in_proj
    (2688, 4096, 6144, 64, torch.bfloat16),  # Nemotron-3-Nano's
    (2688, 4096, 6144, 64, torch.float32),  # (a conv state in fp32)
    (4096, 8192, 10240, 128, torch.bfloat16)])  # the 8B's
def test_in_proj_conv_real_dims(m, preload, hidden, inner, conv_dim, nh, conv_dtype, monkeypatch):
    """in_proj and the decode conv in one launch (triton_gemv.in_proj_conv), tiled and preloading (slab,
    histories and conv weights before the PDL wait), against small_m_linear then triton_mamba.conv_state_update
    in bf16: z and dt columns bit for bit, the conv columns within fp32 summation order, the slots' histories bit
    for bit, a padding row storing nothing; a CUDA-graph replay after a kernel that writes x equal to eager (x
    must be read after the wait)."""
    from hybrid.ops import triton_gemv
    from hybrid.ops import triton_mamba as tm
    from hybrid.ops.triton_gemv import in_proj_conv, small_m_linear

    monkeypatch.setattr(triton_gemv, "PRELOAD_MAX_ROWS", 4)
    g = torch.Generator(device=DEV).manual_seed(m + hidden)
    n = inner + conv_dim + nh
    x0 = torch.randn(m, hidden, generator=g, device=DEV).bfloat16()
    w_x = (torch.randn(hidden, hidden, generator=g, device=DEV) * hidden ** -0.5).bfloat16()
    w = (torch.randn(n, hidden, generator=g, device=DEV) * hidden ** -0.5).bfloat16()
    cw = (torch.randn(conv_dim, 4, generator=g, device=DEV) * 0.5).bfloat16()
    cb = torch.randn(conv_dim, generator=g, device=DEV).bfloat16()
    state = torch.randn(m + 2, conv_dim, 3, generator=g, device=DEV).to(conv_dtype)
    slots = torch.randperm(m + 1, generator=g, device=DEV)[:m].int()
    slots[m // 2] = -1  # a padding row
    x = small_m_linear(x0, w_x, preload=preload)
    ref_state = state.clone()
    ref = small_m_linear(x, w, preload=preload)
    ref_conv = tm.conv_state_update(ref[:, inner:inner + conv_dim], ref_state, cw, cb, slots)
    start_state = state.clone()
    got = in_proj_conv(x, w, None, state, cw, cb, slots, inner, preload=preload)
    assert torch.equal(got[:, :inner], ref[:, :inner]) and torch.equal(got[:, inner + conv_dim:], ref[:, inner + conv_dim:])
    torch.testing.assert_close(got[:, inner:inner + conv_dim].float(), ref_conv.float(), atol=2e-2, rtol=1.6e-2)
    assert torch.equal(state, ref_state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = in_proj_conv(small_m_linear(x0, w_x, preload=preload), w, None, state, cw, cb, slots, inner,
                           preload=preload)
    state.copy_(start_state)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got) and torch.equal(state, ref_state)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("inner,n_groups,hidden", [(3072, 1, 1536), (4096, 8, 2688), (8192, 8, 4096)])
def test_gated_norm_linear_real_dims(m, inner, n_groups, hidden):
    """The Mamba2 gated norm and out_proj in one launch (Granite-4.0-H-Tiny, Nemotron-3-Nano, the
    8B's dims) against the two launches in bf16; replayed from a CUDA graph equal to eager."""
    from hybrid.ops import triton_norm
    from hybrid.ops.triton_gemv import gated_norm_linear

    g = torch.Generator(device=DEV).manual_seed(m + inner)
    y = torch.randn(m, inner, generator=g, device=DEV).bfloat16()
    z = torch.randn(m, 2 * inner, generator=g, device=DEV).bfloat16()[:, :inner]
    nw = (0.5 + torch.rand(inner, generator=g, device=DEV)).bfloat16()
    w = (torch.randn(hidden, inner, generator=g, device=DEV) * inner ** -0.5).bfloat16()
    got = gated_norm_linear(y, z, nw, 1e-5, n_groups, w)
    ref = torch.nn.functional.linear(triton_norm.gated_rms_norm(y, z, nw, 1e-5, n_groups), w)
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_norm_linear(y, z, nw, 1e-5, n_groups, w)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("heads,head_dim,n_groups,state,hidden", [(48, 64, 1, 128, 1536), (64, 64, 8, 128, 2688),
                                                                  (128, 64, 8, 128, 4096)])
def test_gated_out_proj_real_dims(m, heads, head_dim, n_groups, state, hidden):
    """The SSM update with the gated norm's sums of squares (y bit for bit the plain update's) and out_proj
    normalising with them (Granite-4.0-H-Tiny, Nemotron-3-Nano, the 8B's dims) against the gated norm and
    out_proj as two launches, in bf16; a CUDA-graph replay of both equal to eager."""
    from hybrid.ops import triton_mamba as tm
    from hybrid.ops import triton_norm
    from hybrid.ops.triton_gemv import gated_out_proj

    g = torch.Generator(device=DEV).manual_seed(m + heads)
    inner = heads * head_dim
    st = torch.randn(m + 1, heads, head_dim, state, generator=g, device=DEV) * 0.3
    x = torch.randn(m, heads, head_dim, generator=g, device=DEV).bfloat16()
    dt = torch.randn(m, heads, generator=g, device=DEV).bfloat16()
    A, D = -torch.rand(heads, generator=g, device=DEV) - 0.5, torch.randn(heads, generator=g, device=DEV)
    dtb = torch.randn(heads, generator=g, device=DEV) * 0.1
    B = torch.randn(m, n_groups, state, generator=g, device=DEV).bfloat16()
    C = torch.randn(m, n_groups, state, generator=g, device=DEV).bfloat16()
    z = torch.randn(m, 2 * inner, generator=g, device=DEV).bfloat16()[:, :inner]
    nw = (0.5 + torch.rand(inner, generator=g, device=DEV)).bfloat16()
    w = (torch.randn(hidden, inner, generator=g, device=DEV) * inner ** -0.5).bfloat16()
    slots = torch.arange(m, device=DEV, dtype=torch.int32)
    ref_st = st.clone()
    y_ref = tm.selective_state_update(ref_st, x, dt, A, B, C, D, dtb, slots)
    ref = torch.nn.functional.linear(triton_norm.gated_rms_norm(y_ref.reshape(m, inner), z, nw, 1e-5, n_groups), w)
    start = st.clone()
    y, sq = tm.selective_state_update_gated(st, x, dt, A, B, C, D, dtb, slots, z.reshape(m, heads, head_dim))
    assert torch.equal(y, y_ref) and torch.equal(st, ref_st)
    got = gated_out_proj(y.reshape(m, inner), z, nw, 1e-5, n_groups, sq, w)
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    st.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y2, sq2 = tm.selective_state_update_gated(st, x, dt, A, B, C, D, dtb, slots, z.reshape(m, heads, head_dim))
        out = gated_out_proj(y2.reshape(m, inner), z, nw, 1e-5, n_groups, sq2, w)
    st.copy_(start)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got) and torch.equal(st, ref_st)


SWITCH_SETS = {"decode_linear": {"HYBRID_DECODE_LINEAR": "triton"}, "norm_router": {"HYBRID_NORM_ROUTER": "1"},
               "both": {"HYBRID_DECODE_LINEAR": "triton", "HYBRID_NORM_ROUTER": "1"},
               "in_proj_conv": {"HYBRID_DECODE_IN_PROJ_CONV": "1"},
               "gated_out_proj": {"HYBRID_DECODE_GATED_OUT_PROJ": "1"},
               "decode_fusions": {"HYBRID_DECODE_IN_PROJ_CONV": "1", "HYBRID_DECODE_GATED_OUT_PROJ": "1"},
               "mamba_unfused": {"HYBRID_DECODE_IN_PROJ_CONV": "0", "HYBRID_DECODE_LINEAR": "cublas"},
               "route_in_gemm": {"HYBRID_MOE_ROUTE_IN_GEMM": "1"},
               "moe_three_launches": {"HYBRID_NORM_ROUTER": "1", "HYBRID_MOE_ROUTE_IN_GEMM": "1"},
               "gemv_preload_sites": {"HYBRID_GEMV_PRELOAD": "1"}, "gemv_preload_off": {"HYBRID_GEMV_PRELOAD": "0"},
               "moe_preload_off": {"HYBRID_MOE_PRELOAD": "0"}, "lm_head_preload_off": {"HYBRID_LM_HEAD_PRELOAD": "0"},
               "moe_shared_early_off": {"HYBRID_MOE_SHARED_EARLY": "0"}}


@pytest.mark.parametrize("switches", list(SWITCH_SETS))
@pytest.mark.parametrize("name", ["granite_moe", "nemotron_h"])
def test_engine_with_the_kernel_switches(tiny_ckpt, monkeypatch, tmp_path, switches, name):
    """HYBRID_DECODE_LINEAR=triton (decode projections on the Triton linear, the gated norm in
    out_proj), HYBRID_NORM_ROUTER=1 (the norm before each MoE layer in its router's launch),
    HYBRID_DECODE_IN_PROJ_CONV=1 (a decode step's Mamba in_proj and conv in one launch) and
    HYBRID_DECODE_GATED_OUT_PROJ=1 (the gated norm in the SSM update and out_proj), the Mamba decode as before
    its fusions were the default (HYBRID_DECODE_IN_PROJ_CONV=0 HYBRID_DECODE_LINEAR=cublas) and
    HYBRID_MOE_ROUTE_IN_GEMM=1 (a one-token step routed inside the first expert GEMM), alone and with
    HYBRID_NORM_ROUTER=1 (the router logits of the norm's launch routed in the GEMM), the preloading linears kept
    to the Triton linear's sites (HYBRID_GEMV_PRELOAD=1) and off (=0), a one-token step's expert GEMMs on
    the tiled kernels rather than the one-token preloading kernel (HYBRID_MOE_PRELOAD=0) or with its programs in pair
    order (HYBRID_MOE_SHARED_EARLY=0), its LM head on cuBLAS
    rather than the preloading linear (HYBRID_LM_HEAD_PRELOAD=0), under CUDA graphs,
    the prompts together and the first alone (batch-1 decode): every token the default engine's greedy
    choice given the same prefix (or a bf16 near-tie). NemotronH without group masking, so that its
    router is the Triton one."""
    import tiny_checkpoints

    from hybrid import LLM, SamplingParams
    from hybrid.layers import Linear
    from hybrid.ops import triton_guard

    path = tiny_ckpt(name)
    if name == "nemotron_h":
        path = tiny_checkpoints.copy_checkpoint(path, tmp_path)
        tiny_checkpoints.rewrite_config(path, lambda cfg: cfg.update(topk_group=cfg["n_group"]))
    sp = SamplingParams(max_tokens=16, **GREEDY)
    prompts = [[5, 6, 7, 8, 9], [11], list(range(20, 50))]
    kw = dict(device="cuda", max_num_seqs=4, max_model_len=128, gpu_memory_utilization=0.3)
    reference = LLM(str(path), **kw)
    for env, value in SWITCH_SETS[switches].items():
        monkeypatch.setenv(env, value)
    triton_guard.reset_switches()
    try:
        llm = LLM(str(path), **kw)
        assert all(m.fused for m in llm.model.modules() if isinstance(m, Linear))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], sp, use_tqdm=False)]
        assert llm.runner.stats["graph_replays"] > 0
    finally:
        for env in SWITCH_SETS[switches]:
            monkeypatch.delenv(env)
        triton_guard.reset_switches()
    assert_greedy_under_reference(reference, prompts, got)
    assert_greedy_under_reference(reference, prompts[:1], alone)


@pytest.mark.parametrize("T", [1, 8, 16])
@pytest.mark.parametrize("H,E,top_k,router_dtype", [(2688, 128, 6, torch.float32), (1536, 64, 6, torch.bfloat16)])
def test_add_rms_norm_route_real_dims(T, H, E, top_k, router_dtype):
    """The norm before an MoE layer inside its router's launch (Nemotron-3-Nano: fp32 router, sigmoid;
    Granite-4.0-H-Tiny: bf16, softmax, the residual multiplier) against add_rms_norm then route_hidden:
    the normed rows and the new residual bit for bit; the fp32 router's choices exactly, the bf16
    one's where the two agree (their partial sums add in another order), weights within a rounding."""
    from hybrid.ops import triton_moe_route

    g = torch.Generator(device=DEV).manual_seed(T + H)
    x = torch.randn(T, H, generator=g, device=DEV).bfloat16()
    residual = (torch.randn(T, H, generator=g, device=DEV) * 3).bfloat16()
    weight = (0.5 + torch.rand(H, generator=g, device=DEV)).bfloat16()
    router = (torch.randn(E, H, generator=g, device=DEV) * H ** -0.5).to(router_dtype)
    sigmoid = router_dtype == torch.float32
    w_fp32, scale = (True, 1.0) if sigmoid else (False, 0.22)
    kw = dict(bias=torch.randn(E, generator=g, device=DEV) * 0.1, normalize=True) if sigmoid else {}
    res_ref = residual.clone()
    want = tn.add_rms_norm(x, res_ref, weight, 1e-5, w_fp32, scale)
    want_idx, want_w = triton_moe_route.route_hidden(want, router, top_k, logits_dtype=router_dtype, sigmoid=sigmoid,
                                                     num_shared=2, scale=2.5, **kw)
    normed, new_res, idx, w = tn.add_rms_norm_route(x, residual, weight, 1e-5, w_fp32, scale, router, top_k,
                                                    logits_dtype=router_dtype, sigmoid=sigmoid, num_shared=2,
                                                    route_scale=2.5, **kw)
    assert torch.equal(normed, want) and torch.equal(new_res, res_ref)
    same = (idx == want_idx).all(-1)
    assert bool(same.all()) if sigmoid else same.float().mean().item() >= 0.75
    torch.testing.assert_close(w[same], want_w[same], rtol=1e-5, atol=1e-2 if not sigmoid else 1e-6)
