"""The streamed response path's host-side plumbing, without a model: the real AsyncEngine.generate
and streaming.respond over a fake engine whose step outputs the test hands in, as the worker does.

- A step's updates reach the event loop in one call_soon_threadsafe (not one per request).
- An update is read only once the previous one is written: AsyncEngine.generate extends the
  running token and logprob lists in place, so reading ahead (as a pump task did) sent the logprob
  rows of a later token with an earlier chunk.
- Updates that are ready at once are written together, byte for byte what one write per event
  would send; every event is exactly json.dumps of its chunk dict (id, object, created, model,
  choices[, usage]), as before the chunks were built from a pre-serialised head.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from hybrid.async_engine import AsyncEngine, _put_all
from hybrid.outputs import CompletionOutput, RequestOutput
from hybrid.sampling import SamplingParams

pytest.importorskip("starlette")

from hybrid.server.streaming import ChatFormat, CompletionFormat, Prompt, respond  # noqa: E402


class _Free:
    num_free = 8


class _KV:
    allocator = _Free()


class FakeEngine:
    """What AsyncEngine reads of an Engine before any step (the worker is never started here)."""

    state_pool = _Free()
    kv_cache = _KV()
    max_num_seqs = 8

    def validate_request(self, ids, params) -> None:
        pass


class _Admission:
    streaming = False

    def release(self) -> None:
        pass


def _events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    return [e for e in text.split("\n\n") if e]


def _check_json(events: list[str], with_usage: bool) -> list[dict]:
    """Each event is 'data: ' + json.dumps(chunk) with the chunk's keys in the API's order."""
    out = []
    for e in events:
        assert e.startswith("data: ")
        if e == "data: [DONE]":
            continue
        d = json.loads(e[len("data: "):])
        assert e == "data: " + json.dumps(d, ensure_ascii=False)
        assert list(d) == ["id", "object", "created", "model", "choices"] + (["usage"] if with_usage else [])
        out.append(d)
    return out


def _step_output(rid: str, index_tokens: dict[int, list[int]], texts: dict[int, str], finished: bool,
                 logprobs: bool = True) -> RequestOutput:
    """A "delta" output as Engine.step makes it: the new tokens (and their logprob rows) only, the
    whole text so far."""
    outs = [CompletionOutput(i, texts[i], list(toks), "length" if finished else None,
                             [{t: -0.25 * t} for t in toks] if logprobs else None)
            for i, toks in index_tokens.items()]
    return RequestOutput(rid, None, [1, 2], outs, finished=finished)


async def _stream(ae: AsyncEngine, prompts: list[Prompt], fmt, steps, include_usage: bool = True) -> list[str]:
    """Run respond() as a streamed response; `steps(trackeds)` gives the list of step batches (each
    a list of (tracked, output)), handed to the loop as the worker hands them. Returns the body
    writes."""
    resp = await respond(ae, None, prompts, fmt, model="m", stream=True, include_usage=include_usage,
                         admission=_Admission(), request_id="cmpl-x")
    writes: list[str] = []

    async def consume():
        async for part in resp.body_iterator:
            writes.append(part)

    task = asyncio.create_task(consume())
    tracked = []
    while len(tracked) < len(prompts):  # the adds generate() queued for the worker
        await asyncio.sleep(0)
        while not ae._commands.empty():
            cmd = ae._commands.get_nowait()
            if cmd[0] == "add":
                tracked.append(cmd[1])
    tracked.sort(key=lambda tr: tr.request_id)
    loop = asyncio.get_running_loop()
    for batch in steps(tracked):
        loop.call_soon(_put_all, [(tr.queue, out) for tr, out in batch])
    await asyncio.wait_for(task, 10)
    return writes


def test_updates_ready_at_once_are_written_together_and_read_one_at_a_time():
    """Three steps of one request queued before the stream runs: one write, and each chunk carries
    the logprob row of its own token (reading ahead gave the first chunk all three rows)."""
    ae = AsyncEngine(FakeEngine())
    fmt = CompletionFormat(1, 1, str)
    prompt = Prompt(None, [1, 2], SamplingParams(max_tokens=3, logprobs=1))

    def steps(tr):
        (t,) = tr
        return [[(t, _step_output(t.request_id, {0: [5]}, {0: "a"}, False))],
                [(t, _step_output(t.request_id, {0: [6]}, {0: "ab"}, False))],
                [(t, _step_output(t.request_id, {0: [7]}, {0: "abc"}, True))]]

    writes = asyncio.run(_stream(ae, [prompt], fmt, steps))
    text = "".join(writes)
    chunks = _check_json(_events(text), with_usage=True)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert [d["text"] for d in deltas] == ["a", "b", "c"]
    assert [d["logprobs"]["tokens"] for d in deltas] == [["5"], ["6"], ["7"]]
    assert [d["logprobs"]["text_offset"] for d in deltas] == [[0], [1], [2]]
    assert [d["finish_reason"] for d in deltas] == [None, None, "length"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert text.endswith("data: [DONE]\n\n")
    # the three steps were queued before the stream ran: their events went out in one write (then
    # the usage chunk, and [DONE])
    assert writes[0].count("data: ") == 3 and len(writes) == 3
    # byte for byte the events one write per chunk made (json.dumps of the whole chunk dict)
    expected = "".join(
        "data: " + json.dumps({"id": "cmpl-x", "object": "text_completion", "created": c["created"], "model": "m",
                               "choices": c["choices"], "usage": c["usage"]}, ensure_ascii=False) + "\n\n"
        for c in chunks) + "data: [DONE]\n\n"
    assert text == expected


def test_steps_one_by_one_are_written_one_by_one():
    """A stream that keeps up writes each event as its update arrives (nothing is held back)."""
    ae = AsyncEngine(FakeEngine())
    fmt = CompletionFormat(1, None, str)
    prompt = Prompt("p", [1, 2], SamplingParams(max_tokens=3))
    writes: list[str] = []

    async def main():
        resp = await respond(ae, None, [prompt], fmt, model="m", stream=True, include_usage=False,
                             admission=_Admission(), request_id="cmpl-y")

        async def consume():
            async for part in resp.body_iterator:
                writes.append(part)

        task = asyncio.create_task(consume())
        while ae._commands.empty():
            await asyncio.sleep(0)
        tr = ae._commands.get_nowait()[1]
        loop = asyncio.get_running_loop()
        for k, (tok, text) in enumerate([(5, "x"), (6, "xy"), (7, "xyz")]):
            loop.call_soon(_put_all, [(tr.queue, _step_output(tr.request_id, {0: [tok]}, {0: text}, k == 2, False))])
            for _ in range(20):
                await asyncio.sleep(0)
            assert len(writes) >= k + 1 and writes[k].count("data: ") == 1  # written before the next one arrives
        await asyncio.wait_for(task, 10)

    asyncio.run(main())
    assert [json.loads(w[len("data: "):])["choices"][0]["text"] for w in writes[:3]] == ["x", "y", "z"]
    chunks = _check_json(_events("".join(writes)), with_usage=False)
    assert len(chunks) == 3


@pytest.mark.parametrize("n", [1, 2])
def test_several_prompts_and_choices_each_get_their_own_rows(n):
    """Two prompts (n choices each) with their steps queued at once: every chunk carries exactly its
    own token's logprob row (the per-prompt generators are advanced one update at a time too)."""
    ae = AsyncEngine(FakeEngine())
    fmt = CompletionFormat(n, 0, str)
    prompts = [Prompt(None, [1, 2], SamplingParams(max_tokens=2, logprobs=0, n=n)) for _ in range(2)]

    def steps(trs):
        batches = []
        for k in range(2):
            batch = []
            for p, t in enumerate(trs):
                toks = {i: [10 * (p + 1) + 2 * k + i] for i in range(n)}
                texts = {i: "".join(chr(97 + j) for j in range(k + 1)) for i in range(n)}
                batch.append((t, _step_output(t.request_id, toks, texts, k == 1)))
            batches.append(batch)
        return batches

    writes = asyncio.run(_stream(ae, prompts, fmt, steps))
    chunks = _check_json(_events("".join(writes)), with_usage=True)
    seen: dict[int, list] = {}
    for c in chunks:
        for ch in c["choices"]:
            seen.setdefault(ch["index"], []).append((ch["text"], ch["logprobs"]["tokens"] if ch["logprobs"] else None))
    assert sorted(seen) == list(range(2 * n))
    for idx, got in seen.items():
        p, i = divmod(idx, n)
        assert got == [("a", [str(10 * (p + 1) + i)]), ("b", [str(10 * (p + 1) + 2 + i)])], (idx, got)
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * 2 * n


