"""Async scheduling (Engine(async_scheduling=True), LLM's default on CUDA): step N+1 is scheduled and
launched before step N's tokens reach the host; decode rows read N's tokens on the device. It must
give exactly the tokens, logprobs and finish reasons of the synchronous engine, free nothing that a
launched step still uses, and leave no slot or page behind."""
from __future__ import annotations

import pytest
import torch

from hybrid import SamplingParams

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower

PROMPTS = [[7, 19, 33, 41, 5, 60, 12, 88, 9], [4], [100, 3, 57, 22, 61, 17, 18, 19, 20, 21, 22, 23], [45, 46]]


def _params(stop_token: int | None = None) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.8, max_tokens=11, seed=4, ignore_eos=True, logprobs=0),
        SamplingParams(n=2, temperature=1.0, top_k=5, max_tokens=9, seed=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                       stop_token_ids=[stop_token] if stop_token is not None else None),
    ]


def _summary(outs):
    return [[(c.index, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _assert_same(got, ref):
    """Same tokens, finish and stop reasons and logprob entries; logprob values within 1e-4 (a request
    that stops still runs one extra row in the step already in flight, which changes that step's
    batch size: CPU GEMMs then round the other rows' logits differently in the last bits)."""
    assert len(got) == len(ref)
    for g_req, r_req in zip(got, ref):
        assert [(i, t, f, s) for i, t, _, f, s in g_req] == [(i, t, f, s) for i, t, _, f, s in r_req]
        for (*_, g_lp, _f, _s), (*_, r_lp, _f2, _s2) in zip(g_req, r_req):
            assert (g_lp is None) == (r_lp is None)
            for g, r in zip(g_lp or [], r_lp or []):
                assert g.keys() == r.keys() and all(abs(g[t] - r[t]) < 1e-4 for t in g)


def _watch_frees(engine):
    """Fail the test if a slot or page is freed while a launched, unfinished step still uses it."""
    pool, alloc = engine.state_pool, engine.kv_cache.allocator
    free_slot, release = pool.free, alloc.release

    def in_flight():
        step = engine._in_flight
        if step is None:
            return set(), set()
        pages = set(int(p) for p in step.batch.page_table.flatten().tolist()) - {0}
        return set(step.batch.state_slot_cpu), pages

    def checked_free(slot):
        assert slot not in in_flight()[0], f"slot {slot} freed while the step in flight uses it"
        return free_slot(slot)

    def checked_release(pages):
        used = in_flight()[1]
        assert not (set(pages) & used), f"pages {sorted(set(pages) & used)} released while in flight"
        return release(pages)

    pool.free, alloc.release = checked_free, checked_release


@pytest.mark.parametrize("name", ["nemotron_h", "bamba"])
def test_async_matches_sync(tiny_ckpt, make_llm, name):
    path = tiny_ckpt(name)
    sync = make_llm(path, max_num_seqs=8, max_num_batched_tokens=16, async_scheduling=False)
    ref = sync.generate(PROMPTS, _params(), use_tqdm=False)
    stop = ref[3].outputs[0].token_ids[6]  # stops request 3 early, with steps of the others in flight
    ref = _summary(sync.generate(PROMPTS, _params(stop), use_tqdm=False))
    assert ref[3][0][3] == "stop"
    llm = make_llm(path, max_num_seqs=8, max_num_batched_tokens=16, async_scheduling=True, check_state=True)
    _watch_frees(llm.engine)
    _assert_same(_summary(llm.generate(PROMPTS, _params(stop), use_tqdm=False)), ref)
    assert llm.engine.stats["overlapped_steps"] > 10
    assert llm.state_pool.num_free == 8 and llm.kv_cache.allocator.num_free == llm.kv_cache.num_pages - 1


def test_async_under_preemption_matches(tiny_ckpt, make_llm):
    """Out of pages with steps in flight: the victims' slots and pages are freed only after the step
    that used them, and their in-flight tokens are kept for the recompute."""
    path = tiny_ckpt("nemotron_h")
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 36, 24, 40)]
    sps[1] = SamplingParams(temperature=0.8, max_tokens=36, seed=2, ignore_eos=True, logprobs=1)
    ref = _summary(make_llm(path, max_num_seqs=4, page_size=4, max_model_len=64, async_scheduling=False)
                   .generate(PROMPTS, sps, use_tqdm=False))
    llm = make_llm(path, max_num_seqs=4, page_size=4, max_model_len=64, num_kv_pages=17, check_state=True,
                   async_scheduling=True)
    _watch_frees(llm.engine)
    _assert_same(_summary(llm.generate(PROMPTS, sps, use_tqdm=False)), ref)
    assert llm.engine.stats["preemptions"] > 0 and llm.engine.stats["overlapped_steps"] > 0
    assert llm.state_pool.num_free == 4 and llm.kv_cache.allocator.num_free == 16


def test_abort_and_arrivals_while_a_step_is_in_flight(tiny_ckpt, make_llm):
    path = tiny_ckpt("granite_dense")
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = make_llm(path, max_num_seqs=4, async_scheduling=False)
    ref = {i: alone.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for i, p in enumerate(PROMPTS)}
    llm = make_llm(path, max_num_seqs=4, async_scheduling=True, check_state=True)
    eng = llm.engine
    _watch_frees(eng)
    eng.add_request("r0", PROMPTS[0], greedy)
    eng.add_request("doomed", PROMPTS[1], greedy)
    final = {}
    for step in range(40):
        if step == 3:
            assert eng._in_flight is not None  # a step of "doomed" is queued when it is aborted
            eng.abort_request("doomed")
        if step == 5:  # arrivals while decoding
            eng.add_request("r2", PROMPTS[2], greedy)
            eng.add_request("r3", PROMPTS[3], greedy)
        for out in eng.step():
            assert out.request_id != "doomed" or step <= 3
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        if not eng.has_unfinished_requests():
            break
    assert final == {"r0": ref[0], "r2": ref[2], "r3": ref[3]}
    assert llm.state_pool.num_free == 4 and eng.kv_cache.allocator.num_free == eng.kv_cache.num_pages - 1
    assert eng.requests == {} and eng.resources.num_deferred == 0


def test_speculation_runs_synchronously(tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("granite_dense"), async_scheduling=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert not llm.engine.async_scheduling  # drafts need the latest tokens on the host
