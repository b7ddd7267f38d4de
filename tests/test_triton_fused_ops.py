"""The fused Triton ops (hybrid/ops/triton_norm.py, triton_act.py) against the torch layers they
replace, on CPU through Triton's interpreter: RMSNorm in both weight conventions, with and without
the residual add (and its multiplier), the Mamba gated norm, relu2 and SwiGLU, fp32 and bf16, and
whole model forwards with them switched on (LLM(fused_ops=True), the MoE models' fused experts
included) against the torch chains."""
from __future__ import annotations

import pytest
import torch

from hybrid.layers import RMSNorm
from hybrid.model import use_fused_ops

tn = pytest.importorskip("hybrid.ops.triton_norm")
ta = pytest.importorskip("hybrid.ops.triton_act")
if not tn.is_available():
    pytest.skip("triton is not installed", allow_module_level=True)


def _tol(dtype):
    # bf16: one bf16 step (2**-7 relative) apart at most; CPU's interpreter also rounds fp32 -> bf16
    # its own way
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_in_fp32", [True, False])
@pytest.mark.parametrize("hidden", [64, 96])  # 96: not a power of two (masked lanes)
def test_rms_norm(dtype, weight_in_fp32, hidden):
    g = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-5, weight_in_fp32)
    norm.weight = torch.nn.Parameter((0.5 + torch.rand(hidden, generator=g)).to(dtype), requires_grad=False)
    x = (torch.randn(5, hidden, generator=g) * 3).to(dtype)
    ref = norm(x)
    got = tn.rms_norm(x, norm.weight, norm.eps, weight_in_fp32)
    assert got.dtype == ref.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_in_fp32", [True, False])
@pytest.mark.parametrize("scale", [1.0, 0.22])
def test_add_rms_norm(dtype, weight_in_fp32, scale):
    hidden = 96
    g = torch.Generator().manual_seed(7)
    norm = RMSNorm(hidden, 1e-5, weight_in_fp32)
    norm.weight = torch.nn.Parameter((0.5 + torch.rand(hidden, generator=g)).to(dtype), requires_grad=False)
    x = (torch.randn(5, hidden, generator=g) * 3).to(dtype)
    residual = (torch.randn(5, hidden, generator=g) * 3).to(dtype)
    ref_out, ref_res = norm.add_norm(x, residual.clone(), scale)
    updated = residual.clone()
    got = tn.add_rms_norm(x, updated, norm.weight, norm.eps, weight_in_fp32, scale)
    assert got.dtype == ref_out.dtype == dtype
    # the residual stream is rounded as torch rounds `residual + x * scale` (bit-exact on the GPU,
    # tests/gpu; the interpreter's fp32 -> bf16 cast may land one bf16 step away)
    torch.testing.assert_close(updated, ref_res, **(_tol(dtype) if dtype == torch.bfloat16 else dict(atol=0, rtol=0)))
    torch.testing.assert_close(got.float(), ref_out.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 1500])  # 1500: two blocks, the second masked
def test_activations(dtype, width):
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(3, width, generator=g) * 4).to(dtype)
    torch.testing.assert_close(ta.relu2(x), torch.square(torch.relu(x)), **_tol(dtype))
    gate_up = (torch.randn(3, 2 * width, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ta.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_matches_the_mixer(tiny_ckpt, make_llm, dtype):
    llm = make_llm(tiny_ckpt("nemotron_h"))
    mixer = llm.model.mamba_mixers()[0]
    inner = mixer.cfg.intermediate_size
    g = torch.Generator().manual_seed(1)
    y = torch.randn(6, inner, generator=g)
    z = torch.randn(6, 3 * inner, generator=g)[:, inner:2 * inner].to(dtype)  # a strided view, as after the split
    mixer.norm_weight = torch.nn.Parameter(mixer.norm_weight.to(dtype), requires_grad=False)
    ref = mixer.gated_norm(y, z)
    got = tn.gated_rms_norm(y, z, mixer.norm_weight, mixer.cfg.norm_eps, mixer.cfg.n_groups)
    assert got.dtype == ref.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), **_tol(dtype))


MOE = {"nemotron_h", "granite_moe", "nemotron_h_latent"}


@pytest.mark.parametrize("name", ["granite_dense", "nemotron_h", "granite_moe", "bamba", "falcon_h1", "falcon_h1_norm",
                                  "zamba2", "zamba2_rope", "nemotron_h_latent"])
