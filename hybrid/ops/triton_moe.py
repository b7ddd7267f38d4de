"""Fused MoE experts (Triton): the routed (token, expert) pairs grouped by expert, one grouped-GEMM
launch per projection, the activation fused into the first and the routing weight into the second.

`fused_experts(x, w_up, w_down, top_idx, top_w, gated, add=None)` computes what the torch loop of
`hybrid.layers.Experts` (the CPU reference) does, up to rounding:
    x [T, H]; w_up [E, I, H] (relu2) or [E, 2I, H] ([gate | up] rows, SwiGLU); w_down [E, H, I];
    top_idx [T, k] (int); top_w [T, k] (any float dtype); add [T, H] or None (added before the one
    rounding to x.dtype: the shared expert's output).
    out[t] = sum_j top_w[t, j] * down_e(act(up_e(x[t])))  for e = top_idx[t, j]  (+ add[t])

The n = T*k pairs are numbered p = t*k + j. Steps, every one a launch whose shape depends on T alone
(no host synchronisation, CUDA-graph capturable):
1. alignment: the pairs grouped by expert, each expert's group padded to a multiple of BLOCK_M with
   the sentinel n -> `pairs` [max_blocks * BLOCK_M], `block_expert` [max_blocks] and the padded total
   (a 1-element tensor). max_blocks = cdiv(n, BLOCK_M) + min(E, n) bounds the padded total for any
   routing; blocks past the total exit at once. Three ways, one result shape:
   - `naive` (decode at small batch, n <= NAIVE_MAX_PAIRS): every pair is its own block (its row 0),
     nothing to sort; an expert chosen twice is streamed twice, which at these sizes is rare;
   - one-program Triton kernel (n <= TRITON_ALIGN_MAX_PAIRS: decode batches, verify);
   - `counting` (prefill chunks): a counting sort in three launches over P programs (each counts its
     slice of the pairs per expert; one program turns the counts into each expert's padded offset and
     each program's base within it, the block experts and the total; each program places its pairs),
     with the pairs of an expert in pair order as the others keep them;
   - torch ops around a stable sort (the reference of the kernels; `method="torch"`).
2. GEMM 1: each block's rows x[p // k] against its expert's up rows -> h [n, I] in x.dtype, relu2
   or silu(gate) * up applied in fp32 in the epilogue (gate and up tiles of the same columns in one
   program).
3. GEMM 2: rows h[p] against the expert's down rows, times top_w[p] -> y [n, H] in x.dtype.
4. out[t] = sum_j y[t*k + j] (+ add[t]) in fp32, in a fixed order (no atomics: deterministic).
A row's result does not depend on which other rows share its blocks, so padding rows (graph
buckets) cannot change a real row's output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.ops.triton_guard import HAS_TRITON, pdl_options, require, tl, triton
from state_pool.util import cdiv

NAIVE_MAX_PAIRS = 32
TRITON_ALIGN_MAX_PAIRS = 4096
ACT_NONE, ACT_RELU2, ACT_SILU_MUL = 0, 1, 2


def is_available() -> bool:
    return HAS_TRITON


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    return cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def align_torch(flat_ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pairs, block_expert, total) by torch ops: a stable sort of the pairs by expert, each expert's
    run placed at its padded offset. Pairs of one expert keep their order."""
    n = flat_ids.numel()
    dev = flat_ids.device
    ids = flat_ids.long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    sorted_ids, order = torch.sort(ids, stable=True)
    run_start = counts.cumsum(0) - counts
    dest = (pad_end - padded)[sorted_ids] + torch.arange(n, device=dev) - run_start[sorted_ids]
    nb = max_blocks(n, num_experts, block_m)
    pairs = torch.full((nb * block_m,), n, dtype=torch.int32, device=dev)
    pairs.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(nb, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, starts, right=True).to(torch.int32)
    return pairs, block_expert, pad_end[-1:].to(torch.int32)


