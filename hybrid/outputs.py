"""Results returned to users, shaped like vLLM's."""
from __future__ import annotations

from dataclasses import dataclass, field


class Logprob(float):
    """A token's log-probability. A float (what this package's own code and the server read), with
    vLLM's Logprob fields for code written against vLLM: `.logprob`, `.rank` (1 for the most
    likely token; a sampled or prompt token outside the top entries has its own rank, 1 + the tokens more
    likely than it) and
    `.decoded_token` (the token's text; LLM.generate fills it in, None where no tokenizer is known)."""
    __slots__ = ("rank", "decoded_token")

    def __new__(cls, value: float, rank: int | None = None, decoded_token: str | None = None) -> "Logprob":
        obj = super().__new__(cls, value)
        obj.rank = rank
        obj.decoded_token = decoded_token
        return obj

    def __reduce__(self):  # (pickled with its rank and text, for the tensor-parallel workers' pipes)
        return Logprob, (float(self), self.rank, self.decoded_token)

    @property
    def logprob(self) -> float:
        return float(self)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    lora_request: None = None  # (vLLM's field: no adapters here)

    def finished(self) -> bool:
        """Whether this completion has ended (a method, as vLLM's)."""
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the generated tokens' log-probabilities (with logprobs asked for, else None), as vLLM's."""
        if self.logprobs is None:
            return None
        return float(sum(d[t] for d, t in zip(self.logprobs, self.token_ids)))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # Set when the request failed inside the engine ("ExceptionType: message"); it is then finished
    # and its unfinished completions have finish_reason "error".
    error: str | None = None
    # SamplingParams.prompt_logprobs: per prompt token {its id: logprob given the tokens before it,
    # plus the top entries}, None for the first token (as vLLM returns them); set once the prompt is done
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # prompt tokens whose KV and state came from the prefix cache (vLLM's field; 0 without a hit or before
    # the prompt is admitted)
    num_cached_tokens: int = 0
    # vLLM's fields that have nothing to say here (no encoder, adapters, images or KV transfer; the request's
    # timings are the server's /metrics), present so that code reading them finds what vLLM gives it
    metrics: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    lora_request: None = None
    multi_modal_placeholders: dict = field(default_factory=dict)
    kv_transfer_params: None = None
