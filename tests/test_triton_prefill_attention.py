"""attention/triton_prefill.py's paged prefill attention vs the torch reference
(attention/reference.py's TorchAttentionBackend.attend), on CPU through Triton's interpreter.

The interpreter must be switched on before triton is first imported, hence the env var at the top
(as tests/test_triton_kernels.py; tests/conftest.py does the same for the whole CPU session). On a
machine with CUDA the interpreter is NOT switched on here; there these tests run only in their own
process with the variable set explicitly:
    TRITON_INTERPRET=1 python -m pytest tests/test_triton_prefill_attention.py
(GPU tests of the compiled kernel: tests/gpu/test_triton_prefill_attention_gpu.py.)

The batches mix every kind of row a step carries (decodes, a verify-sized row, a chunk over a long
history, whole prompts, one shorter than a page), their pages shuffled in the page table; every
cache position that no request's KV covers holds NaN, so a read past a request's sequence (or
through a wrong page) shows. Small tiles (16 query rows, 32 KV positions, unless a case says
otherwise) make the requests span several query blocks and KV tiles; one case runs the default tiles.
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

import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from attention.reference import FP8_KV_DTYPE, TorchAttentionBackend, quantize_kv  # noqa: E402
from attention.triton_prefill import kv_splits, paged_prefill_attention, tiles  # noqa: E402
from state_pool.step_batch import StepBatch  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _dots_on_widened_operands():
    """Triton's interpreter (3.8) keeps bf16 tiles as their raw uint16 bits (numpy has no bf16), and its
    tl.dot multiplies those bits as integers. Here 16-bit operands are widened to fp32 first (exact),
    which is what the GPU's bf16 / fp16 MMA with fp32 accumulation computes, and the product is
    numpy's fp32 BLAS matmul (the interpreter's casting matmul takes ~10 ms a tile). fp32 and other
    operands (8-bit floats) keep the interpreter's own dot."""
    original = interpreter.InterpreterBuilder.create_dot

    def widened(x):
        if x.dtype == tl.bfloat16:
            return (x.data.astype(np.uint32) << 16).view(np.float32)
        return x.data.astype(np.float32) if x.dtype in (tl.float16, tl.float32) else None

    def create_dot(self, a, b, d, *args, **kwargs):
        wa, wb = widened(a), widened(b)
        if wa is None or wb is None or d.data.dtype != np.float32:
            return original(self, a, b, d, *args, **kwargs)
        return interpreter.TensorHandle(np.matmul(wa, wb) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
    yield
    interpreter.InterpreterBuilder.create_dot = original


# (q_len, context) per request: decodes first (one over a history, one at position 0), a verify-sized
# row, a chunk over a long history, a whole prompt, a prompt shorter than a page
ROWS = [(1, 40), (1, 0), (3, 20), (20, 100), (37, 0), (5, 0)]


def paged_batch(rows, page_size: int, seed: int = 0, spare_pages: int = 3) -> tuple[StepBatch, int]:
    """A step over requests with `context` cached tokens and q_len new ones each, their pages a random
    permutation of pages 1.. (page 0 is the dummy page), plus a few pages no request owns."""
    g = torch.Generator().manual_seed(seed)
    seq = [q + c for q, c in rows]
    need = [-(-s // page_size) for s in seq]
    num_pages = sum(need) + 1 + spare_pages
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    width = max(need) + 1  # one column more than any request needs
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    k = 0
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[k:k + n], dtype=torch.int32)
        k += n
    qsl = [0]
    for q, _ in rows:
        qsl.append(qsl[-1] + q)
    T, n = qsl[-1], len(rows)
    decodes = 0
    while decodes < n and rows[decodes][0] == 1:
        decodes += 1
    batch = StepBatch(
        input_ids=torch.zeros(T, dtype=torch.long), positions=torch.zeros(T, dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq, dtype=torch.int32),
        page_table=table, kv_write_loc=torch.zeros(T, dtype=torch.long), state_slot=torch.arange(n),
        has_initial_state=torch.ones(n, dtype=torch.bool), logits_indices=torch.tensor(qsl[1:]) - 1,
        num_decodes=decodes, num_prefills=n - decodes, query_lens_cpu=[q for q, _ in rows], seq_lens_cpu=seq,
        state_slot_cpu=list(range(n)), has_initial_state_cpu=[True] * n,
    )
    return batch, num_pages


def kv_cache(batch: StepBatch, num_pages: int, kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype,
             scales=(1.0, 1.0), seed: int = 1) -> torch.Tensor:
    """Random K/V at every position a request covers (quantized into an FP8 cache), NaN everywhere else."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(num_pages, 2, kv_heads, page_size, head_dim, generator=g)
    if dtype == FP8_KV_DTYPE:
        kv = torch.empty(base.shape, dtype=dtype)
        kv[:, 0] = quantize_kv(base[:, 0] * scales[0] * 4, dtype, scales[0])  # stored values up to ~+-16
        kv[:, 1] = quantize_kv(base[:, 1] * scales[1] * 4, dtype, scales[1])
    else:
        kv = base.to(dtype)
    covered = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for i, s in enumerate(batch.seq_lens_cpu):
        for p in range(s):
            covered[batch.page_table[i, p // page_size], p % page_size] = True
    nan = torch.tensor(float("nan")).to(dtype)
    return torch.where(covered[:, None, None, :, None], kv, nan)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _check(rows, heads, kv_heads, head_dim, dtype, kv_dtype=None, scales=(1.0, 1.0), page_size=16, block_m=16,
           block_n=32, seed=0, num_splits=1):
    kv_dtype = kv_dtype or dtype
    batch, num_pages = paged_batch(rows, page_size, seed=seed)
    kv = kv_cache(batch, num_pages, kv_heads, page_size, head_dim, kv_dtype, scales, seed=seed + 1)
    T = batch.num_tokens
    q = torch.randn(T, heads, head_dim, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(q, kv, batch, scale, scales, block_m=block_m, block_n=block_n,
                                  num_splits=num_splits)
    assert out.shape == (T, heads, head_dim) and out.dtype == dtype
    if dtype == torch.float32:
        ref = TorchAttentionBackend().attend(q, kv, batch, scale, scales)
        tol = 1e-4
    else:  # the reference in fp32 over the same cache (K/V widened exactly): the kernel's bf16 products vs exact ones
        ref = TorchAttentionBackend().attend(q.float(), kv if kv_dtype == FP8_KV_DTYPE else kv.float(), batch, scale,
                                             scales)
        tol = 2e-2
    err = _rel(out.reshape(T, -1), ref)
    print(f"relative error {err:.2e}")
    assert err < tol, err


@pytest.mark.parametrize("head_dim", [64, 96, 160, 224])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2), (10, 2)])  # GQA 1, 4, 5 (5 padded to 8 rows a token)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_the_reference(head_dim, heads, kv_heads, dtype):
    group_rows = 1 << (heads // kv_heads - 1).bit_length()
    _check(ROWS, heads, kv_heads, head_dim, dtype, block_m=max(16, 4 * group_rows))  # 16 or 4 tokens a block


def test_forty_query_heads_over_eight_kv_heads():
    """The GQA-5 layout of a 40-head model (8 programs a query block), 8-token query blocks."""
    _check(ROWS[:1] + ROWS[2:4], 40, 8, 160, torch.bfloat16, block_m=64, block_n=32)


@pytest.mark.parametrize("head_dim", [80, 224])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.05)])
def test_fp8_cache_with_scales(head_dim, scales):
    _check(ROWS, 8, 2, head_dim, torch.bfloat16, kv_dtype=FP8_KV_DTYPE, scales=scales)


def test_fp8_cache_fp32_queries_tight():
    """fp32 queries over an FP8 cache: fp32 products on both sides, so fp32-tight agreement checks the
    dequantization (k_scale folded into the softmax scale, v_scale on the output) closely."""
    _check(ROWS[:4], 4, 2, 64, torch.float32, kv_dtype=FP8_KV_DTYPE, scales=(0.03, 0.2))


# tiles over pages, pages over tiles, a page size that is no power of two
@pytest.mark.parametrize("page_size,block_n", [(8, 32), (32, 16), (64, 64), (12, 16)])
def test_page_sizes(page_size, block_n):
    _check(ROWS, 4, 2, 64, torch.float32, page_size=page_size, block_n=block_n, seed=3)


def test_default_tiles():
    """The launch's own tiles (64 x 64 at head dim 160): whole prompts in one query block, the chunk's
    history over two KV tiles."""
    assert tiles(160, 4, 4, torch.bfloat16)[:2] == (64, 64)
    _check(ROWS, 4, 4, 160, torch.bfloat16, block_m=None, block_n=None, seed=5)


def test_fp16_and_a_single_kv_head():
    _check(ROWS[2:5], 4, 1, 32, torch.float16, seed=7)


def test_grid_depends_only_on_tokens_and_requests():
    """Requests whose query blocks straddle the numbering (q_len a multiple of the block, one more,
    one less) and an empty row (q_len 0) in between: every token gets its output. Two rows put
    a query block's first token right before a KV tile's end (context + q0 + 2 a multiple of the
    32-wide tile): its unmasked tiles must stop one tile early."""
    rows = [(16, 0), (17, 3), (0, 9), (15, 40), (1, 5), (32, 0), (6, 30), (20, 14)]
    _check(rows, 2, 2, 64, torch.float32, seed=9)


# KV split (flash-decoding): parts of a program's KV range in their own programs, then combined
@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kv_split_matches_the_reference(num_splits, dtype):
    """Every kind of row split S ways (parts past a row's length empty; a prompt's early tokens see
    nothing of the later parts): the same attention as unsplit, fp32-tight for fp32."""
    _check(ROWS, 8, 2, 160, dtype, num_splits=num_splits, seed=11)


def test_kv_split_over_an_fp8_cache_and_padding_rows():
    """An FP8 cache with scales (v_scale applied when the parts are combined), and decode padding rows
    (q_len 1 at a 1-token length on the dummy page) between real ones."""
    _check([(1, 70), (1, 0), (1, 0), (4, 33)], 4, 4, 224, torch.bfloat16, kv_dtype=FP8_KV_DTYPE, scales=(0.03, 0.2),
           num_splits=4, seed=13)


def test_kv_split_choice():
    """Split only when the grid fills at most half the SMs, into one wave; from the grid, the KV
    capacity and the launch's size alone; every part a multiple of the KV tile, S parts covering
    the capacity."""
    assert kv_splits(32, 16384, 64, 132) == (4, 4096)  # a Zamba2 decode row: 32 programs, 128 split
    assert kv_splits(128, 16384, 64, 132) == (1, 16384)  # four rows: the SMs are (nearly) full
    assert kv_splits(32, 256, 64, 132) == (1, 256)  # each part would cover under 512 positions
    assert kv_splits(64, 4096, 64, 132, row_bytes=2**20)[0] == 2
    assert kv_splits(4, 16384, 64, 132, row_bytes=8 * 2**20)[0] == 4  # the workspace cap
    for programs, capacity in ((1, 16384), (7, 5000), (40, 2048)):
        splits, split_len = kv_splits(programs, capacity, 64, 132)
        assert split_len % 64 == 0 and (splits - 1) * split_len < capacity <= splits * split_len


def test_a_decode_batch_picks_the_split_itself():
    """The launch's own choice (no num_splits) on a decode step of a long capacity: split, and the
    same output as forced unsplit."""
    rows = [(1, 900), (1, 20)]
    batch, num_pages = paged_batch(rows, 16, seed=4, spare_pages=40)  # a wide page table: 16K-like capacity
    kv = kv_cache(batch, num_pages, 2, 16, 160, torch.float32, seed=5)
    q = torch.randn(batch.num_tokens, 2, 160, generator=torch.Generator().manual_seed(6))
    wide = torch.cat([batch.page_table, torch.zeros(2, 64, dtype=torch.int32)], dim=1)  # capacity 1,984 positions
    import dataclasses
    batch = dataclasses.replace(batch, page_table=wide)
    assert kv_splits(2 * 2, wide.shape[1] * 16, tiles(160, 2, 2, torch.float32)[1], 132)[0] > 1
    auto = paged_prefill_attention(q, kv, batch, 0.08)
    ref = TorchAttentionBackend().attend(q, kv, batch, 0.08)
    assert _rel(auto.reshape(batch.num_tokens, -1), ref) < 1e-4


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padded_verify_row_over_stale_non_finite_kv(num_splits):
    """A padded verify row (graphs/padding.pad_verify_batch) has a KV length that runs over its
    padding tokens, whose K/V went to the dummy page: those positions of the row's own last page
    hold what an earlier owner left, here NaN. The real tokens give them weight 0, and must come out
    exactly as the unpadded row does (0 * NaN must not reach them)."""
    import dataclasses

    ps = 16
    batch, npages = paged_batch([(4, 20)], ps, seed=0)  # context 20: 2 real tokens padded to 4, seq_len 24
    real = dataclasses.replace(batch, seq_lens_cpu=[22])
    kv = kv_cache(real, npages, 2, ps, 160, torch.float32, seed=1)  # NaN from position 22 on
    q = torch.randn(4, 2, 160, generator=torch.Generator().manual_seed(2))
    out = paged_prefill_attention(q, kv, batch, 160 ** -0.5, num_splits=num_splits, block_m=16, block_n=16)
    unpadded, _ = paged_batch([(2, 20)], ps, seed=0)
    assert torch.equal(unpadded.page_table, batch.page_table)  # the same pages
    ref = paged_prefill_attention(q[:2].contiguous(), kv, unpadded, 160 ** -0.5, block_m=16, block_n=16)
    assert torch.isfinite(out[:2]).all()
    assert torch.allclose(out[:2], ref, atol=1e-6, rtol=1e-5)
