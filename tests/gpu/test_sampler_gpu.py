"""The sampler on CUDA (hybrid/sampling.py): the same tokens as on CPU for the same logits and
streams, no host sync in sample_tokens (the prefilter's uncovered rows go to the Triton kernel),
and the kernel's redo equal to the torch redo at the real vocabulary size."""
from __future__ import annotations

import pytest
import torch

import hybrid.sampling as sampling
from hybrid.sampling import SampleStream, SamplingParams, sample_tokens

COMBOS = [SamplingParams(temperature=0.8), SamplingParams(top_p=0.95), SamplingParams(top_k=50),
          SamplingParams(min_p=0.05), SamplingParams(top_k=50, top_p=0.95, min_p=0.05, temperature=0.7),
          SamplingParams(top_p=0.5, top_k=3000)]


def _logits(n: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    sd = torch.rand(n, 1, generator=g) * 4.5 + 1.3  # flat (all fall back) .. peaked (all covered)
    return torch.randn(n, V, generator=g) * sd


@pytest.mark.parametrize("V", [4096, 131072])
def test_cuda_samples_the_cpu_tokens(V):
    n = 64
    for c, sp in enumerate(COMBOS):
        logits = _logits(n, V, c)
        cpu = sample_tokens(logits, [sp] * n, [SampleStream(i) for i in range(n)])[0]
        cuda = sample_tokens(logits.cuda(), [sp] * n, [SampleStream(i) for i in range(n)])[0]
        # the softmax may round differently on the two devices: a token may differ only where a
        # draw falls within rounding of a boundary (not seen in practice; allow one in the lot)
        assert int((cuda.cpu() != cpu).sum()) <= 1, (sp, V)


def test_sample_tokens_does_not_sync():
    V, n = 131072, 256
    logits = _logits(n, V, 7).cuda()
    params = [COMBOS[i % len(COMBOS)] for i in range(n - 2)] + [None, SamplingParams(temperature=0.0)]
    streams = [SampleStream(i) for i in range(n)]
    sample_tokens(logits, params, streams)  # compile the kernel first (its first launch may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, finite = sample_tokens(logits, params, streams)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert finite.all() and not sampling._kernel_failed


def test_the_kernel_redo_equals_the_torch_redo_at_full_vocabulary(monkeypatch):
    V, n = 131072, 32
    logits = _logits(n, V, 3).cuda()
    logits[0] = 0.0  # every token tied
    for sp in COMBOS[1:]:
        _assert_kernel_gives_the_torch_redo(monkeypatch, logits, sp, n)


def _assert_kernel_gives_the_torch_redo(monkeypatch, logits, sp, n):
    """n rows of `logits` sampled with `sp`: the fallback kernel's tokens equal the torch redo's (the sync path)."""
    monkeypatch.setattr(sampling, "FALLBACK", "sync")
    want = sample_tokens(logits, [sp] * n, [SampleStream(i) for i in range(n)])[0]
    monkeypatch.setattr(sampling, "FALLBACK", "kernel")
    got = sample_tokens(logits, [sp] * n, [SampleStream(i) for i in range(n)])[0]
    assert not sampling._kernel_failed, sampling._kernel_failed
    assert torch.equal(got, want), sp


def test_the_kernel_on_every_row_at_full_vocabulary(monkeypatch):
    """Every row forced through the kernel (the prefilter's covered rows too: their top-p cut is the
    search's upper end itself) against the torch redo, at the real vocabulary: flat and peaked rows, a token
    of probability ~1, every token tied, bf16 ties, most of the row masked; top-p from keeping one token to
    just below 1 (the target above the row's mass), with top-k and min-p (looser and tighter than the cut)."""
    V, n = 131072, 16
    logits = _logits(n, V, 11)
    logits[0] = 0.0
    logits[1] = 0.0
    logits[1, 12345] = 40.0
    logits[2] = (logits[2] * 0.3).bfloat16().float()
    logits[3, : 2 * V // 3] = float("-inf")
    logits = logits.cuda()
    real_cuts = sampling._cuts
    monkeypatch.setattr(sampling, "_cuts", lambda vals, probs, knobs: (
        real_cuts(vals, probs, knobs)[0], torch.zeros(vals.shape[0], dtype=torch.bool, device=vals.device)))
    for sp in COMBOS[1:] + [SamplingParams(top_p=1e-6), SamplingParams(top_p=1 - 1e-12),
                            SamplingParams(top_p=0.9, min_p=1e-6), SamplingParams(top_p=0.99, min_p=0.2)]:
        _assert_kernel_gives_the_torch_redo(monkeypatch, logits, sp, n)


@pytest.mark.parametrize("V", [100352, 131072, 256000])
@pytest.mark.parametrize("rows", [1, 8, 256])
def test_greedy_kernels_give_torchs_argmax(V, rows):
    """The greedy launches (hybrid/ops/triton_greedy.py, sample_tokens' argmax on CUDA) against torch.argmax
    and isfinite at the released vocabularies: random rows, ties across chunks, NaN, +-inf, all -inf, bf16."""
    from hybrid.ops import triton_greedy

    g = torch.Generator(device="cuda").manual_seed(V + rows)
    x = torch.randn(rows, V, generator=g, device="cuda")
    x[0, [17, V - 1]] = 50.0  # a tie: the first wins
    if rows > 1:
        x[1, [V // 2, 3]] = float("nan")
        x[-1] = float("-inf")
    if rows > 2:
        x[2, 5000] = float("inf")
        x[3, ::2] = float("-inf")
    for logits in (x, x.to(torch.bfloat16)):
        tokens, finite = triton_greedy.greedy_tokens(logits)
        want = logits.argmax(dim=-1)
        assert torch.equal(tokens, want)
        assert torch.equal(finite, torch.isfinite(logits.gather(1, want[:, None])[:, 0]))
    tokens, finite = sampling.greedy_tokens(x)
    assert torch.equal(tokens, x.argmax(dim=-1))
