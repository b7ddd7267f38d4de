"""The response side, one path for both endpoints: running a request's prompts on the AsyncEngine,
the per-choice updates (text deltas with stop strings and partial characters held back, and the
logprob rows whose text is sent), and the response built from them: one JSON body, or a stream of
server-sent events. What differs between /v1/completions and /v1/chat/completions is only how a
choice is written (ResponseFormat: CompletionFormat, ChatFormat).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Callable, NamedTuple

from starlette.responses import JSONResponse, StreamingResponse

from hybrid.output_processor import TextDeltas
from hybrid.sampling import SamplingParams
from hybrid.server.api_errors import error_for
from hybrid.server.reasoning import ReasoningMode, ReasoningStream
from hybrid.server.tool_calls import ChoiceStream, ToolMode
from hybrid.server.tool_tags import MarkedText, MarkerTokens


class Prompt(NamedTuple):
    text: str | None  # None: sent as token ids
    ids: list[int]
    params: SamplingParams  # per prompt: a default max_tokens is fitted to each prompt's room
    priority: int = 0  # the request's (--scheduling-policy priority)
    cache_salt: str | None = None  # vLLM's: shares cached prefixes only with requests of the same salt


class ChoiceUpdate(NamedTuple):
    prompt_index: int
    index: int  # choice index within the prompt's request (0 .. n-1)
    delta: str
    logprobs: tuple[list[dict[int, float]], list[int]] | None  # (logprob rows, their token ids) now sent
    text_offset: int  # characters of this choice sent before `delta`
    finish_reason: str | None
    num_tokens: int
    stop_reason: int | str | None = None  # the stop string or token id that ended it (vLLM's field)
    token_ids: list[int] | None = None  # the tokens generated since the previous update (return_token_ids)
    prompt_logprobs: list | None = None  # on a choice's first update, if asked for: its prompt's logprob rows


class _ChoiceState:
    __slots__ = ("deltas", "lp_sent", "tokens_sent", "text_len", "done")

    def __init__(self, stops) -> None:
        self.deltas = TextDeltas(stops)
        self.lp_sent = 0
        self.tokens_sent = 0
        self.text_len = 0
        self.done = False


# ---------------------------------------------------------------------------------- running prompts
async def run(engine, prompts: list[Prompt], base_id: str):
    """Yield (prompt index, RequestOutput) for every update of every prompt's request.

    A request's generator is advanced only once the caller is done with its previous update:
    AsyncEngine.generate extends the running token and logprob lists of the output it yielded last
    in place, so reading ahead would show the caller tokens (and logprob rows) of a later update."""
    gens = [engine.generate(p.ids, p.params, request_id=f"{base_id}-{i}", prompt=p.text, priority=p.priority,
                            cache_salt=p.cache_salt)
            for i, p in enumerate(prompts)]
    try:
        if len(gens) == 1:  # one request (the usual case): its updates as they come, no task in between
            async for out in gens[0]:
                yield 0, out
            return
        # several: one pending __anext__ per request; whichever comes first is yielded
        pending = {asyncio.ensure_future(g.__anext__()): i for i, g in enumerate(gens)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in sorted(done, key=pending.get):
                    i = pending.pop(t)
                    try:
                        out = t.result()
                    except StopAsyncIteration:
                        continue
                    yield i, out
                    pending[asyncio.ensure_future(gens[i].__anext__())] = i
        finally:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        # left early (client gone, cancelled, a failed prompt): the unfinished requests are aborted now
        for g in gens:
            await g.aclose()


async def choice_updates(engine, prompts: list[Prompt], base_id: str, want_logprobs: bool,
                         text_of: Callable | None = None, cached: dict[int, int] | None = None,
                         want_token_ids: bool = False, want_prompt_logprobs: bool = False):
    """Updates per choice, a list for each engine output (one per choice it changed): ChoiceUpdate
    with the text delta (stop strings and partial characters held back), the logprob rows whose
    text is now sent, the finish reason once it ends, (want_token_ids) the tokens new since the last update and
    (want_prompt_logprobs) on its first update, the prompt's logprob rows.
    text_of((prompt index, choice index), output): the choice's text (default: output.text).
    cached: filled with each prompt's tokens taken from the prefix cache (RequestOutput.num_cached_tokens)."""
    states: dict[tuple[int, int], _ChoiceState] = {}
    agen = run(engine, prompts, base_id)
    try:
        async for pi, out in agen:
            if cached is not None:
                cached[pi] = out.num_cached_tokens
            updates = []
            for c in out.outputs:
                st = states.get((pi, c.index))
                first = st is None
                if first:
                    st = states[(pi, c.index)] = _ChoiceState(prompts[pi].params.stop)
                if st.done:
                    continue
                finished = c.finish_reason is not None
                delta = st.deltas.update(text_of((pi, c.index), c) if text_of else c.text, finished)
                rows = None
                if want_logprobs and c.logprobs is not None:
                    # logprobs of the tokens whose text is now (fully or partly) sent
                    upto = len(c.token_ids) if (finished or delta) else st.lp_sent
                    if upto > st.lp_sent:
                        rows = (c.logprobs[st.lp_sent:upto], c.token_ids[st.lp_sent:upto])
                        st.lp_sent = upto
                new_ids = None
                if want_token_ids:
                    new_ids, st.tokens_sent = c.token_ids[st.tokens_sent:], len(c.token_ids)
                update = ChoiceUpdate(pi, c.index, delta, rows, st.text_len,
                                      c.finish_reason if finished else None, len(c.token_ids),
                                      c.stop_reason if finished else None, new_ids,
                                      out.prompt_logprobs if first and want_prompt_logprobs else None)
                st.text_len += len(delta)
                st.done = finished
                updates.append(update)
            if updates:
                yield updates
    finally:
        await agen.aclose()


