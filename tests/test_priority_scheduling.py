"""scheduling_policy="priority" (vLLM's): waiting requests are admitted by (priority, arrival), lower values
first; when pages run out the running sequence that goes last by that order is preempted. Under the default
"fcfs" a non-zero priority is refused. The tokens are those of first-come scheduling either way."""
from __future__ import annotations

import pytest
import torch

from hybrid import SamplingParams
from hybrid.errors import ConfigurationError, InvalidRequestError

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower

PROMPTS = [[7, 19, 33, 41, 5, 60, 12, 88, 9], [4, 8, 15], [100, 3, 57, 22, 61], [45, 46]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _finish_order(llm, priorities, params=GREEDY) -> tuple[list[int], dict]:
    """Queue PROMPTS with `priorities` on the engine, step to the end: (prompt indexes in finishing order,
    {prompt index: tokens})."""
    eng = llm.engine
    for i, (ids, prio) in enumerate(zip(PROMPTS, priorities)):
        eng.add_request(f"r{i}", ids, params, output_kind="final", priority=prio)
    order, tokens = [], {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                i = int(out.request_id[1:])
                order.append(i)
                tokens[i] = out.outputs[0].token_ids
    return order, tokens


def test_admission_follows_priority_then_arrival(tiny_ckpt, make_llm):
    path = tiny_ckpt("nemotron_h")
    fcfs_order, ref = _finish_order(make_llm(path, max_num_seqs=1), [0, 0, 0, 0])
    assert fcfs_order == [0, 1, 2, 3]
    llm = make_llm(path, max_num_seqs=1, scheduling_policy="priority")
    order, got = _finish_order(llm, [3, 1, 2, 1])
    assert order == [1, 3, 2, 0]  # priority 1 (twice: by arrival), 2, 3
    assert got == ref
    assert llm.state_pool.num_free == llm.state_pool.num_slots


def test_generate_takes_one_priority_per_prompt(tiny_ckpt, make_llm):
    path = tiny_ckpt("nemotron_h")
    ref = make_llm(path).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = make_llm(path, max_num_seqs=2, scheduling_policy="priority")
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[5, -1, 0, 2])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]  # (in prompt order)
    with pytest.raises(InvalidRequestError, match="one integer per prompt"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[1, 2])
    with pytest.raises(InvalidRequestError, match="prompt 1: priority must be an integer"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, priority=[1, "high"])
    assert not llm.engine.has_unfinished_requests()


def test_fcfs_refuses_a_priority(tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("nemotron_h"))
    with pytest.raises(InvalidRequestError, match="scheduling_policy='priority'"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, priority=[1])
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, priority=[0])[0].finished
    with pytest.raises(ConfigurationError, match="scheduling_policy must be one of fcfs, priority"):
        make_llm(tiny_ckpt("nemotron_h"), scheduling_policy="lifo")


@pytest.mark.parametrize("policy,victim", [("fcfs", 1), ("priority", 0)])
def test_out_of_pages_preempts_the_lowest_priority(tiny_ckpt, make_llm, policy, victim):
    """Two long generations on 16 pages of 4 tokens (one full-length sequence fits): first come, first
    served preempts the newer one; by priority, the one with the larger value though it came first. Both
    still give the tokens of an unconstrained run."""
    path = tiny_ckpt("nemotron_h")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[2]]
    ref = make_llm(path, page_size=4, max_model_len=64).generate(prompts, params, use_tqdm=False)
    llm = make_llm(path, max_num_seqs=2, page_size=4, max_model_len=64, num_kv_pages=17, scheduling_policy=policy,
                   check_state=True)
    eng = llm.engine
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{i}", ids, params, output_kind="final", priority=(5 if i == 0 else 0) if policy == "priority" else 0)
    seqs = [eng.requests[f"r{i}"].seqs[0] for i in range(2)]
    outs = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    assert seqs[victim].num_preemptions > 0 and seqs[1 - victim].num_preemptions == 0
    assert [outs["r0"], outs["r1"]] == [o.outputs[0].token_ids for o in ref]
    assert llm.state_pool.num_free == 2 and llm.kv_cache.allocator.num_free == 16
