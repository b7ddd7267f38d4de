"""Sampling parameters and the sampler.

Each request draws from its own torch.Generator, seeded from `seed` (or from the engine's seed and
the request's arrival order), so a seeded request samples the same tokens whatever else is in
the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.batch import to_device
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


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token for one request from its fp32 logits row [V] (syncs: for the rare per-row paths)."""
    return int(sample_tokens(logits[None], [params], [generator])[0])


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams | None],
                  generators: list[torch.Generator | None]) -> torch.Tensor:
    """Next token of every logits row [R, V] (fp32), on the device and without a host sync, so that a
    step can be launched before the previous one's tokens reach the host (Engine async scheduling).
    Row i follows params[i] (None: argmax) and draws its noise from generators[i]: the same math and
    the same generator draws as sample_row, so a row's token does not depend on the other rows."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if p is not None and not p.greedy]
    if not rows:
        return tokens
    dev = logits.device
    index = to_device(rows, torch.long, dev)
    temps = to_device([params[i].temperature for i in rows], logits.dtype, dev)
    scaled = logits[index] / temps[:, None]
    top_k = [params[i].top_k for i in rows]
    if any(k != -1 and k < logits.shape[-1] for k in top_k):
        k_eff = [k if k != -1 and k < logits.shape[-1] else 0 for k in top_k]  # 0: no top-k on this row
        kth = torch.topk(scaled, max(k_eff), dim=-1).values
        pick = to_device([max(k, 1) - 1 for k in k_eff], torch.long, dev)
        kth = kth.gather(1, pick[:, None])
        on = to_device([k > 0 for k in k_eff], torch.bool, dev)
        scaled = scaled.masked_fill(on[:, None] & (scaled < kth), float("-inf"))
    top_p = [params[i].top_p for i in rows]
    if any(p < 1.0 for p in top_p):
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        limit = to_device(top_p, probs.dtype, dev)
        drop_sorted = before >= limit[:, None]  # a row with top_p 1 drops nothing (before < 1 up to rounding)
        drop_sorted &= (limit < 1.0)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    # exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one RNG draw per vocab entry
    noise = torch.empty_like(probs)
    for j, i in enumerate(rows):  # each row from its own generator (as many draws as sample_row makes)
        noise[j].exponential_(1.0, generator=generators[i])
    tokens[index] = torch.argmax(probs / noise, dim=-1)
    return tokens


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows that want logprobs (ks[j] top entries for logits row j): the sampled token's logprob
    [R], and the top max(ks) logprobs and their ids [R, max(ks)], all on the device (no sync)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    k = min(max(ks), logprobs.shape[-1]) if ks else 0
    if k > 0:
        values, ids = torch.topk(logprobs, k, dim=-1)
    else:
        values = logprobs.new_empty(logprobs.shape[0], 0)
        ids = tokens.new_empty(logprobs.shape[0], 0)
    return chosen, values, ids


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """{token: logprob} plus the top k entries of one logits row [V] (syncs)."""
    tok = torch.tensor([token], dtype=torch.long, device=logits.device)
    chosen, values, ids = logprob_rows(logits[None], tok, [k])
    return logprob_dict(token, float(chosen[0]), values[0, :k].tolist(), ids[0, :k].tolist())


def logprob_dict(token: int, token_logprob: float, top_values: list[float], top_ids: list[int]) -> dict[int, float]:
    out = {token: token_logprob}
    out.update({int(i): float(v) for i, v in zip(top_ids, top_values)})
    return out
