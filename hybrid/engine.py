"""The engine: continuous batching with chunked prefill, one step at a time.

A step goes schedule -> build -> launch -> finish, each in its own room:
- hybrid/scheduler.py decides what runs (decodes, verifies, replays, prefill chunks under a token
  budget; admission and preemption) and returns one SchedulerOutput;
- hybrid/resources.py owns the Mamba slots and KV pages (allocation, forks, fenced release,
  prefix-cache holdings);
- hybrid/launcher.py turns the output into a StepBatch, queues the forward (the model runner,
  graphs/runner.py), sampling and the copy to the host, and reads the results back;
- hybrid/output_processor.py detokenises, checks stops and builds each request's output;
- hybrid/step_sanitizer.py runs the state sanitizer's checks around each step (check_state=True).
This module joins them, and applies a finished step's tokens (draft acceptance, forks).

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

import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import Iterable

import torch

from attention.kv_cache import PagedKVCache
from hybrid.batch import StepBatch
from hybrid.engine_config import EngineConfig
from hybrid.errors import EngineDeadError, InvalidRequestError, is_fatal_device_error
from hybrid.inputs import prompt_ids
from hybrid.launcher import LaunchedStep, StepLauncher
from hybrid.logits_processing import bad_words_token_ids
from hybrid.output_processor import OUTPUT_KINDS, OutputProcessor
from hybrid.outputs import RequestOutput
from hybrid.prefix_cache import PrefixCache
from hybrid.request import (Request, ScheduledChunk, Sequence, Status, check_cache_salt, make_generator,
                            truncate_prompt, validate_params, validate_prompt)
from hybrid.resources import ResourceManager
from hybrid.sampling import ENGINE_OUTPUT_KIND, SamplingParams
from hybrid.scheduler import Scheduler, SchedulerOutput
from hybrid.spec_decode import NgramProposer, verify_drafts
from hybrid.step_sanitizer import StepSanitizer
from hybrid.structured_outputs import GrammarCompiler
from state_pool.pool import MambaStatePool
from state_pool.util import cdiv

logger = logging.getLogger("hybrid.engine")


class Engine:
    def __init__(
        self,
        runner,
        state_pool: MambaStatePool,
        kv_cache: PagedKVCache,
        config: EngineConfig,
        *,
        vocab_size: int,
        eos_token_ids: set[int],
        tokenizer=None,
    ) -> None:
        """`config`: the validated EngineConfig (hybrid/engine_config.py) with its sizes settled
        (EngineConfig.with_sizes); its sizes, seed, device, sanitizer, speculation, async
        scheduling and prefix caching configure the engine, the scheduler and the resources."""
        if not config.sizes_known:
            raise ValueError("the engine needs an EngineConfig with its sizes settled (EngineConfig.with_sizes): "
                             f"max_num_seqs={config.max_num_seqs}, max_num_batched_tokens="
                             f"{config.max_num_batched_tokens}, max_model_len={config.max_model_len}")
        self.config = config
        self.runner = runner
        self.state_pool = state_pool
        self.kv_cache = kv_cache
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len = config.max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer = tokenizer
        self.seed = config.seed
        self.device = device = config.device
        self.page_size = kv_cache.page_size
        self.max_pages_per_seq = cdiv(max_model_len, self.page_size)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.stats = {"steps": 0, "preemptions": 0, "generated_tokens": 0, "prompt_tokens": 0,
                      "forks": 0, "overlapped_steps": 0,
                      "prefix_cache_hits": 0, "prefix_cache_hit_tokens": 0, "prefix_cache_evictions": 0,
                      "spec_verify_rows": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        # State sanitizer: poison freed slots, check every batch against live slots/pages.
        self.check_state = config.check_state
        state_pool.poison_freed = self.check_state
        self.spec_config = config.speculative
        proposer = NgramProposer(self.spec_config) if self.spec_config is not None else None
        if self.spec_config is not None:
            state_pool.enable_spec_scratch(config.max_num_seqs, self.spec_config.num_speculative_tokens + 1)
        # Async scheduling: step N+1 is scheduled and launched while step N still runs on the device
        # (its decode rows read N's sampled tokens on the device), then N's tokens are read back. The
        # host's scheduling, batch building and output work hide behind the device step. Drafts need
        # the latest tokens on the host, so speculation runs synchronously.
        self.async_scheduling = config.async_scheduling and self.spec_config is None
        self._in_flight: LaunchedStep | None = None
        self.resources = ResourceManager(state_pool, kv_cache, self.stats, config)
        self.scheduler = Scheduler(self.resources, self.stats, config, proposer=proposer)
        self.sanitizer = StepSanitizer(runner, self.resources, self.scheduler)  # used when check_state
        self.grammars = GrammarCompiler(tokenizer, vocab_size, self.eos_token_ids)  # structured outputs
        self.launcher = StepLauncher(self.resources, device=device, max_pages_per_seq=self.max_pages_per_seq,
                                     eos_token_ids=self.eos_token_ids, vocab_size=vocab_size,
                                     check_state=self.check_state, grammars=self.grammars)
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, max_model_len, self.stats)
        # Set by an unrecoverable device error (see _die): the engine then refuses all work.
        self.dead: EngineDeadError | None = None

    # ------------------------------------------------------------------ state, as callers see it
    @property
    def max_num_seqs(self) -> int:
        """The most sequences running at once: the scheduler's admission cap (at most the config's:
        the state pool has that many slots; lowering it here takes effect at the next schedule)."""
        return self.scheduler.max_num_seqs

    @max_num_seqs.setter
    def max_num_seqs(self, value: int) -> None:
        # above the config's, a sequence would take a slot the pool keeps for the prefix cache and a verify
        # scratch row that was never allocated
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= self.config.max_num_seqs:
            raise ValueError(f"max_num_seqs must be an int in [1, {self.config.max_num_seqs}] (the engine's "
                             f"configured max_num_seqs), got {value!r}")
        self.scheduler.max_num_seqs = value

    @property
    def waiting(self) -> deque[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.resources.prefix_cache

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def forget_history(self) -> None:
        """Leave no trace of the requests run so far (the startup warm-up's, hybrid/warmup.py): their
        cached prefixes evicted (slots and pages freed), the fenced releases done, the arrival count
        (it seeds unseeded sampling) and the statistics started again. With no request in the engine."""
        if self.has_unfinished_requests():
            raise RuntimeError("forget_history() with requests in the engine")
        while self.resources.evict_cached_prefix():
            pass
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.resources.all_synced()
        self._arrivals = itertools.count()
        for key in self.stats:
            self.stats[key] = 0

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix, giving back its slot and pages (vLLM's reset_prefix_cache: e.g.
        between benchmark runs). False, and nothing dropped, while requests are in the engine."""
        if self.has_unfinished_requests():
            logger.warning("reset_prefix_cache: requests are running; the prefix cache is kept")
            return False
        while self.resources.evict_cached_prefix():
            pass
        return True

    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens so far (None before any draft was verified)."""
        drafted = self.stats["spec_draft_tokens"]
        return self.stats["spec_accepted_tokens"] / drafted if drafted else None

    # ------------------------------------------------------------------ requests
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if add_request would refuse this prompt and these params. Reads
        only immutable settings, so another thread may call it while the engine runs."""
        self._checked(prompt_token_ids, params)

    def _checked(self, prompt_token_ids: list[int], params: SamplingParams) -> tuple[list[int], list[list[int]] | None]:
        """validate_request's checks; returns the prompt as the request keeps it (truncate_prompt_tokens)
        and the bad words as token-id sequences (None without bad words)."""
        validate_params(params, self.vocab_size)
        prompt_token_ids = truncate_prompt(prompt_token_ids, params.truncate_prompt_tokens, self.max_model_len)
        validate_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        # bad words are tokenized here, where the tokenizer is (the tokens, not the words, are masked)
        bad_words = bad_words_token_ids(params.bad_words, self.tokenizer, self.vocab_size) if params.bad_words else None
        if params.stop and self.tokenizer is None:  # (no text is made, so a stop string could never match)
            raise InvalidRequestError("invalid sampling parameter stop=...: stop strings need the checkpoint's "
                                      "tokenizer (tokenizer.json) to read the text; this model has none: "
                                      "use stop_token_ids")
        if params.allowed_token_ids is not None and params.min_tokens > 0:
            # min_tokens masks the end tokens: allowed ids that are all end tokens leave nothing to sample
            ends = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if set(params.allowed_token_ids) <= ends:
                raise InvalidRequestError(
                    f"invalid sampling parameter allowed_token_ids={params.allowed_token_ids}: every allowed token "
                    f"ends the output, and min_tokens={params.min_tokens} forbids ending it before then")
        if params.structured_outputs is not None:
            if self.spec_config is not None:
                raise InvalidRequestError("structured outputs with speculative decoding are not supported")
            self.grammars.matchers(params.structured_outputs, 0)  # compiles (and caches) the grammar, or raises
        return list(prompt_token_ids), bad_words

    def add_request(self, request_id: str, prompt_token_ids: list[int] | str | dict, params: SamplingParams,
                    prompt: str | None = None, output_kind: str = "cumulative", priority: int = 0,
                    cache_salt: str | None = None) -> None:
        """Queue a request. The prompt: token ids, or as vLLM's LLMEngine.add_request takes it, a string or a
        TextPrompt / TokensPrompt dict (hybrid.inputs; a dict's "cache_salt" too). `priority`
        (scheduling_policy "priority" only): lower values run first and are preempted last; ties go by arrival.
        `cache_salt` (vLLM's): the request shares cached prefixes only with requests of the same salt
        (hybrid/prefix_cache.py)."""
        self._check_alive()
        if isinstance(prompt_token_ids, (str, dict)):
            if isinstance(prompt_token_ids, dict) and cache_salt is None:
                cache_salt = prompt_token_ids.get("cache_salt")
            text, prompt_token_ids = prompt_ids(prompt_token_ids, self.tokenizer)
            prompt = prompt if prompt is not None else text
        check_cache_salt(cache_salt)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id '{request_id}' is already in use")
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        if output_kind == "cumulative" and isinstance(params, SamplingParams):  # (the default: the params' own)
            output_kind = ENGINE_OUTPUT_KIND[params.output_kind]
        self.check_priority(priority)
        prompt_token_ids, bad_words = self._checked(prompt_token_ids, params)
        if params.logprobs == -1 or params.prompt_logprobs == -1:  # (vLLM's -1: every token of the vocabulary)
            params = dataclasses.replace(
                params, logprobs=self.vocab_size if params.logprobs == -1 else params.logprobs,
                prompt_logprobs=self.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs)
        # structured outputs: a matcher per branch, all in the grammar's initial state (a fork happens
        # before branch 0 accepts its first token, so each child starts from its parent's state)
        grammars = (self.grammars.matchers(params.structured_outputs, params.n)
                    if params.structured_outputs is not None else [None] * params.n)
        arrival = next(self._arrivals)
        seqs = [Sequence(request_id=request_id, index=i, prompt_token_ids=prompt_token_ids, params=params,
                         generator=make_generator(params, self.seed, arrival, i, self.device), arrival=arrival,
                         priority=priority, cache_salt=cache_salt,
                         logprobs=[] if params.logprobs is not None else None, grammar=grammars[i],
                         prompt_logprobs=[None] if params.prompt_logprobs is not None and i == 0 else None,
                         bad_words_ids=bad_words)
                for i in range(params.n)]
        self.requests[request_id] = Request(request_id, prompt, prompt_token_ids, params, seqs,
                                            output_kind=output_kind)
        # Only branch 0 prefills the prompt; the others fork from it once it is done (see _fork).
        self.scheduler.add(seqs[0])

    def check_priority(self, priority: int) -> None:
        """InvalidRequestError for a priority that is not an integer, or not 0 where the policy is "fcfs"."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        if priority and not self.scheduler.by_priority:
            raise InvalidRequestError(f"priority {priority} needs scheduling_policy='priority' "
                                      "(--scheduling-policy priority); this engine schedules first come, first served")

    def get_tokenizer(self):
        """The checkpoint's tokenizer (None without tokenizer.json), as vLLM's LLMEngine.get_tokenizer()."""
        return self.tokenizer

    def get_num_unfinished_requests(self) -> int:
        return sum(not req.finished for req in self.requests.values())

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort a request, or each of several (vLLM's LLMEngine takes a list); unknown ids are ignored."""
        if not isinstance(request_id, str):
            for rid in list(request_id):
                self.abort_request(rid)
            return
        req = self.requests.get(request_id)
        if req is None:
            return
        if self.dead is not None:  # (every request is already finished; the pools are unusable)
            self.requests.pop(request_id, None)
            return
        for seq in req.seqs:
            if seq.status != Status.FINISHED:
                self.scheduler.finish(seq, "abort")
        self.requests.pop(request_id, None)

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
        if prev is not None and self.scheduler.decode_pages_needed() > self.resources.num_free_pages:
            # Out of pages: preempting now would free nothing (a victim's pages wait for the step in
            # flight), so each victim would bring down the next. Finish that step first; this step's
            # schedule then sees every page that came back, as a synchronous engine does.
            self._in_flight = None
            self._finish_guarded(prev, changed)
            prev = None
        try:
            out = self._schedule()
        except Exception as e:  # which requests it touched is unknown: all of them fail
            self._fail_step(e, list(self.requests), changed, "scheduling")
            out = SchedulerOutput([])
        launched = None
        if out:
            try:
                launched = self._launch(out)
            except Exception as e:
                self._fail_step(e, out.request_ids, changed, "launch")
        self._in_flight = None
        if prev is not None:
            self._finish_guarded(prev, changed)
        if launched is not None:
            if launched.overlappable:
                self._in_flight = launched
                self.stats["overlapped_steps"] += 1
            else:
                self._finish_guarded(launched, changed)
        outputs = self.outputs.request_outputs(changed.values())
        for req in changed.values():
            if req.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def _build_batch(self, out: SchedulerOutput) -> StepBatch:
        return self.launcher.build_batch(out, self._in_flight)

    def _launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Queue the forward pass and the sampling of the scheduled chunks on the device, and the copy
        of the sampled tokens to the host; advance each sequence past the tokens the step consumes."""
        self.resources.plan_snapshots(out.chunks)  # prefix-cache states inside prefill chunks: the batch names them
        try:
            batch = self._build_batch(out)
            state_nan_before = None
            if self.check_state:  # host half: refuses the step before it runs
                expected, state_nan_before = self.sanitizer.before_forward(batch, out.chunks)
            logits = self.runner.execute(batch)
            # device half: what ran, padding rows the runner added included
            checks = self.sanitizer.device_checks(expected) if self.check_state else None
            self.resources.state_launched(out.chunks)  # the sanitizer's ledger (check_state only)
        except BaseException:
            self.resources.drop_snapshots(out.chunks)  # nothing was cached from this step
            raise
        self.resources.cache_prefixes(out.chunks)  # queued right behind the forward that computed them
        index = self.resources.step_launched()
        self.stats["steps"] += 1
        state_nan = None if state_nan_before is None else (state_nan_before, self.resources.state_nan(batch))
        step = self.launcher.sample(index, out, batch, logits, state_nan, self._in_flight, checks)
        self.scheduler.advance(out)
        # Verify rows are accepted on the host, and a fork copies its parent's state before anything
        # else runs on it: the next schedule needs those outcomes, so such steps are not overlapped.
        # Nor are steps that sample a constrained row: its next mask needs this token in its matcher.
        step.overlappable = self.async_scheduling and not any(
            c.draft or (c.samples and (self._forks_from(c.seq) or c.seq.grammar is not None)) for c in out.chunks)
        return step

    def _finish_step(self, step: LaunchedStep) -> dict[str, Request]:
        """Wait for a launched step's tokens and apply them: emit, check stops, fork, accept drafts.
        Returns the requests it changed."""
        result = self.launcher.read_back(step)
        changed: dict[str, Request] = {}
        fault = self.sanitizer.fault(step, result.checks) if result.checks else None
        if fault is not None:
            self._fail_step(*fault, changed, "finish (state sanitizer)")
            return changed
        self.resources.step_synced(step.index)
        for row, c in enumerate(step.chunks):
            seq = c.seq
            if not c.is_decode:
                self.stats["prompt_tokens"] += c.num_tokens
            if c.samples and not c.draft:
                seq.pending -= 1
            if seq.status == Status.FINISHED:
                continue  # it stopped (or was aborted, or failed) while this step ran: the token is dropped
            req = self.requests[seq.request_id]
            reason = result.failure(c, row)
            if reason is not None:
                self._fail_request(req, reason)
                changed[seq.request_id] = req
                continue
            if c.prompt_rows is not None:
                self.outputs.append_prompt_logprobs(c, result)
            if not c.samples:
                continue  # a prefill chunk that does not reach the end samples nothing
            if c.draft:
                self._finish_verify(c, step.logits, result.tokens)
                changed[seq.request_id] = req
                continue
            token = result.tokens[c.logits_row]
            if self._forks_from(seq):
                self._fork(req, step.logits[c.logits_row], token)  # before branch 0 may finish and free its slot
            self._append_token(seq, token, result.logprobs_of(c, token))
            changed[seq.request_id] = req
        self.resources.free_deferred()
        return changed

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        # A matcher error, before the token or on it (the mask allowed it): the request's grammar exceeds what
        # the matcher can follow (e.g. "lexer error: too many expressions constructed" for a{1000000}), so
        # the request fails as the client's to fix, never stopping as if its output were complete.
        if seq.grammar is not None and (seq.grammar.failed or not seq.grammar.accept(token)):
            why = (seq.grammar.error().strip().splitlines() or ["unknown"])[0][:300]
            self._fail_request(self.requests[seq.request_id], f"{InvalidRequestError.__name__}: structured outputs: "
                                                               f"the grammar failed at token {token}: {why}")
            return
        stop = self.outputs.append_token(seq, token, logprobs)
        if stop is not None:
            self.scheduler.finish(seq, *stop)

    def _emit(self, seq: Sequence, seq_logits: torch.Tensor, greedy_token: int) -> int:
        """Sample one token from a logits row with the sequence's own generator and append it
        (`greedy_token` is the row's argmax, already on the host). For verify rows and forks."""
        token, logprobs = self.launcher.sample_one(seq, seq_logits, greedy_token)
        self._append_token(seq, token, logprobs)
        return token

    def _finish_verify(self, c: ScheduledChunk, logits: torch.Tensor, greedy: list[int]) -> None:
        """Accept the chunk's drafts (spec_decode.verify_drafts), emit the sampled tokens and commit
        the state after the last accepted one."""
        seq, row = c.seq, c.logits_row
        start = seq.num_computed
        emitted, accepted = verify_drafts(c.draft, lambda j: self._emit(seq, logits[row + j], greedy[row + j]),
                                          lambda: seq.status == Status.FINISHED)
        self.stats["spec_verify_rows"] += 1
        self.stats["spec_draft_tokens"] += len(c.draft)
        self.stats["spec_accepted_tokens"] += accepted
        # inputs 0..emitted-1 (last token + accepted drafts) are now in the cache; the rest are not
        seq.num_computed = start + emitted
        if seq.status == Status.RUNNING:
            self.resources.commit_verify(seq, c.scratch_index, emitted - 1)

    # ------------------------------------------------------------------ forking (n > 1)
    def _forks_from(self, seq: Sequence) -> bool:
        """Whether the other branches of seq's request fork from it once its prompt is prefilled."""
        req = self.requests[seq.request_id]
        return seq.index == 0 and len(req.seqs) > 1 and not req.forked

    def _fork(self, req: Request, seq_logits: torch.Tensor, greedy_token: int) -> None:
        """Branch 0 has just prefilled the prompt: every other branch starts from its state
        (Scheduler.fork) and samples its first token with its own generator. A branch that finds
        no free slot or page waits, and is later recomputed from its prompt."""
        req.forked = True
        parent = req.seqs[0]
        for child in req.seqs[1:]:
            if child.status != Status.WAITING or child in self.scheduler.waiting:
                continue
            if self.scheduler.fork(parent, child):
                self.stats["forks"] += 1
                self._emit(child, seq_logits, greedy_token)
            else:
                self.scheduler.add(child)

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
        self.resources.all_synced()
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
                self.scheduler.finish(seq, "error")
        self.resources.forget_prefixes_of(req.prompt_token_ids, req.seqs[0].cache_salt)

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
        self.scheduler.clear()
        self._in_flight = None
        self.resources.abandon()
        raise EngineDeadError(str(self.dead)) from error
