"""The CUDA defaults, on the CPU: what differs between the two devices by default (the fused Triton
ops, here through the interpreter; async scheduling; decode and verify batches padded to the graph
buckets, which on CUDA the graphs replay) switched on together, with prefix caching, chunked
prefill, queueing past max_num_seqs, speculation and the state sanitizer, against the plain CPU
engine: the same tokens, log-probabilities within rounding, nothing left held. Each feature has its
own tests; this one catches what only their combination breaks (e.g. a fused path meeting a layer
type it was not written for)."""
from __future__ import annotations

import pytest

from hybrid import SamplingParams

FAMILIES = ["granite_moe", "nemotron_h", "zamba2", "bamba"]


def _workload(vocab: int):
    shared = [(7 * i + 3) % (vocab - 4) + 4 for i in range(21)]  # a long common prefix (prefix-cache hits)
    return [shared + [5, 6], shared + [9], [11, 12, 13], [(5 * i) % (vocab - 4) + 4 for i in range(30)], [17]]


def _outputs(llm, prompts, n: int = 6):
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def _assert_close(want, got):
    assert got[0] == want[0]
    for a_row, b_row in zip(want[1], got[1]):
        for a, b in zip(a_row, b_row):
            t = next(iter(a))
            assert abs(a[t] - b[t]) < 1e-4


def _assert_released(llm):
    llm.engine.forget_history()  # (the cached prefixes evicted: what they held is freed)
    assert llm.state_pool.num_free == llm.state_pool.num_slots
    assert llm.kv_cache.allocator.num_free == llm.kv_cache.num_pages - 1


@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_defaults_together(name, tiny_ckpt, make_llm):
    import tiny_checkpoints

    path = tiny_ckpt(name)
    prompts = _workload(tiny_checkpoints.vocab_size_of(path))
    common = dict(max_num_seqs=3, page_size=4, max_num_batched_tokens=16)
    want = _outputs(make_llm(path, **common), prompts)
    llm = make_llm(path, fused_ops=True, async_scheduling=True, enable_prefix_caching=True, check_state=True, **common)
    llm.runner.pad_decode = True
    got = _outputs(llm, prompts)
    _assert_close(want, got)
    _assert_close((want[0][:2], want[1][:2]), _outputs(llm, prompts[:2]))  # again, over the cached prefixes
    assert llm.runner.stats["padded_eager"] > 0 and llm.engine.stats["prefix_cache_hits"] > 0
    _assert_released(llm)


@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_defaults_with_speculation(name, tiny_ckpt, make_llm, monkeypatch):
    import tiny_checkpoints

    path = tiny_ckpt(name)
    prompts = _workload(tiny_checkpoints.vocab_size_of(path))[:4]
    common = dict(max_num_seqs=3, page_size=4, max_num_batched_tokens=32)
    want = _outputs(make_llm(path, **common), prompts)
    llm = make_llm(path, fused_ops=True, enable_prefix_caching=True, check_state=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **common)
    llm.runner.pad_decode = llm.runner.pad_verify = True
    # drafts at every step, so that verify steps of verify rows only (what the verify graphs replay)
    # come in every family whatever it generates: the plain engine's next tokens with the last one
    # wrong, so every verify accepts some drafts and rejects one
    vocab = tiny_checkpoints.vocab_size_of(path)
    reference = {tuple(p): w for p, w in zip(prompts, want[0])}

    def propose(tokens, k):
        prompt = max((p for p in reference if tuple(tokens[:len(p)]) == p), key=len)
        ahead = reference[prompt][len(tokens) - len(prompt):][:k]
        return ahead[:-1] + [(ahead[-1] + 1) % vocab] if ahead else []

    monkeypatch.setattr(llm.engine.scheduler.proposer, "propose", propose)
    got = _outputs(llm, prompts)
    _assert_close(want, got)
    stats = llm.engine.stats
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0 and llm.runner.stats["padded_verify_eager"] > 0
    _assert_released(llm)
