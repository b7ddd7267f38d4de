"""The engine: continuous batching with chunked prefill.

Each step the scheduler picks work under a token budget: first one token for every running
sequence that is decoding, then prefill chunks (of running sequences, then of newly admitted
ones). A sequence owns one Mamba slot and a list of KV pages while it runs; both are freed the
moment it finishes, is aborted or is preempted. When pages run out, the newest running sequence
is preempted and later recomputed from its tokens (its outputs so far are kept), so no request
ever writes into state it does not own. On readmission only the prompt is prefilled; the tokens it
had generated are then replayed through the decode recurrence as "replay" chunks (as many tokens
per step as the budget and the free pages allow; see hybrid/batch.py), so its rebuilt Mamba state
is the one its decodes built.

A step that fails does not stop the engine. An exception raised while a step is scheduled,
launched or finished fails the requests in that step (finish_reason "error", RequestOutput.error
set; every request if the scheduler itself raised, as which ones it touched is unknown), waits for
the device, frees their slots and pages, and the engine serves the others. A row whose logits are
not finite (checked on every step, see sample_tokens) fails only its own request. Only an
unrecoverable device error (an illegal memory access, a device-side assert: the CUDA context is
lost) stops the engine: `Engine.dead` then holds an EngineDeadError saying why, every request
fails, and step() / add_request() raise it.
"""
from __future__ import annotations

import enum
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from attention.kv_cache import DUMMY_PAGE, PagedKVCache
from hybrid.batch import StepBatch, to_device
from hybrid.errors import EngineDeadError, InvalidRequestError, NonFiniteLogitsError, StateCorruptionError
from hybrid.outputs import CompletionOutput, RequestOutput
from hybrid.prefix_cache import PrefixCache
from hybrid.sampling import (SamplingParams, generator_seed, logprob_dict, logprob_rows, process_logits,
                             sample_row, sample_tokens, top_logprobs)
from hybrid.spec_decode import NgramProposer, SpeculativeConfig
from state_pool.pool import PAD_SLOT_ID, MambaStatePool
from state_pool.sanitizer import RowOwner, check_batch

logger = logging.getLogger("hybrid.engine")

# Messages of device errors after which the CUDA context is unusable (every later call fails too).
_FATAL_DEVICE_ERRORS = (
    "illegal memory access", "device-side assert", "unspecified launch failure", "illegal instruction",
    "misaligned address", "launch timed out", "uncorrectable ECC", "hardware stack error", "illegal address",
)


