"""An asyncio front end over the (synchronous, not thread-safe) Engine.

One worker thread owns the Engine: every engine call (add_request, abort_request, step) runs on
it, one at a time. The event loop hands it commands through a queue; the worker applies every
pending command before each step, so an abort (a client that went away) frees the request's
Mamba slot and KV pages before the next forward pass. Each request's RequestOutput updates are
delivered to its own asyncio.Queue; a step's updates go to the event loop in one
loop.call_soon_threadsafe (see _deliver_batch). The server turns texts into stream deltas with
hybrid.output_processor.TextDeltas.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from hybrid.errors import EngineDeadError, HybridError, RequestFailedError
from hybrid.outputs import RequestOutput
from hybrid.request import check_cache_salt
from hybrid.sampling import SamplingParams

logger = logging.getLogger("hybrid.async_engine")


__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "RequestFailedError"]


class QueueFullError(HybridError):
    """Too many requests are already queued."""


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: one step's updates into their requests' queues, in order."""
    for q, item in items:
        q.put_nowait(item)


@dataclass
class _Tracked:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None


class AsyncEngine:
    """Owns an Engine; runs it on one worker thread; streams RequestOutputs to asyncio callers."""

    def __init__(self, engine, tokenizer=None, *, max_queued_requests: int | None = None,
                 metrics=None, idle_wait_s: float = 0.5) -> None:
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._tracked: dict[str, _Tracked] = {}  # touched by the worker only
        self._inflight: dict[str, asyncio.Queue] = {}  # touched by the event loop only: request id -> its queue
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # EngineDeadError once the engine stopped for good (read by /health; see dead_reason)
        self.dead: BaseException | None = None
        # A snapshot of the engine's state, published by the worker after each step.
        self.snapshot = {"running": 0, "waiting": 0, "slots_used": 0, "pages_used": 0, "prefix_cache_hit_tokens": 0}
        self._slots_total = engine.state_pool.num_free
        self._pages_total = engine.kv_cache.allocator.num_free

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="hybrid-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped for good (None while it serves): for /health. Only an unrecoverable
        device error stops it; a failed step fails just its own requests (RequestFailedError)."""
        return str(self.dead) if self.dead is not None else None

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        try:
            import torch

            torch.set_grad_enabled(False)
        except Exception:  # pragma: no cover
            pass
        while not self._stop.is_set():
            self._drain_commands()
            if self.dead is not None or not self.engine.has_unfinished_requests():
                # (once dead the worker stays, only to refuse the requests still arriving)
                self._publish()
                self._wakeup.wait(self.idle_wait_s)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as e:
                # EngineDeadError: the device is lost. Anything else escaping step() (which fails the
                # requests of a failed step itself) means its bookkeeping cannot be trusted. Either way
                # every request fails and the engine takes no more work.
                logger.exception("engine stopped")
                self.dead = e if isinstance(e, EngineDeadError) else EngineDeadError(f"engine step failed: {e!r}")
                for tr in list(self._tracked.values()):
                    self._deliver(tr, EngineDeadError(str(self.dead)))
                self._tracked.clear()
                self._publish()
                continue
            now = time.monotonic()
            batch = []  # (tracked, item): the step's updates, handed to the event loop(s) at once
            new_tokens = 0
            for out in outputs:
                tr = self._tracked.get(out.request_id)
                if tr is None:
                    continue
                new_tokens += self._observe(tr, out, now)
                if out.error is not None:  # failed in the engine (the others carry on): its stream ends with the error
                    batch.append((tr, RequestFailedError(f"request {out.request_id} failed: {out.error}",
                                                         failed={out.request_id: out.error})))
                else:
                    batch.append((tr, out))
                if out.finished:
                    self._tracked.pop(out.request_id, None)
            if new_tokens and self.metrics is not None:
                self.metrics.add_tokens(new_tokens)
            self._deliver_batch(batch)
            self._publish()

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                tr, prompt_ids, prompt, cache_salt = cmd[1], cmd[2], cmd[3], cmd[4]
                if self.dead is not None:
                    self._deliver(tr, EngineDeadError(str(self.dead)))
                    continue
                try:
                    # deltas: the per-step cost stays flat however long the output grows; generate()
                    # turns them back into running totals on the caller's side
                    self.engine.add_request(tr.request_id, prompt_ids, tr.params, prompt=prompt, output_kind="delta",
                                            priority=tr.priority, cache_salt=cache_salt)
                except BaseException as e:
                    self._deliver(tr, e)
                    continue
                self._tracked[tr.request_id] = tr
            elif kind == "abort":
                rid = cmd[1]
                was_tracked = self._tracked.pop(rid, None) is not None
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    logger.exception("abort of %s failed", rid)
                if was_tracked and self.metrics is not None:
                    self.metrics.on_abort()

    def _deliver(self, tr: _Tracked, item) -> None:
        try:
            tr.loop.call_soon_threadsafe(tr.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _deliver_batch(self, batch: list[tuple[_Tracked, object]]) -> None:
        """A step's updates, in order, to their requests' queues: one call_soon_threadsafe per event
        loop (in practice one) instead of one per request. Each of those calls wakes the loop through
        its self-pipe, a syscall that lets the loop take the GIL in the middle of this thread's step;
        one per step keeps the worker running and the loop's work in one piece."""
        if not batch:
            return
        loop = batch[0][0].loop
        if all(tr.loop is loop for tr, _ in batch):
            groups = {loop: [(tr.queue, item) for tr, item in batch]}
        else:
            groups = {}
            for tr, item in batch:
                groups.setdefault(tr.loop, []).append((tr.queue, item))
        for loop, items in groups.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _observe(self, tr: _Tracked, out: RequestOutput, now: float) -> int:
        """Record the output's latencies; returns how many new tokens it carries (the caller adds
        them to the token counter once per step)."""
        new = sum(len(c.token_ids) for c in out.outputs)  # a delta output: the new tokens only
        if new > 0:
            if tr.first_token_at is None:
                tr.first_token_at = now
                if self.metrics is not None:
                    self.metrics.observe_ttft(now - tr.arrival)
            elif self.metrics is not None and tr.last_token_at is not None:
                self.metrics.observe_tpot(now - tr.last_token_at)
            tr.last_token_at = now
        if out.finished and self.metrics is not None:
            self.metrics.on_finish(out, now - tr.arrival, tr.num_prompt_tokens)
        return new

    def _publish(self) -> None:
        e = self.engine
        self.snapshot = {
            "running": len(e.running),
            "waiting": len(e.waiting),
            "slots_used": self._slots_total - e.state_pool.num_free,
            "pages_used": self._pages_total - e.kv_cache.allocator.num_free,
            "prefix_cache_hit_tokens": e.stats["prefix_cache_hit_tokens"],
        }

    # ------------------------------------------------------------------ API (event loop side)
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError now (on the caller's thread) for a bad prompt or params: every
        check add_request makes, vocabulary-dependent ones (logit_bias ids) included, so a streamed
        request can be refused before its response starts. Only reads immutable engine settings."""
        self.engine.validate_request(prompt_token_ids, params)

    def check_capacity(self, num_new: int = 1) -> None:
        if self.max_queued_requests is None:
            return
        limit = self.engine.max_num_seqs + self.max_queued_requests
        if len(self._inflight) + num_new > limit:
            raise QueueFullError(
                f"the server is overloaded: {len(self._inflight)} requests in flight "
                f"({self.engine.max_num_seqs} running at most, {self.max_queued_requests} queued at most); "
                "retry later"
            )

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       prompt: str | None = None, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's RequestOutput after every step that changed it; the last one has
        finished=True. Each output holds everything so far (text, token_ids, logprobs); the token_ids
        and logprobs lists are this iteration's running totals, extended in place when the next
        output arrives (copy them to keep a snapshot). Leaving the iteration early (client gone, task
        cancelled) aborts the request. A request that fails inside the engine raises
        RequestFailedError here (its slot and pages are already freed; other requests carry on);
        EngineDeadError if the engine stopped for good. `cache_salt`: Engine.add_request's."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        self.validate(prompt_token_ids, params)
        check_cache_salt(cache_salt)
        if priority != 0:  # (0 is every policy's default)
            self.engine.check_priority(priority)
        rid = request_id or self.new_request_id()
        loop = asyncio.get_running_loop()
        tr = _Tracked(rid, loop, asyncio.Queue(), len(prompt_token_ids), params, priority)
        self._inflight[rid] = tr.queue
        finished = False
        totals: dict[int, tuple[list[int], list | None]] = {}  # per completion index: tokens, logprobs
        prompt_logprobs = None  # sent once (the first delta after the prompt is done), kept on every output
        try:
            self._commands.put(("add", tr, list(prompt_token_ids), prompt, cache_salt))
            self._wakeup.set()
            while True:
                item = await tr.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                if item.prompt_logprobs is not None:
                    prompt_logprobs = item.prompt_logprobs
                item.prompt_logprobs = prompt_logprobs
                for c in item.outputs:  # delta -> running totals
                    tokens, logprobs = totals.setdefault(c.index, ([], [] if c.logprobs is not None else None))
                    tokens.extend(c.token_ids)
                    c.token_ids = tokens
                    if logprobs is not None:
                        logprobs.extend(c.logprobs)
                        c.logprobs = logprobs
                yield item
                if finished:
                    return
        finally:
            self._inflight.pop(rid, None)
            if not finished:
                self.abort(rid)

    def has_update(self, request_id: str) -> bool:
        """Whether an update of the request (in flight through generate()) is already queued, so that
        generate() yields it without waiting (on the event loop; the streams write what is ready in
        one piece)."""
        q = self._inflight.get(request_id)
        return q is not None and not q.empty()

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()
