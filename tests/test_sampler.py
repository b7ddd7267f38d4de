"""The sampler (hybrid/sampling.py): counter-based per-request streams, the top-k prefilter and its
full-sort fallback, and the distribution it draws from.

Every test is deterministic: the draws come from seeded SampleStreams, so the empirical
distributions below are the same on every run.
"""
from __future__ import annotations

import math

import pytest
import torch

from hybrid.request import make_generator
from hybrid.sampling import (FIXED_ONE, PREFILTER_CANDIDATES, SampleStream, SamplingParams, _cuts, _Knobs,
                             sample_row, sample_tokens, splitmix64)


# ---------------------------------------------------------------- reference: today's math in float64
def reference_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filtered softmax of one row [V]: temperature, top-k (ties with the k-th kept), top-p over
    the top-k-renormalised probabilities (a token is kept when the mass strictly above it is below
    top_p), min-p relative to the top probability; renormalised, float64."""
    v = (logits.float() / p.temperature).double()  # the sampler scales in fp32
    probs = torch.softmax(v, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    V = v.numel()
    if 1 <= p.top_k < V:
        kth = torch.sort(v, descending=True).values[p.top_k - 1]
        keep &= v >= kth
    pk = torch.where(keep, probs, 0.0)
    pk = pk / pk.sum()
    if p.top_p < 1.0:
        above = torch.stack([pk[pk > x].sum() for x in pk])
        keep &= above < p.top_p
    pp = torch.where(keep, pk, 0.0)
    if p.min_p > 0.0:
        keep &= pp >= p.min_p * pp.max()
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


def draw_many(logits_row: torch.Tensor, p: SamplingParams, n: int, *, candidates: int | None = None,
              seed0: int = 0) -> torch.Tensor:
    """n tokens for the same row, each from its own stream (seed0 + i): one batched call."""
    rows = logits_row[None].expand(n, -1).contiguous()
    tokens, finite = sample_tokens(rows, [p] * n, [SampleStream(seed0 + i) for i in range(n)], candidates=candidates)
    assert finite.all()
    return tokens


def total_variation(tokens: torch.Tensor, want: torch.Tensor) -> float:
    got = torch.bincount(tokens, minlength=want.numel()).double() / tokens.numel()
    return 0.5 * float((got - want).abs().sum())


def chi_square(tokens: torch.Tensor, want: torch.Tensor) -> tuple[float, int]:
    got = torch.bincount(tokens, minlength=want.numel()).double()
    expected = want * tokens.numel()
    on = want > 0
    return float(((got[on] - expected[on]) ** 2 / expected[on]).sum()), int(on.sum()) - 1


# ---------------------------------------------------------------- the streams
def test_splitmix64_matches_the_published_generator():
    # SplitMix64 from seed 0: its state advances by the golden increment, its first outputs are these
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    assert splitmix64((2 * 0x9E3779B97F4A7C15) % 2**64) == 0x06C45D188009454F


def test_a_stream_draw_is_a_function_of_the_seed_and_the_counter():
    a, b = SampleStream(123), SampleStream(123)
    seq = [a.next_draw() for _ in range(5)]
    assert seq == [b.draw_at(i) for i in range(5)] and a.draws == 5 and b.draws == 0
    assert all(0 <= d < 2**53 for d in seq) and len(set(seq)) == 5
    assert SampleStream(123 + 2**64).draw_at(3) == seq[3]  # seeds are reduced modulo 2**64
    assert SampleStream(-1).draw_at(0) == SampleStream(2**64 - 1).draw_at(0)
    assert SampleStream(124).draw_at(0) != seq[0]


def test_make_generator_keeps_the_seed_semantics():
    sp = SamplingParams(temperature=1.0, seed=7)
    g1, g2 = make_generator(sp, 0, 0, 0), make_generator(sp, 99, 5, 0)
    assert g1.draw_at(0) == g2.draw_at(0)  # a seeded request: the engine seed and arrival play no part
    assert make_generator(sp, 0, 0, 1).draw_at(0) != g1.draw_at(0)  # each branch of n > 1 its own stream
    free = SamplingParams(temperature=1.0)
    draws = {make_generator(free, 0, arrival, 0).draw_at(0) for arrival in range(50)}
    assert len(draws) == 50  # no seed: fresh randomness per request (from the engine seed and arrival)
    assert make_generator(free, 1, 0, 0).draw_at(0) != make_generator(free, 0, 0, 0).draw_at(0)
    assert make_generator(SamplingParams(temperature=0.0), 0, 0, 0) is None


def test_one_draw_per_sampled_row_and_none_for_greedy_rows():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    gens = [SampleStream(1), SampleStream(2), SampleStream(3)]
    sample_tokens(logits, [SamplingParams(top_p=0.9), SamplingParams(temperature=0.0), None], gens)
    assert [g.draws for g in gens] == [1, 0, 0]
    g = SampleStream(5)
    t = sample_row(logits[0], SamplingParams(top_k=7), g)
    assert g.draws == 1
    # sample_row is sample_tokens on one row: same stream position, same token
    assert t == int(sample_tokens(logits[:1], [SamplingParams(top_k=7)], [SampleStream(5)])[0][0])


# ---------------------------------------------------------------- batch independence
PARAMS = [SamplingParams(top_p=0.9), SamplingParams(top_k=20), SamplingParams(min_p=0.05),
          SamplingParams(temperature=0.7), SamplingParams(top_k=50, top_p=0.8, min_p=0.02, temperature=1.3),
          SamplingParams(top_p=0.999)]


@pytest.mark.parametrize("candidates", [None, 16])
def test_a_seeded_row_samples_the_same_tokens_in_any_batch(candidates):
    """Each request alone, step by step, against batches of other sizes, orders and contents (greedy
    rows, argmax rows, a top_k=300 row that raises the prefilter size): the same tokens."""
    g = torch.Generator().manual_seed(1)
    V, steps = 512, 12
    n = len(PARAMS)
    logits = [torch.randn(n, V, generator=g) * 3 for _ in range(steps)]  # step s, request j
    alone = [[int(sample_tokens(logits[s][j:j + 1], [PARAMS[j]], [stream], candidates=candidates)[0][0])
              for s in range(steps)] for j, stream in enumerate(SampleStream(100 + j) for j in range(n))]
    extra = SamplingParams(top_k=300, top_p=0.95)
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 4, 2], [2, 4]):
        streams = {j: SampleStream(100 + j) for j in order}
        other = SampleStream(999)
        got = {j: [] for j in order}
        for s in range(steps):
            noise = torch.randn(3, V, generator=g) * 3
            rows = torch.cat([noise[:1], logits[s][order], noise[1:]])
            params = [SamplingParams(temperature=0.0)] + [PARAMS[j] for j in order] + [None, extra]
            gens = [None] + [streams[j] for j in order] + [None, other]
            tokens, _ = sample_tokens(rows, params, gens, candidates=candidates)
            assert int(tokens[0]) == int(rows[0].argmax()) and int(tokens[-2]) == int(rows[-2].argmax())
            for pos, j in enumerate(order):
                got[j].append(int(tokens[1 + pos]))
        for j in order:
            assert got[j] == alone[j], f"request {j} ({PARAMS[j]}) differs in batch order {order}"


def _random_rows(seed: int, n: int, V: int, *, flat: bool = False, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, 1, generator=g) * (0.5 if flat else 6.0) + 0.1
    x = torch.randn(n, V, generator=g) * scale
    if ties:  # bf16 logits cast to fp32: runs of equal values
        x = x.bfloat16().float()
    x[0, : V // 3] = float("-inf")  # masked tokens (a grammar, a banned EOS)
    return x


@pytest.mark.parametrize("ties", [False, True], ids=["fp32", "bf16_ties"])
@pytest.mark.parametrize("flat", [False, True], ids=["peaked", "flat"])
def test_the_prefilter_draws_the_tokens_of_the_full_sort(flat, ties):
    """Any candidate count gives the token of the exhaustive (full stable sort) path: rows the
    prefilter covers are exact from it, the others are redone from the sort. Both paths run here."""
    V, n = 256, 64
    combos = [SamplingParams(top_p=tp, top_k=k, min_p=mp, temperature=t)
              for tp in (1.0, 0.5, 0.95) for k in (-1, 1, 5, 40) for mp in (0.0, 0.01, 0.3) for t in (0.6, 1.0)
              if (tp, k, mp) != (1.0, -1, 0.0)]
    for c, sp in enumerate(combos):
        logits = _random_rows(c, n, V, flat=flat, ties=ties)
        want = sample_tokens(logits, [sp] * n, [SampleStream(7 * c + i) for i in range(n)], candidates=V)[0]
        for candidates in (2, 8, 64):
            got = sample_tokens(logits, [sp] * n, [SampleStream(7 * c + i) for i in range(n)], candidates=candidates)[0]
            assert torch.equal(got, want), f"{sp} with {candidates} candidates"
        assert not torch.isinf(logits[0, want[0]])


def _coverage(logits: torch.Tensor, sp: SamplingParams, candidates: int) -> torch.Tensor:
    """The prefilter's check for each row, as sample_tokens runs it."""
    n, V = logits.shape
    scaled = logits / sp.temperature
    probs = torch.softmax(scaled, dim=-1)
    C = min(V, max(candidates, (sp.top_k if 1 <= sp.top_k < V else 0) + 1))
    vals, ids = torch.topk(scaled, C, dim=-1)
    knobs = _Knobs(torch.full((n,), sp.top_k if 1 <= sp.top_k < V else 0) if 1 <= sp.top_k < V else None,
                   torch.full((n,), sp.top_p, dtype=torch.float64) if sp.top_p < 1 else None,
                   torch.full((n,), sp.min_p) if sp.min_p > 0 else None)
    return _cuts(vals, probs.gather(1, ids), knobs)[1]


