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
    first = llm.generate([a], GREEDY, use_tqdm=False)[0]
    second = llm.generate([b], GREEDY, use_tqdm=False)[0]
    got = second.outputs[0].token_ids
    assert llm.engine.stats["prefix_cache_hit_tokens"] == hit
    # RequestOutput.num_cached_tokens (vLLM's field): the prompt tokens the cache gave this request
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, hit)
    assert got == hf_oracle.oracle_run(path, b, GREEDY.max_tokens).tokens
    assert len(llm.engine.prefix_cache) == (4 if interval else 2)  # a: 8, 16, 24; b: 24 (16 is a's)


def test_insert_under_a_taken_key_returns_the_displaced_entry():
    from hybrid.prefix_cache import PrefixCache

    cache = PrefixCache(page_size=4, max_entries=1)
    assert cache.insert(BASE[:8], 3, [1, 2]) is None
    old = cache.insert(BASE[:8], 5, [7, 8])  # the same key again, cache full: a replacement, not an overflow
    assert (old.slot, old.pages) == (3, [1, 2]) and len(cache) == 1
    assert cache.lookup(BASE).slot == 5


def test_given_page_hashes_equal_the_computed_ones():
    """lookup / contains / insert with the caller's page hashes (a longer sequence's, as the resource manager
    keeps a prompt's) find and key what they find and key without them; too few hashes is an error."""
    from hybrid.prefix_cache import PrefixCache

    plain, given = PrefixCache(page_size=4, max_entries=4), PrefixCache(page_size=4, max_entries=4)
    long_prompt = BASE + [70, 71, 72, 73, 74]  # 20 tokens: 5 whole pages
    hashes = plain.page_hashes(long_prompt, 5, "s")
    for cache, h in ((plain, None), (given, hashes)):
        assert cache.insert(BASE[:8], 3, [1, 2], "s", h) is None
        assert cache.contains(BASE[:8], "s", h) and not cache.contains(BASE[:12], "s", h)
        assert cache.lookup(long_prompt, "s", h).slot == 3
    assert plain.entries.keys() == given.entries.keys()
    assert given.lookup(long_prompt, "other") is None  # another salt: other hashes
    with pytest.raises(ValueError, match="page hashes"):
        given.contains(long_prompt, "s", hashes[:2])