def test_model_forward_with_fused_ops(tiny_ckpt, make_llm, name):
    from hybrid import SamplingParams
    from hybrid.layers import DenseMLP, GatedMLP, Linear, Mamba2Mixer
    from hybrid.moe import Experts

    path = tiny_ckpt(name)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[5, 6, 7, 8, 9], [11]]
    ref = make_llm(path).generate(prompts, sp, use_tqdm=False)
    llm = make_llm(path, fused_ops=True)
    mods = list(llm.model.modules())
    norms = sum(isinstance(m, RMSNorm) for m in mods)
    mixers = sum(isinstance(m, Mamba2Mixer) for m in mods)
    mlps = sum(isinstance(m, (DenseMLP, GatedMLP)) and m.can_fuse for m in mods)  # (Zamba2's gelu MLPs: torch)
    experts = sum(isinstance(m, Experts) for m in mods)
    linears = sum(isinstance(m, Linear) for m in mods)
    assert norms and mixers and linears and (mlps > 0) == (not name.startswith("zamba2")) and (experts > 0) == (name in MOE)
    assert all(m.fused for m in mods if isinstance(m, (RMSNorm, Mamba2Mixer, Linear))
               or (isinstance(m, (DenseMLP, GatedMLP, Experts)) and m.can_fuse))
    assert use_fused_ops(llm.model) == norms + mixers + mlps + experts + linears
    # the experts hand their rows unsummed to the next norm, which sums them in its own launch; LatentMoE's
    # sum goes to its projection back up instead
    assert all(m.defer_sum == (name != "nemotron_h_latent") for m in mods if isinstance(m, Experts))
    got = llm.generate(prompts, sp, use_tqdm=False)
    for r, o in zip(ref, got):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(r.outputs[0].logprobs, o.outputs[0].logprobs):
            t = next(iter(a))
            assert abs(a[t] - b[t]) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_add", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.22])