async def _wait_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(engine, request, prompts: list[Prompt], base_id: str) -> list | None:
    """Run to completion: the final RequestOutput of each prompt; everything is aborted if the
    client disconnects first (None)."""
    finals: list = [None] * len(prompts)

    async def consume():
        agen = run(engine, prompts, base_id)
        try:
            async for idx, out in agen:
                if out.finished:
                    finals[idx] = out
        finally:
            await agen.aclose()

    work = asyncio.create_task(consume())
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return None
        work.result()
        return finals
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()


# ---------------------------------------------------------------------------------- how a choice is written
def finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """The usage object; with cached_tokens (--enable-prompt-tokens-details), prompt_tokens_details says how
    many prompt tokens came from the prefix cache."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


class ResponseFormat:
    """How one endpoint writes its choices; `logprobs` is the number of top logprobs asked for
    (None: no logprobs), `token_str` a token id's text."""
    id_prefix = object_name = chunk_object_name = ""
    echo = False  # completions only: the prompt before each choice (CompletionFormat.echoed)

    def __init__(self, n: int, logprobs: int | None, token_str: Callable[[int], str]) -> None:
        self.n = n
        self.k = logprobs
        self.token_str = token_str

    def logprobs(self, lps: list[dict[int, float]], token_ids: list[int], text_offset: int) -> dict:
        raise NotImplementedError

    def text(self, key: tuple[int, int], c) -> str:
        """The text of choice `key` ((prompt index, choice index)) in its output `c` so far."""
        return c.text

    def choice(self, index: int, text: str, lp: dict | None, reason: str | None,
               stop_reason: int | str | None = None) -> dict:
        """A choice of the non-streamed response; stop_reason: the stop string or token id that ended it."""
        raise NotImplementedError

    def opening(self, prompts: list["Prompt"]) -> list[list[dict]]:
        """The choices of the chunks a stream starts with."""
        return []

    def deltas(self, u: ChoiceUpdate, index: int, lp: dict | None) -> list[list[dict]]:
        """The choices of the chunks an update streams."""
        raise NotImplementedError

    def empty_delta(self, index: int) -> dict:
        """A chunk's choice that says nothing new (it carries an update's token_ids)."""
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    id_prefix, object_name, chunk_object_name = "cmpl", "text_completion", "text_completion"

    def __init__(self, n: int, logprobs: int | None, token_str: Callable[[int], str], *,
                 echo: bool = False, echo_only: bool = False, decode: Callable[[list[int]], str] | None = None) -> None:
        super().__init__(n, logprobs, token_str)
        self.echo, self.echo_only, self.decode = echo, echo_only, decode

    @property
    def echo_with_first_update(self) -> bool:
        """echo, streamed, with logprobs or max_tokens 0: each choice's prompt opens its first update's chunk
        (its logprobs are known once the prompt has run), as vLLM streams it; otherwise it opens the stream."""
        return self.echo and (self.k is not None or self.echo_only)

    def opening(self, prompts):
        """echo, streamed: each choice starts with its prompt's text (vLLM's order: prompt by prompt, n each)."""
        if not self.echo:
            return []
        self._prompts = prompts
        self._prompt_texts = [self.prompt_text(p) for p in prompts]  # (once: a token-id prompt is decoded)
        self._echoed: set[int] = set()
        if self.echo_with_first_update:
            return []
        return [[self.choice(pi * self.n + j, text, None, None)]
                for pi, text in enumerate(self._prompt_texts) for j in range(self.n)]

    def prompt_text(self, prompt: "Prompt") -> str:
        return prompt.text if prompt.text is not None else self.decode(prompt.ids)

    def prompt_lp(self, prompt: "Prompt", rows: list) -> dict:
        """The logprobs of an echoed prompt: its first token has none (null), as in the OpenAI API."""
        lp = self.logprobs([d or {} for d in rows], prompt.ids, 0)
        if prompt.ids:
            lp["token_logprobs"][0] = lp["top_logprobs"][0] = None
        return lp

    def echoed(self, prompt: "Prompt", out, c) -> tuple[str, dict | None, int]:
        """echo: (text, logprobs, completion tokens) of a choice with the prompt before it; the prompt's
        first token has no logprob (null), as in the OpenAI API. echo_only drops the one token run."""
        text = self.prompt_text(prompt)
        completion = [] if self.echo_only else c.token_ids
        if not self.echo_only:
            text += c.text
        if self.k is None:
            return text, None, len(completion)
        lp = self.prompt_lp(prompt, out.prompt_logprobs)
        if completion and c.logprobs is not None:
            offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if prompt.ids else 0
            more = self.logprobs(c.logprobs, completion, offset)
            for key in lp:
                lp[key] = lp[key] + more[key]
        return text, lp, len(completion)

    def logprobs(self, lps, token_ids, text_offset):
        tokens, token_lps, tops, offsets = [], [], [], []
        off = text_offset
        for tid, d in zip(token_ids, lps):
            s = self.token_str(tid)
            tokens.append(s)
            token_lps.append(d.get(tid))
            # the k most likely and, as the OpenAI API promises, always the chosen token (up to k + 1 entries)
            top = sorted(d.items(), key=lambda kv: -kv[1])[:self.k] if self.k else []
            if tid in d and all(t != tid for t, _ in top):
                top = sorted(top + [(tid, d[tid])], key=lambda kv: -kv[1])
            tops.append({self.token_str(t): v for t, v in top})
            offsets.append(off)
            off += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def choice(self, index, text, lp, reason, stop_reason=None):
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason, "stop_reason": stop_reason}

    def empty_delta(self, index: int) -> dict:
        return self.choice(index, "", None, None)

    def deltas(self, u, index, lp):
        delta = u.delta
        if self.echo_with_first_update:
            delta, lp = self._echo_delta(u, index, lp)
        if delta or u.finish_reason is not None or lp is not None:
            return [[self.choice(index, delta, lp, finish_reason(u.finish_reason), u.stop_reason)]]
        return []

    def _echo_delta(self, u, index, lp) -> tuple[str, dict | None]:
        """(text, logprobs) of an update of an echoed choice streamed with its prompt's logprobs: the prompt's
        (text and logprobs) before the first update's; the generated text's offsets after the prompt's text;
        with max_tokens 0 the prompt alone (the one token run is dropped)."""
        prompt, text = self._prompts[u.prompt_index], self._prompt_texts[u.prompt_index]
        shift = len(text)
        if self.echo_only:
            delta, lp = "", None
        else:
            delta = u.delta
            if lp is not None:
                lp = {**lp, "text_offset": [o + shift for o in lp["text_offset"]]}
        if index in self._echoed:
            return delta, lp
        self._echoed.add(index)
        head = self.prompt_lp(prompt, u.prompt_logprobs) if self.k is not None else None
        if head is not None and lp is not None:
            head = {key: head[key] + lp[key] for key in head}
        return text + delta, head if head is not None else lp


