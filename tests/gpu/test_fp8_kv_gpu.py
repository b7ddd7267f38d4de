"""FP8 KV cache on CUDA (kv_cache_dtype="fp8", issue 17 item 3): the fused K/V write quantizes as the
CPU reference does, XQA decode and FlashInfer prefill over e4m3 pages match the torch reference over
the same pages, the engine runs under CUDA graphs against the CPU reference of the same cache dtype,
and the memory plan fits about twice the KV pages. Written without a GPU at hand: not yet run."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_util import GREEDY, assert_greedy_under_reference, rel_err  # noqa: E402
from test_kernels import attn_batch  # noqa: E402

from attention.reference import FP8_KV_DTYPE, TorchAttentionBackend, quantize_kv, write_kv  # noqa: E402

DEV = "cuda"


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (32, 2, 128), (12, 4, 128)])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.05)])
def test_trtllm_attention_over_fp8_pages_vs_torch(mode, heads, kv_heads, head_dim, scales):
    from attention.trtllm import TrtllmAttentionBackend

    page_size = 16
    q_lens, ctx = ([1, 1, 1, 1], [0, 15, 200, 517]) if mode == "decode" else ([1, 40, 7, 130], [33, 0, 100, 16])
    batch, num_pages = attn_batch(q_lens, ctx, page_size, max_pages=-(-700 // page_size))
    torch.manual_seed(2)
    base = torch.randn(num_pages, 2, kv_heads, page_size, head_dim, device=DEV)
    kv = torch.empty_like(base, dtype=FP8_KV_DTYPE)
    kv[:, 0] = quantize_kv(base[:, 0], FP8_KV_DTYPE, scales[0])
    kv[:, 1] = quantize_kv(base[:, 1], FP8_KV_DTYPE, scales[1])
    T = sum(q_lens)
    q = torch.randn(T, heads, head_dim, device=DEV).bfloat16()
    k = torch.randn(T, kv_heads, head_dim, device=DEV).bfloat16()
    v = torch.randn(T, kv_heads, head_dim, device=DEV).bfloat16()
    scale = head_dim ** -0.5
    kv_ref = kv.clone()
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), kv_ref, batch, scale, scales)
    out = TrtllmAttentionBackend().forward(q, k, v, kv, batch, scale, scales)
    torch.cuda.synchronize()
    # the kernels run their products in bf16 / fp8 with fp32 accumulation: bf16-level agreement
    assert rel_err(out.float(), ref) < 3e-2, rel_err(out.float(), ref)
    assert torch.equal(kv.view(torch.uint8), kv_ref.view(torch.uint8))  # the fused write == the reference's


def test_fused_fp8_write_saturates_like_the_reference():
    from attention.trtllm import write_kv_fused

    kv = torch.zeros(3, 2, 2, 16, 64, device=DEV, dtype=FP8_KV_DTYPE)
    kv_ref = kv.clone()
    k = torch.randn(5, 2, 64, device=DEV).bfloat16() * 300  # some beyond 448 / scale
    v = torch.randn(5, 2, 64, device=DEV).bfloat16()
    loc = torch.tensor([16, 17, 33, 47, 20], device=DEV)
    write_kv_fused(kv, k, v, loc, (0.5, 0.01))
    write_kv(kv_ref, k, v, loc, (0.5, 0.01))
    torch.cuda.synchronize()
    assert torch.equal(kv.view(torch.uint8), kv_ref.view(torch.uint8))
    assert kv.float().abs().max() == 448


@pytest.mark.parametrize("name", ["granite_dense", "nemotron_h"])
def test_fp8_cache_under_cuda_graphs_vs_cpu(name, tiny_ckpt):
    """bf16 + graphs + an e4m3 cache on the GPU, every token teacher-forced against the CPU fp32 model
    with an e4m3 cache of its own (both round K/V through e4m3; bf16 rounds before that differently,
    so a near-tie allowance as for the FP8 checkpoints)."""
    from hybrid import LLM

    path = tiny_ckpt(name)
    gpu = LLM(path, device="cuda", kv_cache_dtype="fp8", max_num_seqs=8, page_size=16, max_model_len=256,
              cuda_graph_sizes=[1, 2, 4, 8], gpu_memory_utilization=0.3)
    assert gpu.kv_cache.kv.dtype == FP8_KV_DTYPE and gpu.runner.use_graphs
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, gpu.config.vocab_size, (n,), generator=g).tolist() for n in (1, 9, 40, 130)]
    from hybrid import SamplingParams

    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, SamplingParams(max_tokens=12, **GREEDY),
                                                         use_tqdm=False)]
    assert gpu.runner.stats["graph_replays"] > 0
    cpu = LLM(path, device="cpu", dtype="float32", kv_cache_dtype="fp8", max_num_seqs=8, max_model_len=256)
    assert_greedy_under_reference(cpu, prompts, got, near_tie=0.5)


def test_memory_plan_counts_half_the_bytes_a_page(tiny_ckpt):
    """The plan sizes FP8 pages at half the bf16 bytes (so a budget-bound cache holds twice the
    tokens; a tiny model is bound by max_num_seqs x max_model_len instead, so pages are compared)."""
    from hybrid import LLM

    kw = dict(device="cuda", max_num_seqs=4, gpu_memory_utilization=0.3, enforce_eager=True)
    bf16 = LLM(tiny_ckpt("granite_dense"), **kw)
    fp8 = LLM(tiny_ckpt("granite_dense"), kv_cache_dtype="fp8", **kw)
    assert fp8.memory_plan.page_bytes * 2 == bf16.memory_plan.page_bytes
    assert fp8.kv_cache.kv.element_size() == 1
