"""Beam search over an LLM (vLLM's LLM.beam_search): at each step every live beam is extended by one token
through LLM.generate (max_tokens 1, the 2 * beam_width most likely next tokens), and each prompt keeps the
beam_width best candidates by cumulative log-probability; a candidate ending in an end-of-sequence token is
set aside as finished. At the end the finished and the live beams are ranked by their length-penalised score.

Each step runs every beam's whole sequence as a prompt: with LLM(enable_prefix_caching=True) the sequence
before its last token is found in the cache (its KV pages and Mamba state), so a step costs one token a
beam; without it, each step prefills the beams again."""
from __future__ import annotations

from dataclasses import dataclass, field

from hybrid.errors import InvalidRequestError
from hybrid.outputs import Logprob
from hybrid.sampling import SamplingParams


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
        if not isinstance(self.length_penalty, (int, float)):
            raise InvalidRequestError(f"invalid beam search parameter length_penalty={self.length_penalty!r}")


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


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: set[int],
                decode=None) -> list[BeamSearchOutput]:
    """Beam search for each prompt (token ids) on `llm` (module docstring); `decode(ids)`: the text of the
    sequences (None: no text)."""
    width = params.beam_width
    step_params = SamplingParams(max_tokens=1, logprobs=2 * width, temperature=params.temperature,
                                 ignore_eos=True, seed=0)
    live = [[BeamSearchSequence(tokens=list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]

    def score(b: BeamSearchSequence) -> float:
        return beam_score(b.tokens, b.cum_logprob, eos_token_ids, params.length_penalty)

    for _ in range(params.max_tokens):
        beams = [(i, b) for i, bs in enumerate(live) for b in bs]
        if not beams:
            break
        outs = llm.generate([b.tokens for _, b in beams], step_params, use_tqdm=False)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), out in zip(beams, outs):
            top = out.outputs[0].logprobs[0]
            for tok, lp in sorted(top.items(), key=lambda kv: -kv[1])[:2 * width]:
                candidates[i].append(BeamSearchSequence(tokens=beam.tokens + [tok], logprobs=beam.logprobs + [top],
                                                        cum_logprob=beam.cum_logprob + float(lp)))
        for i, cands in enumerate(candidates):
            cands.sort(key=lambda b: -b.cum_logprob)
            kept = []
            for b in cands[:width]:
                if not params.ignore_eos and b.tokens[-1] in eos_token_ids:
                    b.finish_reason, b.stop_reason = "stop", b.tokens[-1]
                    done[i].append(b)
                else:
                    kept.append(b)
            live[i] = kept
    results = []
    for i in range(len(prompts)):
        for b in live[i]:
            b.finish_reason = "length"
        best = sorted(done[i] + live[i], key=score, reverse=True)[:width]
        if decode is not None:
            for b in best:
                b.text = decode(b.tokens)
        results.append(BeamSearchOutput(best))
    return results