class ChatFormat(ResponseFormat):
    """Chat choices: message / delta with the content; with a ReasoningMode (hybrid/server/reasoning.py)
    the thought apart from it, as `reasoning` and `reasoning_content`; with a ToolMode
    (hybrid/server/tool_calls.py) the tool calls read from the content. `markers` (tool_tags.MarkerTokens,
    active): tags to parse are special tokens of the tokenizer, so the text parsed is rebuilt from the
    token ids with them kept. `echo` (vLLM's chat echo): the text the reply's content starts with (the
    last message's, when it is the assistant's: the reply continues it)."""
    id_prefix, object_name, chunk_object_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, n: int, logprobs: int | None, token_str: Callable[[int], str], tools: ToolMode | None = None,
                 markers: MarkerTokens | None = None, reasoning: ReasoningMode | None = None, echo: str = "",
                 token_bytes: Callable[[int], bytes] | None = None) -> None:
        super().__init__(n, logprobs, token_str)
        self.token_bytes = token_bytes  # a logprob's `bytes` (default: its token string's)
        self.echo_text = echo
        self.tools = tools
        self.reasoning = reasoning
        self.markers = markers if markers is not None and markers.ids else None
        self._texts: dict[tuple[int, int], MarkedText] = {}
        self._streams: dict[int, ChoiceStream] = {}
        self._thoughts: dict[int, ReasoningStream] = {}
        self._held_lp: dict[int, list] = {}

    def text(self, key, c):
        if self.markers is None:
            return c.text
        marked = self._texts.get(key)
        if marked is None:
            marked = self._texts[key] = MarkedText(self.markers)
        return marked.text(c.token_ids, c.text, c.stop_reason, c.finish_reason is not None)

    def _entry(self, tid: int, logprob: float | None) -> dict:
        s = self.token_str(tid)
        raw = self.token_bytes(tid) if self.token_bytes is not None else s.encode("utf-8")
        return {"token": s, "logprob": logprob, "bytes": list(raw)}

    def logprobs(self, lps, token_ids, text_offset):
        content = []
        for tid, d in zip(token_ids, lps):
            top = sorted(d.items(), key=lambda kv: -kv[1])[:self.k] if self.k else []
            content.append({**self._entry(tid, d.get(tid)), "top_logprobs": [self._entry(t, v) for t, v in top]})
        return {"content": content}

    def choice(self, index, text, lp, reason, stop_reason=None):
        thought = None
        if self.reasoning is not None:
            thought, text = self.reasoning.split(text)
        if self.tools is None:
            message = {"role": "assistant", "content": text}
        else:
            content, calls = self.tools.read(text or "")
            if self.reasoning is not None and not content:
                content = None  # (as the content of a reply that is all thought)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [c.as_dict() for c in calls]
            reason = self.tools.finish_reason(reason, bool(calls))
        if self.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = thought
        if self.echo_text:
            message["content"] = self.echo_text + (message["content"] or "")
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason,
                "stop_reason": stop_reason}

    def opening(self, prompts):
        return [[{"index": i, "delta": {"role": "assistant", "content": self.echo_text}, "logprobs": None,
                  "finish_reason": None}] for i in range(self.n)]

    def empty_delta(self, index: int) -> dict:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": None}

    def deltas(self, u, index, lp):
        if self.tools is not None or self.reasoning is not None:
            return self._parsed_deltas(u, index, lp)
        chunks = []
        if u.delta or lp is not None:
            chunks.append([{"index": index, "delta": {"content": u.delta}, "logprobs": lp, "finish_reason": None}])
        if u.finish_reason is not None:
            chunks.append([{"index": index, "delta": {}, "logprobs": None,
                            "finish_reason": finish_reason(u.finish_reason), "stop_reason": u.stop_reason}])
        return chunks

    def _parsed_deltas(self, u, index, lp):
        """With reasoning or tools: the text deltas split into reasoning and content (ReasoningStream),
        the content into content and tool-call deltas (ChoiceStream); text that may still be a tag is
        held back until it is known. Logprob rows ride on the next chunk sent, the rest on the
        finishing one."""
        final = u.finish_reason is not None
        pieces = [("content", u.delta)]
        if self.reasoning is not None:
            thought = self._thoughts.get(index)
            if thought is None:
                thought = self._thoughts[index] = self.reasoning.stream()
            pieces = thought.feed(u.delta, final)
        stream = None
        if self.tools is not None:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = self.tools.stream()
        deltas: list[dict] = []
        for kind, text in pieces:
            if kind == "reasoning":
                deltas.append({"reasoning": text, "reasoning_content": text})
            elif stream is not None:
                deltas.extend(stream.update(text, False))
            elif text:
                deltas.append({"content": text})
        if final and stream is not None:
            deltas.extend(stream.update("", True))
        held = self._held_lp.setdefault(index, [])
        if lp is not None:
            held.extend(lp["content"])

        def take_lp():
            if not held:
                return None
            rows = {"content": list(held)}
            held.clear()
            return rows

        chunks = [[{"index": index, "delta": d, "logprobs": take_lp(), "finish_reason": None}] for d in deltas]
        if final:
            reason = finish_reason(u.finish_reason)
            if self.tools is not None:
                reason = self.tools.finish_reason(reason, stream.called)
            chunks.append([{"index": index, "delta": {}, "logprobs": take_lp(), "finish_reason": reason,
                            "stop_reason": u.stop_reason}])
        return chunks


