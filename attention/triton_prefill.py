"""Our Triton paged prefill attention: causal attention of a step's query tokens over the paged KV cache,
for the shapes FlashInfer's sm_90 prefill has no kernel for (head dims other than 64/128/256, e.g.
Zamba2-2.7B's 160 and Zamba2-7B's 224). Its reference is attention/reference.py's
`TorchAttentionBackend.attend`, which computes the same thing with a per-request host loop.

`paged_prefill_attention(q, kv_layer, batch, scale, kv_scales)`:
    q        [T, num_heads, head_dim]: the step's query tokens, requests concatenated in batch order
             (batch.query_start_loc [B+1] int32 gives each request's token range)
    kv_layer [num_pages, 2, num_kv_heads, page_size, head_dim] ("HND", K at [:, 0], V at [:, 1]),
             already holding this step's K/V (any page size; 16 by default)
    batch.page_table [B, max_pages] int32, batch.seq_lens [B] int32 (KV length after this step)
    scale    the softmax scale; kv_scales (k_scale, v_scale): an FP8 e4m3 cache stores K/V divided by
             them (1.0 for a 16-bit cache)
    returns  [T, num_heads, head_dim] in q's dtype.
Causal, bottom-right aligned: query token i of a request with q_len tokens and seq_len KV sees KV
positions [0, seq_len - q_len + i]. GQA: query head h reads KV head h // (num_heads // num_kv_heads).
Rows of any kind (decodes, verify / replay rows, prefill chunks) may share the step.

Algorithm (FlashAttention-2's forward): online softmax in fp32 (running row max and row sum, the
output accumulator rescaled when the max grows), exp2 with log2(e) folded into the scale; the
q . k products and p . v products run in q's dtype with fp32 accumulation (IEEE fp32 for fp32
queries). An FP8 cache's K and V are widened to q's dtype in registers; k_scale is folded into the
softmax scale and v_scale applied once to the normalised output (the fused scales of the XQA /
FlashInfer calls in attention/trtllm.py).

Grid and tiles:
- axis 1: one program per KV head; its tile packs the GROUP = num_heads // num_kv_heads query heads
  that read that KV head (GROUP padded to a power of two, GP) for BLOCK_Q = BLOCK_M // GP query
  tokens: BLOCK_M rows (token-major, row = token * GP + head-in-group). Each K/V tile is then loaded
  once for the whole group, and a decode row (q_len 1) fills GROUP rows of the tile, not one.
- axis 0: the request's query blocks, without any host list: request i's blocks are numbered from
  query_start_loc[i] // BLOCK_Q + i, which leaves room for its cdiv(q_len, BLOCK_Q) blocks, so a
  grid of T // BLOCK_Q + B programs covers every block whatever the lengths; each program finds its
  request by binary search over query_start_loc and programs past their request's last block exit
  at once. The grid depends only on T and B: no host sync, no per-request host loop.
- the KV is streamed in BLOCK_N-position tiles, each row's page looked up in the request's
  page-table row (page = position // PAGE_SIZE, PAGE_SIZE a constexpr, a shift for the usual
  powers of two): a tile may cover part of a page or several pages. Causal skipping: a query block
  stops at the KV position its last token sees; tiles entirely visible to all of its tokens run
  without masks, only the tiles over the diagonal (and the tail of the sequence) apply the causal
  / length mask.
- the head-dim tile is head_dim padded to the next power of two (at least 16, for tl.dot) and
  masked: 160 and 224 run a 256-wide tile. `TILES` holds the default (BLOCK_M, BLOCK_N, warps,
  stages) per padded head dim; not tuned on the GPU yet. Compiled for sm_90 at 160 / 224 (64 x 64
  tiles, 8 warps, 2 stages; tests/triton_compile_cases.py): about 200-220 registers, no spills,
  128-160 KiB of shared memory.
Split KV (flash-decoding), for steps of few programs: when the grid above fills at most half the
GPU's SMs (a few decode or verify rows: at these head dims sm_90's XQA does not build, so
attention/trtllm.py runs them here too), axis 2 splits each block's KV range (up to its last
visible position) into S equal runs of whole BLOCK_N tiles. Each program writes its unnormalised
output rows and their running max and sum (fp32) to a workspace [T, num_heads, S, ...];
`_combine_splits_kernel` (one program per token and head) rescales the S parts to their common max
and normalises. S follows from the grid, the page table's width (the KV capacity a row can have)
and the workspace size, never from the sequence lengths, so a captured graph keeps its split; the
parts' lengths come from each block's own KV length on the device (a short row's trailing parts
may be empty: max -1e30, sum 0, weight nothing).
No programmatic dependent launch (PDL): attention/ imports nothing from hybrid/ (hybrid/ops/
triton_guard.py has the PDL helpers), and the fused KV write before it is not PDL-launched either
(attention/trtllm.py's write_kv_fused). It runs in prefill / mixed steps at any head dim without a
FlashInfer prefill kernel, and in decode / verify steps only at head dims sm_90's XQA does not build
(attention/trtllm.xqa_builds), where it is the only graph-capturable kernel at hand.

Triton is imported guarded, as hybrid/ops/triton_guard.py does it (attention/ must not import
hybrid/): importing this module without triton works, calling the kernel raises. Set
TRITON_INTERPRET=1 before triton is first imported to run the kernel on CPU tensors
(tests/test_triton_prefill_attention.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from state_pool.util import cdiv, sm_count

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False

if TYPE_CHECKING:
    from state_pool.step_batch import StepBatch

FP8_KV_DTYPE = torch.float8_e4m3fn  # as attention/reference.py
LOG2_E = 1.4426950408889634

# padded head dim -> (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit queries (fp32 queries
# halve BLOCK_N: twice the bytes per K/V element). Unmeasured defaults (FlashAttention-2's usual
# 128 x 64 tiles up to 128-wide heads; a 64-row tile at 256, whose fp32 accumulator alone is 64 KiB).
TILES: dict[int, tuple[int, int, int, int]] = {
    16: (128, 64, 4, 3), 32: (128, 64, 4, 3), 64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 64, 8, 2),
}


def is_available() -> bool:
    return HAS_TRITON


def require(module: str) -> None:
    """Raise a clear error when the kernel is called without triton (as hybrid/ops/triton_guard.py)."""
    if not HAS_TRITON:
        raise RuntimeError(f"{module} needs triton, which is not importable here")


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tiles(head_dim: int, num_heads: int, num_kv_heads: int, q_dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a launch (see TILES); BLOCK_M at least the
    padded group of query heads, so that a tile holds at least one token."""
    block_d = max(16, _next_pow2(head_dim))
    block_m, block_n, warps, stages = TILES[min(block_d, 256)]
    if q_dtype == torch.float32:
        block_n = max(16, block_n // 2)
    return max(block_m, _next_pow2(num_heads // num_kv_heads)), block_n, warps, stages


if HAS_TRITON:

    @triton.jit
    def _attend_tile(acc, l_i, m_i, q, kv_base, pt_row, start_n, kv_end, ctx_tok,
                     stride_kv, stride_page, stride_off, k_mul,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                     PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
        """One BLOCK_N tile of KV positions [start_n, start_n + BLOCK_N) into the running softmax:
        returns (acc, l_i, m_i). MASKED tiles apply the causal mask (position <= ctx_tok, the last
        position each row sees) and the sequence end (position < kv_end); unmasked ones are known
        to be visible to every row."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        if MASKED:
            in_seq = offs_n < kv_end
            page = tl.load(pt_row + offs_n // PAGE_SIZE, mask=in_seq, other=0)
        else:
            page = tl.load(pt_row + offs_n // PAGE_SIZE)
        row = page.to(tl.int64) * stride_page + (offs_n % PAGE_SIZE) * stride_off  # [BLOCK_N]
        ptrs = kv_base + row[:, None] + offs_d[None, :]
        if MASKED:
            kv_mask = in_seq[:, None] & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(ptrs, mask=kv_mask, other=0.0)
            v = tl.load(ptrs + stride_kv, mask=kv_mask, other=0.0)
        elif BLOCK_D == HEAD_DIM:
            k = tl.load(ptrs)
            v = tl.load(ptrs + stride_kv)
        else:
            d_mask = (offs_d < HEAD_DIM)[None, :]
            k = tl.load(ptrs, mask=d_mask, other=0.0)
            v = tl.load(ptrs + stride_kv, mask=d_mask, other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if MASKED:
            # A masked tile may hold positions a row must not see whose V is not finite: a padded verify
            # row's KV length runs over its padding tokens, whose K/V went to the dummy page, so those
            # positions hold what an earlier owner of the page left. p is 0 there, but 0 * NaN = NaN in
            # the dot below: such V reads as 0 (finite values are kept as they are).
            v = tl.where(tl.abs(v.to(tl.float32)) < float("inf"), v, 0.0).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * k_mul  # scale * k_scale * log2(e): s is in log2 units
        if MASKED:
            visible = (offs_n[None, :] <= ctx_tok[:, None]) & in_seq[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, l_i, m_new

    # num_seqs and num_splits follow the step's batch: not specialised (a compile per value class at
    # run time otherwise); the head counts and strides are fixed per model.
    @triton.jit(do_not_specialize=["num_seqs", "num_splits"])
    def _paged_prefill_kernel(
        q_ptr, kv_ptr, out_ptr, qsl_ptr, seq_lens_ptr, pt_ptr, part_ptr, part_ml_ptr,
        num_seqs, group, num_heads, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_page, stride_kv, stride_head, stride_off, stride_pt,
        k_mul, v_mul,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
    ):
        BLOCK_Q: tl.constexpr = BLOCK_M // GP
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        # the request: the last i with query_start_loc[i] // BLOCK_Q + i <= pid (binary search)
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
            below = first <= pid
            lo = tl.where(below, mid + 1, lo)
            hi = tl.where(below, hi, mid)
        req = lo - 1
        q_start = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_start
        q0 = (pid - (q_start // BLOCK_Q + req)) * BLOCK_Q  # the block's first token, in the request
        if q0 >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + req)
        ctx = seq_len - q_len  # KV positions before the request's first new token

        offs_m = tl.arange(0, BLOCK_M)
        tok = q0 + offs_m // GP  # token of each row, in the request
        hg = offs_m % GP  # query head of each row, in the group
        head = kvh * group + hg
        row_ok = (tok < q_len) & (hg < group)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a row fully masked in a tile stays NaN-free
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_base = kv_ptr + kvh.to(tl.int64) * stride_head
        pt_row = pt_ptr + req.to(tl.int64) * stride_pt
        ctx_tok = ctx + tok  # the last KV position each row sees
        # every position below ctx + q0 + 1 is visible to every token of the block: whole tiles of
        # those run unmasked; the rest, up to the block's last visible position, masked
        last_tok = tl.minimum(q0 + BLOCK_Q, q_len)
        kv_end = ctx + last_tok
        full_end = ((ctx + q0 + 1) // BLOCK_N) * BLOCK_N
        lo_n = 0
        hi_n = kv_end
        if SPLIT:  # this program's part of the block's KV: one of num_splits equal runs of BLOCK_N tiles
            part_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
            lo_n = tl.program_id(2) * part_len
            hi_n = tl.minimum(lo_n + part_len, kv_end)
        for start_n in range(lo_n, tl.minimum(hi_n, full_end), BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, kv_base, pt_row, start_n, kv_end, ctx_tok,
                                         stride_kv, stride_page, stride_off, k_mul,
                                         HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, False, IEEE)
        for start_n in range(tl.maximum(lo_n, full_end), hi_n, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, kv_base, pt_row, start_n, kv_end, ctx_tok,
                                         stride_kv, stride_page, stride_off, k_mul,
                                         HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, IEEE)
        row_mask = row_ok[:, None] & d_ok[None, :]
        if SPLIT:  # unnormalised rows and their (max, sum) to the workspace: _combine_splits_kernel ends it
            part_row = ((q_start + tok).to(tl.int64) * num_heads + head) * num_splits + tl.program_id(2)
            tl.store(part_ptr + part_row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_mask)
            tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_ok)
        else:
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows only: every real row sees position 0
            out = acc * (v_mul / l_safe)[:, None]
            o_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
            tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask)

    @triton.jit(do_not_specialize=["num_splits"])  # follows the step's batch (kv_splits)
    def _combine_splits_kernel(part_ptr, part_ml_ptr, out_ptr, num_heads, num_splits, stride_ot, stride_oh, v_mul,
                               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        """One token and head: its num_splits parts rescaled to their common max, summed, normalised."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < num_splits
        base = (t.to(tl.int64) * num_heads + h) * num_splits
        m = tl.load(part_ml_ptr + (base + offs_s) * 2, mask=s_ok, other=-1.0e30)
        l = tl.load(part_ml_ptr + (base + offs_s) * 2 + 1, mask=s_ok, other=0.0)
        acc = tl.load(part_ptr + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                      mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        w = tl.exp2(m - tl.max(m, 0))  # empty parts (max -1e30) weigh 0 next to any real part
        l_sum = tl.sum(w * l, 0)
        l_safe = tl.where(l_sum > 0.0, l_sum, 1.0)  # padding rows only
        out = tl.sum(acc * w[:, None], 0) * (v_mul / l_safe)
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
                 mask=offs_d < HEAD_DIM)


MAX_SPLITS = 16  # KV parts a program's range is split into at most
MIN_SPLIT_POSITIONS = 512  # and each part covers at least this many KV positions of the capacity
MAX_PART_BYTES = 32 * 2**20  # the fp32 parts of one launch at most (few programs can still mean many tokens)


def kv_splits(programs: int, kv_capacity: int, block_n: int, sms: int, row_bytes: int = 0) -> tuple[int, int]:
    """(S, split_len): how many parts each program's KV range is split into, and the positions a
    part of a full-capacity row covers (a multiple of block_n; the kernel sizes each block's parts
    from its own KV length). S > 1 only when the programs fill at most half the GPU's
    SMs, and S x programs stays one wave (at these tiles one program fills an SM: a second wave
    would take as long as the unsplit launch); from the grid, the KV capacity and the launch's size
    alone (graph capturable). `row_bytes`: the workspace one part of every token and head takes
    (S of them must fit in MAX_PART_BYTES)."""
    if 2 * programs > sms or kv_capacity <= block_n:
        return 1, kv_capacity
    splits = min(MAX_SPLITS, sms // programs, max(1, kv_capacity // MIN_SPLIT_POSITIONS),
                 MAX_PART_BYTES // max(row_bytes, 1))
    if splits <= 1:
        return 1, kv_capacity
    split_len = cdiv(cdiv(kv_capacity, splits), block_n) * block_n
    return cdiv(kv_capacity, split_len), split_len


def paged_prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, batch: "StepBatch", scale: float,
                            kv_scales: tuple[float, float] = (1.0, 1.0), *, block_m: int | None = None,
                            block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Causal attention of the step's queries over the paged cache (see the module docstring):
    [T, num_heads, head_dim] in q's dtype. block_m / block_n / num_warps / num_stages override the
    defaults of `tiles`, num_splits the KV split (tests, tuning)."""
    require(__name__)
    T, num_heads, head_dim = q.shape
    num_pages, two, num_kv_heads, page_size, kv_dim = kv_layer.shape
    assert two == 2 and kv_dim == head_dim and num_heads % num_kv_heads == 0, (q.shape, kv_layer.shape)
    assert head_dim <= 256, f"head dim {head_dim}: the kernel's tiles go up to 256"
    fp8 = kv_layer.dtype == FP8_KV_DTYPE
    assert fp8 or kv_layer.dtype == q.dtype, (q.dtype, kv_layer.dtype)
    out = torch.empty(T, num_heads, head_dim, dtype=q.dtype, device=q.device)
    B = batch.page_table.shape[0]
    assert batch.query_start_loc.shape == (B + 1,) and batch.seq_lens.shape == (B,), "one row per request"
    if T == 0 or B == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert kv_layer.stride(-1) == 1
    group = num_heads // num_kv_heads
    gp = _next_pow2(group)
    bm, bn, warps, stages = tiles(head_dim, num_heads, num_kv_heads, q.dtype)
    bm = max(block_m or bm, gp)
    bn = block_n or bn
    block_q = bm // gp
    k_scale, v_scale = (float(kv_scales[0]), float(kv_scales[1])) if fp8 else (1.0, 1.0)
    block_d = max(16, _next_pow2(head_dim))
    programs = T // block_q + B
    capacity = batch.page_table.shape[1] * page_size
    if num_splits is None:
        splits, _ = kv_splits(programs * num_kv_heads, capacity, bn, sm_count(q.device),
                              row_bytes=T * num_heads * (block_d + 2) * 4)
    else:
        splits = max(1, num_splits)
    split = splits > 1
    if split:  # fp32 parts of the real rows only: [T, heads, S, D] and their (max, sum)
        part = torch.empty(T * num_heads * splits * block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(T * num_heads * splits * 2, dtype=torch.float32, device=q.device)
    else:
        part = part_ml = out  # not read
    _paged_prefill_kernel[(programs, num_kv_heads, splits)](
        q, kv_layer, out, batch.query_start_loc, batch.seq_lens, batch.page_table, part, part_ml,
        B, group, num_heads, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3), batch.page_table.stride(0),
        float(scale) * k_scale * LOG2_E, v_scale,
        HEAD_DIM=head_dim, BLOCK_D=block_d, GP=gp, BLOCK_M=bm, BLOCK_N=bn,
        PAGE_SIZE=page_size, IEEE=q.dtype == torch.float32, SPLIT=split,
        num_warps=num_warps or warps, num_stages=num_stages or stages,
    )
    if split:
        _combine_splits_kernel[(T, num_heads)](
            part, part_ml, out, num_heads, splits, out.stride(0), out.stride(1), v_scale,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, _next_pow2(splits)), num_warps=4,
        )
    return out