def test_sum_add_rms_norm_equals_the_two_launches(dtype, has_add, scale):
    """An MoE layer's ExpertRows folded into the next norm: the same values, bit for bit, as the sum
    over k (triton_moe) followed by add_rms_norm, for the normed rows and the updated residual."""
    tm = pytest.importorskip("hybrid.ops.triton_moe")
    T, K, H = 3, 4, 96
    g = torch.Generator().manual_seed(11)
    rows = tm.ExpertRows((torch.randn(T * K, H, generator=g)).to(dtype),
                         (torch.randn(T, H, generator=g)).to(dtype) if has_add else None, K)
    weight = (0.5 + torch.rand(H, generator=g)).to(dtype)
    residual = (torch.randn(T, H, generator=g) * 3).to(dtype)
    res_ref = residual.clone()
    want = tn.add_rms_norm(rows.sum(), res_ref, weight, 1e-5, True, scale)
    res_got = residual.clone()
    got = tn.sum_add_rms_norm(rows, res_got, weight, 1e-5, True, scale)
    assert torch.equal(got, want) and torch.equal(res_got, res_ref)
    # and RMSNorm.add_norm takes ExpertRows on both paths
    norm = RMSNorm(H, 1e-5, weight_in_fp32=True)
    norm.weight = torch.nn.Parameter(weight, requires_grad=False)
    plain_out, plain_res = norm.add_norm(rows, residual.clone(), scale)
    norm.fused = True
    fused_res = residual.clone()
    fused_out, _ = norm.add_norm(rows, fused_res, scale)
    torch.testing.assert_close(fused_out.float(), plain_out.float(), **_tol(dtype))
    torch.testing.assert_close(fused_res.float(), plain_res.float(), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_in_fp32,scale,sigmoid", [(True, 1.0, True), (False, 0.22, False)])
@pytest.mark.parametrize("T", [1, 5, 16])
def test_add_rms_norm_route_equals_the_two_launches(dtype, weight_in_fp32, scale, sigmoid, T):
    """The residual add and norm inside the router's launch (NemotronH: weight in fp32, sigmoid
    routing with a bias; Granite: the residual multiplier, softmax routing): the normed rows, the new
    residual and the routing are those of add_rms_norm then route_hidden, bit for bit; the residual
    passed in is left as it was."""
    tm = pytest.importorskip("hybrid.ops.triton_moe_route")
    H, E, top_k = 200, 20, 3  # H: several router K splits, the last partial
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(dtype)
    residual = (torch.randn(T, H, generator=g) * 3).to(dtype)
    weight = (0.5 + torch.rand(H, generator=g)).to(dtype)
    logits_dtype = torch.float32 if sigmoid else dtype
    router = (torch.randn(E, H, generator=g) * H ** -0.5).to(logits_dtype)
    kw = dict(bias=torch.randn(E, generator=g) * 0.1, normalize=True) if sigmoid else {}
    res_ref = residual.clone()
    want = tn.add_rms_norm(x, res_ref, weight, 1e-5, weight_in_fp32, scale)
    want_idx, want_w = tm.route_hidden(want, router, top_k, logits_dtype=logits_dtype, sigmoid=sigmoid,
                                       num_shared=2, scale=1.5, **kw)
    before = residual.clone()
    normed, new_res, idx, w = tn.add_rms_norm_route(x, residual, weight, 1e-5, weight_in_fp32, scale, router, top_k,
                                                    logits_dtype=logits_dtype, sigmoid=sigmoid, num_shared=2,
                                                    route_scale=1.5, **kw)
    assert torch.equal(normed, want) and torch.equal(new_res, res_ref) and torch.equal(residual, before)
    assert torch.equal(idx, want_idx) and torch.equal(w, want_w)


def _moe_case(tiny_ckpt, name: str, tmp_path):
    """(checkpoint, sampling params, prompts) of the engine-level MoE switch tests: the tiny checkpoint (NemotronH
    without group masking, which the Triton router does not do), greedy with logprobs, three prompts of which the
    second alone makes one-token steps."""
    import tiny_checkpoints

    from hybrid import SamplingParams

    path = tiny_ckpt(name)
    if name == "nemotron_h":
        path = tiny_checkpoints.copy_checkpoint(path, tmp_path)
        tiny_checkpoints.rewrite_config(path, lambda cfg: cfg.update(topk_group=cfg["n_group"]))
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    return path, sp, [[5, 6, 7, 8, 9], [11], list(range(20, 45))]


@pytest.mark.parametrize("name", ["nemotron_h", "granite_moe", "nemotron_h_latent"])
@pytest.mark.parametrize("route_in_gemm", [False, True])
def test_moe_models_with_the_norm_in_the_router(tiny_ckpt, make_llm, name, route_in_gemm, monkeypatch, tmp_path):
    """HYBRID_NORM_ROUTER=1: the norm before each MoE layer runs in its router's launch for steps
    of few tokens; the engine gives the same tokens and logprobs as with the separate launches. With
    HYBRID_MOE_ROUTE_IN_GEMM=1 too, a one-token step's router logits from that launch are routed inside
    the first expert GEMM (an MoE layer in three launches). (NemotronH without group masking, which
    the Triton router does not do.)"""
    from hybrid.ops import triton_guard, triton_moe

    path, sp, prompts = _moe_case(tiny_ckpt, name, tmp_path)
    # (the expert GEMMs tiled throughout: routed inside the first, a one-token step leaves the one-token kernel)
    monkeypatch.setenv("HYBRID_MOE_PRELOAD", "0")
    triton_guard.reset_switches()
    ref = make_llm(path, fused_ops=True).generate(prompts, sp, use_tqdm=False)
    ref_alone = make_llm(path, fused_ops=True).generate(prompts[1:2], sp, use_tqdm=False)
    switches = {"HYBRID_NORM_ROUTER": "1", **({"HYBRID_MOE_ROUTE_IN_GEMM": "1"} if route_in_gemm else {})}
    for var, value in switches.items():
        monkeypatch.setenv(var, value)
    triton_guard.reset_switches()
    try:
        calls, routed_in_gemm = [], []
        real = tn.add_rms_norm_router
        monkeypatch.setattr(tn, "add_rms_norm_router", lambda *a, **k: calls.append(1) or real(*a, **k))
        real_gemm = triton_moe._grouped_gemm
        monkeypatch.setattr(triton_moe, "_grouped_gemm",
                            lambda *a, **k: routed_in_gemm.append(k.get("routed") is not None) or real_gemm(*a, **k))
        # one request alone (one-token steps), then the three together
        alone = make_llm(path, fused_ops=True).generate(prompts[1:2], sp, use_tqdm=False)
        got = make_llm(path, fused_ops=True).generate(prompts, sp, use_tqdm=False)
    finally:
        for var in switches:
            monkeypatch.delenv(var)
        triton_guard.reset_switches()
    assert calls, "the fused norm + router never ran"
    assert any(routed_in_gemm) == route_in_gemm, "the routing inside the first GEMM ran where it should not, or never"
    for r, o in zip([*ref, *ref_alone], [*got, *alone]):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        assert o.outputs[0].logprobs == r.outputs[0].logprobs
