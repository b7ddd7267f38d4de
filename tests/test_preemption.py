"""Preemption by recompute under a tiny page / slot budget gives identical outputs."""
from __future__ import annotations

import pytest
import torch

from hybrid import SamplingParams

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower

PROMPTS = [[7, 19, 33, 41, 5, 60, 12, 88, 9], [4], [100, 3, 57, 22, 61, 17, 18, 19, 20, 21, 22, 23], [45, 46]]


@pytest.mark.parametrize("check_state", [False, True])
def test_tiny_page_budget_preempts_and_matches(tiny_ckpt, make_llm, check_state):
    path = tiny_ckpt("nemotron_h")
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 36, 24, 40)]
    ref = make_llm(path, max_num_seqs=4, page_size=4, max_model_len=64).generate(PROMPTS, sps, use_tqdm=False)
    # 16 pages of 4 tokens (+ the dummy): one full-length sequence fits, four do not
    llm = make_llm(path, max_num_seqs=4, page_size=4, max_model_len=64, num_kv_pages=17, check_state=check_state)
    got = llm.generate(PROMPTS, sps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.stats["preemptions"] > 0
    assert llm.state_pool.num_free == 4 and llm.kv_cache.allocator.num_free == 16


def test_preempted_sampled_and_forked_requests_match(tiny_ckpt, make_llm):
    """Seeded sampling and n > 1 survive preemption: same generator draws after recompute."""
    path = tiny_ckpt("nemotron_h")
    sps = [SamplingParams(n=2, temperature=0.8, max_tokens=30, seed=5, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True),
           SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=6, ignore_eos=True),
           SamplingParams(n=2, temperature=0.0, max_tokens=30, ignore_eos=True)]
    ref = make_llm(path, max_num_seqs=8, page_size=4, max_model_len=64).generate(PROMPTS, sps, use_tqdm=False)
    llm = make_llm(path, max_num_seqs=3, page_size=4, max_model_len=64, num_kv_pages=17, check_state=True)
    got = llm.generate(PROMPTS, sps, use_tqdm=False)
    for r, g in zip(ref, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in r.outputs]
    assert llm.engine.stats["preemptions"] > 0
    assert llm.state_pool.num_free == 3 and llm.kv_cache.allocator.num_free == 16
