"""The state-pool regression scenarios (slot reuse, n>1 forks, speculative verify, preemption) on the
GPU with CUDA graphs on and the state sanitizer on (`check_state=True`: every batch's slot and page
indices are checked against their owners, freed slots are poisoned with NaN).

bf16 on the GPU is not batch-invariant bit for bit (kernels pick tiles by batch size), so outputs are
compared with the runtime's own runs by token agreement; corrupted state shows up as a sanitizer
error, as NaN logits, or as garbage continuations far below these bounds.
"""
from __future__ import annotations

import pytest
import torch

from hybrid import LLM, SamplingParams

FAMILIES = ["bamba", "granite_dense"]  # dense: MoE models decode eagerly, these replay graphs
PROMPTS = [[7, 19, 33, 41, 5, 60, 12, 88, 9], [4], [100, 3, 57, 22, 61], [45], list(range(20, 60))]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def make(path, **kw) -> LLM:
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("page_size", 16)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("check_state", True)
    return LLM(path, device="cuda", gpu_memory_utilization=0.3, **kw)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for p, q in zip(a, b) for x, y in zip(p, q)) / max(1, sum(len(q) for q in b))


def assert_clean(llm: LLM) -> None:
    assert llm.runner.use_graphs and llm.runner.stats["graph_replays"] > 0, "decode did not replay graphs"
    assert llm.state_pool.num_free == llm.state_pool.num_slots
    assert llm.kv_cache.allocator.num_free == llm.kv_cache.num_pages - 1


@pytest.mark.parametrize("name", FAMILIES)
def test_recycled_slot_under_graphs(name, tiny_ckpt):
    path = tiny_ckpt(name)
    sp = SamplingParams(max_tokens=12, **GREEDY)
    fresh = [tokens(make(path, max_num_seqs=1).generate([p], sp, use_tqdm=False))[0] for p in PROMPTS[:3]]
    llm = make(path, max_num_seqs=1)  # one slot: each request reuses the slot its predecessor freed
    reused = [tokens(llm.generate([p], sp, use_tqdm=False))[0] for p in PROMPTS[:3]]
    assert reused == fresh  # same batch shapes as the fresh engines: bit-identical kernels
    assert_clean(llm)


@pytest.mark.parametrize("name", FAMILIES)
def test_forked_branches_under_graphs(name, tiny_ckpt):
    path = tiny_ckpt(name)
    llm = make(path, max_num_seqs=8)
    single = tokens(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False))[0]
    out = llm.generate([PROMPTS[0]], SamplingParams(n=4, max_tokens=16, **GREEDY), use_tqdm=False)[0]
    branches = [c.token_ids for c in out.outputs]
    assert len(branches) == 4 and all(b == branches[0] for b in branches)  # identical rows, one batch
    assert branches[0][0] == single[0] and agreement([branches[0]], [single]) >= 0.9
    assert llm.engine.stats["forks"] == 3
    assert_clean(llm)


@pytest.mark.parametrize("name", FAMILIES)
def test_speculative_verify_under_graphs(name, tiny_ckpt):
    path = tiny_ckpt(name)
    sp = SamplingParams(max_tokens=24, **GREEDY)
    plain = tokens(make(path).generate(PROMPTS[:4], sp, use_tqdm=False))
    llm = make(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    spec = tokens(llm.generate(PROMPTS[:4], sp, use_tqdm=False))
    assert llm.engine.stats["spec_draft_tokens"] > 0
    assert [s[0] for s in spec] == [p[0] for p in plain] and agreement(spec, plain) >= 0.9
    assert_clean(llm)


@pytest.mark.parametrize("name", FAMILIES)
def test_preemption_under_graphs(name, tiny_ckpt):
    path = tiny_ckpt(name)
    sps = [SamplingParams(max_tokens=40, **GREEDY)] * 4
    ref = tokens(make(path).generate(PROMPTS[:4], sps, use_tqdm=False))
    llm = make(path, max_model_len=64, num_kv_pages=6)  # 5 pages of 16 tokens for 4 requests of ~50
    got = tokens(llm.generate(PROMPTS[:4], sps, use_tqdm=False))
    assert llm.engine.stats["preemptions"] > 0
    assert [g[0] for g in got] == [r[0] for r in ref] and agreement(got, ref) >= 0.9
    assert_clean(llm)


def test_sanitizer_catches_a_bad_index_under_graphs(tiny_ckpt):
    """A decode row pointed at a freed slot is refused before the graph replays."""
    from hybrid.errors import StateCorruptionError

    llm = make(tiny_ckpt("bamba"))
    eng = llm.engine
    eng.add_request("victim", PROMPTS[0], SamplingParams(max_tokens=8, **GREEDY))
    eng.step()  # prefill
    seq = eng.requests["victim"].seqs[0]
    free_slot = next(s for s in range(llm.state_pool.num_slots) if s not in llm.state_pool.live_slots)
    real_slot, seq.slot = seq.slot, free_slot  # the corruption the sanitizer exists for
    try:
        with pytest.raises(StateCorruptionError, match="victim"):
            eng.step()
    finally:
        seq.slot = real_slot
    assert not torch.isnan(llm.state_pool.ssm_state[:, real_slot]).any()