_naive_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def align_naive(flat_ids: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair p alone in block p (row 0); the layout is a constant of (n, block_m), cached."""
    n = flat_ids.numel()
    key = (n, block_m, flat_ids.device)
    if key not in _naive_cache:
        pairs = torch.full((n, block_m), n, dtype=torch.int32, device=flat_ids.device)
        pairs[:, 0] = torch.arange(n, dtype=torch.int32, device=flat_ids.device)
        total = torch.tensor([n * block_m], dtype=torch.int32, device=flat_ids.device)
        _naive_cache[key] = (pairs.view(-1), total)
    pairs, total = _naive_cache[key]
    return pairs, flat_ids, total


if HAS_TRITON:
    from hybrid.ops.triton_guard import pdl_wait

    @triton.jit
    def _count_experts(ids_ptr, begin, end, EP: tl.constexpr, CHUNK: tl.constexpr):
        """[EP] the pairs in [begin, end) routed to each expert."""
        experts = tl.arange(0, EP)
        counts = tl.zeros([EP], dtype=tl.int32)
        for start in range(begin, end, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + offs, mask=offs < end, other=-1).to(tl.int32)
            counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        return counts

    @triton.jit
    def _store_block_experts(block_expert_ptr, pad_end, num_blocks, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
        """Each block's expert: the one whose padded group [pad_end - padded, pad_end) holds its first row."""
        for start in range(0, num_blocks, CHUNK):
            b = start + tl.arange(0, CHUNK)
            e = tl.sum((pad_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, e, mask=b < num_blocks)

    @triton.jit
    def _place_pairs(ids_ptr, pairs_ptr, begin, end, next_row, EP: tl.constexpr, CHUNK: tl.constexpr):
        """The pairs in [begin, end) into their rows, chunk by chunk in pair order: a pair's row is
        next_row[its expert] (the expert's first free row) plus the same-expert pairs before it."""
        experts = tl.arange(0, EP)
        for start in range(begin, end, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + offs, mask=offs < end, other=-1).to(tl.int32)
            hit = (ids[:, None] == experts[None, :]).to(tl.int32)
            earlier = tl.cumsum(hit, axis=0) - hit
            dest = tl.sum(hit * (earlier + next_row[None, :]), axis=1)
            tl.store(pairs_ptr + dest, offs, mask=offs < end)
            next_row += tl.sum(hit, axis=0)

    @triton.jit
    def _align_kernel(ids_ptr, n, pairs_ptr, block_expert_ptr, total_ptr, num_rows, num_blocks,
                      BLOCK_M: tl.constexpr, EP: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # One program: counts per expert, padded offsets, then each pair's place (its expert's offset
        # plus the number of same-expert pairs before it), chunk by chunk in pair order.
        counts = _count_experts(ids_ptr, 0, n, EP, CHUNK)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pad_end = tl.cumsum(padded, axis=0)
        tl.store(total_ptr, tl.sum(padded, axis=0))
        sentinel = tl.full([CHUNK], 0, tl.int32) + n
        for start in range(0, num_rows, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            tl.store(pairs_ptr + offs, sentinel, mask=offs < num_rows)
        _store_block_experts(block_expert_ptr, pad_end, num_blocks, BLOCK_M, CHUNK)
        tl.debug_barrier()  # the sentinel fill above must land before the pairs below
        _place_pairs(ids_ptr, pairs_ptr, 0, n, pad_end - padded, EP, CHUNK)

    @triton.jit
    def _align_count_kernel(ids_ptr, n, counts_ptr, per_program, EP: tl.constexpr, CHUNK: tl.constexpr,
                            PDL: tl.constexpr):
        # counts[p, e]: the pairs of program p's slice [p * per_program, ...) routed to expert e
        pdl_wait(PDL)
        p = tl.program_id(0)
        begin = p * per_program
        counts = _count_experts(ids_ptr, begin, tl.minimum(begin + per_program, n), EP, CHUNK)
        tl.store(counts_ptr + p * EP + tl.arange(0, EP), counts)

    @triton.jit
    def _align_offsets_kernel(counts_ptr, base_ptr, block_expert_ptr, total_ptr, num_programs, num_blocks,
                              BLOCK_M: tl.constexpr, EP: tl.constexpr, PP: tl.constexpr, CHUNK: tl.constexpr,
                              PDL: tl.constexpr):
        # One program: each expert's group padded to BLOCK_M and laid out in expert order (as
        # _align_kernel does); base[p, e]: where program p's pairs of expert e start.
        pdl_wait(PDL)
        experts = tl.arange(0, EP)
        progs = tl.arange(0, PP)
        counts = tl.load(counts_ptr + progs[:, None] * EP + experts[None, :], mask=(progs < num_programs)[:, None],
                         other=0)
        per_expert = tl.sum(counts, axis=0)
        padded = (per_expert + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pad_end = tl.cumsum(padded, axis=0)
        tl.store(total_ptr, tl.sum(padded, axis=0))
        base = (pad_end - padded)[None, :] + tl.cumsum(counts, axis=0) - counts
        tl.store(base_ptr + progs[:, None] * EP + experts[None, :], base, mask=(progs < num_programs)[:, None])
        _store_block_experts(block_expert_ptr, pad_end, num_blocks, BLOCK_M, CHUNK)

    @triton.jit
    def _align_place_kernel(ids_ptr, n, base_ptr, pairs_ptr, per_program, EP: tl.constexpr, CHUNK: tl.constexpr,
                            PDL: tl.constexpr):
        # program p's pairs into their places (the rows past each expert's pairs keep the sentinel
        # the caller filled in)
        pdl_wait(PDL)
        p = tl.program_id(0)
        begin = p * per_program
        _place_pairs(ids_ptr, pairs_ptr, begin, tl.minimum(begin + per_program, n),
                     tl.load(base_ptr + p * EP + tl.arange(0, EP)), EP, CHUNK)

    @triton.jit
    def _moe_gemm_kernel(a_ptr, b_ptr, s_ptr, c_ptr, w_ptr, pairs_ptr, block_expert_ptr, total_ptr,
                         N, K, num_pairs, a_div, num_m_blocks, num_experts, s_am, s_be, s_bn, s_sn, s_se,
                         s_up, s_cm, ACT: tl.constexpr, MUL_W: tl.constexpr, HAS_SHARED: tl.constexpr,
                         IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EARLY_B: tl.constexpr,
                         PDL: tl.constexpr):
        # C[p, :N] = act(A[p // a_div] @ W_e.T) (* w[p]) for the pairs p of each block (expert e).
        # W_e: b + e*s_be (rows s_bn apart; gated: the up rows N rows below the gate rows), or for
        # e >= num_experts the shared pseudo-expert s = e - num_experts: s_ptr + s*s_se (rows s_sn
        # apart; up rows s_up further). K is contiguous in both.
        # EARLY_B (the second GEMM): the blocks, pairs and routing weights were written before the
        # first GEMM, i.e. (under PDL) by kernels that are complete when this one starts, and nothing
        # writes W: they and the first W tile load before the wait; only A (the first GEMM's
        # output) waits. Otherwise the wait comes first.
        if not EARLY_B:
            pdl_wait(PDL)
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n  # GROUP_M row blocks walk the column tiles together (L2 reuse)
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        live = pid_m * BLOCK_M < tl.load(total_ptr)  # blocks past the padded total have no expert
        if not EARLY_B:
            if not live:
                return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pair < num_pairs
        a_row = (pair // a_div).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row[:, None] * s_am + offs_k[None, :]
        w_base = b_ptr + expert * s_be
        row_stride = s_bn
        up_off = N * s_bn
        if HAS_SHARED:
            if expert >= num_experts:
                w_base = s_ptr + (expert - num_experts) * s_se
                row_stride = s_sn
                up_off = s_up
        b_ptrs = w_base + offs_n[None, :].to(tl.int64) * row_stride + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if EARLY_B:  # (ACT_NONE: one W tile a step) the first K step peeled, its W tile before the wait
            k_ok = offs_k < K
            b = tl.load(b_ptrs, mask=live & k_ok[:, None] & n_ok[None, :], other=0.0)
            pdl_wait(PDL)
            if not live:
                return
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
            for k0 in range(BLOCK_K, K, BLOCK_K):
                k_ok = offs_k < K - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if IEEE:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
        else:
            for k0 in range(0, K, BLOCK_K):
                k_ok = offs_k < K - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if IEEE:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
                if ACT == 2:
                    b_up = tl.load(b_ptrs + up_off, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                    if IEEE:
                        acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
                    else:
                        acc_up = tl.dot(a, b_up, acc_up)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
        if ACT == 1:
            acc = tl.maximum(acc, 0.0)
            acc = acc * acc
        if ACT == 2:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if MUL_W:
            acc = acc * tl.load(w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * s_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit
    def expert_sum(y_ptr, add_ptr, t, offs, mask, H, TOP_K: tl.constexpr, HAS_ADD: tl.constexpr):
        """Token t's sum over its TOP_K expert rows of y [T * TOP_K, H] (+ add [T, H]) at columns
        offs, in fp32 and in a fixed order (also inlined by triton_norm.sum_add_rms_norm)."""
        acc = tl.zeros(offs.shape, dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            acc += tl.load(y_ptr + (t * TOP_K + j) * H + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_ADD:
            acc += tl.load(add_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
        return acc

    @triton.jit
    def _sum_k_kernel(y_ptr, add_ptr, out_ptr, H, TOP_K: tl.constexpr, HAS_ADD: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        acc = expert_sum(y_ptr, add_ptr, t, offs, mask, H, TOP_K, HAS_ADD)
        tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


if HAS_TRITON:

    @triton.jit
    def router_split(w_ptr, s_w, E, K, k_per_split, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (t, e block, split) of a split-K router launch over the router weight [E, K]:
        (offs_e, e_ok, k_begin, k_end, w_rows, wv) with wv its first [BLOCK_E, BLOCK_K] weight tile in
        fp32 (usually its only one), read at once: no kernel writes the weight, so before the PDL wait."""
        offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = offs_e < E
        k_begin = tl.program_id(2) * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, K)
        w_rows = w_ptr + offs_e[:, None].to(tl.int64) * s_w
        offs_k = k_begin + tl.arange(0, BLOCK_K)
        wv = tl.load(w_rows + offs_k[None, :], mask=e_ok[:, None] & (offs_k < k_end)[None, :], other=0.0)
        return offs_e, e_ok, k_begin, k_end, w_rows, wv.to(tl.float32)

    @triton.jit
    def _router_partial_kernel(x_ptr, w_ptr, out_ptr, T, E, K, s_x, s_w, k_per_split,
                               BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        # partial[s, t, e] = sum over split s's slice of K of x[t, k] * w[e, k], in fp32. A step of few
        # tokens reads the router weight from many programs at once (a [T, E] GEMM has too few output
        # tiles to fill the GPU); _route_kernel adds the splits in a fixed order (no atomics).
        t = tl.program_id(0).to(tl.int64)
        offs_e, e_ok, k_begin, k_end, w_rows, wv = router_split(w_ptr, s_w, E, K, k_per_split, BLOCK_E, BLOCK_K)
        pdl_wait(PDL)
        acc = tl.zeros([BLOCK_E], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_end
            if k0 > k_begin:
                wv = tl.load(w_rows + offs_k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + t * s_x + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            acc += tl.sum(wv * xv[None, :], axis=1)
        tl.store(out_ptr + (tl.program_id(2) * T + t) * E + offs_e, acc, mask=e_ok)

    @triton.jit
    def _route_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, E, s_l, s_split, scale, TOP_K: tl.constexpr,
                      KP: tl.constexpr, EP: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                      NORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr, SP: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        # One token per program: the k best experts by repeated argmax over the row (E <= a few
        # hundred); KP, EP, SP: k, E and NUM_SHARED padded to powers of two for the register tiles.
        # The logits are the sum of NUM_SPLITS partial rows s_split apart (1: the logits themselves),
        # rounded to bf16 (ROUND 1) or fp16 (2) first where the reference router computes in that dtype.
        # Output row: the k routed (id, weight), then the shared pseudo-experts (E + s, 1.0).
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, EP)
        ok = e < E
        logits = tl.load(logits_ptr + t * s_l + e, mask=ok, other=0.0).to(tl.float32)
        for s in tl.static_range(1, NUM_SPLITS):
            logits += tl.load(logits_ptr + s * s_split + t * s_l + e, mask=ok, other=0.0)
        if ROUND == 1:
            logits = logits.to(tl.bfloat16).to(tl.float32)
        if ROUND == 2:
            logits = logits.to(tl.float16).to(tl.float32)
        logits = tl.where(ok, logits, float("-inf"))
        if SIGMOID:
            scores = 1.0 / (1.0 + tl.exp(-logits))
        else:
            scores = logits
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
        choice = tl.where(ok, choice, float("-inf"))
        ks = tl.arange(0, KP)
        real = ks < TOP_K
        top_idx = tl.zeros([KP], dtype=tl.int32)
        top_s = tl.zeros([KP], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.argmax(choice, axis=0)
            top_idx = tl.where(ks == j, best, top_idx)
            top_s = tl.where(ks == j, tl.sum(tl.where(e == best, scores, 0.0), axis=0), top_s)
            choice = tl.where(e == best, float("-inf"), choice)
        if SIGMOID:
            w = top_s
            if NORMALIZE:
                w = w / (tl.sum(tl.where(real, w, 0.0), axis=0) + 1e-20)
        else:  # softmax over the k chosen logits
            top_s = tl.where(real, top_s, float("-inf"))
            w = tl.exp(top_s - tl.max(top_s, axis=0))
            w = w / tl.sum(w, axis=0)
        row = t * (TOP_K + NUM_SHARED)
        tl.store(idx_ptr + row + ks, top_idx, mask=real)
        tl.store(w_ptr + row + ks, w * scale, mask=real)
        if NUM_SHARED > 0:
            ss = tl.arange(0, SP)
            tl.store(idx_ptr + row + TOP_K + ss, E + ss, mask=ss < NUM_SHARED)
            tl.store(w_ptr + row + TOP_K + ss, tl.full([SP], 1.0, tl.float32), mask=ss < NUM_SHARED)


def route(logits: torch.Tensor, top_k: int, *, sigmoid: bool, bias: torch.Tensor | None = None,
          normalize: bool = False, scale: float = 1.0, num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing in one launch: (top_idx [T, k + num_shared] int32, top_w [T, k + num_shared] fp32)
    from router logits [T, E] (any float dtype). sigmoid: NemotronH (experts chosen by sigmoid(logit)
    + bias, weighted by sigmoid(logit), optionally normalised over the k, times `scale`); else
    Granite (the top-k logits, softmax over them). The last num_shared columns are the shared
    expert's slices for fused_experts: ids E .. E+num_shared-1, weight 1."""
    require(__name__)
    T, E = logits.shape
    assert logits.stride(1) == 1 and top_k <= E
    return _route_rows(logits, logits.stride(0), 0, 1, 0, T, E, top_k, sigmoid=sigmoid, bias=bias,
                       normalize=normalize, scale=scale, num_shared=num_shared)


def _route_rows(logits, s_l, s_split, num_splits, round_to, T, E, top_k, *, sigmoid, bias, normalize, scale,
                num_shared) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing launch over T rows of logits (or of NUM_SPLITS partial sums): (idx, w)."""
    width = top_k + num_shared
    idx = torch.empty(T, width, dtype=torch.int32, device=logits.device)
    w = torch.empty(T, width, dtype=torch.float32, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, bias if bias is not None else logits, idx, w, E, s_l, s_split, scale,
                            TOP_K=top_k, KP=triton.next_power_of_2(top_k), EP=triton.next_power_of_2(E),
                            SIGMOID=sigmoid, HAS_BIAS=bias is not None, NORMALIZE=normalize,
                            NUM_SHARED=num_shared, SP=triton.next_power_of_2(max(num_shared, 1)),
                            NUM_SPLITS=num_splits, ROUND=round_to, num_warps=1 if E <= 256 else 4,
                            **pdl_options(logits.device))
    return idx, w


# Steps of at most this many tokens compute the router logits with _router_partial_kernel (split over
# the hidden size, so that even one token reads the router weight from many SMs), which the routing
# launch then sums: two launches in place of the GEMM (and for NemotronH's fp32 router, the cast of x)
# plus the routing one. Past it a [T, E] GEMM has tiles enough of its own.
ROUTER_FUSED_MAX_TOKENS = 16
# One [16, 64] weight tile per program (up to 64 K splits): the H200 profile of (32, 128, 8 splits)
# showed 6.7 us a layer for NemotronH's 1.4 MB fp32 router (28 programs, each looping over three
# tiles: latency-bound), no faster than the GEMM it replaced; bench/bench_router.py compares tilings.
_ROUTER_BLOCK_E, _ROUTER_BLOCK_K, _ROUTER_SPLITS = 16, 64, 64
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def route_hidden(x: torch.Tensor, weight: torch.Tensor, top_k: int, *, logits_dtype: torch.dtype, sigmoid: bool,
                 bias: torch.Tensor | None = None, normalize: bool = False, scale: float = 1.0,
                 num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` of the router logits x [T, H] @ weight [E, H].T computed as the reference does in
    `logits_dtype` (NemotronH: fp32 from fp32 x and weight; Granite: the model dtype, i.e. an fp32
    sum rounded once): for few tokens in two launches (see ROUTER_FUSED_MAX_TOKENS), else a GEMM
    and the routing launch."""
    require(__name__)
    T, H = x.shape
    E = weight.shape[0]
    if T > ROUTER_FUSED_MAX_TOKENS or T == 0:
        logits = torch.nn.functional.linear(x.to(logits_dtype), weight.to(logits_dtype))
        return route(logits, top_k, sigmoid=sigmoid, bias=bias, normalize=normalize, scale=scale,
                     num_shared=num_shared)
    assert x.stride(1) == 1 and weight.stride(1) == 1 and top_k <= E
    bk, be, splits, k_per_split = router_tiling(H, E)
    partial = torch.empty(splits, T, E, dtype=torch.float32, device=x.device)
    _router_partial_kernel[(T, cdiv(E, be), splits)](
        x, weight, partial, T, E, H, x.stride(0), weight.stride(0), k_per_split,
        BLOCK_E=be, BLOCK_K=bk, num_warps=4, **pdl_options(x.device))
    return route_partials(partial, T, E, top_k, logits_dtype=logits_dtype, sigmoid=sigmoid, bias=bias,
                          normalize=normalize, scale=scale, num_shared=num_shared)


def router_tiling(H: int, E: int) -> tuple[int, int, int, int]:
    """(BLOCK_K, BLOCK_E, splits, k_per_split) of the split-K router launch over hidden size H."""
    k_blocks = cdiv(H, _ROUTER_BLOCK_K)
    k_per_split = cdiv(k_blocks, _ROUTER_SPLITS) * _ROUTER_BLOCK_K
    return _ROUTER_BLOCK_K, _ROUTER_BLOCK_E, cdiv(H, k_per_split), k_per_split


def route_partials(partial: torch.Tensor, T: int, E: int, top_k: int, *, logits_dtype: torch.dtype, sigmoid: bool,
                   bias: torch.Tensor | None, normalize: bool, scale: float,
                   num_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing launch over the split-K partials [splits, T, E] of the router logits."""
    return _route_rows(partial, E, T * E, partial.shape[0], _ROUND[logits_dtype], T, E, top_k, sigmoid=sigmoid,
                       bias=bias, normalize=normalize, scale=scale, num_shared=num_shared)


# Kernel configurations per regime: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages).
# Decode (few rows per expert): weight streaming, narrow column tiles for enough programs in flight.
# Prefill: compute-bound tiles. bench/bench_moe_kernels.py sweeps alternatives on the device.
CONFIGS = {
    "decode": (16, 64, 128, 1, 4, 4),
    "decode_wide": (32, 64, 128, 1, 4, 4),
    "prefill": (128, 256, 64, 8, 8, 3),
    "prefill_gated": (128, 128, 64, 8, 8, 3),  # two B tiles: (128, 256) is over the shared memory
}


def pick_config(num_pairs: int, num_experts: int, gated: bool) -> str:
    # measured on the H200 (bench/bench_moe_kernels.py): 16-row blocks while an expert averages at
    # most 16 pairs, 32-row ones above that, the prefill tiles past the one-program alignment's range
    if num_pairs <= TRITON_ALIGN_MAX_PAIRS:
        return "decode" if num_pairs <= 16 * num_experts else "decode_wide"
    return "prefill_gated" if gated else "prefill"


ALIGN_PROGRAMS = 64  # the counting sort's programs (at most): each places n / 64 pairs


def align_counting(flat_ids: torch.Tensor, num_experts: int, block_m: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The counting-sort alignment (module docstring): three launches and a fill, for any n."""
    require(__name__)
    n = flat_ids.numel()
    nb = max_blocks(n, num_experts, block_m)
    dev = flat_ids.device
    ep = triton.next_power_of_2(num_experts)
    chunk = max(16, min(128, 8192 // ep))
    per_program = chunk * cdiv(cdiv(n, ALIGN_PROGRAMS), chunk)
    programs = cdiv(n, per_program)
    counts = torch.empty(programs, ep, dtype=torch.int32, device=dev)
    base = torch.empty(programs, ep, dtype=torch.int32, device=dev)
    pairs = torch.full((nb * block_m,), n, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    pdl = pdl_options(dev)
    _align_count_kernel[(programs,)](flat_ids, n, counts, per_program, EP=ep, CHUNK=chunk, num_warps=4, **pdl)
    _align_offsets_kernel[(1,)](counts, base, block_expert, total, programs, nb, BLOCK_M=block_m, EP=ep,
                                PP=triton.next_power_of_2(programs), CHUNK=chunk, num_warps=8, **pdl)
    _align_place_kernel[(programs,)](flat_ids, n, base, pairs, per_program, EP=ep, CHUNK=chunk, num_warps=4, **pdl)
    return pairs, block_expert, total


def align(flat_ids: torch.Tensor, num_experts: int, block_m: int, method: str | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pairs, block_expert, total): see the module docstring; `method` forces
    naive|triton|counting|torch."""
    n = flat_ids.numel()
    if method is None:
        method = "naive" if n <= NAIVE_MAX_PAIRS else "triton" if n <= TRITON_ALIGN_MAX_PAIRS else "counting"
    if method == "naive":
        return align_naive(flat_ids, block_m)
    if method == "torch":
        return align_torch(flat_ids, num_experts, block_m)
    if method == "counting":
        return align_counting(flat_ids, num_experts, block_m)
    require(__name__)
    nb = max_blocks(n, num_experts, block_m)
    dev = flat_ids.device
    pairs = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    ep = triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](flat_ids, n, pairs, block_expert, total, nb * block_m, nb, BLOCK_M=block_m, EP=ep,
                        CHUNK=max(16, min(128, 8192 // ep)), num_warps=8, **pdl_options(dev))
    return pairs, block_expert, total


_sm_count: dict = {}
_SMEM_BUDGET = 200 * 1024  # bytes of pipelined tiles per program (the H100/H200 limit is 227 KiB)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # (the CPU interpreter: any figure does)
    if device not in _sm_count:
        _sm_count[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_count[device]


def _grouped_gemm(a, w, shared, out, weights, pairs, block_expert, total, a_div, act, cfg, narrow: bool,
                  early_b: bool = False) -> None:
    """One grouped GEMM launch. `shared`: (tensor, row stride, pseudo-expert stride, up-row offset)
    or None. `narrow`: halve BLOCK_N (down to 16) while the launch has under two programs per SM,
    so that a decode step with few pairs still streams the weights from every SM. `early_b`: the
    blocks were aligned before the previous launch (the second GEMM): see _moe_gemm_kernel."""
    bm, bn, bk, gm, warps, stages = cfg
    # fp32 operands (tests, fp32 models) take twice the shared memory of the bf16 tiles the configs
    # were tuned for: fewer pipeline stages, then shorter K steps, until the buffers fit
    tile_bytes = lambda: stages * (bm * bk + (2 if act == ACT_SILU_MUL else 1) * bk * bn) * a.element_size()
    while stages > 2 and tile_bytes() > _SMEM_BUDGET:
        stages -= 1
    while bk > 32 and tile_bytes() > _SMEM_BUDGET:
        bk //= 2
    n_out = out.shape[1]
    nb = block_expert.shape[0]
    if narrow:  # (32: the narrowest tile measured on the H200, bench/bench_moe_kernels.py)
        while bn > 32 and nb * cdiv(n_out, bn) < 2 * _num_sms(a.device):
            bn //= 2
    s_t, s_sn, s_se, s_up = shared if shared is not None else (w, 0, 0, 0)
    pdl = pdl_options(a.device)
    _moe_gemm_kernel[(nb * cdiv(n_out, bn),)](
        a, w, s_t, out, weights if weights is not None else out, pairs, block_expert, total,
        n_out, a.shape[1], out.shape[0], a_div, nb, w.shape[0], a.stride(0), w.stride(0), w.stride(1),
        s_sn, s_se, s_up, out.stride(0),
        ACT=act, MUL_W=weights is not None, HAS_SHARED=shared is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, EARLY_B=early_b and act == ACT_NONE,
        num_warps=warps, num_stages=stages, **pdl,
    )


# The shared expert joins the expert launches only for steps of at most this many tokens: then each
# of its slices is one 16-row block, streamed once, and the step saves the shared MLP's three
# launches. Above it a slice would span several blocks, each streaming the slice's weights again
# (the shared MLP then runs on its own, through cuBLAS).
SHARED_FOLD_MAX_TOKENS = 16


def num_shared_pseudo_experts(shared_down: torch.Tensor | None, inter: int) -> int:
    """How many expert-wide slices the shared expert's down weight [H, S*I] makes (0: none)."""
    return 0 if shared_down is None else shared_down.shape[1] // inter


@dataclass
class ExpertRows:
    """The experts' weighted outputs before their sum over k: y [T * top_k, H] (row t * top_k + j:
    token t's j-th choice, already times its routing weight) and `add` [T, H] or None. `sum()` is
    what fused_experts returns; triton_norm.sum_add_rms_norm folds the same sum into the next
    layer's residual add and norm (one launch fewer a layer, the same rounding)."""

    y: torch.Tensor
    add: torch.Tensor | None
    top_k: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.y.shape[0] // self.top_k, self.y.shape[1]))

    def sum(self) -> torch.Tensor:
        T, H = self.shape
        out = torch.empty(T, H, dtype=self.y.dtype, device=self.y.device)
        if T:
            block = min(1024, triton.next_power_of_2(H))
            _sum_k_kernel[(T, cdiv(H, block))](self.y, self.add if self.add is not None else self.y, out, H,
                                                  TOP_K=self.top_k, HAS_ADD=self.add is not None, BLOCK=block,
                                                  num_warps=4, **pdl_options(self.y.device))
        return out


def fused_experts(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, top_idx: torch.Tensor,
                  top_w: torch.Tensor, gated: bool, add: torch.Tensor | None = None, *,
                  shared_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
                  config: tuple | None = None, align_method: str | None = None,
                  defer_sum: bool = False) -> torch.Tensor | ExpertRows:
    """The routed experts' output [T, H] in x.dtype (+ `add`); see the module docstring. With
    `defer_sum`, the ExpertRows that sum to it (for the next norm to add up: ExpertRows).

    With shared_up [S*I or 2*S*I, H] ([gate | up] rows when gated) and shared_down [H, S*I] the
    shared expert (of S times the expert width) joins the same launches as S pseudo-experts
    E .. E+S-1, each an I-wide slice of it: top_idx / top_w then carry S more columns, ids E+s with
    weight 1 (`route(..., num_shared=S)` writes them). The slices' outputs add up to the shared MLP's."""
    require(__name__)
    T, H = x.shape
    E, width, _ = w_up.shape
    inter = w_down.shape[2]
    top_k = top_idx.shape[1]
    assert x.stride(1) == 1 and w_up.stride(2) == 1 and w_down.stride(2) == 1
    assert width == (2 * inter if gated else inter)
    S = num_shared_pseudo_experts(shared_down, inter)
    up_shared = down_shared = None
    if S:
        s_width = S * inter
        assert shared_down.shape == (H, s_width) and shared_up.shape == ((2 if gated else 1) * s_width, H)
        assert shared_up.stride(1) == 1 and shared_down.stride(1) == 1
        up_shared = (shared_up, shared_up.stride(0), inter * shared_up.stride(0), s_width * shared_up.stride(0))
        down_shared = (shared_down, shared_down.stride(0), inter, 0)
    if T == 0:
        return torch.empty(T, H, dtype=x.dtype, device=x.device)
    n = T * top_k
    cfg = config or CONFIGS[pick_config(n, E + S, gated)]
    if align_method is None and S and T > 1 and n <= NAIVE_MAX_PAIRS:
        align_method = "triton"  # naive blocks would stream the shared slices once per token
    pairs, block_expert, total = align(top_idx.reshape(-1), E + S, cfg[0], align_method)
    narrow = config is None and cfg[0] == 16
    h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w_up, up_shared, h, None, pairs, block_expert, total, top_k,
                  ACT_SILU_MUL if gated else ACT_RELU2, cfg, narrow)
    y = torch.empty(n, H, dtype=x.dtype, device=x.device)
    _grouped_gemm(h, w_down, down_shared, y, top_w.reshape(-1).contiguous(), pairs, block_expert, total, 1,
                  ACT_NONE, cfg, narrow, early_b=True)
    if add is not None:
        assert add.shape == (T, H) and add.stride(1) == 1 and add.stride(0) == H
    rows = ExpertRows(y, add, top_k)
    return rows if defer_sum else rows.sum()