def test_the_fallback_runs_for_a_nucleus_wider_than_the_candidates():
    """A flat row whose top-p nucleus holds ~90% of 256 tokens is not covered by 8 candidates: the
    full sort decides, and tokens far outside the top 8 come out, with the right distribution."""
    V = 256
    row = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 0.05
    sp = SamplingParams(top_p=0.9)
    assert not _coverage(row[None], sp, 8).any()
    assert _coverage(row[None] * 400, sp, 8).all()  # a peaked row is covered
    tokens = draw_many(row, sp, 20000, candidates=8)
    top8 = set(torch.topk(row, 8).indices.tolist())
    assert sum(int(t) not in top8 for t in tokens) > 15000
    want = reference_distribution(row, sp)
    assert set(tokens.unique().tolist()) <= set(want.nonzero()[:, 0].tolist())
    assert total_variation(tokens, want) < 0.06  # 230 tokens, 20000 draws: ~0.04 expected


# ---------------------------------------------------------------- the distribution
DIST_CASES = {
    "temperature": (SamplingParams(temperature=1.3), None),
    "top_k": (SamplingParams(top_k=6), None),
    "top_p": (SamplingParams(top_p=0.8), None),
    "min_p": (SamplingParams(min_p=0.1), None),
    "all_three": (SamplingParams(top_k=12, top_p=0.9, min_p=0.05, temperature=0.7), None),
    "top_p_prefilter_4": (SamplingParams(top_p=0.8), 4),  # the nucleus is wider than 4: fallback rows
    "top_k_prefilter_2": (SamplingParams(top_k=6), 2),  # top_k raises the candidate count to 7
}


