"""GPU tests of attention/triton_prefill.py (compiled Triton) vs the torch reference
(attention/reference.py's TorchAttentionBackend.attend, in fp32 over the same pages), at the released
Zamba2 attention shapes FlashInfer's sm_90 prefill has no kernel for: Zamba2-7B (32 heads, 32 KV heads,
head dim 224) and Zamba2-2.7B (32 / 32, 160), in mixed steps (decodes, chunks over a history, whole
prompts, pages shuffled), over an FP8 cache with scales, at 16K context (one 512-token chunk over a
16K history; decode rows over 16K histories split over the KV), and through the trtllm backend's forward.

Run in a process where TRITON_INTERPRET is not set (tests/test_triton_prefill_attention.py sets it
only on machines without CUDA):  python -m pytest -m gpu tests/gpu/test_triton_prefill_attention_gpu.py
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

# Without CUDA, tests/gpu/conftest.py marks every test here skipped (and `-m "not gpu"` deselects them).
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process: run the GPU tests in their own process", allow_module_level=True)
pytest.importorskip("triton")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_util import rel_err  # noqa: E402
from test_kernels import attn_batch  # noqa: E402

from attention.reference import FP8_KV_DTYPE, TorchAttentionBackend, quantize_kv  # noqa: E402
from attention.triton_prefill import paged_prefill_attention  # noqa: E402

DEV = "cuda"
PAGE = 16
ZAMBA2 = {"zamba2_7b": (32, 32, 224), "zamba2_2p7b": (32, 32, 160)}  # heads, KV heads, head dim
# decode rows over histories, a verify-sized row, chunks over histories, whole prompts (one under a page)
MIXED = ([1, 1, 1, 4, 96, 300, 517, 7], [15, 200, 1030, 60, 700, 33, 0, 0])
BF16_TOL = 2e-2  # bf16 products (P rounded to bf16 before P @ V) vs the fp32 reference


def _cache(num_pages: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype, scales=(1.0, 1.0), seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    base = torch.randn(num_pages, 2, kv_heads, PAGE, head_dim, device=DEV, generator=g)
    if kv_dtype != FP8_KV_DTYPE:
        return base.to(kv_dtype)
    kv = torch.empty(base.shape, device=DEV, dtype=kv_dtype)
    kv[:, 0] = quantize_kv(base[:, 0], kv_dtype, scales[0])
    kv[:, 1] = quantize_kv(base[:, 1], kv_dtype, scales[1])
    return kv


def _reference(q, kv, batch, scale, scales):
    """The torch reference in fp32 over the same pages (an FP8 cache dequantized by gather_kv)."""
    kv_ref = kv if kv.dtype == FP8_KV_DTYPE else kv.float()
    return TorchAttentionBackend().attend(q.float(), kv_ref, batch, scale, scales)


def _check(q_lens, ctx, heads, kv_heads, head_dim, kv_dtype=torch.bfloat16, scales=(1.0, 1.0), seed=0):
    max_pages = -(-max(q + c for q, c in zip(q_lens, ctx)) // PAGE) + 1
    batch, num_pages = attn_batch(q_lens, ctx, PAGE, max_pages=max_pages, device=DEV, seed=seed)
    kv = _cache(num_pages, kv_heads, head_dim, kv_dtype, scales, seed=seed + 1)
    q = torch.randn(sum(q_lens), heads, head_dim, device=DEV,
                    generator=torch.Generator(device=DEV).manual_seed(seed + 2)).bfloat16()
    scale = head_dim ** -0.5
    out = paged_prefill_attention(q, kv, batch, scale, scales)
    ref = _reference(q, kv, batch, scale, scales)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    err = rel_err(out.reshape(len(out), -1).float(), ref)
    assert err < BF16_TOL, err
    return q, kv, batch, scale


@pytest.mark.parametrize("model", sorted(ZAMBA2))
def test_zamba2_shapes_mixed_step(model):
    heads, kv_heads, head_dim = ZAMBA2[model]
    _check(*MIXED, heads, kv_heads, head_dim)


@pytest.mark.parametrize("model", sorted(ZAMBA2))
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.05)])
def test_zamba2_shapes_over_an_fp8_cache(model, scales):
    heads, kv_heads, head_dim = ZAMBA2[model]
    _check(*MIXED, heads, kv_heads, head_dim, kv_dtype=FP8_KV_DTYPE, scales=scales, seed=4)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(40, 8, 96), (32, 8, 80), (16, 2, 160)])
def test_gqa_and_other_head_dims(heads, kv_heads, head_dim):
    _check(*MIXED, heads, kv_heads, head_dim, seed=6)


@pytest.mark.parametrize("model", sorted(ZAMBA2))
def test_chunk_over_a_16k_history(model):
    """One 512-token chunk over 16K cached tokens (plus a decode row over 16K): the long KV stream of a
    chunked 16K prompt; prints the kernel's time next to the reference's (no assertion on it)."""
    heads, kv_heads, head_dim = ZAMBA2[model]
    q, kv, batch, scale = _check([1, 512], [16384, 16384], heads, kv_heads, head_dim, seed=8)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):  # warm up (compile, autotune nothing)
        paged_prefill_attention(q, kv, batch, scale)
    start.record()
    for _ in range(10):
        paged_prefill_attention(q, kv, batch, scale)
    end.record()
    torch.cuda.synchronize()
    kernel_ms = start.elapsed_time(end) / 10
    start.record()
    TorchAttentionBackend().attend(q, kv, batch, scale)
    end.record()
    torch.cuda.synchronize()
    torch_ms = start.elapsed_time(end)
    print(f"\n{model} 512 over 16K: triton prefill {kernel_ms:.3f} ms, torch reference {torch_ms:.3f} ms")


@pytest.mark.parametrize("model", sorted(ZAMBA2))
def test_decode_rows_over_16k_histories_split_over_the_kv(model):
    """A Zamba2 decode step of one and of two rows over 16K histories: the launch splits the KV
    (32 or 64 programs leave most of the H200's SMs idle), matches the reference, and is timed
    against the same launch unsplit (printed; the split must win)."""
    from attention.triton_prefill import kv_splits, tiles

    heads, kv_heads, head_dim = ZAMBA2[model]
    for rows in (1, 2):
        q, kv, batch, scale = _check([1] * rows, [16384 - 7 * i for i in range(rows)], heads, kv_heads, head_dim,
                                     seed=20 + rows)
        block_n = tiles(head_dim, heads, kv_heads, torch.bfloat16)[1]
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        splits = kv_splits(rows * kv_heads, batch.page_table.shape[1] * PAGE, block_n, sms)[0]
        assert splits > 1, splits
        times = {}
        for label, forced in (("split", None), ("unsplit", 1)):  # the default choice vs none
            for _ in range(3):
                paged_prefill_attention(q, kv, batch, scale, num_splits=forced)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                paged_prefill_attention(q, kv, batch, scale, num_splits=forced)
            end.record()
            torch.cuda.synchronize()
            times[label] = start.elapsed_time(end) / 20
        print(f"\n{model} {rows} decode row(s) over 16K: {splits} parts {times['split']:.3f} ms, "
              f"unsplit {times['unsplit']:.3f} ms")
        assert times["split"] < times["unsplit"], times


def test_launch_never_syncs_the_host():
    """The launch reads only device tensors and shapes: no host sync (under async scheduling a sync
    would stall the host until every queued kernel has run)."""
    heads, kv_heads, head_dim = ZAMBA2["zamba2_7b"]
    q, kv, batch, scale = _check(*MIXED, heads, kv_heads, head_dim, seed=10)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_prefill_attention(q, kv, batch, scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("model", sorted(ZAMBA2))
def test_trtllm_backend_runs_it_where_flashinfer_has_no_kernel(model, caplog):
    """TrtllmAttentionBackend.forward of a mixed step at the Zamba2 shapes: the fused KV write, then this
    kernel on sm_90 (sm_100 runs trtllm-gen's context kernel), against the torch backend's forward."""
    import logging

    from attention.trtllm import TrtllmAttentionBackend

    heads, kv_heads, head_dim = ZAMBA2[model]
    q_lens, ctx = MIXED
    batch, num_pages = attn_batch(q_lens, ctx, PAGE, max_pages=-(-1100 // PAGE), device=DEV)
    g = torch.Generator(device=DEV).manual_seed(12)
    kv = torch.randn(num_pages, 2, kv_heads, PAGE, head_dim, device=DEV, generator=g).bfloat16()
    T = sum(q_lens)
    q, k, v = (torch.randn(T, n, head_dim, device=DEV, generator=g).bfloat16() for n in (heads, kv_heads, kv_heads))
    scale = head_dim ** -0.5
    kv_ref = kv.float()
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), kv_ref, batch, scale)
    with caplog.at_level(logging.INFO, logger="attention.trtllm"):
        out = TrtllmAttentionBackend().forward(q, k, v, kv, batch, scale)
    torch.cuda.synchronize()
    assert rel_err(out.float(), ref) < BF16_TOL, rel_err(out.float(), ref)
    if torch.cuda.get_device_capability()[0] < 10:
        assert any("triton_prefill" in r.getMessage() for r in caplog.records)


MOE_ATTENTION = {"granite_tiny": (12, 4, 128), "nemotron_nano": (32, 2, 128)}  # heads, KV heads, head dim


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("model", sorted(MOE_ATTENTION))
def test_decode_on_the_triton_kernel_where_xqa_builds(model, rows, monkeypatch):
    """HYBRID_DECODE_ATTENTION=triton (the A/B of bench_moe.py --triton-decode-attention-ab): a decode step of
    the MoE shapes' attention at a 2K context through the backend's forward on our kernel, against the
    reference and against XQA (both bf16), captured in a CUDA graph and replayed; the two timed (printed)."""
    from attention.trtllm import TrtllmAttentionBackend

    heads, kv_heads, head_dim = MOE_ATTENTION[model]
    q_lens, ctx = [1] * rows, [2047 - 5 * i for i in range(rows)]
    batch, num_pages = attn_batch(q_lens, ctx, PAGE, max_pages=4096 // PAGE, device=DEV, seed=rows)
    kv = _cache(num_pages, kv_heads, head_dim, torch.bfloat16, seed=3)
    g = torch.Generator(device=DEV).manual_seed(7)
    q, k, v = (torch.randn(rows, n, head_dim, device=DEV, generator=g).bfloat16() for n in (heads, kv_heads, kv_heads))
    scale = head_dim ** -0.5
    backend = TrtllmAttentionBackend()
    outs, times = {}, {}
    for label, env in (("xqa", None), ("triton", "triton")):
        if env is None:
            monkeypatch.delenv("HYBRID_DECODE_ATTENTION", raising=False)
        else:
            monkeypatch.setenv("HYBRID_DECODE_ATTENTION", env)
        cache = kv.clone()
        outs[label] = backend.forward(q, k, v, cache, batch, scale).float()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = backend.forward(q, k, v, cache, batch, scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.float(), outs[label]), label
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times[label] = start.elapsed_time(end) / 50 * 1e3
    ref = _reference(q, kv_after_write(kv, k, v, batch), batch, scale, (1.0, 1.0))
    assert rel_err(outs["triton"], ref) < BF16_TOL
    assert rel_err(outs["triton"], outs["xqa"]) < BF16_TOL
    print(f"\n{model} decode x{rows} at 2K: XQA {times['xqa']:.1f} us, Triton split-KV {times['triton']:.1f} us "
          f"(KV write included)")


def kv_after_write(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch) -> torch.Tensor:
    """The cache with this step's K / V written at batch.kv_write_loc (as the backend's fused write does)."""
    out = kv.clone()
    page_size = out.shape[3]
    loc = batch.kv_write_loc.long()
    pages, offs = loc // page_size, loc % page_size
    out[pages, 0, :, offs] = k
    out[pages, 1, :, offs] = v
    return out
