"""The scheduler: decides what runs each step, under a token budget, and returns it as one
SchedulerOutput.

Each step it picks, in order: one token for every running sequence that is decoding (oldest
first), then prefill chunks of running sequences, then of newly admitted ones. A sequence owns
one Mamba slot and a list of KV pages while it runs (hybrid/resources.py hands them out); when
pages run out, the newest running sequence is preempted and later recomputed from its tokens
(its outputs so far are kept), so no request ever writes into state it does not own. On
readmission only the prompt is prefilled; the tokens it had generated are then replayed through
the decode recurrence as "replay" chunks (as many tokens per step as the budget and the free
pages allow; see state_pool/step_batch.py), so its rebuilt Mamba state is the one its decodes built.
With speculation, a decoding sequence with n-gram drafts becomes a verify chunk.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybrid.request import PROMPT_LOGPROBS_ROWS_PER_STEP, ScheduledChunk, Sequence, Status
from hybrid.resources import ResourceManager
from hybrid.spec_decode import NgramProposer

if TYPE_CHECKING:
    from hybrid.engine_config import EngineConfig


@dataclass
class SchedulerOutput:
    """What one step runs: its chunks in batch order [decodes | verifies | replays | prefills]."""

    chunks: list[ScheduledChunk]

    def __bool__(self) -> bool:
        return bool(self.chunks)

    @property
    def request_ids(self) -> list[str]:
        return [c.seq.request_id for c in self.chunks]


class Scheduler:
    """The waiting queue and the running set, and every decision that moves sequences between them."""

    def __init__(self, resources: ResourceManager, stats: dict[str, int], config: EngineConfig, *,
                 proposer: NgramProposer | None) -> None:
        self.resources = resources
        self.stats = stats
        # the config's sizes (settled); max_num_seqs, the admission cap, may be lowered later (Engine.max_num_seqs)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self._prompt_rows_left = PROMPT_LOGPROBS_ROWS_PER_STEP  # this step's logits rows for prompt logprobs
        self.proposer = proposer
        # "priority": the waiting queue, the running set's order and preemption go by order_key; under
        # "fcfs" every priority is 0, so the same key is the arrival order
        self.by_priority = config.scheduling_policy == "priority"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @staticmethod
    def order_key(seq: Sequence) -> tuple[int, int]:
        """Which of two sequences goes first: the lower priority value, then the earlier arrival."""
        return seq.priority, seq.arrival

    def add(self, seq: Sequence) -> None:
        self._queue(seq)

    def _queue(self, seq: Sequence) -> None:
        """Into the waiting queue behind every sequence that goes before it (at the end when it is the
        newest, as every new arrival is under "fcfs")."""
        key = self.order_key(seq)
        i = len(self.waiting)
        while i > 0 and self.order_key(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ leaving the running set
    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """The sequence is done (stopped, aborted or failed): out of the queues, its resources released."""
        if seq in self.running:
            self.running.remove(seq)
        if seq.status == Status.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.resources.release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def preempt(self, seq: Sequence) -> None:
        """Give up the sequence's slot and pages; it is recomputed from its tokens when readmitted."""
        self.running.remove(seq)
        self.resources.release(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.stats["preemptions"] += 1
        if self.by_priority:  # back in its place by priority: a preempted low-priority sequence waits behind
            self._queue(seq)
        else:  # first back in
            self.waiting.appendleft(seq)

    def clear(self) -> None:
        self.waiting.clear()
        self.running.clear()

    # ------------------------------------------------------------------ forks (n > 1)
    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Start `child` running from the parent's state (its prompt prefilled); False if there is
        no room for it now."""
        if len(self.running) >= self.max_num_seqs:
            return False  # (the state pool may hold more slots: those of cached prefixes)
        if not self.resources.fork(parent, child):
            return False
        child.num_computed = parent.num_computed
        child.prefill_len = parent.num_computed
        child.status = Status.RUNNING
        self.running.append(child)
        return True

    # ------------------------------------------------------------------ after a launch
    def advance(self, out: SchedulerOutput) -> None:
        """The step is launched: its sequences are past the tokens it consumes, and those that sample
        have a token pending on the device. Verify chunks advance when their drafts are accepted."""
        for c in out.chunks:
            if c.draft:
                continue
            c.seq.num_computed += c.num_tokens
            if c.samples:
                c.seq.pending += 1  # 2 for a moment: until the step before this one is finished
                c.seq.pending_row = c.logits_row

    def decode_pages_needed(self) -> int:
        """New pages the decoding sequences need for their next token."""
        ps = self.resources.page_size
        return sum(1 for s in self.running if s.is_decoding and s.num_computed // ps >= len(s.pages))

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        self._prompt_rows_left = PROMPT_LOGPROBS_ROWS_PER_STEP
        decodes: list[ScheduledChunk] = []
        verifies: list[ScheduledChunk] = []
        replays: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        res = self.resources
        # 1. one token for every decoding sequence, oldest first; preempt the newest when out of pages.
        #    With speculation, a sequence with n-gram drafts becomes a verify chunk (1 + drafts tokens).
        #    A sequence readmitted after a preemption whose generated tokens are known but not computed
        #    yet replays as many of them as the budget and the free pages allow (a replay chunk: decode
        #    recurrence, sampled only if it reaches the last token); it preempts others only as a
        #    one-token decode would.
        decoding = sorted([s for s in self.running if s.is_decoding], key=self.order_key)
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
            if draft and not res.grow_pages(seq, seq.num_computed + 1 + len(draft)):
                draft = []  # no pages for the drafts: plain decode (never preempt for speculation)
            if draft:
                verifies.append(ScheduledChunk(seq, 1 + len(draft), True, draft))
                budget -= 1 + len(draft)
                continue
            while not res.grow_pages(seq, seq.num_computed + 1):
                victim = max(self.running, key=lambda s: (*self.order_key(s), s.index))
                self.preempt(victim)
                decodes = [c for c in decodes if c.seq is not victim]
                verifies = [c for c in verifies if c.seq is not victim]
                replays = [c for c in replays if c.seq is not victim]
                if victim is seq:
                    break
            if seq.status == Status.RUNNING:
                (replays if replaying else decodes).append(ScheduledChunk(seq, 1, True, replay=replaying))
                budget -= 1

        # 2. continue running prefills
        for seq in sorted([s for s in self.running if not s.is_decoding], key=self.order_key):
            if budget <= 0:
                break
            chunk = self._fit_chunk(seq, budget)
            if chunk:
                prefills.append(ScheduledChunk(seq, chunk, False))
                budget -= chunk
                self._take_prompt_rows(seq, chunk)

        # 3. admit waiting sequences while there is budget, a slot and pages
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.pending:
                break  # preempted with a token still in flight: readmit it once that token is known
            slot = res.allocate_slot()
            if slot is None:
                break
            seq.slot = slot
            # Only the prompt goes through the prefill scan. Tokens generated before a preemption are
            # then replayed through the decode recurrence (replay chunks, step 1), as they first ran, so
            # the rebuilt state is bit-identical (the scan clamps dt and rounds differently).
            seq.prefill_len = len(seq.prompt_token_ids)
            seq.num_computed = 0
            reused = res.reuse_cached_prefix(seq)
            chunk = self._fit_chunk(seq, budget)
            if not chunk:  # nothing launched has used them yet: back at once
                res.release_unused(seq)
                seq.num_computed = 0
                break
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = reused
            if reused:
                self.stats["prefix_cache_hits"] += 1
                self.stats["prefix_cache_hit_tokens"] += reused
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            prefills.append(ScheduledChunk(seq, chunk, False))
            budget -= chunk
            self._take_prompt_rows(seq, chunk)

        if not decodes and not verifies and not replays and not prefills and self.running \
                and not any(s.pending for s in self.running):
            # Every running sequence is stuck waiting for pages: free the newest and try again.
            victim = max(self.running, key=lambda s: (*self.order_key(s), s.index))
            self.preempt(victim)
            return self.schedule()
        return SchedulerOutput(decodes + verifies + replays + prefills)

    def _propose(self, seq: Sequence, budget: int) -> list[int]:
        """Speculative drafts for a decoding sequence ([] without speculation or without a match)."""
        if self.proposer is None or seq.num_computed + 1 < seq.num_tokens:
            return []  # no speculation while replaying known tokens after a preemption
        # a verify emits up to 1 + drafts tokens: stay within max_tokens, the context and the budget
        room = min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens,
                   budget) - 1
        room = min(room, self.proposer.cfg.num_speculative_tokens)  # the verify scratch holds K+1 states
        if room <= 0:
            return []
        drafts = self.proposer.propose(seq.tokens, room)
        if len(drafts) > room:
            raise RuntimeError(f"the draft proposer returned {len(drafts)} drafts where at most {room} fit")
        return drafts

    def _take_prompt_rows(self, seq: Sequence, chunk: int) -> None:
        if seq.scores_prompt:
            self._prompt_rows_left -= chunk

    def _fit_chunk(self, seq: Sequence, budget: int, upto: int | None = None) -> int:
        """Largest chunk (<= budget, ending at or before token `upto`, default the prefill length)
        whose pages can be allocated now."""
        chunk = min((seq.prefill_len if upto is None else upto) - seq.num_computed, budget)
        if seq.scores_prompt:  # every position of the chunk is a logits row
            chunk = min(chunk, self._prompt_rows_left)
        ps = self.resources.page_size
        while chunk > 0 and not self.resources.grow_pages(seq, seq.num_computed + chunk):
            free_tokens = (len(seq.pages) + self.resources.num_free_pages) * ps - seq.num_computed
            chunk = min(chunk - 1, max(free_tokens, 0))
        return chunk
