"""The sampler's fallback kernel (CUDA): for the rows of a step whose kept tokens the top-k prefilter
does not provably cover (hybrid/sampling.py: sample_tokens), the exact top-k / top-p / min-p cut and
the draw over the full row, one program a row, no host sync. Its reference is the torch redo in
hybrid/sampling.py (`_redo_sorted`), which it equals token for token (tests/test_sampler.py through
Triton's interpreter; tests/gpu/test_sampler_gpu.py at vocabulary 131072).

The masses are hybrid/sampling.py's fixed point, trunc(p * 2**52), held in float64: each is an integer
and every partial sum of them (of them with signs too) is an integer of magnitude at most the row's
total, below 2**53, so float64 adds them exactly, in any order. Why: an int64 add is two 32-bit
instructions with a carry, a float64 add one (on its own pipe). The bound: the fp32 softmax
p_i = e_i / s, s the rounded sum of the same e_i in any order (at least sum(e_i) * (1 - V * 2**-24)),
sums to at most (1 + 2**-23) / (1 - V * 2**-24): below 1.01 at V = 131072, below 1.5 for any V under
2**22; the truncated masses sum to at most 2**52 times that. GPUs whose float64 runs at a small fraction of
their fp32 rate (INT_MASSES, hybrid/sampling.py `int_masses`) sum int64s instead: the same integers, exact too."""
from __future__ import annotations