# ---------------------------------------------------------------------------------- the response
_MAX_EVENTS_A_WRITE = 64  # events of outputs that are ready at once, written together (at most)

def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def sse_events(body, updates):
    """A streamed response's SSE body: `body`'s events, an in-band error event if it fails (the
    status line is already sent), then [DONE]; the engine updates closed either way (also when
    the client goes away mid-stream)."""
    try:
        async for event in body:
            yield event
    except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
        yield sse(error_for(e, "stream").body())
    finally:
        await updates.aclose()
    yield "data: [DONE]\n\n"


class AdmittedStream(StreamingResponse):
    """A streamed response that releases its request's admission when it ends, however it ends
    (finished, failed, client gone before or during the stream). It takes the admission over
    from the handler (admission.streaming)."""

    def __init__(self, content, admission, **kw) -> None:
        super().__init__(content, **kw)
        self.admission = admission
        admission.streaming = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.admission.release()


def prompt_logprob_rows(rows: list[dict | None], ids: list[int], k: int,
                        token_str: Callable[[int], str]) -> list[dict | None]:
    """vLLM's prompt_logprobs in JSON: per prompt token (None for the first) {token id: {"logprob",
    "rank", "decoded_token"}} of the token itself and the k most likely."""
    out: list[dict | None] = []
    for tid, d in zip(ids, rows):
        if d is None:
            out.append(None)
            continue
        kept = sorted(((t, v) for t, v in d.items() if t == tid or (v.rank is not None and v.rank <= k)),
                      key=lambda kv: (kv[0] != tid, kv[1].rank or 0))  # (the token itself first, as vLLM's)
        out.append({str(t): {"logprob": max(float(v), -9999.0), "rank": v.rank, "decoded_token": token_str(t)}
                    for t, v in kept})
    return out