@pytest.mark.parametrize("case", list(DIST_CASES))
def test_the_empirical_distribution_is_the_filtered_softmax(case):
    """40000 draws (fixed streams) on a 32-token vocabulary: no token outside the filtered support,
    and a chi-square statistic far below what a wrong distribution gives."""
    sp, candidates = DIST_CASES[case]
    row = torch.randn(32, generator=torch.Generator().manual_seed(11)) * 1.5
    want = reference_distribution(row, sp)
    tokens = draw_many(row, sp, 40000, candidates=candidates)
    support = set(want.nonzero()[:, 0].tolist())
    assert set(tokens.unique().tolist()) <= support
    stat, df = chi_square(tokens, want)
    assert df >= 1 or len(support) == 1
    # mean df, sd sqrt(2 df): 6 sd above the mean is never reached by the right distribution
    assert stat < df + 6 * math.sqrt(2 * max(df, 1)), f"chi2 {stat:.1f} on {df} dof"
    assert total_variation(tokens, want) < 0.02


def test_fixed_point_masses_are_exact():
    probs = torch.softmax(torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)), dim=-1)
    q = (probs * FIXED_ONE).to(torch.int64)
    assert ((q.sum(-1) - FIXED_ONE).abs() < FIXED_ONE * 1e-5).all()  # fp32 softmax: a sum of 1 up to rounding
    assert torch.equal(q.flip(-1).cumsum(-1)[:, -1], q.cumsum(-1)[:, -1])  # any order: the same sum


