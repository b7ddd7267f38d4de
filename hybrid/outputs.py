"""Results returned to users, shaped like vLLM's."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
