"""The LM head returns fp32 logits computed from the fp32 accumulator, in every model dtype: rounding
16-bit logits costs up to half a bf16 step of the logit (0.125 nats at logits of 16-32), which alone
flips greedy near-ties and quantizes every reported log-probability (measured on CPU in bf16 at 8K
contexts: teacher-forced flips of 0.125 and 0.25 nats with bf16 logits, under 0.1 with fp32 ones)."""
from __future__ import annotations

import pytest
import torch

from hybrid import SamplingParams
from hybrid.layers import logits_fp32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_fp32_is_the_widened_product_not_a_rounded_one(dtype):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(5, 64, generator=g) * 3).to(dtype)
    w = torch.randn(300, 64, generator=g).to(dtype)
    out = logits_fp32(h, w)
    exact = h.double() @ w.double().t()
    assert out.dtype == torch.float32
    assert (out.double() - exact).abs().max().item() < 1e-4
    rounded = torch.nn.functional.linear(h, w).float()  # what a 16-bit LM head gives
    assert (rounded.double() - exact).abs().max().item() > 1e-3  # the test can tell the two apart


def test_cpu_widens_the_weight_a_slab_at_a_time(monkeypatch):
    """A head larger than one slab: the same logits as widening it whole."""
    import hybrid.layers as layers

    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(3, 32, generator=g).bfloat16(), torch.randn(1000, 32, generator=g).bfloat16()
    whole = logits_fp32(h, w)
    monkeypatch.setattr(layers, "_CPU_WIDEN_BYTES", 4 * 32 * 97)  # 97 rows a slab: the last one partial
    slabbed = logits_fp32(h, w)
    # the same up to fp32 summation order (CPU GEMM kernels block a 97-row and a 1000-row product
    # differently); a slab in the wrong columns or a row missed would be off by whole logits
    assert torch.allclose(slabbed, whole, rtol=1e-5, atol=1e-5)
    assert torch.allclose(slabbed.double(), h.double() @ w.double().t(), rtol=1e-5, atol=1e-5)


def test_fp32_model_unchanged():
    h, w = torch.randn(3, 16), torch.randn(40, 16)
    assert torch.equal(logits_fp32(h, w), torch.nn.functional.linear(h, w))


@pytest.mark.parametrize("name", ["bamba", "granite_moe", "zamba2", "nemotron_h"])
def test_bf16_model_logits_are_not_rounded(name, tiny_ckpt, make_llm):
    """The bf16 model's LM head (tied or not) gives the widened product, and the engine's
    log-probabilities are those of the fp32 logits of its forward."""
    llm = make_llm(tiny_ckpt(name), dtype="bfloat16")
    model = llm.model
    weight = model.embed if model.lm_head is None else model.lm_head.weight
    assert weight.dtype == torch.bfloat16
    h = (torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    exact = h.double() @ weight.double().t()
    got = model.lm_logits(h)
    assert got.dtype == torch.float32 and (got.double() - exact).abs().max().item() < 1e-4
    assert (torch.nn.functional.linear(h, weight).double() - exact).abs().max().item() > 1e-3
    out = llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                               logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 2 and all(out.token_ids[i] in out.logprobs[i] for i in range(2))


def test_the_16bit_switch_on_the_cpu(monkeypatch):
    """HYBRID_16BIT_LOGITS=1 gives the model dtype's rounded logits on the CPU too (as on CUDA)."""
    from hybrid.ops import triton_guard

    g = torch.Generator().manual_seed(5)
    h = (torch.randn(4, 64, generator=g) * 3).bfloat16()
    w = torch.randn(200, 64, generator=g).bfloat16()
    monkeypatch.setenv("HYBRID_16BIT_LOGITS", "1")
    triton_guard.reset_switches()
    try:
        out = logits_fp32(h, w)
    finally:
        monkeypatch.delenv("HYBRID_16BIT_LOGITS")
        triton_guard.reset_switches()
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.nn.functional.linear(h, w).float())
    assert not torch.equal(logits_fp32(h, w), out)  # the default: the unrounded product