# ---------------------------------------------------------------- edge cases
def test_a_tiny_top_p_is_the_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2)) * 2
    tokens, _ = sample_tokens(logits, [SamplingParams(top_p=1e-6)] * 8, [SampleStream(i) for i in range(8)])
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_1_is_the_argmax():
    logits = torch.randn(8, 3000, generator=torch.Generator().manual_seed(4)) * 0.01
    for candidates in (None, 4):
        tokens, _ = sample_tokens(logits, [SamplingParams(top_k=1)] * 8, [SampleStream(i) for i in range(8)],
                                  candidates=candidates)
        assert torch.equal(tokens, logits.argmax(-1))


def test_tied_maxima_are_drawn_evenly():
    """top_k=1 (or min_p=1, or a tiny top_p) with three equal maxima keeps all three (ties with the
    cut-off value are kept together), each drawn a third of the time."""
    row = torch.full((50,), -3.0)
    row[[7, 19, 41]] = 2.0
    for sp in (SamplingParams(top_k=1), SamplingParams(min_p=1.0), SamplingParams(top_p=1e-3)):
        tokens = draw_many(row, sp, 9000, candidates=2)
        counts = torch.bincount(tokens, minlength=50)
        assert set(tokens.unique().tolist()) == {7, 19, 41}, sp
        assert (counts[[7, 19, 41]] - 3000).abs().max() < 200, (sp, counts[[7, 19, 41]])


def test_masked_tokens_are_never_drawn():
    V = 300
    logits = torch.zeros(64, V)
    logits[:, ::2] = float("-inf")  # a flat row with half of it masked
    for sp in (SamplingParams(), SamplingParams(top_p=0.99), SamplingParams(top_k=250), SamplingParams(min_p=1e-9)):
        tokens, finite = sample_tokens(logits, [sp] * 64, [SampleStream(i) for i in range(64)], candidates=8)
        assert finite.all() and (tokens % 2 == 1).all(), sp
    one = torch.full((1, V), float("-inf"))
    one[0, 123] = 0.0
    assert int(sample_tokens(one, [SamplingParams(top_p=0.5)], [SampleStream(0)])[0][0]) == 123


def test_rows_mixing_greedy_and_sampled():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(6, 2000, generator=g)
    params = [None, SamplingParams(temperature=0.0), SamplingParams(top_p=0.9), SamplingParams(temperature=1e-7),
              SamplingParams(), SamplingParams(min_p=0.2)]
    tokens, finite = sample_tokens(logits, params, [SampleStream(i) for i in range(6)])
    for r in (0, 1, 3):
        assert int(tokens[r]) == int(logits[r].argmax())
    for r in (2, 4, 5):  # the same as alone
        assert int(tokens[r]) == int(sample_tokens(logits[r:r + 1], [params[r]], [SampleStream(r)])[0][0])
    assert finite.all()


def test_non_finite_rows_are_flagged_and_do_not_break_the_others():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(8))
    ok = sample_tokens(logits[2:], [SamplingParams(top_p=0.9)], [SampleStream(2)])[0]
    logits[0, 5] = float("nan")
    logits[1, 9] = float("inf")
    tokens, finite = sample_tokens(logits, [SamplingParams(top_p=0.9)] * 3, [SampleStream(i) for i in range(3)])
    assert finite.tolist() == [False, False, True]
    assert int(tokens[2]) == int(ok[0]) and ((tokens >= 0) & (tokens < 500)).all()


