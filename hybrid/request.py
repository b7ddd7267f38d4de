"""Requests and their sequences as the engine tracks them, the chunk of a sequence that one step
runs (ScheduledChunk), and the checks a new request passes.

A request with n > 1 has n sequences (branches). Only branch 0 prefills the prompt; the other
branches wait outside the waiting queue until it has, then fork from it (hybrid/engine.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid.errors import InvalidRequestError
from hybrid.sampling import SampleStream, SamplingParams
from hybrid.structured_outputs import SequenceGrammar


# Prompt logprobs need the logits of every prompt position: at most this many such rows per step (the
# [rows, vocab] fp32 logits of a whole 8K chunk would be gigabytes for a 131K vocabulary)
PROMPT_LOGPROBS_ROWS_PER_STEP = 256


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One generated continuation of a request (a request with n > 1 has n of them)."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: SampleStream | None  # the branch's random stream (hybrid.sampling), None if greedy
    arrival: int
    # scheduling_policy "priority": lower runs first (ties by arrival); always 0 under "fcfs"
    priority: int = 0
    cache_salt: str | None = None  # vLLM's: only requests of the same salt share cached prefixes
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    status: Status = Status.WAITING
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV and state are in the cache
    prefill_len: int = 0  # tokens processed as prefill since (re)admission
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    detok_prefix: int = 0  # incremental detokenization: output tokens decoded as context ...
    detok_read: int = 0  # ... and the ones whose text is already in `text`
    stop_search_from: int = 0  # stop strings are looked for in text from here on (after min_tokens tokens)
    text_deltas: Any = None  # the text sent so far ("text_delta" outputs: output_processor.TextDeltas)
    num_preemptions: int = 0
    # prompt tokens taken from the prefix cache when first admitted (None until then; a readmission after a
    # preemption does not change it)
    num_cached_tokens: int | None = None
    num_sent: int = 0  # output tokens already reported ("delta" outputs)
    # Async scheduling: tokens sampled by launched steps, still on the device (1 while a step is in
    # flight), and the row of the latest in that step's token tensor. num_computed already counts
    # the tokens those steps consumed.
    pending: int = 0
    pending_row: int = -1
    cache_at: int = 0  # prefix caching: the next caching point of the prompt (0: no more)
    # prefix caching: the chained hashes of the prompt's whole pages (PrefixCache.page_hashes), taken once:
    # admission's lookup and every caching point's check and insert read them (None until needed)
    prompt_page_hashes: list[int] | None = None
    # structured outputs: this branch's grammar matcher, advanced with every token it accepts (None: free)
    grammar: SequenceGrammar | None = None
    # prompt logprobs (branch 0 of a request that asks for them): entry i for prompt token i, None for
    # the first; filled as the prefill chunks run, never again after a preemption
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # params.bad_words as token-id sequences (logits_processing.bad_words_token_ids; the request's branches
    # share one list); None: no bad words
    bad_words_ids: list[list[int]] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def scores_prompt(self) -> bool:
        """Prompt logprobs are asked for and some prompt positions are not scored yet: their prefill
        needs the logits of every position (no cached prefix, a bounded number a step)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without concatenating the whole prompt and output (hot in every step)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_decoding(self) -> bool:
        return self.status == Status.RUNNING and self.num_computed >= self.prefill_len

    @property
    def label(self) -> str:
        """How errors name the sequence."""
        return f"request '{self.request_id}' (branch {self.index})"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    # n > 1: branches 1..n-1 wait (outside the waiting queue) until branch 0 has prefilled the prompt,
    # then fork from it (copy of its slot, its prompt pages shared by refcount)
    forked: bool = False
    output_kind: str = "cumulative"  # see hybrid.output_processor.OUTPUT_KINDS
    error: str | None = None  # why the request failed inside the engine ("Type: message")
    prompt_logprobs_sent: bool = False  # "delta" outputs carry the prompt logprobs once

    @property
    def finished(self) -> bool:
        return all(s.status == Status.FINISHED for s in self.seqs)


