"""FP8 KV cache (kv_cache_dtype="fp8", issue 17 item 3) on CPU: the cache stores e4m3 K / k_scale and
V / v_scale; attention over it equals attention over the dequantized values; the checkpoint's
calibrated scales are loaded under the exporters' names; bad values and combinations are refused."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8_reference as R  # noqa: E402
from attention.kv_cache import PagedKVCache  # noqa: E402
from attention.reference import FP8_KV_DTYPE, TorchAttentionBackend, quantize_kv  # noqa: E402
from hybrid import LLM, SamplingParams  # noqa: E402
from hybrid.errors import CheckpointError, ConfigurationError  # noqa: E402
from hybrid.layers import Attention  # noqa: E402
from state_pool.step_batch import StepBatch  # noqa: E402

torch.set_num_threads(1)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _batch(q_lens, seq_lens, page_size, pages_per_row):
    """A StepBatch of len(q_lens) requests, request i on pages [1 + i * pages_per_row, ...)."""
    positions, locs = [], []
    table = torch.zeros(len(q_lens), pages_per_row, dtype=torch.int32)
    for i, (q, s) in enumerate(zip(q_lens, seq_lens)):
        pages = list(range(1 + i * pages_per_row, 1 + (i + 1) * pages_per_row))
        table[i] = torch.tensor(pages)
        for p in range(s - q, s):
            positions.append(p)
            locs.append(pages[p // page_size] * page_size + p % page_size)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    n = len(q_lens)
    return StepBatch(
        input_ids=torch.zeros(len(positions), dtype=torch.long), positions=torch.tensor(positions),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        page_table=table, kv_write_loc=torch.tensor(locs), state_slot=torch.arange(n),
        has_initial_state=torch.ones(n, dtype=torch.bool), logits_indices=torch.arange(len(positions)),
        num_decodes=0, num_prefills=n, query_lens_cpu=list(q_lens), seq_lens_cpu=list(seq_lens),
        state_slot_cpu=list(range(n)), has_initial_state_cpu=[True] * n)


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 0.2)])
def test_attention_over_an_fp8_cache_equals_attention_over_the_dequantized_kv(scales):
    """Two requests, prefilled in one step then one decode each: the reference backend over an e4m3
    cache equals causal softmax attention over fake-quantized K/V, computed independently."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, hd, ps = 4, 2, 16, 4
    lens = [7, 10]
    kv = PagedKVCache(1, 1 + 2 * 3, ps, kv_heads, hd, dtype=FP8_KV_DTYPE).layer(0)
    backend = TorchAttentionBackend()
    k_all = [torch.randn(n + 1, kv_heads, hd, generator=g) * 3 for n in lens]
    v_all = [torch.randn(n + 1, kv_heads, hd, generator=g) * 3 for n in lens]
    q_all = [torch.randn(n + 1, heads, hd, generator=g) for n in lens]
    # step 1: both prompts; step 2: one decode token each
    for step in (0, 1):
        q_lens = lens if step == 0 else [1, 1]
        seq = lens if step == 0 else [n + 1 for n in lens]
        sl = [slice(0, n) for n in lens] if step == 0 else [slice(n, n + 1) for n in lens]
        q = torch.cat([q_all[i][sl[i]] for i in range(2)])
        k = torch.cat([k_all[i][sl[i]] for i in range(2)])
        v = torch.cat([v_all[i][sl[i]] for i in range(2)])
        out = backend.forward(q, k, v, kv, _batch(q_lens, seq, ps, 3), 0.25, scales)
    assert kv.dtype == FP8_KV_DTYPE
    # the decode step's outputs, independently: SDPA over dequantized K/V (stored = x / scale in e4m3)
    for i, n in enumerate(lens):
        kd = quantize_kv(k_all[i], FP8_KV_DTYPE, scales[0]).float() * scales[0]
        vd = quantize_kv(v_all[i], FP8_KV_DTYPE, scales[1]).float() * scales[1]
        kd, vd = (t.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1) for t in (kd, vd))  # [h, n+1, d]
        qi = q_all[i][n:n + 1].transpose(0, 1)  # [heads, 1, hd]: the decode token sees all n + 1 keys
        want = F.scaled_dot_product_attention(qi, kd, vd, scale=0.25)[:, 0]
        got = out.view(2, heads, hd)[i]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and the stored bytes are K / k_scale rounded to e4m3 (saturating), not K
    stored = kv[1, 0, :, 0, :].float()
    torch.testing.assert_close(stored, (k_all[0][0] * (1.0 / scales[0])).clamp(-448, 448).to(FP8_KV_DTYPE).float())


