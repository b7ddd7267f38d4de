"""Prefix caching (LLM(enable_prefix_caching=True)): a prompt that starts like an earlier one resumes
from the cached prefix (shared KV pages + a copy of every Mamba layer's state after it) and gives
the tokens of a full prefill; eviction gives slots and pages back; nothing leaks."""
from __future__ import annotations

import pytest
import torch

import hf_oracle
from hybrid import SamplingParams

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BASE = [7, 19, 33, 41, 5, 60, 12, 88, 9, 14, 23, 31, 45, 17, 29]  # 15 tokens: cached up to 12 (pages of 4)


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _held_pages(llm):
    """Distinct pages the cache holds (an entry that extends another shares the other's pages)."""
    return len({p for e in llm.engine.prefix_cache.entries.values() for p in e.pages})


@pytest.mark.parametrize("name", ["nemotron_h", "bamba", "falcon_h1"])
def test_second_prompt_resumes_from_the_cache_and_matches_transformers(name, tiny_ckpt, make_llm):
    path = tiny_ckpt(name)
    llm = make_llm(path, page_size=4, enable_prefix_caching=True, check_state=True)
    first = _tokens(llm, [BASE])[0]
    assert llm.engine.stats["prefix_cache_hits"] == 0 and len(llm.engine.prefix_cache) == 1
    follow = BASE + first + [50, 51, 52]  # a second turn: the first prompt, its answer, more
    again = _tokens(llm, [BASE, follow])
    assert llm.engine.stats["prefix_cache_hits"] == 2
    assert llm.engine.stats["prefix_cache_hit_tokens"] == 12 + 12  # BASE's 12, then the longest cached
    assert again[0] == first
    for prompt, got in zip([BASE, follow], again):
        assert got == hf_oracle.oracle_run(path, prompt, GREEDY.max_tokens).tokens
    # everything but what the cache holds is back
    eng = llm.engine
    assert llm.state_pool.num_free == llm.state_pool.num_slots - len(eng.prefix_cache)
    assert llm.kv_cache.allocator.num_free + _held_pages(llm) == llm.kv_cache.num_pages - 1


@pytest.mark.parametrize("max_num_seqs, num_kv_pages", [(2, 20), (3, 18)])
def test_same_tokens_as_without_cache_under_pressure_and_async(tiny_ckpt, make_llm, max_num_seqs, num_kv_pages):
    """Few pages and one cache entry: the entry is evicted for running sequences (and, with 3 running,
    sequences are preempted too) and replaced; greedy and seeded outputs equal the cache-less run,
    with steps in flight and the sanitizer on."""
    path = tiny_ckpt("nemotron_h")
    prompts = [BASE[:12] + [i, 40 + i] for i in range(6)] + [[3, 4, 5, 6, 8] * 3, BASE]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(len(prompts))]
    ref = _tokens(make_llm(path, page_size=4, max_num_seqs=3), prompts, params)
    llm = make_llm(path, page_size=4, max_num_seqs=max_num_seqs, max_model_len=64, num_kv_pages=num_kv_pages,
                   enable_prefix_caching=True, prefix_cache_entries=1, check_state=True, async_scheduling=True)
    assert _tokens(llm, prompts, params) == ref
    stats = llm.engine.stats
    assert stats["prefix_cache_evictions"] >= 1
    if max_num_seqs == 2:
        assert stats["prefix_cache_hits"] >= 4  # the shared 12-token prefix, computed once or twice
    else:
        assert stats["preemptions"] >= 1
    assert llm.state_pool.num_free == llm.state_pool.num_slots - len(llm.engine.prefix_cache)
    assert llm.kv_cache.allocator.num_free + _held_pages(llm) == llm.kv_cache.num_pages - 1