@dataclass
class ScheduledChunk:
    """What one sequence runs in a step: a decode token, a verify row (its last token and the
    drafts), a replay of known generated tokens, or a prefill chunk."""

    seq: Sequence
    num_tokens: int
    is_decode: bool
    draft: list[int] = field(default_factory=list)  # speculative drafts: a verify chunk when non-empty
    replay: bool = False  # known generated tokens replayed after a preemption (decode recurrence, in place)
    scratch_index: int = -1  # verify chunks: row of the pool's verify scratch (set when the batch is built)
    logits_row: int = -1  # first logits row of the chunk, -1 if it samples nothing (set when the batch is built)
    # prompt logprobs: (first logits row, prompt position it scores, count) of this prefill chunk
    prompt_rows: tuple[int, int, int] | None = None
    # prefix caching: (prompt tokens, cache-owned slot) of each caching point strictly inside this prefill
    # chunk, whose state the step leaves in that slot (ResourceManager.plan_snapshots)
    snapshots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        return self.logits_row >= 0


def make_generator(params: SamplingParams, engine_seed: int, arrival: int, index: int,
                   device: torch.device | None = None) -> SampleStream | None:
    """Branch `index`'s own random stream (None for greedy requests): seeded from the request's seed,
    or from the engine's seed and the request's arrival order. Counter based and on the host, so
    `device` plays no part: a seeded request samples the same tokens on any device."""
    if params.greedy:
        return None
    base = params.seed if params.seed is not None else engine_seed * 1_000_003 + arrival
    return SampleStream(base * 7919 + index)  # any int seed: reduced into the 64-bit range


def truncate_prompt(prompt_token_ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """The prompt as SamplingParams.truncate_prompt_tokens keeps it: its last k tokens (-1: the last
    max_model_len - 1, the longest prompt that leaves room for one generated token; None: all of it).
    Anything but a list or tuple is returned as it is, for validate_prompt to name."""
    if k is None or not isinstance(prompt_token_ids, (list, tuple)):
        return prompt_token_ids
    keep = max(1, max_model_len - 1) if k == -1 else k
    return list(prompt_token_ids[-keep:]) if len(prompt_token_ids) > keep else prompt_token_ids


def validate_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise InvalidRequestError(f"a prompt must be a list of token ids, got {type(prompt_token_ids).__name__}")
    if not prompt_token_ids:
        raise InvalidRequestError("empty prompt: at least one token is needed")
    # plain ints in range, checked at C speed (a long prompt is validated on the path to its first token);
    # anything else is found, and named, by the loop
    if not (set(map(type, prompt_token_ids)) == {int}
            and 0 <= min(prompt_token_ids) and max(prompt_token_ids) < vocab_size):
        for i, t in enumerate(prompt_token_ids):
            if type(t) is not int:  # (bool, float, a numpy integer: the type is the problem, not the value)
                raise InvalidRequestError(f"prompt token ids must be Python ints: position {i} holds {t!r} "
                                          f"({type(t).__name__}); a numpy array or tensor converts with .tolist()")
            if not 0 <= t < vocab_size:
                raise InvalidRequestError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompt of {len(prompt_token_ids)} tokens is longer than the context: max_model_len is "
            f"{max_model_len} and at least one token must be generated"
        )


def validate_params(params: SamplingParams, vocab_size: int) -> None:
    """Every check of the sampling parameters, including those that need the vocabulary."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    bad = [t for t in (params.logit_bias or {}) if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"invalid sampling parameter logit_bias={{{bad[0]}: {params.logit_bias[bad[0]]}}}: "
                                  f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    bad = [t for t in (params.allowed_token_ids or ()) if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"invalid sampling parameter allowed_token_ids=[..., {bad[0]}, ...]: "
                                  f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def check_cache_salt(salt) -> None:
    """InvalidRequestError unless `salt` is None or a non-empty string (vLLM's cache_salt)."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError(f"cache_salt must be a non-empty string, got {salt!r}")
