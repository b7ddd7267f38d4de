"""LLM.beam_search (vLLM's): against a beam search written here over transformers' own forward passes (the
oracle: its full-sequence log-probabilities, no cache), with and without prefix caching; width 1 is greedy;
end-of-sequence tokens finish beams; bad parameters are clear errors."""
from __future__ import annotations

import pytest
import torch

import hf_oracle
from hybrid import BeamSearchParams, SamplingParams
from hybrid.errors import InvalidRequestError

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower

PROMPTS = [[7, 19, 33, 41, 5, 60, 12, 88, 9], [4, 8, 15, 16]]


def _reference(path, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """(tokens, cumulative log-probability) of the `width` best beams after `steps` tokens, no beam
    finishing: each step expands every beam by every token of the vocabulary."""
    beams = [(list(prompt), 0.0)]
    for _ in range(steps):
        cands = []
        for tokens, cum in beams:
            lp = hf_oracle.full_forward_logprobs(path, tokens)[-1]
            vals, ids = torch.topk(lp, width)
            cands += [(tokens + [int(t)], cum + float(v)) for v, t in zip(vals, ids)]
        beams = sorted(cands, key=lambda b: -b[1])[:width]
    return beams


@pytest.mark.parametrize("caching", [False, True])
def test_beams_match_a_search_over_transformers(tiny_ckpt, make_llm, caching):
    path = tiny_ckpt("nemotron_h")
    llm = make_llm(path, enable_prefix_caching=caching, page_size=4)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ref = _reference(path, prompt, 3, 4)
        assert [s.tokens for s in out.sequences] == [t for t, _ in ref]
        for s, (_, cum) in zip(out.sequences, ref):
            assert s.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert s.finish_reason == "length" and len(s.logprobs) == 4
            assert s.text == llm.tokenizer.decode(s.tokens)
    if caching:  # the steps after the first found beams' sequences in the cache (as many as its entries hold)
        assert llm.engine.stats["prefix_cache_hits"] >= 3 * len(PROMPTS)
    assert llm.state_pool.num_free == llm.state_pool.num_slots - len(llm.engine.prefix_cache or [])


def test_width_one_is_greedy(tiny_ckpt, make_llm):
    path = tiny_ckpt("granite_moe")
    llm = make_llm(path)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True))
    for prompt, g, b in zip(PROMPTS, greedy, beams):
        assert b.sequences[0].tokens == prompt + g.outputs[0].token_ids


def test_end_of_sequence_finishes_a_beam(tiny_ckpt, make_llm):
    """With the first step's best token counted as end-of-sequence, the best beam is that one-token
    sequence, finished with "stop" (its score is its log-probability over the prompt's length)."""
    path = tiny_ckpt("nemotron_h")
    llm = make_llm(path)
    prompt = PROMPTS[0]
    first = int(torch.argmax(hf_oracle.full_forward_logprobs(path, prompt)[-1]))
    llm.engine.eos_token_ids.add(first)
    try:
        out = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0))[0]
    finally:
        llm.engine.eos_token_ids.discard(first)
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped and stopped[0].tokens == prompt + [first] and stopped[0].stop_reason == first
    assert all(len(s.tokens) == len(prompt) + 3 for s in out.sequences if s.finish_reason == "length")


def test_bad_parameters(tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("nemotron_h"), max_model_len=32)
    with pytest.raises(InvalidRequestError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=True)
    with pytest.raises(InvalidRequestError, match="exceed max_model_len"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=30))
    with pytest.raises(InvalidRequestError, match="BeamSearchParams"):
        llm.beam_search([PROMPTS[0]], SamplingParams())
    # the prompts are checked as generate checks them, before any step runs, naming the prompt
    with pytest.raises(InvalidRequestError, match="prompt 1: prompt token id .* outside the vocabulary"):
        llm.beam_search([PROMPTS[0], [1, 10**9]], BeamSearchParams(beam_width=2, max_tokens=3))
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        llm.beam_search([[]], BeamSearchParams(beam_width=2, max_tokens=3))
    assert not llm.engine.has_unfinished_requests()