def test_forked_branches_and_later_requests_with_cache(tiny_ckpt, make_llm):
    """n > 1 forks from a prefill that resumed from the cache; later prompts sharing the prefix hit."""
    path = tiny_ckpt("granite_dense")
    prompts = [BASE, BASE[:13] + [3, 3], BASE + [99]]
    params = [SamplingParams(n=2, temperature=0.7, seed=1, max_tokens=14, ignore_eos=True), GREEDY, GREEDY]
    cacheless = make_llm(path, page_size=4, max_num_seqs=4)
    ref = [[[c.token_ids for c in o.outputs] for o in cacheless.generate([p], sp, use_tqdm=False)]
           for p, sp in zip(prompts, params)]
    llm = make_llm(path, page_size=4, max_num_seqs=4, enable_prefix_caching=True, check_state=True)
    got = [[[c.token_ids for c in o.outputs] for o in llm.generate([p], sp, use_tqdm=False)]
           for p, sp in zip(prompts, params)]
    assert got == ref
    stats = llm.engine.stats
    assert stats["forks"] == 1 and stats["prefix_cache_hits"] == 2 and stats["prefix_cache_hit_tokens"] == 24


def test_off_by_default_and_bad_size(tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("granite_dense"))
    assert llm.engine.prefix_cache is None and llm.state_pool.num_slots == 8
    with pytest.raises(ValueError, match="prefix_cache_entries"):
        make_llm(tiny_ckpt("granite_dense"), enable_prefix_caching=True, prefix_cache_entries=0)


@pytest.mark.parametrize("interval, hit", [(8, 16), (0, 0)])
def test_prompts_sharing_only_a_system_prompt(interval, hit, tiny_ckpt, make_llm):
    """Cached every `interval` tokens along a prompt, a shared beginning is found by a prompt that
    differs after it; cached at the end only (interval 0), it is not."""
    path = tiny_ckpt("bamba")
    system = [9, 8, 7, 6, 5, 4, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43]  # 20 tokens
    a, b = system + [60, 61, 62, 63, 64, 65, 66], system + [70, 71, 72, 73, 74]
    llm = make_llm(path, page_size=4, enable_prefix_caching=True, prefix_cache_interval=interval, check_state=True)
    _tokens(llm, [a])
    got = _tokens(llm, [b])[0]
    assert llm.engine.stats["prefix_cache_hit_tokens"] == hit
    assert got == hf_oracle.oracle_run(path, b, GREEDY.max_tokens).tokens
    assert len(llm.engine.prefix_cache) == (4 if interval else 2)  # a: 8, 16, 24; b: 24 (16 is a's)


def test_insert_under_a_taken_key_returns_the_displaced_entry():
    from hybrid.prefix_cache import PrefixCache

    cache = PrefixCache(page_size=4, max_entries=1)
    assert cache.insert(BASE[:8], 3, [1, 2]) is None
    old = cache.insert(BASE[:8], 5, [7, 8])  # the same key again, cache full: a replacement, not an overflow
    assert (old.slot, old.pages) == (3, [1, 2]) and len(cache) == 1
    assert cache.lookup(BASE).slot == 5


def test_colliding_prefix_keys_leak_nothing(tiny_ckpt, make_llm, monkeypatch):
    """Two different prompts whose cached prefixes collide on one key: the second entry displaces the
    first, whose slot and pages go back (before: leaked). After everything is released the pools'
    free counts are back where they started, and the first prompt never resumes from the other's state."""
    from hybrid.prefix_cache import PrefixCache

    path = tiny_ckpt("nemotron_h")
    monkeypatch.setattr(PrefixCache, "page_hashes", lambda self, tokens, n: list(range(n)))  # key = page count
    llm = make_llm(path, page_size=4, enable_prefix_caching=True, check_state=True)
    eng, pool, pages = llm.engine, llm.state_pool, llm.kv_cache.allocator
    free_slots, free_pages = pool.num_free, pages.num_free
    other = [t + 1 for t in BASE]
    first = _tokens(llm, [BASE])[0]
    _tokens(llm, [other])
    assert len(eng.prefix_cache) == 1
    assert next(iter(eng.prefix_cache.entries.values())).tokens == tuple(other[:12])
    assert _tokens(llm, [BASE])[0] == first  # the key is taken by `other`: verified by tokens, no hit
    assert eng.stats["prefix_cache_hits"] == 0
    while eng.resources.evict_cached_prefix():
        pass
    assert pool.num_free == free_slots and pages.num_free == free_pages
