"""Expert alignment for the fused MoE experts (hybrid/ops/triton_moe.py, step 1 of fused_experts):
the n = T*k routed (token, expert) pairs, numbered p = t*k + j, grouped by expert, each expert's
group padded to a multiple of BLOCK_M with the sentinel n -> `pairs` [max_blocks * BLOCK_M],
`block_expert` [max_blocks] and the padded total (a 1-element tensor). max_blocks = cdiv(n, BLOCK_M)
+ min(E, n) bounds the padded total for any routing; the grouped GEMM's blocks past the total exit
at once. Every launch's shape depends on n alone (no host synchronisation, CUDA-graph capturable).
Three ways, one result shape (`align` picks by n, or `method` forces one):
- `naive` (decode at small batch, n <= NAIVE_MAX_PAIRS): every pair is its own block (its row 0),
  nothing to sort; an expert chosen twice is streamed twice, which at these sizes is rare;
- one-program Triton kernel (n <= TRITON_ALIGN_MAX_PAIRS: decode batches, verify);
- `counting` (prefill chunks): a counting sort in three launches over P programs (each counts its
  slice of the pairs per expert; one program turns the counts into each expert's padded offset and
  each program's base within it, the block experts and the total; each program places its pairs),
  with the pairs of an expert in pair order as the others keep them;
- torch ops around a stable sort (the reference of the kernels; `method="torch"`).
"""
from __future__ import annotations

import torch

from hybrid.ops.triton_guard import HAS_TRITON, pdl_options, require, tl, triton
from state_pool.util import cdiv

NAIVE_MAX_PAIRS = 32
TRITON_ALIGN_MAX_PAIRS = 4096
ALIGN_PROGRAMS = 64  # the counting sort's programs (at most): each places n / 64 pairs


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

    # Batch-dependent integer arguments (pair counts, block and program counts) are not specialised:
    # Triton compiles a kernel per value class (1, a multiple of 16, other), which a step can change
    # after the warm-up. Not listed: num_rows and per_program, always multiples of BLOCK_M / CHUNK
    # (their class never changes, and the alignment lets the fills and id loads vectorise).
    @triton.jit(do_not_specialize=["n", "num_blocks"])
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

    @triton.jit(do_not_specialize=["n"])
    def _align_count_kernel(ids_ptr, n, counts_ptr, per_program, EP: tl.constexpr, CHUNK: tl.constexpr,
                            PDL: tl.constexpr):
        # counts[p, e]: the pairs of program p's slice [p * per_program, ...) routed to expert e
        pdl_wait(PDL)
        p = tl.program_id(0)
        begin = p * per_program
        counts = _count_experts(ids_ptr, begin, tl.minimum(begin + per_program, n), EP, CHUNK)
        tl.store(counts_ptr + p * EP + tl.arange(0, EP), counts)

    @triton.jit(do_not_specialize=["num_programs", "num_blocks"])
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

    @triton.jit(do_not_specialize=["n"])
    def _align_place_kernel(ids_ptr, n, base_ptr, pairs_ptr, per_program, EP: tl.constexpr, CHUNK: tl.constexpr,
                            PDL: tl.constexpr):
        # program p's pairs into their places (the rows past each expert's pairs keep the sentinel
        # the caller filled in)
        pdl_wait(PDL)
        p = tl.program_id(0)
        begin = p * per_program
        _place_pairs(ids_ptr, pairs_ptr, begin, tl.minimum(begin + per_program, n),
                     tl.load(base_ptr + p * EP + tl.arange(0, EP)), EP, CHUNK)


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


def pick_method(num_pairs: int) -> str:
    """align's method for a step of num_pairs (token, expert) pairs."""
    return "naive" if num_pairs <= NAIVE_MAX_PAIRS else "triton" if num_pairs <= TRITON_ALIGN_MAX_PAIRS else "counting"


def align(flat_ids: torch.Tensor, num_experts: int, block_m: int, method: str | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pairs, block_expert, total): see the module docstring; `method` forces
    naive|triton|counting|torch."""
    n = flat_ids.numel()
    if method is None:
        method = pick_method(n)
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
