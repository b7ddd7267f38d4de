"""Sampling parameters and the sampler.

Each request draws from its own torch.Generator, seeded from `seed` (or from the engine's seed and
the request's arrival order), so a seeded request samples the same tokens whatever else is in
the batch. Any Python int is a valid seed: the generator's seed is reduced modulo 2**64 (its
range; see generator_seed), so seeds that differ by a multiple of 2**64 sample the same tokens.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from hybrid.batch import to_device
from hybrid.errors import InvalidRequestError
from hybrid.structured_outputs import StructuredOutputsParams  # re-exported: hybrid.sampling.StructuredOutputsParams

# torch.Generator.manual_seed takes a 64-bit value (a negative one is read as its two's complement)
# and raises OverflowError beyond that range.
GENERATOR_SEED_RANGE = 2**64


# Temperatures below this sample greedily (see SamplingParams.greedy).
GREEDY_TEMPERATURE = 1e-5


def generator_seed(value: int) -> int:
    """`value` reduced into the generator's seed range [0, 2**64), deterministically. For every value
    torch already accepted (-2**63 .. 2**64 - 1) the generator's stream is unchanged."""
    return value % GENERATOR_SEED_RANGE


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    seed: int | None = None  # any int (negative or huge too): reduced modulo 2**64, see generator_seed
    stop_token_ids: list[int] | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probabilities returned per generated token
    # per prompt token (from the second on): its log-probability given the tokens before it, plus
    # this many top entries (0: only the prompt token's); RequestOutput.prompt_logprobs
    prompt_logprobs: int | None = None
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the top one's
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # ... times the number of times it was generated
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or output: / if > 0, * if < 0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # JSON schema / JSON object / regex / choice / grammar the output must match (hybrid/structured_outputs.py)
    structured_outputs: StructuredOutputsParams | None = None

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
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "must be an integer")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "must be an integer >= 0")
        if self.stop_token_ids is not None and not all(isinstance(t, int) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integers")
        if not isinstance(self.min_p, (int, float)) or not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must be in [0, 1]")
        if not isinstance(self.min_tokens, int) or not (0 <= self.min_tokens <= self.max_tokens):
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not (-2.0 <= v <= 2.0):
                raise bad(name, "must be in [-2, 2]")
        if not isinstance(self.repetition_penalty, (int, float)) or not (0.0 < self.repetition_penalty < float("inf")):
            raise bad("repetition_penalty", "must be a finite number > 0")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must map token ids to numbers")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise bad("logit_bias", "must map token ids to numbers") from None
            if any(not (-100.0 <= v <= 100.0) for v in self.logit_bias.values()):
                raise bad("logit_bias", "values must be in [-100, 100]")
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise bad("structured_outputs", f"not a StructuredOutputsParams: {e}") from None
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE, logits / temperature overflow fp32 (1e-40: inf - inf = NaN in the
        # softmax, a garbage token); such a temperature means argmax anyway (vLLM uses the same 1e-5).
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before sampling (greedy rows too): bias, min_tokens, penalties."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.penalised


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token for one request from its fp32 logits row [V] (syncs: for the rare per-row paths)."""
    return int(sample_tokens(logits[None], [params], [generator])[0][0])


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams | None],
                  generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of every logits row [R, V] (fp32), on the device and without a host sync, so that a
    step can be launched before the previous one's tokens reach the host (Engine async scheduling).
    Row i follows params[i] (None: argmax) and draws its noise from generators[i]: the same math and
    the same generator draws as sample_row, so a row's token does not depend on the other rows.

    Also returns `finite` [R] (bool): whether the row's maximum is finite. It costs a gather of R
    values on top of the argmax every row needs anyway: argmax propagates NaN (a NaN anywhere in a
    row is its "maximum"), so a row with a NaN or a +Inf is flagged. (-Inf entries are legitimate:
    masked tokens.)"""
    tokens = logits.argmax(dim=-1)
    finite = torch.isfinite(logits.gather(1, tokens[:, None])[:, 0])
    rows = [i for i, p in enumerate(params) if p is not None and not p.greedy]
    if not rows:
        return tokens, finite
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
    min_p = [params[i].min_p for i in rows]
    if any(p > 0.0 for p in min_p):
        probs = torch.softmax(scaled, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * to_device(min_p, probs.dtype, dev)[:, None]
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    # exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one RNG draw per vocab entry
    noise = torch.empty_like(probs)
    for j, i in enumerate(rows):  # each row from its own generator (as many draws as sample_row makes)
        noise[j].exponential_(1.0, generator=generators[i])
    tokens[index] = torch.argmax(probs / noise, dim=-1)
    return tokens, finite


def process_logits(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], generated: list[int],
                   histories: list[tuple[list[int], list[int]]], banned: list[list[int]],
                   pending: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
    """A copy of `logits` [R, V] with, on each listed row (params[j] for logits row rows[j]): the
    tokens of banned[j] (EOS and stop ids) masked while fewer than min_tokens are generated
    (generated[j] counts them), the logit bias added, then the repetition, frequency and presence
    penalties over histories[j] = (prompt ids, output ids). `pending` = (positions j, the tokens on
    the device) adds to a row's output a token sampled by the step still in flight (async
    scheduling), so nothing waits for it on the host."""
    out = logits.clone()
    dev = logits.device
    ban_r, ban_t, bias_r, bias_t, bias_v = [], [], [], [], []
    for j, (r, p) in enumerate(zip(rows, params)):
        if generated[j] < p.min_tokens:
            ban_r += [r] * len(banned[j])
            ban_t += banned[j]
        if p.logit_bias:
            bias_r += [r] * len(p.logit_bias)
            bias_t += list(p.logit_bias)
            bias_v += list(p.logit_bias.values())
    if ban_r:
        out[to_device(ban_r, torch.long, dev), to_device(ban_t, torch.long, dev)] = float("-inf")
    if bias_r:
        out.index_put_((to_device(bias_r, torch.long, dev), to_device(bias_t, torch.long, dev)),
                       to_device(bias_v, out.dtype, dev), accumulate=True)
    pen = [j for j, p in enumerate(params) if p.penalised]
    if not pen:
        return out
    n, vocab = len(pen), logits.shape[-1]
    counts = torch.zeros(n, vocab, dtype=out.dtype, device=dev)  # output-token counts per penalised row
    prompt_seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
    out_r, out_t = _row_token_index([histories[j][1] for j in pen], dev)
    counts.index_put_((out_r, out_t), torch.ones(len(out_r), dtype=out.dtype, device=dev), accumulate=True)
    if pending is not None:
        at = {j: k for k, j in enumerate(pending[0])}
        has = [(i, at[j]) for i, j in enumerate(pen) if j in at]
        if has:
            dst, src = zip(*has)
            counts.index_put_((to_device(list(dst), torch.long, dev), pending[1][to_device(list(src), torch.long, dev)]),
                              torch.ones(len(dst), dtype=out.dtype, device=dev), accumulate=True)
    prompt_seen[_row_token_index([histories[j][0] for j in pen], dev)] = True
    index = to_device([rows[j] for j in pen], torch.long, dev)
    sub = out[index]
    rep_p = to_device([params[j].repetition_penalty for j in pen], out.dtype, dev)[:, None]
    seen = prompt_seen | (counts > 0)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep_p, sub * rep_p), sub)
    freq = to_device([params[j].frequency_penalty for j in pen], out.dtype, dev)[:, None]
    pres = to_device([params[j].presence_penalty for j in pen], out.dtype, dev)[:, None]
    out[index] = sub - freq * counts - pres * (counts > 0).to(out.dtype)
    return out


def _row_token_index(token_lists: list[list[int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors of every token in token_lists[row], for scatters into [rows, V]."""
    rows = np.repeat(np.arange(len(token_lists)), [len(t) for t in token_lists])
    tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=len(rows))
    return to_device(rows, torch.long, dev), to_device(tokens, torch.long, dev)


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
