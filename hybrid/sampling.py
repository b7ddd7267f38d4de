"""Sampling parameters and the sampler.

Each request draws from its own torch.Generator, seeded from `seed` (or from the engine's seed and
the request's arrival order), so a seeded request samples the same tokens whatever else is in
the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.errors import InvalidRequestError


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probabilities returned per generated token

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(field_name: str, why: str) -> InvalidRequestError:
            value = getattr(self, field_name)
            return InvalidRequestError(f"invalid sampling parameter {field_name}={value!r}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (off) or an integer >= 1")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0")
        if self.stop_token_ids is not None and not all(isinstance(t, int) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integers")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k and outside the top-p nucleus of one row [V]."""
    if top_k != -1 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep a token if the mass before it is < top_p (the top token is always kept)
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token for one request from its fp32 logits row [V]."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = _filter_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    # exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one RNG draw per vocab entry
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return int(torch.argmax(probs / noise))


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> dict[int, float]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out = {token: float(logprobs[token])}
    if k > 0:
        values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
        out.update({int(i): float(v) for i, v in zip(ids, values)})
    return out
