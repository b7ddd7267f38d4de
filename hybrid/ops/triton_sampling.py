"""The sampler's fallback kernel (CUDA): for the rows of a step whose kept tokens the top-k prefilter
does not provably cover (hybrid/sampling.py: sample_tokens), the exact top-k / top-p / min-p cut and
the draw over the full row, one program a row, no host sync. Its reference is the torch redo in
hybrid/sampling.py (`_redo_sorted`), which it equals token for token (tests/test_sampler.py through
Triton's interpreter; tests/gpu/test_sampler_gpu.py at vocabulary 131072)."""
from __future__ import annotations

from hybrid.ops.triton_guard import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _fixed(p):
        return (p * 4503599627370496.0).to(tl.int64)  # fixed_point: p * 2**52, truncated

    @triton.jit
    def _top_k_masses(p_row, v_row, idx, m, kth, TOP_K: tl.constexpr):
        """(probabilities, fixed-point masses) of the tile idx of a row: the mass 0 past V and, with TOP_K, below
        the k-th value."""
        p = tl.load(p_row + idx, mask=m, other=0.0)
        w = tl.where(m, _fixed(p), 0)
        if TOP_K:
            v = tl.load(v_row + idx, mask=m, other=float("-inf"))
            w = tl.where(v >= kth, w, 0)
        return p, w

    @triton.jit
    def _kept_masses(p_row, v_row, idx, m, cut_key, floor, kth, TOP_K: tl.constexpr):
        """Fixed-point masses of the tile idx of a row, 0 where a token is cut (top-p key, min-p floor,
        top-k value)."""
        p, w = _top_k_masses(p_row, v_row, idx, m, kth, TOP_K)
        return tl.where((p.to(tl.int32, bitcast=True) >= cut_key) & (p >= floor), w, 0)

    @triton.jit
    def fallback_kernel(v_ptr, p_ptr, covered_ptr, top_k_ptr, kth_ptr, top_p_ptr, floor_ptr, u_ptr, out_ptr, V,
                         TOP_K: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr,
                         ROWS: tl.constexpr, EPT: tl.constexpr, PIVOTS: tl.constexpr, PASSES: tl.constexpr):
        """One program per row. A covered row returns at once. Otherwise: the top-k mass (top-p's
        total) over the full row, the top-p cut as the smallest probability bit pattern K whose mass
        strictly above is below top_p * total (a PIVOTS-ary search over the bits of the non-negative
        fp32 probabilities, ordered as integers), then the inverse-CDF draw over the kept tokens in
        vocabulary order, with the same fixed-point masses as the torch path.

        Each pass reads the row in tiles of ROWS x EPT consecutive tokens (ROWS * EPT a tile, row-major:
        vocabulary order), each thread several 16-byte loads of a tile at once, and sums along EPT (within a
        thread or a few) into per-row partial sums [ROWS, ...] that the program reduces once a pass. Why: one
        program streams a whole row, so its bytes in flight bound a pass; one 16-byte load a thread and a
        reduction across warps every 1024 tokens held a pass of 256 rows of 131072 to ~0.8 TB/s."""
        row = tl.program_id(0).to(tl.int64)
        cov = tl.load(covered_ptr + row)
        if cov == 0:
            v_row = v_ptr + row * V
            p_row = p_ptr + row * V
            BLOCK: tl.constexpr = ROWS * EPT
            tile = tl.arange(0, ROWS)[:, None] * EPT + tl.arange(0, EPT)[None, :]
            kth = float("-inf")
            if TOP_K:
                kth = tl.load(kth_ptr + row)
            floor = 0.0
            if MIN_P:
                floor = tl.load(floor_ptr + row)
            zero64 = cov.to(tl.int64) * 0
            # top-p: the cut's bit pattern; 0 keeps every probability
            cut_key = cov * 0  # int32 0
            if TOP_P:
                top_p = tl.load(top_p_ptr + row)
                if top_p < 1.0:
                    total = zero64 + 4503599627370496  # without top-k: all of the mass (FIXED_ONE)
                    if TOP_K:
                        if tl.load(top_k_ptr + row) > 0:  # (kth may be -inf: fewer finite logits than k)
                            acc = tl.zeros([ROWS], dtype=tl.int64)
                            for start in range(0, V, BLOCK):
                                idx = start + tile
                                _, w = _top_k_masses(p_row, v_row, idx, idx < V, kth, TOP_K)
                                acc += tl.sum(w, axis=1)
                            total = tl.sum(acc, axis=0)
                    target = total.to(tl.float64) * top_p
                    # invariant: mass strictly above lo >= target > mass strictly above hi
                    lo = zero64 - 1
                    hi = zero64 + 0x7F800000  # +inf's bits: nothing is above it
                    jj = tl.arange(0, PIVOTS)
                    j = jj.to(tl.int64)
                    for _ in range(0, PASSES):  # each pass divides hi - lo by PIVOTS: PIVOTS**PASSES > 2**31
                        step = (hi - lo + PIVOTS - 1) // PIVOTS
                        piv = tl.minimum(lo + j * step, hi)  # piv[0] = lo
                        piv32 = piv.to(tl.int32)  # (-1 .. 0x7F800000: int32 compares)
                        acc2 = tl.zeros([ROWS, PIVOTS], dtype=tl.int64)
                        for start in range(0, V, BLOCK):
                            idx = start + tile
                            p, w = _top_k_masses(p_row, v_row, idx, idx < V, kth, TOP_K)
                            key = p.to(tl.int32, bitcast=True)
                            for q in tl.static_range(PIVOTS):
                                piv_q = tl.sum(tl.where(jj == q, piv32, 0), axis=0)  # (loop-invariant)
                                above = tl.sum(tl.where(key > piv_q, w, 0), axis=1)
                                acc2 += tl.where(jj[None, :] == q, above[:, None], 0)
                        mass = tl.sum(acc2, axis=0)
                        big = mass.to(tl.float64) >= target  # a prefix of the pivots (mass falls with the key)
                        lo = tl.max(tl.where(big, piv, lo), axis=0)
                        hi = tl.min(tl.where(big, hi, piv), axis=0)
                    cut_key = hi.to(tl.int32)  # kept: mass strictly above < target, i.e. key >= hi
            # the draw: inverse CDF over the kept tokens' masses in vocabulary order
            kept = tl.zeros([ROWS], dtype=tl.int64)
            for start in range(0, V, BLOCK):
                idx = start + tile
                kept += tl.sum(_kept_masses(p_row, v_row, idx, idx < V, cut_key, floor, kth, TOP_K), axis=1)
            kept_total = tl.sum(kept, axis=0)
            u = tl.load(u_ptr + row)
            t = tl.minimum((u * kept_total.to(tl.float64)).to(tl.int64), kept_total - 1)
            t = tl.maximum(t, 0)
            running = zero64
            found = zero64 + V
            for start in range(0, V, BLOCK):
                if running <= t:  # the token lies in this tile or a later one
                    idx = start + tile
                    m = idx < V
                    w = _kept_masses(p_row, v_row, idx, m, cut_key, floor, kth, TOP_K)
                    row_mass = tl.sum(w, axis=1)
                    tile_mass = tl.sum(row_mass, axis=0)
                    if running + tile_mass > t:  # the tile holding it: scan in vocabulary order
                        before = tl.cumsum(row_mass, axis=0) - row_mass  # the tile's rows before each row
                        cum = tl.cumsum(w, axis=1) + before[:, None] + running
                        first = tl.min(tl.where(m & (cum > t), idx, V), axis=1)
                        found = tl.minimum(found, tl.min(first, axis=0).to(tl.int64))
                    running += tile_mass
            tl.store(out_ptr + row, tl.minimum(found, V - 1))