def test_other_generators_still_work():
    """A torch.Generator (callers outside the engine) gives one draw per call; no generator: fresh
    randomness from torch's default generator."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    seen = {int(sample_tokens(logits, [SamplingParams(min_p=0.4)], [g])[0][0]) for _ in range(100)}
    assert seen == {0, 1}
    seen = {int(sample_tokens(logits, [SamplingParams()], [None])[0][0]) for _ in range(200)}
    assert seen == {0, 1, 2, 3}


def test_the_default_candidate_count():
    assert PREFILTER_CANDIDATES >= 256
    # a top_k above the default raises the candidate count: still exact, no fallback needed
    V = 3 * PREFILTER_CANDIDATES
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(9)) * 0.01
    sp = SamplingParams(top_k=PREFILTER_CANDIDATES + 100)
    assert _coverage(logits, sp, PREFILTER_CANDIDATES).all()
    tokens = sample_tokens(logits, [sp] * 4, [SampleStream(i) for i in range(4)])[0]
    assert torch.equal(tokens, sample_tokens(logits, [sp] * 4, [SampleStream(i) for i in range(4)], candidates=V)[0])


# ---------------------------------------------------------------- the CUDA fallback kernel
@pytest.fixture(params=[False, True], ids=["float64_masses", "int64_masses"])
def masses(request, monkeypatch):
    """Both of the fallback kernel's mass types (hybrid/sampling.py int_masses: by the GPU's float64 rate)."""
    import hybrid.sampling as sampling

    monkeypatch.setattr(sampling, "FALLBACK_INT_MASSES", request.param)
    return request.param


@pytest.mark.parametrize("tile", [(256, 16), (32, 16)])
def test_the_fallback_kernel_draws_the_tokens_of_the_torch_redo(monkeypatch, masses, tile):
    """The Triton redo of uncovered rows (CUDA's path, no host sync) against the torch redo (CPU's),
    through Triton's interpreter: the same token for every row, covered rows left alone. Vocabularies
    of one tile and (with a 512-token tile) of several and not a multiple of one; top-k with ties past the
    candidates; flat rows. (Vocabularies of ~1.3K tokens: the interpreter's time grows with them.)"""
    import os

    import hybrid.sampling as sampling

    monkeypatch.setattr(sampling, "FALLBACK_TILE", tile)

    if not sampling.HAS_TRITON:
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton's interpreter must be on before triton is imported (tests/conftest.py)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    combos = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, top_k=30), SamplingParams(top_k=3),
              SamplingParams(min_p=0.02), SamplingParams(top_p=0.97, min_p=0.001, temperature=0.7),
              SamplingParams(top_p=0.3, top_k=200, min_p=0.2)]
    for c, (V, flat, ties) in enumerate([(1300, True, False), (1300, False, True), (700, True, True)]):
        logits = _random_rows(c, 12, V, flat=flat, ties=ties).to(dev)
        logits[3] = 0.0  # every token tied
        logits[4, : V // 2] = 1.0  # a top-k tie run past the candidates
        for j, sp in enumerate(combos):
            streams = lambda: [SampleStream(1000 * c + 10 * j + i) for i in range(12)]  # noqa: E731
            monkeypatch.setattr(sampling, "_use_kernel", lambda t: False)
            want = sample_tokens(logits, [sp] * 12, streams(), candidates=8)[0]
            monkeypatch.setattr(sampling, "_use_kernel", lambda t: True)
            got = sample_tokens(logits, [sp] * 12, streams(), candidates=8)[0]
            assert not sampling._kernel_failed, sampling._kernel_failed
            assert torch.equal(got, want), f"{sp} V={V}: {got.tolist()} != {want.tolist()}"


def test_warm_up_fallback_kernel_meets_both_variants(monkeypatch):
    """The startup warm-up launches the fallback kernel once with and once without top-k (its one
    compile-time choice; top-p and min-p are always on, neutral where unused), on covered rows."""
    import os

    import hybrid.sampling as sampling

    if not sampling.HAS_TRITON:
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton's interpreter must be on before triton is imported (tests/conftest.py)")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    calls = []
    real = sampling._fallback_kernel_launch

    def record(scaled, probs, covered, cuts, knobs, u, tokens):
        calls.append(cuts.kth is not None)
        real(scaled, probs, covered, cuts, knobs, u, tokens)
        assert tokens.tolist() == [0]  # a covered row keeps its token

    monkeypatch.setattr(sampling, "_use_kernel", lambda t: True)
    monkeypatch.setattr(sampling, "_fallback_kernel_launch", record)
    sampling.warm_up_fallback_kernel(dev, 3000)
    assert sorted(calls) == [False, True] and not sampling._kernel_failed


def _every_row_through_the_kernel(monkeypatch, logits: torch.Tensor, params: list[SamplingParams], seed: int,
                                  candidates: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's tokens, the torch redo's) with every row taken as uncovered by its candidates, the
    covered ones too: their top-p cut is then the candidates' cut, the search's upper end itself."""
    import hybrid.sampling as sampling

    real_cuts = sampling._cuts
    monkeypatch.setattr(sampling, "_cuts", lambda vals, probs, knobs: (
        real_cuts(vals, probs, knobs)[0], torch.zeros(vals.shape[0], dtype=torch.bool, device=vals.device)))
    streams = lambda: [SampleStream(seed + i) for i in range(logits.shape[0])]  # noqa: E731
    monkeypatch.setattr(sampling, "_use_kernel", lambda t: False)
    want = sample_tokens(logits, params, streams(), candidates=candidates)[0]
    monkeypatch.setattr(sampling, "_use_kernel", lambda t: True)
    got = sample_tokens(logits, params, streams(), candidates=candidates)[0]
    assert not sampling._kernel_failed, sampling._kernel_failed
    return got, want


def _search_rows(V: int, seed: int) -> torch.Tensor:
    """Rows that put the top-p search at its edges: one token of probability ~1 (the others weigh 0 in
    fixed point), every token tied, two tied halves, bf16 ties, flat and peaked random rows, most of the
    row masked, only 5 finite logits."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(8, V, generator=g)
    rows[0] = 0.0
    rows[0, V // 3] = 40.0
    rows[1] = 0.0
    rows[2] = 0.0
    rows[2, ::2] = 1.0
    rows[3] = (rows[3] * 0.5).bfloat16().float()
    rows[4] *= 0.3
    rows[5] *= 4.0
    rows[6, : 2 * V // 3] = float("-inf")
    rows[7, 5:] = float("-inf")
    return rows


def test_the_fallback_kernel_search_at_its_edges(monkeypatch, masses):
    """The kernel's top-p search and draw (every row forced through it) against the torch redo, through
    Triton's interpreter: rows of _search_rows, top-p from keeping one token to just below 1 (the target
    above the row's whole fixed-point mass: the search ends below every token), with and without top-k
    (a top-k above the 5 finite logits: kth -inf) and min-p (looser than the cut: the kept mass comes from
    the search; tighter: its own pass); two tiles of 512 tokens, the second partial."""
    import os

    import hybrid.sampling as sampling

    if not sampling.HAS_TRITON:
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton's interpreter must be on before triton is imported (tests/conftest.py)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(sampling, "FALLBACK_TILE", (32, 16))  # (small tiles: the interpreter's time grows with V)
    V = sampling.FALLBACK_TILE[0] * sampling.FALLBACK_TILE[1] + 300
    logits = _search_rows(V, 5).to(dev)
    combos = [SamplingParams(top_p=1e-6), SamplingParams(top_p=0.5), SamplingParams(top_p=0.95),
              SamplingParams(top_p=1 - 1e-12), SamplingParams(top_p=0.999999, temperature=0.5),
              SamplingParams(top_p=0.9, top_k=10), SamplingParams(top_p=0.95, top_k=300),
              SamplingParams(top_p=0.9, min_p=1e-4), SamplingParams(top_p=0.99, min_p=0.3),
              SamplingParams(top_p=0.8, top_k=40, min_p=0.05, temperature=1.5)]
    for j, sp in enumerate(combos):
        got, want = _every_row_through_the_kernel(monkeypatch, logits, [sp] * logits.shape[0], 100 * j)
        assert torch.equal(got, want), f"{sp}: {got.tolist()} != {want.tolist()}"
    assert int(want[0]) == V // 3  # (the token of probability ~1)


def test_the_fallback_kernel_mixes_rows(monkeypatch, masses):
    """One launch, rows of different filters (top-k on some rows only: the others read no logits), some
    covered by the prefilter and left alone, the others redone: the torch redo's tokens."""
    import os

    import hybrid.sampling as sampling

    if not sampling.HAS_TRITON:
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton's interpreter must be on before triton is imported (tests/conftest.py)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    V = 2000
    logits = torch.cat([_search_rows(V, 6), _random_rows(7, 8, V, flat=True)]).to(dev)
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=20, top_p=0.7), SamplingParams(min_p=0.01),
              SamplingParams(top_p=0.95, min_p=0.2), SamplingParams(top_k=3), SamplingParams(top_p=0.6, top_k=500),
              SamplingParams(temperature=0.9), SamplingParams(top_p=0.99)] * 2
    for seed in (0, 50):
        streams = lambda: [SampleStream(seed + i) for i in range(len(params))]  # noqa: E731
        monkeypatch.setattr(sampling, "_use_kernel", lambda t: False)
        want = sample_tokens(logits, params, streams(), candidates=16)[0]
        monkeypatch.setattr(sampling, "_use_kernel", lambda t: True)
        got = sample_tokens(logits, params, streams(), candidates=16)[0]
        assert not sampling._kernel_failed, sampling._kernel_failed
        assert torch.equal(got, want), f"{got.tolist()} != {want.tolist()}"