def test_a_hit_hashes_its_prompt_once(tiny_ckpt, make_llm, monkeypatch):
    """Admission's lookup, the caching point's check and its insert share the prompt's page hashes (kept on
    the sequence): one pass over a prompt's pages per request, not one per use."""
    from hybrid.prefix_cache import PrefixCache

    llm = make_llm(tiny_ckpt("nemotron_h"), page_size=4, enable_prefix_caching=True, check_state=True)
    first = _tokens(llm, [BASE])[0]
    calls = []
    real = PrefixCache.page_hashes
    monkeypatch.setattr(PrefixCache, "page_hashes",
                        lambda self, tokens, n, salt=None: (calls.append(n), real(self, tokens, n, salt))[1])
    follow = BASE[:12] + [50, 51, 52, 53, 54, 55, 56]  # a hit at 12, cached again at 16 inside its chunk
    got = _tokens(llm, [follow])[0]
    assert llm.engine.stats["prefix_cache_hit_tokens"] == 12 and len(llm.engine.prefix_cache) == 2
    assert calls == [len(follow) // 4]
    assert got == hf_oracle.oracle_run(tiny_ckpt("nemotron_h"), follow, GREEDY.max_tokens).tokens
    assert _tokens(llm, [BASE])[0] == first


def test_colliding_prefix_keys_leak_nothing(tiny_ckpt, make_llm, monkeypatch):
    """Two different prompts whose cached prefixes collide on one key: the second entry displaces the
    first, whose slot and pages go back (before: leaked). After everything is released the pools'
    free counts are back where they started, and the first prompt never resumes from the other's state."""
    from hybrid.prefix_cache import PrefixCache

    path = tiny_ckpt("nemotron_h")
    monkeypatch.setattr(PrefixCache, "page_hashes", lambda self, tokens, n, salt=None: list(range(n)))  # key: the count
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


def test_a_caching_point_inside_a_chunk_costs_no_step(tiny_ckpt, make_llm):
    """The caching point (12 of 15 tokens) lies inside the prompt's one prefill chunk: the Mamba layers
    leave the state there in the cache's slot as they go (StepBatch.state_snapshots), so caching adds
    no step, and a later prompt resuming from that state gives transformers' tokens."""
    path = tiny_ckpt("nemotron_h")
    llm = make_llm(path, page_size=4, enable_prefix_caching=True, check_state=True)
    eng = llm.engine
    seen = []
    real = eng.runner.execute
    eng.runner.execute = lambda batch: (seen.append(dict(batch.state_snapshots)), real(batch))[1]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    _tokens(llm, [BASE], one)
    assert eng.stats["steps"] == 1 and len(eng.prefix_cache) == 1
    (entry,) = eng.prefix_cache.entries.values()
    assert seen == [{0: [(12, entry.slot)]}] and list(entry.tokens) == BASE[:12]
    follow = BASE[:12] + [50, 51, 52, 53, 54, 55, 56]  # resumes at 12, caches 16 inside its chunk
    got = _tokens(llm, [follow])[0]
    assert eng.stats["prefix_cache_hit_tokens"] == 12 and len(eng.prefix_cache) == 2
    assert got == hf_oracle.oracle_run(path, follow, GREEDY.max_tokens).tokens
    assert seen[1] and list(seen[1].values())[0][0][0] == 16 - 12


def test_several_caching_points_in_chunks_of_a_small_budget(tiny_ckpt, make_llm):
    """Caching points every 4 tokens, chunks of 6 tokens: points inside chunks and at their ends, all
    kept; every prefix then resumes to transformers' tokens, and nothing leaks."""
    path = tiny_ckpt("bamba")
    prompt = BASE + [3, 1, 4, 1, 5, 9, 2, 6]  # 23 tokens: points 4, 8, ..., 20
    llm = make_llm(path, page_size=4, enable_prefix_caching=True, prefix_cache_interval=4, max_num_batched_tokens=6,
                   check_state=True)
    _tokens(llm, [prompt])
    assert sorted(len(e.tokens) for e in llm.engine.prefix_cache.entries.values()) == [4, 8, 12, 16, 20]
    for cut in (5, 10, 19):
        got = _tokens(llm, [prompt[:cut] + [77, 78]])[0]
        assert got == hf_oracle.oracle_run(path, prompt[:cut] + [77, 78], GREEDY.max_tokens).tokens, cut
    eng = llm.engine
    assert llm.state_pool.num_free == llm.state_pool.num_slots - len(eng.prefix_cache)
    assert llm.kv_cache.allocator.num_free + _held_pages(llm) == llm.kv_cache.num_pages - 1


def test_a_failed_step_gives_its_snapshot_slots_back(tiny_ckpt, make_llm):
    """The step that would have kept a snapshot fails: its request fails, the planned slot is free
    again, nothing is cached from it, and the engine serves the next prompt."""
    from state_pool.errors import RequestFailedError

    path = tiny_ckpt("nemotron_h")
    llm = make_llm(path, page_size=4, enable_prefix_caching=True, check_state=True)
    eng = llm.engine
    slots0 = llm.state_pool.num_free
    real = eng.runner.execute

    def execute(batch):
        if batch.state_snapshots:
            raise RuntimeError("injected fault")
        return real(batch)

    eng.runner.execute = execute
    with pytest.raises(RequestFailedError, match="injected fault"):
        llm.generate([BASE], GREEDY, use_tqdm=False)
    assert len(eng.prefix_cache) == 0 and llm.state_pool.num_free == slots0
    eng.runner.execute = real
    assert _tokens(llm, [BASE[:6]])[0] == hf_oracle.oracle_run(path, BASE[:6], GREEDY.max_tokens).tokens


def test_the_sanitizer_refuses_a_snapshot_into_a_slot_in_use(tiny_ckpt, make_llm):
    from hybrid.batch import StepBatch
    from state_pool.errors import StateCorruptionError

    llm = make_llm(tiny_ckpt("granite_dense"), page_size=4, enable_prefix_caching=True, check_state=True)
    res = llm.engine.resources
    live = res.state_pool.allocate()
    free = next(s for s in range(res.state_pool.num_slots) if s not in res.state_pool.allocator.live)
    t = torch.zeros(1, dtype=torch.long)
    batch = StepBatch(input_ids=t, positions=t, query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([1]),
                      page_table=torch.zeros(1, 1, dtype=torch.int32), kv_write_loc=t, state_slot=torch.tensor([live]),
                      has_initial_state=torch.tensor([False]), logits_indices=t, num_decodes=0, num_prefills=1,
                      query_lens_cpu=[1], seq_lens_cpu=[1], state_slot_cpu=[live], has_initial_state_cpu=[False])
    for bad, why in ((live, "in use"), (free, "free")):
        batch.state_snapshots = {0: [(1, bad)]}
        with pytest.raises(StateCorruptionError, match=why):
            res._check_snapshots(batch)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_mixer_segments_a_row_at_its_snapshots(state_dtype):
    """The torch path: a prefill row with snapshots after 3 and 7 of its 11 tokens gives the outputs and
    final state of the row run as three chunks in three steps, each snapshot slot holds the state the
    first chunks leave, and no other slot is touched."""
    import dataclasses
    import math

    from hybrid.config import MambaConfig
    from hybrid.layers import Mamba2Mixer
    from hybrid.mamba_metadata import step_metadata
    from state_pool.step_batch import StepBatch

    cfg = MambaConfig(num_heads=4, head_dim=8, n_groups=2, state_size=8, conv_kernel=4, chunk_size=4, conv_bias=True,
                      proj_bias=False, norm_eps=1e-5, dt_limit=(0.0, math.inf))
    torch.manual_seed(0)
    mixer = Mamba2Mixer(16, cfg, 0).to_empty(device="cpu")
    with torch.no_grad():
        for prm in mixer.parameters():
            prm.copy_(torch.randn_like(prm) * 0.3)
        mixer.A_log.copy_(torch.log(torch.rand(cfg.num_heads) * 4 + 1))

    def batch(lengths, slots, init, snaps=None):
        T = sum(lengths)
        qsl = [0] + torch.tensor(lengths).cumsum(0).tolist()
        b = StepBatch(input_ids=torch.zeros(T, dtype=torch.long), positions=torch.zeros(T, dtype=torch.long),
                      query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lengths),
                      page_table=torch.zeros(len(lengths), 1, dtype=torch.int32), kv_write_loc=torch.zeros(T, dtype=torch.long),
                      state_slot=torch.tensor(slots), has_initial_state=torch.tensor(init), logits_indices=torch.tensor([T - 1]),
                      num_decodes=0, num_prefills=len(lengths), query_lens_cpu=lengths, seq_lens_cpu=lengths,
                      state_slot_cpu=slots, has_initial_state_cpu=init)
        b.state_snapshots = snaps or {}
        return b

    hidden = torch.randn(11 + 5, 16)
    conv = torch.randn(6, cfg.conv_dim, cfg.conv_kernel - 1).to(state_dtype)
    ssm = (torch.randn(6, cfg.num_heads, cfg.head_dim, cfg.state_size) * 0.3).to(state_dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if state_dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    for has_init in (False, True):
        c1, s1 = conv.clone(), ssm.clone()
        b = batch([11, 5], [1, 2], [has_init, True], {0: [(3, 4), (7, 5)]})
        split = mixer(hidden, b, c1, s1)
        assert [(r.start, r.length, r.slot, r.has_initial_state, r.snapshot_slot) for r in step_metadata(b).prefills] \
            == [(0, 3, 1, has_init, 4), (3, 4, 1, True, 5), (7, 4, 1, True, -1), (11, 5, 2, True, -1)]
        assert torch.equal(s1[[0, 3]], ssm[[0, 3]]) and torch.equal(c1[[0, 3]], conv[[0, 3]])
        # the reference: the row as three prefill chunks in three steps (the state between them in its slot)
        c0, s0 = conv.clone(), ssm.clone()
        ys, kept = [], {}
        for lo, hi, keep in ((0, 3, 4), (3, 7, 5), (7, 11, None)):
            ys.append(mixer(hidden[lo:hi], batch([hi - lo], [1], [has_init or lo > 0]), c0, s0))
            if keep is not None:
                kept[keep] = c0[1].clone(), s0[1].clone()
        ys.append(mixer(hidden[11:], batch([5], [2], [True]), c0, s0))
        torch.testing.assert_close(split, torch.cat(ys), **tol)
        for slot in (1, 2):
            torch.testing.assert_close(s1[slot].float(), s0[slot].float(), **tol)
            torch.testing.assert_close(c1[slot].float(), c0[slot].float(), **tol)
        for slot, (c_ref, s_ref) in kept.items():
            torch.testing.assert_close(c1[slot].float(), c_ref.float(), **tol)
            torch.testing.assert_close(s1[slot].float(), s_ref.float(), **tol)
    bad = batch([11, 5], [1, 2], [False, True], {0: [(7, 4), (3, 5)]})
    with pytest.raises(ValueError, match="ascending"):
        mixer(hidden, dataclasses.replace(bad), conv.clone(), ssm.clone())


def test_cache_salt_keeps_prefixes_apart(tiny_ckpt, make_llm):
    """vLLM's cache_salt: a prompt shares cached prefixes only with prompts of the same salt (no salt is a
    salt of its own); the tokens are the same whatever the salt; a salt that is not a non-empty string is
    refused before anything is queued."""
    from hybrid.errors import InvalidRequestError
    from hybrid.prefix_cache import PrefixCache

    cache = PrefixCache(page_size=4, max_entries=4)
    cache.insert(BASE[:12], 0, [0, 1, 2], salt="a")
    assert cache.contains(BASE[:12], "a") and not cache.contains(BASE[:12], "b") and not cache.contains(BASE[:12])
    assert cache.lookup(BASE, "a") is not None and cache.lookup(BASE, "b") is None and cache.lookup(BASE) is None
    assert cache.remove_prefixes_of(BASE, "b") == [] and len(cache.remove_prefixes_of(BASE, "a")) == 1

    llm = make_llm(tiny_ckpt("nemotron_h"), page_size=4, enable_prefix_caching=True, check_state=True)

    def run(salt):
        prompt = {"prompt_token_ids": BASE} if salt is None else {"prompt_token_ids": BASE, "cache_salt": salt}
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    first, cached = run("tenant-a")
    assert cached == 0
    assert run("tenant-a") == (first, 12)  # the same salt: a hit
    assert run("tenant-b") == (first, 0)  # another salt: computed again (and cached under its own)
    assert run(None) == (first, 0)
    assert run("tenant-b") == (first, 12)
    for bad in ("", 5):
        with pytest.raises(InvalidRequestError, match="cache_salt"):
            llm.generate([{"prompt_token_ids": BASE, "cache_salt": bad}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