def test_an_fp8_page_is_half_a_bf16_page():
    args = (4, 16, 8, 128)
    assert PagedKVCache.bytes_per_page(*args, FP8_KV_DTYPE) * 2 == PagedKVCache.bytes_per_page(*args, torch.bfloat16)


def _fake_quant_kv(monkeypatch, backend) -> None:
    """The fp32 cache stores what an FP8 cache would give back: K and V rounded through e4m3."""
    real = backend.forward

    def forward(q, k, v, kv_layer, batch, scale, kv_scales=(1.0, 1.0)):
        kq = quantize_kv(k, FP8_KV_DTYPE, kv_scales[0]).float() * kv_scales[0]
        vq = quantize_kv(v, FP8_KV_DTYPE, kv_scales[1]).float() * kv_scales[1]
        return real(q, kq.to(k.dtype), vq.to(v.dtype), kv_layer, batch, scale, kv_scales)

    monkeypatch.setattr(backend, "forward", forward)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [4, 9], list(range(20, 45))]


@pytest.mark.parametrize("family", ["nemotron_h", "granite_moe", "falcon_h1", "zamba2"])
def test_engine_with_an_fp8_cache_equals_rounding_kv_through_e4m3(tiny_ckpt, family, monkeypatch):
    """The whole engine over an e4m3 cache (pages e4m3, chunked prefill, decode) gives exactly what an
    fp32 cache gives when every K and V written is rounded through e4m3 first: tokens and logprobs."""
    path = tiny_ckpt(family)
    sp = SamplingParams(max_tokens=6, logprobs=2, prompt_logprobs=1, **GREEDY)
    kw = dict(device="cpu", max_num_seqs=4, page_size=4, max_num_batched_tokens=16)
    ref = LLM(path, **kw)
    _fake_quant_kv(monkeypatch, ref.runner.ctx.attention_backend)
    want = ref.generate(PROMPTS, sp, use_tqdm=False)
    llm = LLM(path, kv_cache_dtype="fp8", **kw)
    assert llm.kv_cache.kv.dtype == FP8_KV_DTYPE and llm.kv_dtype == FP8_KV_DTYPE
    got = llm.generate(PROMPTS, sp, use_tqdm=False)
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs and a.prompt_logprobs == b.prompt_logprobs


@pytest.mark.parametrize("family", ["nemotron_h", "granite_moe", "falcon_h1"])
def test_fp8_cache_stays_close_to_the_fp32_cache(tiny_ckpt, family):
    """What the rounding costs: the first greedy token of every prompt is the fp32-cache one, and the
    prompts' logprobs move by less than 0.3 nats (e4m3 keeps 3 mantissa bits: K/V are off by up to
    1/16 relative). Zamba2's tiny random model, whose shared attention block runs at several depths,
    moved by 1.3 nats and is left out of this bound (its exactness is checked above)."""
    path = tiny_ckpt(family)
    sp = SamplingParams(max_tokens=4, prompt_logprobs=1, **GREEDY)
    fp32 = LLM(path, device="cpu", max_num_seqs=4, page_size=4).generate(PROMPTS, sp, use_tqdm=False)
    fp8 = LLM(path, device="cpu", max_num_seqs=4, page_size=4, kv_cache_dtype="fp8").generate(PROMPTS, sp,
                                                                                              use_tqdm=False)
    worst = 0.0
    for a, b, prompt in zip(fp32, fp8, PROMPTS):
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        for j, (pa, pb) in enumerate(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])):
            tok = prompt[j + 1]
            worst = max(worst, abs(pa[tok] - pb[tok]))
    assert 0.0 < worst < 0.3, worst


