"""The startup warm-up (hybrid/warmup.py): its throw-away requests leave nothing behind (no request,
slot, page, cached prefix, statistic or shifted sampling seed), and an engine that warmed up
generates exactly what one that did not generates. On CUDA it is on by default; here it is asked for."""
import pytest

from hybrid import LLM, SamplingParams
from hybrid.engine_config import engine_config
from hybrid.warmup import warmup_requests

KW = dict(device="cpu", max_num_seqs=4, max_model_len=128, max_num_batched_tokens=48, page_size=8, check_state=True)
PROMPTS = [[5, 9, 3, 7, 11, 2, 4] * 3, [8, 1, 6], list(range(3, 60))]
PARAMS = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, ignore_eos=True),  # unseeded: by arrival
          SamplingParams(max_tokens=12, temperature=0.7, top_k=5, seed=3, logprobs=2, ignore_eos=True)]


def _run(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("extra", [dict(), dict(enable_prefix_caching=True),
                                   dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})],
                         ids=["plain", "prefix-caching", "speculation"])
def test_warmup_leaves_nothing_behind(tiny_ckpt, extra):
    path = tiny_ckpt("nemotron_h")
    cold = LLM(path, warmup=False, **KW, **extra)
    warm = LLM(path, warmup=True, **KW, **extra)
    assert "warm-up" in warm.startup_phases and "warm-up" not in cold.startup_phases
    engine = warm.engine
    assert not engine.requests and not engine.has_unfinished_requests()
    assert warm.state_pool.num_free == cold.state_pool.num_free
    assert engine.resources.num_free_pages == cold.engine.resources.num_free_pages
    assert engine.prefix_cache is None or len(engine.prefix_cache) == 0
    assert all(v == 0 for v in engine.stats.values()), engine.stats
    assert all(v == 0 for v in warm.runner.stats.values()), warm.runner.stats
    assert _run(warm) == _run(cold)
    assert engine.stats == cold.engine.stats


def test_warmup_requests_cover_the_step_shapes():
    reqs = warmup_requests(vocab_size=100, max_num_batched_tokens=48, max_model_len=128, max_num_seqs=8,
                           speculative=True)
    lengths = [len(t) for t, _ in reqs]
    assert 1 in lengths and any(n % 16 for n in lengths) and max(lengths) > 48  # chunked: a chunk with a history
    assert all(0 <= t < 100 for toks, _ in reqs for t in toks)
    assert all(len(t) + p.max_tokens <= 128 for t, p in reqs)
    assert {p.temperature == 0.0 for _, p in reqs} == {True, False}  # greedy and sampled steps
    periodic = reqs[-1][0]
    assert periodic[:6] == periodic[6:12]  # n-gram drafts exist for the speculative verify rows
    # a tiny context: every prompt still leaves room for its new tokens; max_num_seqs 1: one request
    small = warmup_requests(vocab_size=100, max_num_batched_tokens=48, max_model_len=8, max_num_seqs=1,
                            speculative=False)
    assert len(small) == 1 and all(len(t) + p.max_tokens <= 8 for t, p in small)


def test_warmup_default_is_cuda_only():
    assert engine_config(device="cpu").warmup is False
    assert engine_config(device="cpu", warmup=True).warmup is True
