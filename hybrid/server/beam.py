"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: the request's `n` beams of
hybrid/beam_search.py, each step of every beam a one-token request of the server's AsyncEngine.

BeamSearchEngine stands where the AsyncEngine stands for the response code (hybrid/server/streaming.py):
its generate() runs the whole search and yields one finished RequestOutput whose `n` outputs are the
beams, best first, so a streamed response sends each beam whole once the search is done (as vLLM's)."""
from __future__ import annotations

from typing import AsyncIterator

from hybrid.async_engine import AsyncEngine
from hybrid.beam_search import BeamSearchParams, beam_search_async
from hybrid.outputs import CompletionOutput, Logprob, RequestOutput
from hybrid.sampling import SamplingParams
from hybrid.server.api_errors import bad


def check_beam_request(params: SamplingParams, prompt_logprobs: int | None) -> None:
    """A 400 naming use_beam_search for what the beams would silently drop: an output constraint (structured
    outputs, a tool choice that compiles one), stop strings or prompt logprobs (echo's too); the beams rank the
    model's own log-probabilities."""
    if prompt_logprobs is not None or params.prompt_logprobs is not None:
        raise bad("use_beam_search", "is not supported with prompt_logprobs (or echo with logprobs)")
    if params.structured_outputs is not None:
        raise bad("use_beam_search", "is not supported with structured outputs or tools")
    if params.stop:
        raise bad("use_beam_search", "is not supported with stop strings (a beam ends at an end-of-sequence token)")


class BeamSearchEngine:
    """The AsyncEngine's generate() for beam-search requests (module docstring). `length_penalty`: the
    request's (BeamSearchParams)."""

    def __init__(self, engine: AsyncEngine, tokenizer, length_penalty: float) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.length_penalty = length_penalty
        self.eos_token_ids = set(engine.engine.eos_token_ids)

    def has_update(self, request_id: str) -> bool:  # (the response code asks; the one output comes at the end)
        return False

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       prompt: str | None = None, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """One finished RequestOutput: params.n beams of up to params.max_tokens tokens (its temperature and
        ignore_eos too). Each step's one-token requests go through the AsyncEngine, so they are validated,
        queued, aborted with the client and failed as any request is."""
        search = BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                  temperature=params.temperature, length_penalty=self.length_penalty)

        async def one_step(ids: list[int], step_params: SamplingParams) -> dict[int, Logprob]:
            final = None
            async for out in self.engine.generate(ids, step_params, priority=priority, cache_salt=cache_salt):
                final = out
            return dict(final.outputs[0].logprobs[0])

        beams = (await beam_search_async(one_step, [list(prompt_token_ids)], search, self.eos_token_ids))[0]
        start = len(prompt_token_ids)
        outputs = []
        for i, beam in enumerate(beams.sequences):
            generated = beam.tokens[start:]
            # as vLLM: an end-of-sequence token that finished the beam is not in its text
            shown = generated[:-1] if beam.finish_reason == "stop" and generated else generated
            text = self.tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens) \
                if self.tokenizer is not None else ""
            outputs.append(CompletionOutput(i, text, generated, beam.finish_reason,
                                            beam.logprobs if params.logprobs is not None else None, beam.stop_reason))
        yield RequestOutput(request_id or self.engine.new_request_id("beam"), prompt, list(prompt_token_ids),
                            outputs, finished=True)
