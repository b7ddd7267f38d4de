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


# beam_search_async (the server's): the same search, each step's beams as concurrent requests

# end-of-sequence tokens common enough that beams of both prompts stop, at several lengths
MANY_EOS = {t for t in range(160) if t % 4 == 0 or t % 5 == 0}


def _beams(outs) -> list[list[tuple]]:
    """Each beam's tokens, finish, text and the tokens of each step's top entries."""
    return [[(s.tokens, s.finish_reason, s.stop_reason, s.text, [list(d) for d in s.logprobs])
             for s in out.sequences] for out in outs]


def _cum_logprobs(outs) -> list[float]:
    return [s.cum_logprob for out in outs for s in out.sequences]


class _Recorder:
    """The LLM to beam_search, noting how many beams each step ran."""

    def __init__(self, llm) -> None:
        self.llm, self.steps = llm, []

    def generate(self, prompts, params, use_tqdm=True):
        self.steps.append(len(prompts))
        return self.llm.generate(prompts, params, use_tqdm=use_tqdm)


@pytest.mark.parametrize("via", ["llm", "async_engine"])
def test_async_search_matches_the_sync_one(tiny_ckpt, make_llm, via):
    """Over LLM.generate (one beam per call, the step's calls all in flight together) and over the
    AsyncEngine (the step's beams batched as the engine sees fit): the very same beams and finish reasons
    as beam_search, and their log-probabilities (to rounding: a batch of other sizes may round differently,
    as may a cached prefix, so there is no prefix cache)."""
    import asyncio

    from hybrid.async_engine import AsyncEngine
    from hybrid.beam_search import beam_search, beam_search_async

    llm = make_llm(tiny_ckpt("nemotron_h"), page_size=4)
    decode = llm.tokenizer.decode
    in_flight, peak = 0, 0
    ae = AsyncEngine(llm.engine, idle_wait_s=0.01)

    async def generate_one(ids, step_params):
        nonlocal in_flight, peak
        in_flight += 1
        try:
            await asyncio.sleep(0)  # (lets the step's other calls start)
            peak = max(peak, in_flight)
            if via == "llm":
                out = llm.generate([ids], step_params, use_tqdm=False)[0]
            else:
                async for out in ae.generate(ids, step_params):
                    pass
            return out.outputs[0].logprobs[0]
        finally:
            in_flight -= 1

    cases = [(2, True, set()), (2, False, MANY_EOS), (4, False, MANY_EOS)]
    stop_lengths = set()
    for width, ignore_eos, eos in cases:
        params = BeamSearchParams(beam_width=width, max_tokens=4, ignore_eos=ignore_eos)
        rec = _Recorder(llm)
        want = beam_search(rec, PROMPTS, params, eos, decode)
        peak = 0
        if via == "async_engine":  # (its worker thread steps the engine: not while LLM.generate does)
            ae.start()
        try:
            got = asyncio.run(beam_search_async(generate_one, PROMPTS, params, eos, decode))
        finally:
            ae.shutdown()
        assert _beams(got) == _beams(want), (width, ignore_eos)
        assert _cum_logprobs(got) == pytest.approx(_cum_logprobs(want), abs=1e-5, rel=0)
        assert peak == max(rec.steps)  # a step's beams all run at once
        stop_lengths |= {len(s.tokens) - len(p) for p, o in zip(PROMPTS, want) for s in o.sequences
                         if s.finish_reason == "stop"}
    assert len(stop_lengths) >= 2  # (the end-of-sequence tokens did finish beams, at different steps)
    assert llm.state_pool.num_free == llm.state_pool.num_slots and not llm.engine.has_unfinished_requests()


def test_async_search_raises_what_a_step_raises():
    """An exception of one beam's generate_one ends the search with that exception, the step's other beams
    (still waiting) cancelled first; nothing runs the model here."""
    import asyncio

    from hybrid.beam_search import beam_search_async
    from hybrid.outputs import Logprob

    calls, cancelled = [], []

    async def generate_one(ids, step_params):
        calls.append(list(ids))
        if len(ids) == 2:  # the first step: every beam gets the same 4 candidates
            return {t: Logprob(-0.1 * t) for t in range(1, 5)}
        if ids == [9, 9, 2]:  # the second step's second beam fails while the first one waits
            raise RuntimeError("engine failed")
        try:
            await asyncio.Event().wait()  # never answers
        except asyncio.CancelledError:
            cancelled.append(list(ids))
            raise

    async def main():
        with pytest.raises(RuntimeError, match="engine failed"):
            await asyncio.wait_for(beam_search_async(generate_one, [[9, 9]], BeamSearchParams(2, 5), set()), 10)
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(main())
    assert calls == [[9, 9], [9, 9, 1], [9, 9, 2]] and cancelled == [[9, 9, 1]]


def test_search_steps():
    """BeamSearch on its own: the sequences to extend, until max_tokens steps or no live beam; a step's
    results must be one per sequence."""
    from hybrid.beam_search import BeamSearch
    from hybrid.outputs import Logprob

    search = BeamSearch([[5], [6, 7]], BeamSearchParams(beam_width=2, max_tokens=3), eos_token_ids={0, 3})
    assert search.step_params.max_tokens == 1 and search.step_params.logprobs == 4
    assert search.next_sequences() == [[5], [6, 7]]
    with pytest.raises(ValueError, match="1 results for 2 beams"):
        search.advance([{1: Logprob(-1.0)}])
    search.advance([{0: Logprob(-0.5), 1: Logprob(-1.0), 2: Logprob(-2.0)}, {0: Logprob(-0.1), 3: Logprob(-0.2)}])
    assert search.next_sequences() == [[5, 1]]  # [5, 2] is third; both candidates of [6, 7] finished
    search.advance([{0: Logprob(-1.5), 4: Logprob(-1.6)}])
    assert search.next_sequences() == [[5, 1, 4]]
    search.advance([{6: Logprob(-0.1)}])
    assert search.next_sequences() == []  # max_tokens steps
    outs = search.outputs(decode=lambda ids: str(ids))
    # ranked by score: [5, 1, 4, 6] (-2.7 over 4 tokens) beats [5, 1, 0] (-2.5 over 2: its end-of-sequence
    # token not counted), though its cumulative log-probability is lower
    assert [[(s.tokens, s.finish_reason, s.stop_reason, s.text) for s in o.sequences] for o in outs] == [
        [([5, 0], "stop", 0, "[5, 0]"), ([5, 1, 4, 6], "length", None, "[5, 1, 4, 6]")],
        [([6, 7, 0], "stop", 0, "[6, 7, 0]"), ([6, 7, 3], "stop", 3, "[6, 7, 3]")]]
    search = BeamSearch([[5]], BeamSearchParams(beam_width=1, max_tokens=3), eos_token_ids={0})
    search.advance([{0: Logprob(-0.1)}])
    assert search.next_sequences() == []  # no live beam left
    assert search.outputs()[0].sequences[0].tokens == [5, 0]