def test_calibrated_scales_are_loaded(tiny_ckpt, tmp_path):
    """A ModelOpt and a compressed-tensors FP8 checkpoint with calibrated KV scales (written by
    hybrid.tools.quantize_fp8 under each format's names): every attention module gets its k/v scale;
    without kv_cache_dtype="fp8" they stay 1.0 (read past)."""
    src = tiny_ckpt("granite_dense")
    for scheme in ("modelopt_fp8", "ct_fp8"):
        dst = R.quantize(src, tmp_path / scheme, scheme, kv_cache_scales=True)
        names = json.dumps(sorted(R.read_tensors(dst)))
        assert ("k_proj.k_scale" in names) == scheme.startswith("modelopt") and "v_scale" in names
        llm = LLM(dst, device="cpu", max_num_seqs=2, kv_cache_dtype="fp8")
        attn = [m for m in llm.model.modules() if isinstance(m, Attention)]
        assert attn and all(m.k_scale != 1.0 and m.v_scale != 1.0 and m.k_scale > 0 for m in attn)
        plain = LLM(dst, device="cpu", max_num_seqs=2)
        assert all(m.k_scale == 1.0 for m in plain.model.modules() if isinstance(m, Attention))
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


def _edit_tensors(path, edit) -> None:
    from safetensors.torch import load_file, save_file

    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(path, f))
            edit(tensors)
            save_file(tensors, os.path.join(path, f), metadata={"format": "pt"})


def test_bad_scales_and_options_are_refused(tiny_ckpt, tmp_path):
    src = tiny_ckpt("granite_dense")
    zero = R.quantize(src, tmp_path / "zero", "ct_fp8", kv_cache_scales=True)
    _edit_tensors(zero, lambda t: t.update({k: torch.zeros_like(v) for k, v in t.items() if k.endswith("k_scale")}))
    with pytest.raises(CheckpointError, match="KV-cache scale .*k_scale' is 0.0: it must be positive"):
        LLM(zero, device="cpu", max_num_seqs=2, kv_cache_dtype="fp8")
    half = R.quantize(src, tmp_path / "half", "ct_fp8", kv_cache_scales=True)
    _edit_tensors(half, lambda t: [t.pop(k) for k in [k for k in t if k.endswith("v_scale")]])
    with pytest.raises(CheckpointError, match="only one of K and V"):
        LLM(half, device="cpu", max_num_seqs=2, kv_cache_dtype="fp8")
    with pytest.raises(ConfigurationError, match="kv_cache_dtype='fp8_e5m2' is not supported"):
        LLM(src, device="cpu", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ConfigurationError, match="tensor_parallel_size > 1"):
        LLM(src, device="cpu", kv_cache_dtype="fp8", tensor_parallel_size=2)


@pytest.mark.parametrize("case", ["prefix_cache_and_forks", "speculation_and_preemption"])
def test_fp8_cache_with_prefix_caching_speculation_and_preemption(tiny_ckpt, monkeypatch, case):
    """The paths that copy or reuse KV pages (a prefix-cache hit, forks for n > 1, ngram verify rows,
    preemption and replay with too few pages) over an e4m3 cache: exactly the fake-quantized fp32 run
    under the same options, the sanitizer on, nothing leaked."""
    path = tiny_ckpt("nemotron_h")
    # the last prompt extends the first and is admitted after it (max_num_seqs=3): a prefix-cache hit
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [4, 9, 4, 9, 4], list(range(20, 38)), [5, 6, 7, 5, 6, 7, 5, 6, 9, 9]]
    sps = [SamplingParams(n=2, max_tokens=12, **GREEDY), SamplingParams(max_tokens=10, temperature=0.8, seed=3,
                                                                         ignore_eos=True),
           SamplingParams(max_tokens=16, **GREEDY), SamplingParams(max_tokens=14, **GREEDY)]
    kw = dict(device="cpu", max_num_seqs=3, page_size=4, max_model_len=48, check_state=True)
    if case == "prefix_cache_and_forks":
        kw.update(enable_prefix_caching=True)
    else:
        kw.update(num_kv_pages=13, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    ref = LLM(path, **kw)
    _fake_quant_kv(monkeypatch, ref.runner.ctx.attention_backend)
    want = ref.generate(prompts, sps, use_tqdm=False)
    llm = LLM(path, kv_cache_dtype="fp8", **kw)
    got = llm.generate(prompts, sps, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    stats = llm.engine.stats
    if case == "prefix_cache_and_forks":
        assert stats["prefix_cache_hits"] > 0, stats
        assert llm.state_pool.num_free + len(llm.engine.prefix_cache) == llm.state_pool.num_slots
    else:
        assert stats["preemptions"] > 0 and stats["spec_verify_rows"] > 0, stats
        assert llm.state_pool.num_free == llm.state_pool.num_slots