@pytest.mark.parametrize("pivots", [8, 16])
def test_the_fallback_kernel_cut_to_the_bit(monkeypatch, masses, pivots):
    """Probabilities made by hand, every row forced through the kernel, against the torch redo: rows of
    distinct adjacent fp32 values (a cut one bit off keeps one token more or less; cuts far below the
    search's upper end, at it, at the top token), a token of probability 1, the mass above a token exactly
    top_p times the total (dropped: the mass above must be below it), a target above the row's whole mass
    (keeps every token); draws at 0, in the middle and at the top (which lands on the last kept token, so
    the kept mass must be exact). With the search's 8 pivots a pass and with 16."""
    import os

    import hybrid.sampling as sampling

    if not sampling.HAS_TRITON:
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton's interpreter must be on before triton is imported (tests/conftest.py)")
    monkeypatch.setattr(sampling, "FALLBACK_PIVOTS", pivots)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    V = 2048
    g = torch.Generator().manual_seed(9)
    adjacent = (torch.tensor(2.0**-11).view(torch.int32) - torch.arange(V, dtype=torch.int32)).view(torch.float32)
    dyadic = torch.full((V,), 0.25 / (V - 2))
    dyadic[:2] = torch.tensor([0.5, 0.25])
    one = torch.zeros(V)
    one[0] = 1.0
    base = [adjacent, adjacent, adjacent, one, dyadic, adjacent, adjacent, adjacent, dyadic]
    # (7.5 / 2048: the cut is the 8th largest probability, the last of the 8 candidates: the search's upper end)
    params = [SamplingParams(top_p=0.5), SamplingParams(top_p=7.5 / 2048), SamplingParams(top_p=1e-6),
              SamplingParams(top_p=0.5), SamplingParams(top_p=0.5), SamplingParams(top_p=0.99999),
              SamplingParams(top_p=0.5, top_k=1000), SamplingParams(top_p=0.9, min_p=0.9999),
              SamplingParams(top_p=0.75, top_k=2)]
    assert float((adjacent * sampling.FIXED_ONE).to(torch.int64).sum()) < 0.99999 * sampling.FIXED_ONE
    probs = torch.stack([b[torch.randperm(V, generator=g)] for b in base]).to(dev)
    real_cuts = sampling._cuts
    monkeypatch.setattr(sampling, "_cuts", lambda vals, p, knobs: (
        real_cuts(vals, p, knobs)[0], torch.zeros(vals.shape[0], dtype=torch.bool, device=vals.device)))
    for u in (0.0, 0.5, 1 - 2.0**-53, None):
        draws = (torch.rand(len(base), generator=g, dtype=torch.float64) if u is None
                 else torch.full((len(base),), u, dtype=torch.float64)).to(dev)
        monkeypatch.setattr(sampling, "_use_kernel", lambda t: False)
        want = sampling._sample_filtered(probs, probs, params, draws, 8)  # (the probabilities as logits: same order)
        monkeypatch.setattr(sampling, "_use_kernel", lambda t: True)
        got = sampling._sample_filtered(probs, probs, params, draws, 8)
        assert not sampling._kernel_failed, sampling._kernel_failed
        assert torch.equal(got, want), f"u={u}: {got.tolist()} != {want.tolist()}"
