"""The Triton norm kernels (hybrid/ops/triton_norm.py) against the torch layers they replace, on CPU
through Triton's interpreter: RMSNorm in both weight conventions and the Mamba gated norm, fp32 and
bf16, and a whole model forward with them switched on."""
from __future__ import annotations

import pytest
import torch

from hybrid.layers import RMSNorm, use_triton_norms

tn = pytest.importorskip("hybrid.ops.triton_norm")
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


def test_model_forward_with_triton_norms(tiny_ckpt, make_llm):
    from hybrid import SamplingParams

    path = tiny_ckpt("granite_dense")
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[5, 6, 7, 8, 9], [11]]
    ref = make_llm(path).generate(prompts, sp, use_tqdm=False)
    llm = make_llm(path)
    assert use_triton_norms(llm.model) == 2 * len(llm.config.layer_types) + 1 + len(llm.config.mamba_layers)
    got = llm.generate(prompts, sp, use_tqdm=False)
    for r, o in zip(ref, got):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(r.outputs[0].logprobs, o.outputs[0].logprobs):
            t = next(iter(a))
            assert abs(a[t] - b[t]) < 1e-4
