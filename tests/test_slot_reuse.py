"""Slot lifecycle: fresh and recycled slots never leak state; requests wait when slots run out."""
from __future__ import annotations

import pytest
import torch

from hybrid import SamplingParams

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[7, 19, 33, 41, 5, 60, 12, 88, 9], [4], [100, 3, 57, 22, 61], [45]]


def _solo(make_llm, path, prompt, max_tokens):
    llm = make_llm(path, max_num_seqs=2, page_size=4)
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("check_state", [False, True])
def test_recycled_slot_matches_fresh_engine(tiny_ckpt, make_llm, check_state):
    path = tiny_ckpt("nemotron_h")
    fresh = {i: _solo(make_llm, path, p, 10) for i, p in enumerate(PROMPTS)}
    # one slot: every request after the first runs in the slot its predecessor just freed
    llm = make_llm(path, max_num_seqs=1, page_size=4, check_state=check_state)
    for i, p in enumerate(PROMPTS):
        out = llm.generate([p], SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == fresh[i], f"prompt {i} (len {len(p)}) leaked state from its slot"
    assert llm.state_pool.num_free == 1


def test_requests_wait_for_slots_and_reuse_them_mid_run(tiny_ckpt, make_llm):
    path = tiny_ckpt("nemotron_h")
    lens = [3, 12, 5, 8]  # different lengths: slots free and get reused while others run
    fresh = [_solo(make_llm, path, p, n) for p, n in zip(PROMPTS, lens)]
    llm = make_llm(path, max_num_seqs=2, page_size=4, check_state=True)
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, **GREEDY) for n in lens], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == fresh
    assert llm.engine.stats["preemptions"] == 0  # they waited for slots, nobody was evicted
    assert llm.state_pool.num_free == 2
    assert llm.kv_cache.allocator.num_free == llm.kv_cache.num_pages - 1


def test_engine_never_runs_more_than_the_slots(tiny_ckpt, make_llm):
    path = tiny_ckpt("nemotron_h")
    llm = make_llm(path, max_num_seqs=2, page_size=4)
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=4, **GREEDY))
    while eng.has_unfinished_requests():
        eng.step()
        assert eng.num_running <= 2
        assert len(llm.state_pool.live_slots) == eng.num_running
    assert llm.state_pool.num_free == 2