def test_chat_chunks_are_json_dumps_of_their_dicts():
    ae = AsyncEngine(FakeEngine())
    fmt = ChatFormat(1, None, str)
    prompt = Prompt("p", [1, 2], SamplingParams(max_tokens=2))

    def steps(tr):
        (t,) = tr
        return [[(t, _step_output(t.request_id, {0: [5]}, {0: "h\u00e9"}, False, False))],
                [(t, _step_output(t.request_id, {0: [6]}, {0: "h\u00e9\"\n"}, True, False))]]

    text = "".join(asyncio.run(_stream(ae, [prompt], fmt, steps, include_usage=False)))
    chunks = _check_json(_events(text), with_usage=False)
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 4
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""},
                                                          {"content": "h\u00e9"}, {"content": "\"\n"}, {}]
    assert "h\u00e9" in text  # not escaped (ensure_ascii=False, as before)


def test_a_failure_after_ready_updates_sends_them_first():
    """Updates written together with a failure behind them: the updates, then the error event."""
    from hybrid.errors import RequestFailedError

    ae = AsyncEngine(FakeEngine())
    fmt = CompletionFormat(1, None, str)
    prompt = Prompt(None, [1, 2], SamplingParams(max_tokens=5))

    def steps(tr):
        (t,) = tr
        return [[(t, _step_output(t.request_id, {0: [5]}, {0: "a"}, False, False))],
                [(t, RequestFailedError("request failed: boom", failed={t.request_id: "boom"}))]]

    text = "".join(asyncio.run(_stream(ae, [prompt], fmt, steps)))
    events = _events(text)
    assert json.loads(events[0][len("data: "):])["choices"][0]["text"] == "a"
    assert '"error"' in events[1] and events[-1] == "data: [DONE]"


def test_a_step_is_delivered_in_one_call():
    class Loop:
        def __init__(self):
            self.calls = []

        def call_soon_threadsafe(self, fn, *args):
            self.calls.append((fn, args))

    class Q:
        def __init__(self):
            self.items = []

        def put_nowait(self, x):
            self.items.append(x)

    from hybrid.async_engine import _Tracked

    ae = AsyncEngine(FakeEngine())
    loop, other = Loop(), Loop()
    trs = [_Tracked(f"r{i}", loop if i < 5 else other, Q(), 1, SamplingParams()) for i in range(7)]
    ae._deliver_batch([(tr, f"out{i}") for i, tr in enumerate(trs)])
    assert len(loop.calls) == 1 and len(other.calls) == 1  # one call per event loop, not per request
    for lp in (loop, other):
        fn, (items,) = lp.calls[0]
        fn(items)
    assert [tr.queue.items for tr in trs] == [[f"out{i}"] for i in range(7)]
    ae._deliver_batch([])
    assert len(loop.calls) == 1
