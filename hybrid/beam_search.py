"""Beam search over an LLM (vLLM's LLM.beam_search): at each step every live beam is extended by one token
through LLM.generate (max_tokens 1, the 2 * beam_width most likely next tokens), and each prompt keeps the
beam_width best candidates by cumulative log-probability; a candidate ending in an end-of-sequence token is
set aside as finished. At the end the finished and the live beams are ranked by their length-penalised score.

Each step runs every beam's whole sequence as a prompt: with LLM(enable_prefix_caching=True) the sequence
before its last token is found in the cache (its KV pages and Mamba state), so a step costs one token a
beam; without it, each step prefills the beams again.

BeamSearch holds the algorithm, one step at a time; beam_search runs its steps through LLM.generate,
beam_search_async through an async engine's requests (the server's), every beam of a step at once."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from hybrid.errors import InvalidRequestError
from hybrid.outputs import Logprob
from hybrid.sampling import SamplingParams


MAX_LENGTH_PENALTY = 10.0  # |length_penalty|: a beam's length to a larger power overflows a float


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` beams, up to `max_tokens` new tokens each; `ignore_eos`: an
    end-of-sequence token does not finish a beam; `temperature` is passed to each step's SamplingParams but
    does not change the log-probabilities beams are ranked by (they are the model's own, as vLLM's default
    returns them); `length_penalty`: a beam's score is its cumulative log-probability over its length (prompt
    included) to this power."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # (accepted; beams stop on end-of-sequence tokens only)

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"invalid beam search parameter {name}={value!r}: must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < float("inf"):
            raise InvalidRequestError(f"invalid beam search parameter temperature={self.temperature!r}: "
                                      "must be a finite number >= 0")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool) \
                or not abs(self.length_penalty) <= MAX_LENGTH_PENALTY:
            raise InvalidRequestError(f"invalid beam search parameter length_penalty={self.length_penalty!r}: "
                                      f"must be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` (the prompt's, then the generated ones), the generated tokens' `logprobs` (each
    {token: Logprob} of the 2 * beam_width entries the step returned), their sum `cum_logprob`, the decoded
    `text` of `tokens` (set at the end), and `finish_reason` "stop" (an end-of-sequence token) or "length"."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    """The beam_width best beams of one prompt, best first."""
    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids: set[int], length_penalty: float) -> float:
    """The cumulative log-probability over the sequence's length to the length_penalty (a final
    end-of-sequence token not counted), as vLLM scores beams."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length ** length_penalty)


class BeamSearch:
    """The search's state, driven one step at a time by whoever runs the model (beam_search through
    LLM.generate, beam_search_async through an async engine): `next_sequences()` are the token lists to extend
    by one token with `step_params` (empty once done), `advance(tops)` takes each one's top {token: Logprob}
    (as `out.outputs[0].logprobs[0]` of its RequestOutput), `outputs(decode)` ranks the beams at the end."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: set[int]) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        # ignore_eos: the search decides what finishes a beam; seed: the same steps give the same beams
        self.step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width,
                                          temperature=params.temperature, ignore_eos=True, seed=0)
        self.live: list[list[BeamSearchSequence]] = [[BeamSearchSequence(tokens=list(p))] for p in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    def _beams(self) -> list[tuple[int, BeamSearchSequence]]:
        """(prompt index, beam) of every live beam, in the order next_sequences lists them."""
        return [(i, b) for i, bs in enumerate(self.live) for b in bs]

    def next_sequences(self) -> list[list[int]]:
        """The live beams' sequences (prompt included) to extend this step; empty when the search is over."""
        if self.steps >= self.params.max_tokens:
            return []
        return [b.tokens for _, b in self._beams()]

    def advance(self, tops: list[dict[int, Logprob]]) -> None:
        """One step: `tops[k]` is the 2 * beam_width most likely next tokens of next_sequences()[k]."""
        beams = self._beams()
        if len(tops) != len(beams):
            raise ValueError(f"beam search step: {len(tops)} results for {len(beams)} beams")
        width = self.params.beam_width
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.live]
        for (i, beam), top in zip(beams, tops):
            for tok, lp in sorted(top.items(), key=lambda kv: -kv[1])[:2 * width]:
                candidates[i].append(BeamSearchSequence(tokens=beam.tokens + [tok], logprobs=beam.logprobs + [top],
                                                        cum_logprob=beam.cum_logprob + float(lp)))
        for i, cands in enumerate(candidates):
            cands.sort(key=lambda b: -b.cum_logprob)
            kept = []
            for b in cands[:width]:
                if not self.params.ignore_eos and b.tokens[-1] in self.eos_token_ids:
                    b.finish_reason, b.stop_reason = "stop", b.tokens[-1]
                    self.done[i].append(b)
                else:
                    kept.append(b)
            self.live[i] = kept
        self.steps += 1

    def outputs(self, decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
        """Each prompt's beam_width best beams, finished and live ("length"), by their length-penalised score;
        `decode(ids)`: the sequences' text (None: no text)."""
        def score(b: BeamSearchSequence) -> float:
            return beam_score(b.tokens, b.cum_logprob, self.eos_token_ids, self.params.length_penalty)

        results = []
        for live, done in zip(self.live, self.done):
            for b in live:
                b.finish_reason = "length"
            best = sorted(done + live, key=score, reverse=True)[:self.params.beam_width]
            if decode is not None:
                for b in best:
                    b.text = decode(b.tokens)
            results.append(BeamSearchOutput(best))
        return results


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: set[int],
                decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
    """Beam search for each prompt (token ids) on `llm` (module docstring): each step is one llm.generate of
    every live beam; `decode(ids)`: the text of the sequences (None: no text)."""
    search = BeamSearch(prompts, params, eos_token_ids)
    while seqs := search.next_sequences():
        outs = llm.generate(seqs, search.step_params, use_tqdm=False)
        search.advance([out.outputs[0].logprobs[0] for out in outs])
    return search.outputs(decode)


async def beam_search_async(generate_one: Callable[[list[int], SamplingParams], Awaitable[dict[int, Logprob]]],
                            prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: set[int],
                            decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
    """beam_search for an async engine (the server): `generate_one(token_ids, step_params)` returns that
    sequence's top {token: Logprob} for one step; each step runs every live beam at once. An exception of
    generate_one propagates, once the step's other beams are cancelled."""
    search = BeamSearch(prompts, params, eos_token_ids)
    while seqs := search.next_sequences():
        tasks = [asyncio.ensure_future(generate_one(s, search.step_params)) for s in seqs]
        try:
            tops = await asyncio.gather(*tasks)
        except Exception:
            # gather leaves the other beams running when one fails: stop them (an engine aborts their
            # requests), so that nothing outlives the failed search
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        search.advance(list(tops))
    return search.outputs(decode)