async def respond(engine, request, prompts: list[Prompt], fmt: ResponseFormat, *, model: str, stream: bool,
                  include_usage: bool, admission, request_id: str, continuous_usage: bool = False,
                  prompt_tokens_details: bool = False, prompt_logprobs: int | None = None,
                  engine_id: str | None = None, token_ids: bool = False):
    """The response to validated prompts, for either endpoint: the whole JSON body once every
    choice is done (499 if the client went away first), or the stream of SSE chunks (with
    `continuous_usage`, each carries its choice's usage so far, as vLLM's: its prompt's tokens and the
    choice's tokens generated up to it). prompt_tokens_details: the usage says how many prompt tokens the prefix cache gave.
    request_id: the response's id; engine_id: the base of its engine requests' ids (default request_id), unique
    where the response id is the client's own. token_ids (vLLM's return_token_ids): each choice carries its
    `token_ids` (streamed: each chunk the tokens new since the last, a chunk for every engine output) and the
    prompt's `prompt_token_ids` (on each completion choice, its first chunk streamed; on the chat response, its
    first chunk streamed)."""
    created = int(time.time())
    engine_id = engine_id or request_id
    n = fmt.n
    prompt_tokens = sum(len(p.ids) for p in prompts)
    if not stream:
        finals = await collect(engine, request, prompts, engine_id)
        if finals is None:
            return JSONResponse({}, status_code=499)
        choices, completion_tokens = [], 0
        for pi, out in enumerate(finals):
            for c in out.outputs:
                if fmt.echo:
                    text, lp, tokens = fmt.echoed(prompts[pi], out, c)
                    completion_tokens += tokens
                    choices.append(fmt.choice(pi * n + c.index, text, lp, finish_reason(c.finish_reason),
                                              c.stop_reason))
                    continue
                completion_tokens += len(c.token_ids)
                lp = fmt.logprobs(c.logprobs, c.token_ids, 0) if fmt.k is not None and c.logprobs is not None \
                    else None
                choices.append(fmt.choice(pi * n + c.index, fmt.text((pi, c.index), c), lp,
                                          finish_reason(c.finish_reason), c.stop_reason))
        cached_tokens = sum(out.num_cached_tokens for out in finals) if prompt_tokens_details else None
        body = {"id": request_id, "object": fmt.object_name, "created": created, "model": model,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
        if token_ids:
            outputs = {pi * n + c.index: c for pi, out in enumerate(finals) for c in out.outputs}
            for choice in choices:
                if not isinstance(fmt, ChatFormat):
                    choice["prompt_token_ids"] = list(prompts[choice["index"] // n].ids)
                choice["token_ids"] = list(outputs[choice["index"]].token_ids)
            if isinstance(fmt, ChatFormat):
                body["prompt_token_ids"] = list(prompts[0].ids)
        if prompt_logprobs is not None:  # (vLLM's places: on each completion choice, on the chat response)
            rows = [prompt_logprob_rows(out.prompt_logprobs, out.prompt_token_ids, prompt_logprobs, fmt.token_str)
                    for out in finals]
            if isinstance(fmt, ChatFormat):
                body["prompt_logprobs"] = rows[0]
            else:
                for choice in choices:
                    choice["prompt_logprobs"] = rows[choice["index"] // n]
        return JSONResponse(body)

    # Every chunk is {"id", "object", "created", "model", "choices"[, "usage"]}: the fields around the
    # choices are the same in each, so they are serialised once (json.dumps writes a dict's items in
    # order with the same separators, so head + choices + tail is exactly json.dumps of the dict).
    head = "data: " + json.dumps({"id": request_id, "object": fmt.chunk_object_name, "created": created,
                                  "model": model}, ensure_ascii=False)[:-1] + ', "choices": '
    tail = ', "usage": null}\n\n' if include_usage else "}\n\n"

    generated: dict[tuple[int, int], int] = {}  # (prompt, choice) -> its tokens so far (continuous_usage)
    cached: dict[int, int] = {}  # prompt -> its tokens from the prefix cache (prompt_tokens_details)

    def usage_now(completion_tokens: int) -> dict:
        return usage(prompt_tokens, completion_tokens, sum(cached.values()) if prompt_tokens_details else None)

    def chunk(choices: list, usage_: dict | None = None, top: dict | None = None) -> str:
        """One chunk's event; `top`: fields of its own beside the choices (the chat stream's prompt_token_ids)."""
        if usage_ is None and continuous_usage and choices:
            # as vLLM: the usage of the chunk's choice, its prompt's tokens and its own tokens so far
            pi, j = divmod(choices[0]["index"], n)
            usage_ = usage(len(prompts[pi].ids), generated.get((pi, j), 0),
                           cached.get(pi, 0) if prompt_tokens_details else None)
        if usage_ is None and top is None:
            return head + json.dumps(choices, ensure_ascii=False) + tail
        body = {"id": request_id, "object": fmt.chunk_object_name, "created": created, "model": model,
                "choices": choices}
        if usage_ is not None or include_usage:
            body["usage"] = usage_
        return sse({**body, **(top or {})})

    echo_first = isinstance(fmt, CompletionFormat) and fmt.echo_with_first_update
    updates = choice_updates(engine, prompts, engine_id, fmt.k is not None and not (echo_first and fmt.echo_only),
                             fmt.text, cached, token_ids, want_prompt_logprobs=echo_first and fmt.k is not None)
    chat = isinstance(fmt, ChatFormat)
    prompt_ids_sent: set[int] = set()  # (choices whose prompt_token_ids went out; chat: -1, the response's)

    def chat_prompt_ids() -> dict | None:
        """return_token_ids on chat: the stream's prompt_token_ids, on its first chunk only."""
        if not (token_ids and chat) or -1 in prompt_ids_sent:
            return None
        prompt_ids_sent.add(-1)
        return {"prompt_token_ids": list(prompts[0].ids)}

    def with_token_ids(u: ChoiceUpdate, index: int, chunks: list[list[dict]]) -> list[tuple[list[dict], dict | None]]:
        """return_token_ids: the update's new tokens on its first chunk (one with an empty delta if the update
        makes none), the prompt's ids on the first chunk of the choice (completions) or of the stream (chat)."""
        if not token_ids:
            return [(c, None) for c in chunks]
        if not chunks:
            chunks = [[fmt.empty_delta(index)]]
        first = chunks[0][0]
        first["token_ids"] = u.token_ids
        if not chat and index not in prompt_ids_sent:
            prompt_ids_sent.add(index)
            first["prompt_token_ids"] = list(prompts[u.prompt_index].ids)
        top = chat_prompt_ids()
        return [(c, top if i == 0 else None) for i, c in enumerate(chunks)]
    has_update = getattr(engine, "has_update", None)
    rids = [f"{engine_id}-{i}" for i in range(len(prompts))]

    def more_ready() -> bool:  # the next engine output is queued already: generate() returns it without waiting
        return has_update is not None and any(has_update(rid) for rid in rids)

    async def events():
        """The SSE events, one per chunk; the events of the outputs that are ready at once (the loop
        fell behind the engine) are written together, so the cost of a write (the send chain, the
        socket call) is paid once for them; the bytes are the same."""
        completion_tokens = 0
        for choices in fmt.opening(prompts):
            yield chunk(choices, top=chat_prompt_ids())
        parts: list[str] = []
        try:
            async for batch in updates:
                for u in batch:
                    lp = fmt.logprobs(*u.logprobs, u.text_offset) if u.logprobs else None
                    tokens = 0 if echo_first and fmt.echo_only else u.num_tokens  # (max_tokens 0: its token dropped)
                    if u.finish_reason is not None:
                        completion_tokens += tokens
                    generated[u.prompt_index, u.index] = tokens
                    index = u.prompt_index * n + u.index
                    for choices, top in with_token_ids(u, index, fmt.deltas(u, index, lp)):
                        parts.append(chunk(choices, top=top))
                if parts and (len(parts) >= _MAX_EVENTS_A_WRITE or not more_ready()):
                    yield "".join(parts)
                    parts = []
        except Exception:
            if parts:  # what was made before the failure goes out first (then the error event)
                yield "".join(parts)
            raise
        if include_usage:
            parts.append(chunk([], usage_now(completion_tokens)))
        if parts:
            yield "".join(parts)

    return AdmittedStream(sse_events(events(), updates), admission, media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