from hybrid.ops.triton_guard import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _fixed(p, INT: tl.constexpr):
        """fixed_point(p) (hybrid/sampling.py, p * 2**52 truncated): an int64 with INT, else a float64 (exact:
        below 2**53)."""
        w = (p * 4503599627370496.0).to(tl.int64)
        if not INT:
            w = w.to(tl.float64)
        return w

    @triton.jit
    def _top_k_probs(p_row, v_row, idx, V, kth, TOP_K: tl.constexpr):
        """The probabilities of tokens idx of a row, 0 past V and, with TOP_K, below the k-th value (a
        token outside the top-k weighs nothing anywhere). The logits are not read where kth is -inf (no
        top-k on this row): every value is >= -inf."""
        m = idx < V
        p = tl.load(p_row + idx, mask=m, other=0.0)
        if TOP_K:
            v = tl.load(v_row + idx, mask=idx < tl.where(kth > float("-inf"), V, 0), other=float("-inf"))
            p = tl.where(v >= kth, p, 0.0)
        return p

    @triton.jit
    def _kept_masses(p, cut_key, floor, INT: tl.constexpr):
        """Fixed-point masses of probabilities p (top-k applied), 0 where the top-p key or the min-p floor
        cuts a token."""
        return tl.where((p.to(tl.int32, bitcast=True) >= cut_key) & (p >= floor), _fixed(p, INT), 0)

    @triton.jit
    def _signed_masses(w, key, piv, INT: tl.constexpr):
        """+w where key > piv, -w elsewhere: summed over a row, (mass above piv) - (mass at or below piv),
        exact. The sign is that of piv - key (negative iff key > piv; both lie in [-1, 2**31), so the
        difference does not overflow) put into w's sign bit: an integer subtraction and a bitwise op per
        pivot, where a compare and a float64 select take a compare and two selects (the select is what
        bounded the pass)."""
        if INT:  # (int64 masses: a compare and a select)
            signed = tl.where(key > piv, w, -w)
        else:
            flip = (~(piv - key) & -2147483648).to(tl.int64) << 32  # 1 << 63 where key <= piv
            signed = (w.to(tl.int64, bitcast=True) ^ flip).to(tl.float64, bitcast=True)
        return signed

    @triton.jit
    def fallback_kernel(v_ptr, p_ptr, covered_ptr, top_k_ptr, kth_ptr, top_p_ptr, cut_ptr, floor_ptr, u_ptr, out_ptr,
                         V, TOP_K: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr,
                         ROWS: tl.constexpr, EPT: tl.constexpr, PIVOTS: tl.constexpr, INT_MASSES: tl.constexpr):
        """One program per row. A covered row returns at once. Otherwise: the top-p cut as the smallest
        probability bit pattern K whose mass strictly above is below top_p * total (top-p's total: the
        top-k mass, or all of it), by a PIVOTS-ary search over the bits of the non-negative fp32
        probabilities (ordered as integers); then the inverse-CDF draw over the kept tokens in vocabulary
        order, with the same fixed-point masses as the torch path.

        The search keeps `mass strictly above lo >= target > mass strictly above hi` and stops when
        hi = lo + 1 (K = hi), a pass per division of hi - lo by PIVOTS. It starts at lo = -1 (every
        token is above: the mass is the total >= target; if top_p * total exceeds the row's mass, the
        search ends at K = 0, which keeps every token, as the torch path does) and hi = the bits of
        cut_ptr[row], the prefilter's top-p cut (hybrid/sampling.py `_cuts`: the smallest candidate
        probability it keeps). Proof that the mass above it is below target: the tokens above the cut are
        all candidates (a token outside the top-C logits has a probability at most the C-th's, which is at
        most the cut), so their mass is the candidates' mass above the cut, which the prefilter found below
        top_p times the candidates' total; the candidates' total is at most the row's. (It relies on
        probabilities that do not rise as logits fall, as the prefilter and the torch path do.) The rows
        that fall back (cuts near 1e-4) take 10 passes, the full range 11.

        Each search pass reads the row in tiles of ROWS x EPT tokens (as 16-byte pieces of 4) and
        adds, per pivot, each token's mass signed by whether it lies above the pivot (_signed_masses)
        into per-thread float64 sums, which the program reduces once a pass. Pivot 0 is -1, whose sum
        is the row's total T (the top-k mass, top-p's total with top-k, which needs no pass of its own),
        and the mass above pivot q is (sum_q + T) / 2. When the search ends with the floor at or below
        the cut (no min-p, or a looser one), the kept mass is the mass above lo, known: no pass.

        The draw reads the row in tiles of ROWS x EPT consecutive tokens (row-major: vocabulary order)
        and skips to the tile holding its token."""
        row = tl.program_id(0).to(tl.int64)
        cov = tl.load(covered_ptr + row)
        if cov == 0:
            v_row = v_ptr + row * V
            p_row = p_ptr + row * V
            BLOCK: tl.constexpr = ROWS * EPT
            SUB: tl.constexpr = EPT // 4  # search / kept-mass tiles: 4 consecutive tokens a thread-row
            tile3 = tl.arange(0, ROWS)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [1, ROWS, 4]
            kth = float("-inf")
            has_k = cov != cov  # False
            if TOP_K:
                kth = tl.load(kth_ptr + row)  # -inf where top_k is off
                has_k = tl.load(top_k_ptr + row) > 0  # (kth may be -inf: fewer finite logits than k)
            floor = 0.0
            if MIN_P:
                floor = tl.load(floor_ptr + row)
            kept_total = tl.full([], -1.0, tl.float64)  # the kept tokens' mass, once known
            cut_key = cov * 0  # int32 0: keeps every probability
            if TOP_P:
                top_p = tl.load(top_p_ptr + row)
                if top_p < 1.0:
                    jj = tl.arange(0, PIVOTS)
                    lo = cov * 0 - 1
                    hi = tl.minimum(tl.maximum(tl.load(cut_ptr + row).to(tl.int32, bitcast=True), 0), 0x7F800000)
                    lo_mass2 = tl.full([], -1.0, tl.float64)  # twice the mass above lo, once measured
                    while hi - lo > 1:
                        step = (hi - lo + PIVOTS - 1) // PIVOTS
                        piv = tl.where(jj == 0, -1, tl.minimum(lo + jj * step, hi))
                        piv3 = piv[:, None, None]
                        if INT_MASSES:
                            acc = tl.zeros([PIVOTS, ROWS], dtype=tl.int64)
                        else:
                            acc = tl.zeros([PIVOTS, ROWS], dtype=tl.float64)
                        for start in range(0, V, BLOCK):
                            for s in tl.static_range(SUB):
                                p = _top_k_probs(p_row, v_row, start + s * (ROWS * 4) + tile3, V, kth, TOP_K)
                                acc += tl.sum(_signed_masses(_fixed(p, INT_MASSES), p.to(tl.int32, bitcast=True),
                                                             piv3, INT_MASSES), axis=2)
                        sums = tl.sum(acc, axis=1).to(tl.float64)  # (|sum| <= the total < 2**53: exact)
                        row_mass = tl.sum(tl.where(jj == 0, sums, 0.0), axis=0)  # pivot -1: all above
                        total = tl.where(has_k, row_mass, 4503599627370496.0)  # without top-k: FIXED_ONE
                        target2 = 2.0 * (total * top_p)  # (as the torch path's target, doubled: exact)
                        mass2 = sums + row_mass  # twice the mass above each pivot, exact (even, < 2**54)
                        big = (mass2 >= target2) & (jj > 0)  # a prefix of pivots 1.. (mass falls with the key)
                        lo_mass2 = tl.where(lo < 0, 2.0 * row_mass, lo_mass2)
                        lo_mass2 = tl.minimum(lo_mass2, tl.min(tl.where(big, mass2, float("inf")), axis=0))
                        lo = tl.maximum(lo, tl.max(tl.where(big, piv, -1), axis=0))
                        hi = tl.minimum(hi, tl.min(tl.where(big | (jj == 0), hi, piv), axis=0))
                    cut_key = hi  # kept: mass strictly above < target, i.e. key >= hi
                    if lo_mass2 >= 0.0:
                        if floor <= hi.to(tl.float32, bitcast=True):  # the floor keeps all that the cut keeps
                            kept_total = 0.5 * lo_mass2
            if kept_total < 0.0:
                if INT_MASSES:
                    acc1 = tl.zeros([1, ROWS, 4], dtype=tl.int64)
                else:
                    acc1 = tl.zeros([1, ROWS, 4], dtype=tl.float64)
                for start in range(0, V, BLOCK):
                    for s in tl.static_range(SUB):
                        p = _top_k_probs(p_row, v_row, start + s * (ROWS * 4) + tile3, V, kth, TOP_K)
                        acc1 += _kept_masses(p, cut_key, floor, INT_MASSES)
                kept_total = tl.sum(tl.sum(tl.sum(acc1, axis=2), axis=1), axis=0).to(tl.float64)
            # the draw: inverse CDF over the kept tokens' masses in vocabulary order
            u = tl.load(u_ptr + row)
            t = tl.minimum((u * kept_total).to(tl.int64), kept_total.to(tl.int64) - 1)
            t = tl.maximum(t, 0).to(tl.float64)
            tile = tl.arange(0, ROWS)[:, None] * EPT + tl.arange(0, EPT)[None, :]
            running = kept_total * 0.0
            found = row * 0 + V
            for start in range(0, V, BLOCK):
                if running <= t:  # the token lies in this tile or a later one
                    idx = start + tile
                    w = _kept_masses(_top_k_probs(p_row, v_row, idx, V, kth, TOP_K), cut_key, floor,
                                     INT_MASSES).to(tl.float64)
                    row_mass = tl.sum(w, axis=1)
                    tile_mass = tl.sum(row_mass, axis=0)
                    if running + tile_mass > t:  # the tile holding it: scan in vocabulary order
                        before = tl.cumsum(row_mass, axis=0) - row_mass  # the tile's rows before each row
                        cum = tl.cumsum(w, axis=1) + before[:, None] + running
                        first = tl.min(tl.where((idx < V) & (cum > t), idx, V), axis=1)
                        found = tl.minimum(found, tl.min(first, axis=0).to(tl.int64))
                    running += tile_mass
            tl.store(out_ptr + row, tl.minimum(found, V - 1))