def is_fatal_device_error(error: BaseException) -> bool:
    """Whether `error` means the device can no longer be used (out of memory is recoverable)."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    msg = str(error)
    return any(marker in msg for marker in _FATAL_DEVICE_ERRORS)


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
    generator: torch.Generator | None
    arrival: int
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
    num_preemptions: int = 0
    num_sent: int = 0  # output tokens already reported ("delta" outputs)
    # Async scheduling: tokens sampled by launched steps, still on the device (1 while a step is in
    # flight), and the row of the latest in that step's token tensor. num_computed already counts
    # the tokens those steps consumed.
    pending: int = 0
    pending_row: int = -1
    cache_at: int = 0  # prefix caching: a prefill chunk ends here and the prefix is cached (0: no more)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

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
    output_kind: str = "cumulative"  # see OUTPUT_KINDS
    error: str | None = None  # why the request failed inside the engine ("Type: message")

    @property
    def finished(self) -> bool:
        return all(s.status == Status.FINISHED for s in self.seqs)

    def output(self) -> RequestOutput:
        """The request's output now; "delta" outputs carry only the tokens (and their logprobs) that
        no earlier output carried, and mark them as sent."""
        delta = self.output_kind == "delta"
        outputs = []
        for s in self.seqs:
            start = s.num_sent if delta else 0
            outputs.append(CompletionOutput(
                index=s.index, text=s.text, token_ids=s.output_token_ids[start:],
                finish_reason=s.finish_reason,
                logprobs=s.logprobs[start:] if s.logprobs is not None else None,
                stop_reason=s.stop_reason,
            ))
            if delta:
                s.num_sent = len(s.output_token_ids)
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=self.finished, error=self.error)


# What Engine.step() returns for a request (Engine.add_request(output_kind=...)):
# - "cumulative": after every step that changed it, everything so far (copies grow with the output);
# - "delta": after every step that changed it, the new tokens and their logprobs (text stays the
#   whole text so far: stop-string handling may still shorten it, and a str costs nothing to pass);
# - "final": one output, when it finishes. LLM.generate uses "final", the server "delta": their
#   per-step host time does not grow with the length of what was generated.
OUTPUT_KINDS = ("cumulative", "delta", "final")


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int
    is_decode: bool
    draft: list[int] = field(default_factory=list)  # speculative drafts: a verify chunk when non-empty
    replay: bool = False  # known generated tokens replayed after a preemption (decode recurrence, in place)
    scratch_index: int = -1  # verify chunks: row of the pool's verify scratch (set by _build_batch)
    logits_row: int = -1  # first logits row of the chunk, -1 if it samples nothing (set by _build_batch)

    @property
    def samples(self) -> bool:
        return self.logits_row >= 0


@dataclass
class LaunchedStep:
    """A step whose forward pass and sampling are queued on the device; its tokens are read back
    (and the requests updated) by Engine._finish_step."""
    index: int  # launch count: resources released while this step may still run are freed after it
    chunks: list[ScheduledChunk]
    batch: StepBatch  # kept until the step is finished (the sanitizer tests inspect what is in flight)
    logits: torch.Tensor  # [R, V] fp32, read back only by verify rows and forks (never overlapped)
    tokens: torch.Tensor  # [R] int64 on the device: the next decode step reads pending tokens here
    host: dict[str, torch.Tensor]  # tokens, finite flags (and logprobs, state NaN flags) on their way to the host
    done: torch.cuda.Event | None  # recorded after the copies to `host`; None on CPU
    overlappable: bool  # the next step may be launched before this one is finished


class Engine:
    def __init__(
        self,
        runner,
        state_pool: MambaStatePool,
        kv_cache: PagedKVCache,
        *,
        vocab_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: set[int],
        tokenizer=None,
        seed: int = 0,
        device: torch.device = torch.device("cpu"),
        check_state: bool = False,
        speculative_config: dict | SpeculativeConfig | None = None,
        async_scheduling: bool = False,
        prefix_cache_entries: int = 0,
        prefix_cache_interval: int = 0,
    ) -> None:
        self.runner = runner
        self.state_pool = state_pool
        self.kv_cache = kv_cache
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer = tokenizer
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.seed = seed
        self.device = device
        self.page_size = kv_cache.page_size
        self.max_pages_per_seq = -(-max_model_len // self.page_size)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = itertools.count()
        self.stats = {"steps": 0, "preemptions": 0, "generated_tokens": 0, "prompt_tokens": 0,
                      "forks": 0, "overlapped_steps": 0,
                      "prefix_cache_hits": 0, "prefix_cache_hit_tokens": 0, "prefix_cache_evictions": 0, "spec_verify_rows": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        # State sanitizer: poison freed slots, check every batch against live slots/pages.
        self.check_state = bool(check_state)
        state_pool.poison_freed = self.check_state
        self.spec_config = SpeculativeConfig.from_dict(speculative_config)
        self.proposer = NgramProposer(self.spec_config) if self.spec_config is not None else None
        if self.spec_config is not None:
            state_pool.enable_spec_scratch(max_num_seqs, self.spec_config.num_speculative_tokens + 1)
        # Async scheduling: step N+1 is scheduled and launched while step N still runs on the device
        # (its decode rows read N's sampled tokens on the device), then N's tokens are read back. The
        # host's scheduling, batch building and output work hide behind the device step. Drafts need
        # the latest tokens on the host, so speculation runs synchronously.
        self.async_scheduling = bool(async_scheduling) and self.spec_config is None
        self._in_flight: LaunchedStep | None = None
        self._launched = 0  # steps launched so far
        self._synced = 0  # steps whose device work is known to be complete
        self._deferred: list[tuple[int, int | None, list[int]]] = []  # (fence step, slot, pages) to free
        # Prefix caching (hybrid/prefix_cache.py): its entries hold state-pool slots beyond max_num_seqs
        self.prefix_cache = (PrefixCache(self.page_size, prefix_cache_entries, prefix_cache_interval)
                             if prefix_cache_entries else None)
        # Set by an unrecoverable device error (see _die): the engine then refuses all work.
        self.dead: EngineDeadError | None = None

    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens so far (None before any draft was verified)."""
        drafted = self.stats["spec_draft_tokens"]
        return self.stats["spec_accepted_tokens"] / drafted if drafted else None

    # ------------------------------------------------------------------ requests
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise InvalidRequestError(f"a prompt must be a list of token ids, got {type(prompt_token_ids).__name__}")
        if not prompt_token_ids:
            raise InvalidRequestError("empty prompt: at least one token is needed")
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(f"prompt token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt of {len(prompt_token_ids)} tokens is longer than the context: max_model_len is "
                f"{self.max_model_len} and at least one token must be generated"
            )

    def validate_params(self, params: SamplingParams) -> None:
        """Every check of the sampling parameters, including those that need the vocabulary."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"invalid sampling parameter logit_bias={{{bad[0]}: {params.logit_bias[bad[0]]}}}: "
                                      f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if add_request would refuse this prompt and these params. Reads
        only immutable settings, so another thread may call it while the engine runs."""
        self.validate_params(params)
        self.validate_prompt(prompt_token_ids)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, output_kind: str = "cumulative") -> None:
        self._check_alive()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id '{request_id}' is already in use")
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        self.validate_request(prompt_token_ids, params)
        prompt_token_ids = list(prompt_token_ids)
        arrival = next(self._arrivals)
        seqs = []
        for i in range(params.n):
            seqs.append(Sequence(
                request_id=request_id, index=i, prompt_token_ids=prompt_token_ids, params=params,
                generator=self._generator(params, arrival, i), arrival=arrival,
                logprobs=[] if params.logprobs is not None else None,
            ))
        self.requests[request_id] = Request(request_id, prompt, prompt_token_ids, params, seqs,
                                            output_kind=output_kind)
        # Only branch 0 prefills the prompt; the others fork from it once it is done (see _fork).
        self.waiting.append(seqs[0])

    def _generator(self, params: SamplingParams, arrival: int, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        g = torch.Generator(device=self.device)
        base = params.seed if params.seed is not None else self.seed * 1_000_003 + arrival
        g.manual_seed(generator_seed(base * 7919 + index))  # any int seed: reduced into the generator's range
        return g

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        if self.dead is not None:  # (every request is already finished; the pools are unusable)
            self.requests.pop(request_id, None)
            return
        for seq in req.seqs:
            if seq.status != Status.FINISHED:
                self._finish(seq, "abort")
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight is not None)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ resources
    def _release(self, seq: Sequence) -> None:
        """Give back the sequence's slot and pages; while a launched step may still read or write them
        (async scheduling), they are freed only once that step is finished, so nobody reuses them early."""
        if seq.slot is None and not seq.pages:
            return
        if self._launched > self._synced:
            self._deferred.append((self._launched, seq.slot, seq.pages))
        else:
            self._free(seq.slot, seq.pages)
        seq.slot = None
        seq.pages = []

    def _free(self, slot: int | None, pages: list[int]) -> None:
        if slot is not None:
            self.state_pool.free(slot)
        if pages:
            self.kv_cache.allocator.release(pages)

    def _free_deferred(self) -> None:
        keep = []
        for fence, slot, pages in self._deferred:
            if fence <= self._synced:
                self._free(slot, pages)
            else:
                keep.append((fence, slot, pages))
        self._deferred = keep

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.status == Status.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def _preempt(self, seq: Sequence) -> None:
        """Give up the sequence's slot and pages; it is recomputed from its tokens when readmitted."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(seq)

    def _grow_pages(self, seq: Sequence, num_tokens: int) -> bool:
        """Make sure the sequence has pages for `num_tokens` tokens in total."""
        need = -(-num_tokens // self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        pages = self.kv_cache.allocator.allocate(need)
        while pages is None and self._evict_cached_prefix():
            pages = self.kv_cache.allocator.allocate(need)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    # ------------------------------------------------------------------ scheduling
    def _schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []

        verifies: list[ScheduledChunk] = []
        replays: list[ScheduledChunk] = []
        # 1. one token for every decoding sequence, oldest first; preempt the newest when out of pages.
        #    With speculation, a sequence with n-gram drafts becomes a verify chunk (1 + drafts tokens).
        #    A sequence readmitted after a preemption whose generated tokens are known but not computed
        #    yet replays as many of them as the budget and the free pages allow (a replay chunk: decode
        #    recurrence, sampled only if it reaches the last token); it preempts others only as a
        #    one-token decode would.
        decoding = sorted([s for s in self.running if s.is_decoding], key=lambda s: s.arrival)
        for k, seq in enumerate(decoding):
            if seq.status != Status.RUNNING or budget <= 0:
                continue
            if seq.pending and (len(seq.output_token_ids) + seq.pending >= seq.params.max_tokens
                                or seq.num_tokens + seq.pending >= self.max_model_len):
                continue  # its token in flight is its last: it finishes by length, nothing to run
            replaying = seq.num_computed + 1 < seq.num_tokens + seq.pending
            if replaying:
                # leave a token of budget for every decoding sequence after this one
                later = sum(1 for s in decoding[k + 1:] if s.status == Status.RUNNING)
                chunk = self._fit_chunk(seq, max(1, budget - later), upto=seq.num_tokens)
                if chunk:
                    replays.append(ScheduledChunk(seq, chunk, True, replay=True))
                    budget -= chunk
                    continue
                # not even one token's page is free: one token, preempting as a decode does
            draft = self._propose(seq, budget)
            if draft and not self._grow_pages(seq, seq.num_computed + 1 + len(draft)):
                draft = []  # no pages for the drafts: plain decode (never preempt for speculation)
            if draft:
                verifies.append(ScheduledChunk(seq, 1 + len(draft), True, draft))
                budget -= 1 + len(draft)
                continue
            while not self._grow_pages(seq, seq.num_computed + 1):
                victim = max(self.running, key=lambda s: (s.arrival, s.index))
                self._preempt(victim)
                decodes = [c for c in decodes if c.seq is not victim]
                verifies = [c for c in verifies if c.seq is not victim]
                replays = [c for c in replays if c.seq is not victim]
                if victim is seq:
                    break
            if seq.status == Status.RUNNING:
                (replays if replaying else decodes).append(ScheduledChunk(seq, 1, True, replay=replaying))
                budget -= 1

        # 2. continue running prefills
        for seq in sorted([s for s in self.running if not s.is_decoding], key=lambda s: s.arrival):
            if budget <= 0:
                break
            chunk = self._fit_chunk(seq, budget)
            if chunk:
                prefills.append(ScheduledChunk(seq, chunk, False))
                budget -= chunk

        # 3. admit waiting sequences while there is budget, a slot and pages
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.pending:
                break  # preempted with a token still in flight: readmit it once that token is known
            slot = self.state_pool.allocate()
            if slot is None and self._evict_cached_prefix():
                slot = self.state_pool.allocate()
            if slot is None:
                break
            seq.slot = slot
            # Only the prompt goes through the prefill scan. Tokens generated before a preemption are
            # then replayed through the decode recurrence (replay chunks, step 1), as they first ran, so
            # the rebuilt state is bit-identical (the scan clamps dt and rounds differently).
            seq.prefill_len = len(seq.prompt_token_ids)
            seq.num_computed = 0
            reused = self._reuse_cached_prefix(seq) if self.prefix_cache is not None else 0
            chunk = self._fit_chunk(seq, budget)
            if not chunk:  # nothing launched has used them yet: back at once
                self._free(seq.slot, seq.pages)
                seq.slot, seq.pages, seq.num_computed = None, [], 0
                break
            if reused:
                self.stats["prefix_cache_hits"] += 1
                self.stats["prefix_cache_hit_tokens"] += reused
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            prefills.append(ScheduledChunk(seq, chunk, False))
            budget -= chunk

        if not decodes and not verifies and not replays and not prefills and self.running \
                and not any(s.pending for s in self.running):
            # Every running sequence is stuck waiting for pages: free the newest and try again.
            victim = max(self.running, key=lambda s: (s.arrival, s.index))
            self._preempt(victim)
            return self._schedule()
        return decodes + verifies + replays + prefills

    def _propose(self, seq: Sequence, budget: int) -> list[int]:
        """Speculative drafts for a decoding sequence ([] without speculation or without a match)."""
        if self.proposer is None or seq.num_computed + 1 < seq.num_tokens:
            return []  # no speculation while replaying known tokens after a preemption
        # a verify emits up to 1 + drafts tokens: stay within max_tokens, the context and the budget
        room = min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens,
                   budget) - 1
        if room <= 0:
            return []
        return self.proposer.propose(seq.tokens, room)

    def _fit_chunk(self, seq: Sequence, budget: int, upto: int | None = None) -> int:
        """Largest chunk (<= budget, ending at or before token `upto`, default the prefill length)
        whose pages can be allocated now."""
        chunk = min((seq.prefill_len if upto is None else upto) - seq.num_computed, budget)
        if seq.cache_at > seq.num_computed:  # end a chunk at the caching point: the state there is kept
            chunk = min(chunk, seq.cache_at - seq.num_computed)
        while chunk > 0 and not self._grow_pages(seq, seq.num_computed + chunk):
            free_tokens = (len(seq.pages) + self.kv_cache.allocator.num_free) * self.page_size - seq.num_computed
            chunk = min(chunk - 1, max(free_tokens, 0))
        return chunk

    # ------------------------------------------------------------------ batch building
    def _build_batch(self, chunks: list[ScheduledChunk]) -> StepBatch:
        input_ids, starts, logits_rows = [], [], []
        fills: list[tuple[int, int]] = []  # (input position, row in the step in flight) of pending tokens
        query_lens, seq_lens, slots, has_init = [], [], [], []
        page_table = np.full((len(chunks), self.max_pages_per_seq), DUMMY_PAGE, dtype=np.int32)
        offset = 0
        ps = self.page_size
        num_drafts, scratch = [], []
        for row, c in enumerate(chunks):
            seq = c.seq
            start, end = seq.num_computed, seq.num_computed + c.num_tokens
            num_drafts.append(len(c.draft))
            if c.draft:  # verify: the last sampled token, then the drafts; logits for each of them
                c.scratch_index = sum(1 for n in num_drafts if n) - 1
                scratch.append(c.scratch_index)
                input_ids.extend(seq.token_slice(start, start + 1))
                input_ids.extend(c.draft)
                logits_rows.extend(range(offset, offset + c.num_tokens - 1))
            else:
                scratch.append(-1)
                known = min(end, seq.num_tokens)
                input_ids.extend(seq.token_slice(start, known))
                if end > known:  # the token sampled by the step in flight: filled in on the device
                    fills.append((len(input_ids), seq.pending_row))
                    input_ids.append(0)
            starts.append(start)
            query_lens.append(c.num_tokens)
            seq_lens.append(end)
            slots.append(seq.slot)
            has_init.append(start > 0)
            page_table[row, : len(seq.pages)] = seq.pages
            offset += c.num_tokens
            if c.draft:
                c.logits_row = len(logits_rows) - (c.num_tokens - 1)
                logits_rows.append(offset - 1)
            elif end == seq.num_tokens + seq.pending:  # chunk reaches the last token: sample from it
                c.logits_row = len(logits_rows)
                logits_rows.append(offset - 1)
        num_verify = sum(1 for n in num_drafts if n)
        dev = self.device
        qsl = [0] + list(itertools.accumulate(query_lens))
        # positions and KV rows of every token, vectorised (a Python loop over an 8K prompt costs ms)
        q = np.asarray(query_lens, dtype=np.int64)
        token_row = np.repeat(np.arange(len(chunks)), q)
        positions = np.repeat(np.asarray(starts, dtype=np.int64) - np.asarray(qsl[:-1], dtype=np.int64), q) \
            + np.arange(qsl[-1], dtype=np.int64)
        kv_loc = page_table[token_row, positions // ps].astype(np.int64) * ps + positions % ps
        ids = to_device(input_ids, torch.long, dev)
        if fills:  # pending tokens: gathered from the step in flight, in stream order after its sampling
            at, src = zip(*fills)
            ids[to_device(list(at), torch.long, dev)] = self._in_flight.tokens[to_device(list(src), torch.long, dev)]
        return StepBatch(
            input_ids=ids,
            positions=to_device(positions, torch.long, dev),
            query_start_loc=to_device(qsl, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            page_table=to_device(page_table, torch.int32, dev),
            kv_write_loc=to_device(kv_loc, torch.long, dev),
            state_slot=to_device(slots, torch.long, dev),
            has_initial_state=to_device(has_init, torch.bool, dev),
            logits_indices=to_device(logits_rows, torch.long, dev),
            num_decodes=sum(1 for c in chunks if c.is_decode and not c.draft and not c.replay),
            num_prefills=sum(1 for c in chunks if not c.is_decode),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            state_slot_cpu=slots,
            has_initial_state_cpu=has_init,
            num_verify=num_verify,
            num_draft_tokens_cpu=num_drafts,
            scratch_index=to_device(scratch, torch.long, dev) if num_verify else None,
            scratch_index_cpu=scratch,
            state_scratch=self.state_pool.spec_scratch if num_verify else None,
            num_replay=sum(1 for c in chunks if c.replay),
        )

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return the outputs of the requests it changed (as their output_kind says).

        With async scheduling the step launched here is finished (its tokens read back) by the next
        call, so outputs lag one call behind the device; the tokens and their order are the same.
        A failure fails only the requests it concerns (their outputs come back finished, with
        `error` set); EngineDeadError only for an unrecoverable device error (see the module doc)."""
        self._check_alive()
        prev = self._in_flight
        changed: dict[str, Request] = {}
        if prev is not None and self._decode_pages_needed() > self.kv_cache.allocator.num_free:
            # Out of pages: preempting now would free nothing (a victim's pages wait for the step in
            # flight), so each victim would bring down the next. Finish that step first; this step's
            # schedule then sees every page that came back, as a synchronous engine does.
            self._in_flight = None
            self._finish_guarded(prev, changed)
            prev = None
        try:
            chunks = self._schedule()
        except Exception as e:  # which requests it touched is unknown: all of them fail
            self._fail_step(e, list(self.requests), changed, "scheduling")
            chunks = []
        launched = None
        if chunks:
            try:
                launched = self._launch(chunks)
            except Exception as e:
                self._fail_step(e, [c.seq.request_id for c in chunks], changed, "launch")
        self._in_flight = None
        if prev is not None:
            self._finish_guarded(prev, changed)
        if launched is not None:
            if launched.overlappable:
                self._in_flight = launched
                self.stats["overlapped_steps"] += 1
            else:
                self._finish_guarded(launched, changed)
        outputs = []
        for req in changed.values():
            if req.output_kind != "final" or req.finished:
                outputs.append(req.output())
            if req.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    # ------------------------------------------------------------------ failures
    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))

    def _finish_guarded(self, step: LaunchedStep, changed: dict[str, Request]) -> None:
        try:
            changed.update(self._finish_step(step))
        except Exception as e:
            self._fail_step(e, [c.seq.request_id for c in step.chunks], changed, "finish")

    def _fail_step(self, error: Exception, request_ids: list[str], changed: dict[str, Request], phase: str) -> None:
        """A step raised `error`: fail its requests and free what they hold, or stop the engine if the
        device is lost. The requests go into `changed`, so that their outputs (with the error) go out."""
        if is_fatal_device_error(error):
            self._die(error)
        logger.error("engine step failed while %s (%d requests fail): %r", phase, len(set(request_ids)), error,
                     exc_info=error)
        # Whatever the failed step queued on the device may still run: wait for it before its slots and
        # pages are reused. The device has then finished every launched step, so nothing stays deferred.
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as sync_error:  # the device cannot even synchronise: it is lost
            self._die(sync_error)
        self._synced = self._launched
        self._free_deferred()
        reason = f"{type(error).__name__}: {error}"
        for rid in dict.fromkeys(request_ids):
            req = self.requests.get(rid)
            if req is None:
                continue  # aborted meanwhile
            self._fail_request(req, reason)
            changed[rid] = req

    def _fail_request(self, req: Request, reason: str) -> None:
        """Finish every unfinished branch of `req` with finish_reason "error" (its slots and pages freed
        as an abort frees them), and forget the prefixes cached from its prompt: their state came from
        the failed request's steps."""
        req.error = req.error or reason
        for seq in req.seqs:
            if seq.status != Status.FINISHED:
                self._finish(seq, "error")
        if self.prefix_cache is not None:
            for entry in self.prefix_cache.remove_prefixes_of(req.prompt_token_ids):
                self._free(entry.slot, entry.pages)

    def _die(self, error: BaseException) -> None:
        """An unrecoverable device error: record why, fail every request and raise EngineDeadError.
        Nothing is given back to the pools: the device they live on can no longer be used."""
        self.dead = EngineDeadError(f"the engine stopped after an unrecoverable device error: "
                                    f"{type(error).__name__}: {error}")
        logger.critical("%s", self.dead, exc_info=error)
        for req in self.requests.values():
            req.error = req.error or str(self.dead)
            for seq in req.seqs:
                if seq.status != Status.FINISHED:
                    seq.status, seq.finish_reason = Status.FINISHED, "error"
                seq.slot, seq.pages = None, []
        self.waiting.clear()
        self.running.clear()
        self._in_flight = None
        self._deferred.clear()
        raise EngineDeadError(str(self.dead)) from error

    def _decode_pages_needed(self) -> int:
        """New pages the decoding sequences need for their next token."""
        ps = self.page_size
        return sum(1 for s in self.running if s.is_decoding and s.num_computed // ps >= len(s.pages))

    def _launch(self, chunks: list[ScheduledChunk]) -> LaunchedStep:
        """Queue the forward pass and the sampling of `chunks` on the device, and the copy of the
        sampled tokens to the host; advance each sequence past the tokens the step consumes."""
        batch = self._build_batch(chunks)
        state_nan = None
        if self.check_state:
            self.check_batch(batch, chunks)
            padded = self.runner.padded_batch(batch)  # padding rows the runner adds: checked as well
            if padded is not None:
                self.check_batch(padded, chunks)
            state_nan = self._state_nan(batch) & batch.has_initial_state  # read by the rows: before the forward
        logits = self.runner.execute(batch)
        if self.prefix_cache is not None:
            for c in chunks:
                if c.seq.cache_at and not c.is_decode and c.seq.num_computed + c.num_tokens == c.seq.cache_at:
                    self._cache_prefix(c.seq)  # queued right behind the forward that computed it
        self._launched += 1
        self.stats["steps"] += 1
        num_rows = logits.shape[0]
        row_params: list[SamplingParams | None] = [None] * num_rows  # None: argmax (verify rows too)
        row_generators: list[torch.Generator | None] = [None] * num_rows
        lp_rows, lp_ks = [], []
        for c in chunks:
            if c.samples and not c.draft:
                row_params[c.logits_row] = c.seq.params
                row_generators[c.logits_row] = c.seq.generator
                if c.seq.params.logprobs is not None:
                    lp_rows.append(c.logits_row)
                    lp_ks.append(c.seq.params.logprobs)
        tokens, finite = sample_tokens(self._processed(logits, chunks), row_params, row_generators)
        if self.check_state:  # the sanitizer looks at every raw logit, not just each row's maximum
            finite = finite & torch.isfinite(logits).all(dim=-1)
        # finite: one flag per logits row, read with the tokens; a row that is not finite fails its request
        device_out = {"tokens": tokens, "finite": finite}  # logprobs: of the model's own distribution (raw logits)
        if state_nan is not None:  # NaN in a row's state before the forward: it read poisoned state;
            # NaN only after it: this forward made it (rows that sample nothing are caught here too)
            device_out["state_nan"] = state_nan
            device_out["state_nan_after"] = self._state_nan(batch)
        if lp_rows:
            index = to_device(lp_rows, torch.long, logits.device)
            device_out["lp_token"], device_out["lp_values"], device_out["lp_ids"] = \
                logprob_rows(logits[index], tokens[index], lp_ks)
        overlappable = self.async_scheduling
        for c in chunks:
            seq = c.seq
            if c.draft:  # verify rows are accepted on the host (_finish_verify): never overlapped
                overlappable = False
                continue
            seq.num_computed += c.num_tokens
            if c.samples:
                seq.pending += 1  # 2 for a moment: until the step before this one is finished
                seq.pending_row = c.logits_row
                if self._forks_from(seq):
                    overlappable = False  # the fork copies this state before anything else runs on it
        done = None
        if logits.is_cuda:
            host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in device_out.items()}
            for k, v in device_out.items():
                host[k].copy_(v, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host = device_out
        return LaunchedStep(self._launched, chunks, batch, logits, tokens, host, done, overlappable)

    def _processed(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """The logits to sample from: min_tokens, logit bias and penalties applied on the rows whose
        requests ask for them (the logits themselves when none does)."""
        proc = [c for c in chunks if c.samples and not c.draft and c.seq.params.processes_logits]
        if not proc:
            return logits
        seqs = [c.seq for c in proc]
        pending = None
        if any(s.pending for s in seqs):  # the token sampled by the step in flight is part of the history
            at = [j for j, s in enumerate(seqs) if s.pending]
            src = to_device([seqs[j].pending_row for j in at], torch.long, logits.device)
            pending = (at, self._in_flight.tokens[src])
        return process_logits(
            logits, [c.logits_row for c in proc], [s.params for s in seqs],
            [len(s.output_token_ids) + s.pending for s in seqs],
            [(s.prompt_token_ids, s.output_token_ids) for s in seqs], [self._banned(s) for s in seqs], pending)

    def _banned(self, seq: Sequence) -> list[int]:
        """Tokens that would end the output: masked while fewer than min_tokens are generated."""
        ids = set(seq.params.stop_token_ids or ())
        if not seq.params.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(i for i in ids if 0 <= i < self.vocab_size)

    def _finish_step(self, step: LaunchedStep) -> dict[str, Request]:
        """Wait for a launched step's tokens and apply them: emit, check stops, fork, accept drafts.
        Returns the requests it changed."""
        if step.done is not None:
            step.done.synchronize()
        self._synced = max(self._synced, step.index)  # (a failed step may have synced past this one)
        self._free_deferred()
        host = step.host
        bad = None if bool(host["finite"].all()) else (~host["finite"]).tolist()
        made_nan = host["state_nan_after"].tolist() if "state_nan_after" in host else None  # (sanitizer)
        tokens = host["tokens"].tolist()
        lp = {}
        if "lp_token" in host:
            rows = [c.logits_row for c in step.chunks
                    if c.samples and not c.draft and c.seq.params.logprobs is not None]
            token_lp, values, ids = host["lp_token"].tolist(), host["lp_values"].tolist(), host["lp_ids"].tolist()
            lp = {r: (token_lp[j], values[j], ids[j]) for j, r in enumerate(rows)}
        changed: dict[str, Request] = {}
        for row, c in enumerate(step.chunks):
            seq = c.seq
            if not c.is_decode:
                self.stats["prompt_tokens"] += c.num_tokens
            if c.samples and not c.draft:
                seq.pending -= 1
            if seq.status == Status.FINISHED:
                continue  # it stopped (or was aborted, or failed) while this step ran: the token is dropped
            req = self.requests[seq.request_id]
            if (c.samples and bad is not None and any(bad[c.logits_row:c.logits_row + (c.num_tokens if c.draft else 1)])) \
                    or (made_nan is not None and made_nan[row]):
                self._fail_request(req, self._nonfinite_reason(c, row, host.get("state_nan")))
                changed[seq.request_id] = req
                continue
            if not c.samples:
                continue  # a prefill chunk that does not reach the end samples nothing
            if c.draft:
                self._finish_verify(c, step.logits, tokens, c.logits_row)
                changed[seq.request_id] = req
                continue
            token = tokens[c.logits_row]
            if self._forks_from(seq):
                self._fork(req, step.logits[c.logits_row], token)  # before branch 0 may finish and free its slot
            logprobs = None
            if seq.logprobs is not None:
                token_lp, values, ids = lp[c.logits_row]
                k = seq.params.logprobs
                logprobs = logprob_dict(token, token_lp, values[:k], ids[:k])
            self._append_token(seq, token, logprobs)
            changed[seq.request_id] = req
        self._free_deferred()
        return changed

    def _emit(self, seq: Sequence, seq_logits: torch.Tensor, greedy_token: int) -> int:
        """Sample one token from a logits row with the sequence's own generator and append it
        (`greedy_token` is the row's argmax, already on the host). For verify rows and forks."""
        p = seq.params
        if p.processes_logits:
            seq_logits_p = process_logits(seq_logits[None], [0], [p], [len(seq.output_token_ids)],
                                          [(seq.prompt_token_ids, seq.output_token_ids)], [self._banned(seq)])[0]
            greedy_token = int(seq_logits_p.argmax())
        else:
            seq_logits_p = seq_logits
        token = greedy_token if p.greedy else sample_row(seq_logits_p, p, seq.generator)
        logprobs = top_logprobs(seq_logits, token, seq.params.logprobs) if seq.logprobs is not None else None
        self._append_token(seq, token, logprobs)
        return token

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
        seq.output_token_ids.append(token)
        self.stats["generated_tokens"] += 1
        self._check_stop(seq, token)

    # ------------------------------------------------------------------ speculative verify
    def _finish_verify(self, c: ScheduledChunk, logits: torch.Tensor, greedy: list[int], row: int) -> int:
        """Accept drafts position by position (accept iff the token sampled from the target there
        equals the draft), emit the sampled tokens and commit the state after the last accepted one.
        Returns the next logits row."""
        seq, draft = c.seq, c.draft
        k = len(draft)
        start = seq.num_computed
        emitted = accepted = 0
        for j in range(k + 1):
            token = self._emit(seq, logits[row + j], greedy[row + j])
            emitted += 1
            matched = j < k and token == draft[j]
            accepted += matched
            if seq.status == Status.FINISHED or not matched:
                break
        self.stats["spec_verify_rows"] += 1
        self.stats["spec_draft_tokens"] += k
        self.stats["spec_accepted_tokens"] += accepted
        # inputs 0..emitted-1 (last token + accepted drafts) are now in the cache; the rest are not
        seq.num_computed = start + emitted
        if seq.status == Status.RUNNING:
            self.state_pool.commit_spec(seq.slot, c.scratch_index, emitted - 1)
        return row + k + 1

    # ------------------------------------------------------------------ prefix caching
    def _reuse_cached_prefix(self, seq: Sequence) -> int:
        """On admission: start from the longest cached prefix of the prompt (its Mamba state copied
        into the sequence's slot, its KV pages shared), and pick where the prompt is cached next.
        Returns the number of prompt tokens reused."""
        cache = self.prefix_cache
        entry = cache.lookup(seq.prompt_token_ids)
        if entry is not None:
            self.state_pool.copy_slot(entry.slot, seq.slot)
            self.kv_cache.allocator.share(entry.pages)
            seq.pages = list(entry.pages)
            seq.num_computed = len(entry.tokens)
        seq.cache_at = cache.next_point(seq.prompt_token_ids, seq.num_computed)
        return seq.num_computed

    def _cache_prefix(self, seq: Sequence) -> None:
        """The sequence's prefill has just been queued up to seq.cache_at: keep that prefix (a copy of
        the slot, queued behind the forward, and one more reference to its pages)."""
        tokens = seq.prompt_token_ids[:seq.cache_at]
        cache = self.prefix_cache
        seq.cache_at = cache.next_point(seq.prompt_token_ids, seq.cache_at)
        if cache.contains(tokens):
            return
        if cache.is_full:
            self._evict_cached_prefix()
        slot = self.state_pool.allocate()
        if slot is None:
            return  # every slot runs a sequence: not cached
        self.state_pool.copy_slot(seq.slot, slot)
        pages = seq.pages[:len(tokens) // self.page_size]
        self.kv_cache.allocator.share(pages)
        displaced = cache.insert(tokens, slot, pages)
        if displaced is not None:  # a hash collision: the older prefix gives its slot and pages back
            self._free(displaced.slot, displaced.pages)
            self.stats["prefix_cache_evictions"] += 1

    def _evict_cached_prefix(self) -> bool:
        """Drop the least recently used cached prefix (False: none). Freed at once even with steps in
        flight: its slot and pages were only read by copies and shares queued before this point, and
        whoever gets them next queues its work after."""
        entry = self.prefix_cache.pop_lru() if self.prefix_cache is not None else None
        if entry is None:
            return False
        self._free(entry.slot, entry.pages)
        self.stats["prefix_cache_evictions"] += 1
        return True

    # ------------------------------------------------------------------ forking (n > 1)
    def _forks_from(self, seq: Sequence) -> bool:
        """Whether the other branches of seq's request fork from it once its prompt is prefilled."""
        req = self.requests[seq.request_id]
        return seq.index == 0 and len(req.seqs) > 1 and not req.forked

    def _fork(self, req: Request, seq_logits: torch.Tensor, greedy_token: int) -> None:
        """Branch 0 has just prefilled the prompt: give every other branch a copy of its Mamba state
        and share its full prompt pages (the partial last page, which the branches write
        differently, is copied), then sample each branch's first token with its own generator.
        A branch that finds no free slot or page waits, and is later recomputed from its prompt."""
        req.forked = True
        parent = req.seqs[0]
        for child in req.seqs[1:]:
            if child.status != Status.WAITING or child in self.waiting:
                continue
            if self._fork_into(parent, child):
                self.stats["forks"] += 1
                self._emit(child, seq_logits, greedy_token)
            else:
                self.waiting.append(child)

    def _fork_into(self, parent: Sequence, child: Sequence) -> bool:
        if len(self.running) >= self.max_num_seqs:
            return False  # (the state pool may hold more slots: those of cached prefixes)
        alloc = self.kv_cache.allocator
        n = parent.num_computed
        full = n // self.page_size
        new_pages: list[int] = []
        if n % self.page_size:
            got = alloc.allocate(1)
            if got is None:
                return False
            new_pages = got
        slot = self.state_pool.fork(parent.slot)
        if slot is None:
            if new_pages:
                alloc.release(new_pages)
            return False
        if new_pages:  # copy-on-write of the partially filled last page
            kv = self.kv_cache.kv
            kv[:, new_pages[0]].copy_(kv[:, parent.pages[full]])
        shared = parent.pages[:full]
        alloc.share(shared)
        child.slot = slot
        child.pages = shared + new_pages
        child.num_computed = n
        child.prefill_len = n
        child.status = Status.RUNNING
        self.running.append(child)
        return True

    # ------------------------------------------------------------------ sanitizer
    def _owner_name(self, seq: Sequence) -> str:
        return f"request '{seq.request_id}' (branch {seq.index})"

    def check_batch(self, batch: StepBatch, chunks: list[ScheduledChunk]) -> None:
        """Raise StateCorruptionError if the batch would touch a slot or page its rows do not own."""
        owners = [RowOwner(self._owner_name(c.seq), c.seq.slot if c.seq.slot is not None else PAD_SLOT_ID,
                           list(c.seq.pages)) for c in chunks]
        check_batch(batch, self.state_pool, self.kv_cache.allocator, self.page_size, owners, DUMMY_PAGE)

    def _state_nan(self, batch: StepBatch) -> torch.Tensor:
        """Per batch row (sanitizer): whether the Mamba state in the row's slot holds NaN now (in stream
        order: before or after the forward, depending on where it is queued). One NaN-propagating max
        over the pool per slot: a read of the pool, no copy of it."""
        pool = self.state_pool
        if pool.conv_state.shape[0] == 0:  # no Mamba layers
            return torch.zeros(batch.state_slot.shape[0], dtype=torch.bool, device=batch.state_slot.device)
        per_slot = pool.conv_state.amax(dim=(0, 2, 3)).isnan() | pool.ssm_state.amax(dim=(0, 2, 3, 4)).isnan()
        return per_slot[batch.state_slot.clamp(min=0)]

    def _nonfinite_reason(self, c: ScheduledChunk, row: int, state_nan: torch.Tensor | None) -> str:
        """Why a row's logits are not finite, as far as is known."""
        who = f"{self._owner_name(c.seq)} (Mamba slot {c.seq.slot})"
        if state_nan is not None and bool(state_nan[row]):
            # the sanitizer fails a request at the step that makes its state NaN, so NaN found before a
            # step was not made by this request: a freed (poisoned) slot was read, or NaN state copied in
            return (f"{StateCorruptionError.__name__}: {who} produced NaN logits: its Mamba state held NaN before "
                    f"the step, so it read poisoned (freed) state (or a copy of a failed request's state)")
        if state_nan is not None:
            known = ("its Mamba state was finite before the step, so this is not a read of freed state; "
                     "the forward made them, ")
        else:
            known = "check_state=True tells this apart from a read of freed state; "
        return (f"{NonFiniteLogitsError.__name__}: {who} produced non-finite values (NaN or Inf) in this step's "
                f"forward pass ({known}e.g. from non-finite weights, which LLM(check_weights=True) checks at "
                f"load, or an overflow)")

    def _update_text(self, seq: Sequence) -> None:
        """Extend seq.text with the new tokens' text, decoding only a short window of tokens (the
        previous token(s) as context, then the new ones) instead of the whole output every step.
        Text that ends in a partial UTF-8 character is held back until the next token completes it."""
        ids = seq.output_token_ids
        before = self.tokenizer.decode(ids[seq.detok_prefix:seq.detok_read])
        after = self.tokenizer.decode(ids[seq.detok_prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            seq.text += after[len(before):]
            seq.detok_prefix, seq.detok_read = seq.detok_read, len(ids)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if self.tokenizer is not None:
            self._update_text(seq)
        if not p.ignore_eos and token in self.eos_token_ids:
            self._finish_with_text(seq, "stop", token)
            return
        if p.stop_token_ids and token in p.stop_token_ids:
            self._finish_with_text(seq, "stop", token)
            return
        if p.stop and self.tokenizer is not None:
            for s in p.stop:
                at = seq.text.find(s)
                if at != -1:
                    seq.text = seq.text[:at]
                    self._finish(seq, "stop", s)
                    return
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish_with_text(seq, "length")

    def _finish_with_text(self, seq: Sequence, reason: str, stop_reason: int | None = None) -> None:
        if self.tokenizer is not None:  # the final text is the plain decode of every output token
            seq.text = self.tokenizer.decode(seq.output_token_ids)
        self._finish(seq, reason, stop_reason)
