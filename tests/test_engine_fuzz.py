"""Random workloads against the engine's invariants. Requests of random lengths and sampling
parameters arrive at random steps, some are aborted, pages are scarce (preemption, prefix-cache
eviction), with and without async scheduling and prefix caching, the state sanitizer on. Every
request that is not aborted must produce exactly the tokens it produces alone, and at the end every
slot and page is free again (or held by the prefix cache)."""
from __future__ import annotations

import random

import pytest
import torch

from hybrid import SamplingParams

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower

VOCAB_TOP = 120  # below every tiny checkpoint's vocabulary (the smallest: 128)


def _workload(seed: int):
    rng = random.Random(seed)
    shared = [rng.randrange(4, VOCAB_TOP) for _ in range(10)]
    requests = []
    for i in range(9):
        body = [rng.randrange(4, VOCAB_TOP) for _ in range(rng.randrange(1, 14))]
        prompt = shared + body if rng.random() < 0.5 else body  # half share a prefix
        kw = dict(max_tokens=rng.randrange(1, 16), ignore_eos=True)
        if rng.random() < 0.5:
            kw.update(temperature=0.0)
        else:
            kw.update(temperature=rng.choice([0.6, 1.0]), seed=rng.randrange(100), top_p=rng.choice([1.0, 0.9]))
        if rng.random() < 0.3:
            kw.update(n=2)
        if rng.random() < 0.3:
            kw.update(presence_penalty=0.5, repetition_penalty=1.2)
        if rng.random() < 0.2:
            kw.update(stop_token_ids=[rng.randrange(4, VOCAB_TOP)])
        requests.append((f"r{i}", prompt, SamplingParams(**kw), rng.randrange(0, 12)))  # arrival step
    victim = requests[rng.randrange(len(requests))]
    aborted = {victim[0]: victim[3] + rng.randrange(0, 12)}  # request -> step (once it has arrived)
    return requests, aborted


def _alone(make_llm, path, requests):
    llm = make_llm(path, page_size=4, max_num_seqs=4, max_model_len=64)
    return {rid: [c.token_ids for c in llm.generate([p], sp, use_tqdm=False)[0].outputs]
            for rid, p, sp, _ in requests}


def _run(llm, requests, aborted, priorities=None):
    eng = llm.engine
    final, step = {}, 0
    pending = sorted(requests, key=lambda r: r[3])
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, sp, _ = pending.pop(0)
            eng.add_request(rid, prompt, sp, output_kind="final", priority=(priorities or {}).get(rid, 0))
        for rid, at in aborted.items():
            if at == step:
                eng.abort_request(rid)
        for out in eng.step():
            assert out.request_id not in aborted or step < aborted[out.request_id]
            final[out.request_id] = [c.token_ids for c in out.outputs]
        step += 1
        assert step < 2000, "the engine stopped making progress"
    return final


def _check(llm, requests, aborted, got, ref, label: str = "") -> None:
    """Every request not aborted produced its tokens alone; the engine is empty and every slot and page is
    free again or held by the prefix cache."""
    for rid, _, _, _ in requests:
        if rid not in aborted:
            assert got.get(rid) == ref[rid], f"{label}: request {rid}"
    eng = llm.engine
    held = eng.prefix_cache.entries.values() if eng.prefix_cache is not None else []
    assert llm.state_pool.num_free == llm.state_pool.num_slots - len(held), label
    assert llm.kv_cache.allocator.num_free + len({p for e in held for p in e.pages}) == \
        llm.kv_cache.num_pages - 1, label
    assert eng.requests == {} and not eng.running and not eng.waiting, label


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads(seed, tiny_ckpt, make_llm):
    path = tiny_ckpt("nemotron_h")
    requests, aborted = _workload(seed)
    ref = _alone(make_llm, path, requests)
    exercised = set()
    for async_scheduling in (False, True):
        for caching in (False, True):
            llm = make_llm(path, page_size=4, max_num_seqs=3, max_model_len=64, num_kv_pages=17,
                           max_num_batched_tokens=12, check_state=True, async_scheduling=async_scheduling,
                           enable_prefix_caching=caching, prefix_cache_entries=2)
            got = _run(llm, requests, aborted)
            exercised.update(k for k, v in llm.engine.stats.items() if v)
            _check(llm, requests, aborted, got, ref, f"async={async_scheduling} prefix_caching={caching}")
    assert {"overlapped_steps", "prefix_cache_evictions"} <= exercised


@pytest.mark.parametrize("seed", range(3))
def test_random_workloads_by_priority(seed, tiny_ckpt, make_llm):
    """The same workloads scheduled by random priorities (admission and preemption order change, the
    tokens must not), async scheduling and prefix caching on."""
    path = tiny_ckpt("nemotron_h")
    requests, aborted = _workload(seed)
    rng = random.Random(1000 + seed)
    priorities = {rid: rng.randrange(-2, 3) for rid, _, _, _ in requests}
    ref = _alone(make_llm, path, requests)
    llm = make_llm(path, page_size=4, max_num_seqs=3, max_model_len=64, num_kv_pages=17, max_num_batched_tokens=12,
                   check_state=True, async_scheduling=True, enable_prefix_caching=True, prefix_cache_entries=2,
                   scheduling_policy="priority")
    got = _run(llm, requests, aborted, priorities)
    _check(llm, requests, aborted, got, ref)


@pytest.mark.parametrize("name", ["granite_moe", "bamba", "falcon_h1", "zamba2", "nemotron_h_latent"])
def test_random_workloads_across_families(name, tiny_ckpt, make_llm):
    """One workload on each other family, with n-gram speculation on top of async scheduling, prefix caching and
    scarce pages (verify steps, forks, preemption and prefix hits together): the same tokens as alone, and every
    slot and page free again (or held by the prefix cache)."""
    path = tiny_ckpt(name)
    requests, aborted = _workload(7)
    ref = _alone(make_llm, path, requests)
    llm = make_llm(path, page_size=4, max_num_seqs=3, max_model_len=64, num_kv_pages=17, max_num_batched_tokens=12,
                   check_state=True, async_scheduling=True, enable_prefix_caching=True, prefix_cache_entries=2,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                       "prompt_lookup_min": 1})
    got = _run(llm, requests, aborted)
    _check(llm, requests, aborted, got, ref)
    stats = llm.engine.stats
    assert stats["spec_verify_rows"] and (stats["preemptions"] or stats["prefix_cache_evictions"])
