"""Parallel sampling (n > 1): the prompt is prefilled once, the branches fork from it (copy of
the Mamba slot, prompt KV pages shared by refcount, partial last page copied on write)."""
from __future__ import annotations

import pytest
import torch

from hybrid import SamplingParams

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower

PROMPT = [7, 19, 33, 41, 5, 60, 12, 88, 9, 14]  # 10 tokens: 2 full pages of 4 + a partial one
OTHER = [[100, 3, 57], [45, 46, 47, 48, 49, 50, 51]]


def _greedy(n, max_tokens=12):
    return SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("page_size", [4, 5])  # partial last page / prompt ends on a page boundary
def test_greedy_branches_equal_n1(tiny_ckpt, make_llm, page_size):
    path = tiny_ckpt("nemotron_h")
    llm = make_llm(path, max_num_seqs=4, page_size=page_size, check_state=True)
    ref = llm.generate([PROMPT], _greedy(1), use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate([PROMPT], _greedy(4), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == ref for c in out.outputs)
    assert llm.engine.stats["prompt_tokens"] == 2 * len(PROMPT)  # prefilled once for the 4 branches
    assert llm.engine.stats["forks"] == 3
    assert llm.state_pool.num_free == 4
    assert llm.kv_cache.allocator.num_free == llm.kv_cache.num_pages - 1


def test_prompt_pages_shared_mid_run_and_freed_at_end(tiny_ckpt, make_llm):
    path = tiny_ckpt("nemotron_h")
    llm = make_llm(path, max_num_seqs=4, page_size=4, check_state=True)
    eng, alloc = llm.engine, llm.kv_cache.allocator
    eng.add_request("fork", PROMPT, _greedy(3, max_tokens=6))
    seen_shared = seen_cow = False
    while eng.has_unfinished_requests():
        eng.step()
        live = [s for s in eng.running if s.request_id == "fork"]
        if len(live) == 3:
            parent = next(s for s in live if s.index == 0)
            for child in (s for s in live if s is not parent):
                assert child.slot != parent.slot
                # the two full prompt pages are the parent's own pages, shared by refcount
                assert child.pages[:2] == parent.pages[:2]
                seen_shared |= all(alloc.refcount(p) == 3 for p in parent.pages[:2])
                # the partial third page was copied: branches write different tokens into it
                seen_cow |= child.pages[2] != parent.pages[2] and alloc.refcount(child.pages[2]) == 1
    assert seen_shared and seen_cow
    assert llm.state_pool.num_free == 4
    assert alloc.num_free == llm.kv_cache.num_pages - 1


def test_seeded_branches_reproducible_and_batch_independent(tiny_ckpt, make_llm):
    path = tiny_ckpt("nemotron_h")
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=1234, ignore_eos=True)
    llm = make_llm(path, max_num_seqs=8, page_size=4)
    alone = [c.token_ids for c in llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs]
    assert len({tuple(t) for t in alone}) > 1  # branches draw from their own generators
    # with other requests in the batch, and on a fresh engine with another engine seed
    other = make_llm(path, max_num_seqs=8, page_size=4, seed=99, check_state=True)
    mixed = other.generate([OTHER[0], PROMPT, OTHER[1]],
                           [SamplingParams(temperature=0.8, max_tokens=7), sp, _greedy(2)], use_tqdm=False)
    assert [c.token_ids for c in mixed[1].outputs] == alone
    assert len(mixed[2].outputs) == 2 and len(mixed[0].outputs) == 1


def test_branches_wait_when_out_of_slots(tiny_ckpt, make_llm):
    """Two slots for four branches: two branches fork, the other two wait and are recomputed from
    the prompt; outputs are the same as with plenty of slots."""
    path = tiny_ckpt("nemotron_h")
    roomy = make_llm(path, max_num_seqs=8, page_size=4)
    sp = SamplingParams(n=4, temperature=0.7, max_tokens=8, seed=7, ignore_eos=True)
    want = [c.token_ids for c in roomy.generate([PROMPT], sp, use_tqdm=False)[0].outputs]
    ref = roomy.generate([PROMPT], _greedy(1, 8), use_tqdm=False)[0].outputs[0].token_ids
    tight = make_llm(path, max_num_seqs=2, page_size=4, check_state=True)
    got = tight.generate([PROMPT, PROMPT], [sp, _greedy(2, 8)], use_tqdm=False)
    assert [c.token_ids for c in got[0].outputs] == want
    assert [c.token_ids for c in got[1].outputs] == [ref, ref]
    assert tight.state_pool.num_free == 2
    assert tight.kv_cache.allocator.num_free == tight.kv_cache.num_pages - 1
