"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over the AsyncEngine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as
server-sent events, one token delta per event), GET /v1/models, GET /health, GET /metrics
(Prometheus text format).

    app = build_app(LLM("path/to/checkpoint"))        # or: hybrid serve --model path/to/checkpoint
    uvicorn.run(app, host="127.0.0.1", port=8000)

Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}} with status 400 for bad
requests (invalid fields, a prompt longer than the context, an unknown model), 429 when more than
--max-queued-requests requests wait beyond the engine's max_num_seqs running ones.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import time
import uuid
from typing import NamedTuple

from fastapi import Request  # noqa: F401 - module level: FastAPI resolves the endpoints' annotations here

from hybrid.async_engine import AsyncEngine, EngineDeadError, QueueFullError, TextDeltas
from hybrid.errors import InvalidRequestError
from hybrid.sampling import SamplingParams

logger = logging.getLogger("hybrid.server")

DEFAULT_MAX_QUEUED_REQUESTS = 256
MAX_TOP_LOGPROBS = 20


# ---------------------------------------------------------------------------------- errors
class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_PARAM_RE = re.compile(r"invalid sampling parameter (\w+)=")


def _from_invalid(e: InvalidRequestError, default_param: str | None = None) -> APIError:
    msg = str(e)
    m = _PARAM_RE.search(msg)
    return APIError(msg, 400, m.group(1) if m else default_param, "invalid_value")


# ---------------------------------------------------------------------------------- field parsing
def _bad(name: str, why: str) -> APIError:
    return APIError(f"'{name}': {why}", 400, name, "invalid_value")


def _int(body: dict, name: str, default, *, lo: int | None = None, hi: int | None = None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _bad(name, f"expected an integer, got {json.dumps(v)}")
    if lo is not None and v < lo:
        raise _bad(name, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise _bad(name, f"must be <= {hi}, got {v}")
    return v


def _num(body: dict, name: str, default, *, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise _bad(name, f"expected a finite number, got {json.dumps(v)}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise _bad(name, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise _bad(name, f"must be <= {hi}, got {v}")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"expected a boolean, got {json.dumps(v)}")
    return v


def _stop(body: dict) -> list[str] | None:
    v = body.get("stop")
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad("stop", "expected a string or a list of strings")
    v = [s for s in v if s]
    return v or None


def _sampling_params(body: dict, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
    top_k = _int(body, "top_k", -1)
    if top_k == 0:
        top_k = -1
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and (not isinstance(stop_token_ids, list)
                                       or not all(isinstance(t, int) and not isinstance(t, bool)
                                                  for t in stop_token_ids)):
        raise _bad("stop_token_ids", "expected a list of integers")
    logit_bias = body.get("logit_bias")
    if logit_bias is not None:  # OpenAI spells the token ids as strings
        if not isinstance(logit_bias, dict):
            raise _bad("logit_bias", "expected an object mapping token ids to numbers")
        try:
            logit_bias = {int(k): v for k, v in logit_bias.items()}
        except ValueError:
            raise _bad("logit_bias", "keys must be token ids") from None
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in logit_bias.values()):
            raise _bad("logit_bias", "values must be numbers")
    try:
        return SamplingParams(
            n=_int(body, "n", 1, lo=1, hi=128),
            max_tokens=max_tokens,
            temperature=_num(body, "temperature", 1.0, lo=0.0),
            top_p=_num(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
            top_k=top_k,
            seed=_int(body, "seed", None),
            stop=_stop(body),
            stop_token_ids=stop_token_ids,
            ignore_eos=_bool(body, "ignore_eos", False),
            logprobs=logprobs,
            presence_penalty=_num(body, "presence_penalty", 0.0),
            frequency_penalty=_num(body, "frequency_penalty", 0.0),
            repetition_penalty=_num(body, "repetition_penalty", 1.0),
            min_p=_num(body, "min_p", 0.0),
            min_tokens=_int(body, "min_tokens", 0, lo=0),
            logit_bias=logit_bias or None,
        )
    except InvalidRequestError as e:
        raise _from_invalid(e) from None


# ---------------------------------------------------------------------------------- chat template
def _render_chat(template: str, messages: list[dict], tokenizer, add_generation_prompt: bool,
                 extra: dict | None = None) -> str:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    cfg = getattr(tokenizer, "config", {}) or {}

    def special(name):
        t = cfg.get(name)
        return t.get("content") if isinstance(t, dict) else (t or "")

    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=special("bos_token"),
            eos_token=special("eos_token"), **(extra or {}))
    except jinja2.exceptions.TemplateError as e:
        raise APIError(f"the chat template could not be rendered: {e}", 400, "messages", "invalid_value") from None


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "expected a non-empty list of messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "each message needs a string 'role'")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content", "only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "expected a string or a list of text parts")
        out.append({**m, "content": content})
    return out


# ---------------------------------------------------------------------------------- the app
class _Server:
    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, max_model_len: int, metrics) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.created = int(time.time())
        self._token_str: dict[int, str] = {}

    # ---------------------------------------------------------------- helpers
    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           400, "model", "model_not_found")

    def token_str(self, tid: int) -> str:
        s = self._token_str.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid], skip_special_tokens=False) if self.tokenizer is not None else str(tid)
            self._token_str[tid] = s
        return s

    def encode_prompts(self, body: dict) -> list[tuple[str | None, list[int]]]:
        p = body.get("prompt")
        if p is None:
            raise _bad("prompt", "is required")
        if isinstance(p, str):
            prompts: list = [p]
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            prompts = [p]
        elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            prompts = list(p)
        elif isinstance(p, list) and p and all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                           for t in x) for x in p):
            prompts = list(p)
        else:
            raise _bad("prompt", "expected a string, a list of strings, a list of token ids or a list of lists of them")
        out = []
        for x in prompts:
            if isinstance(x, str):
                if self.tokenizer is None:
                    raise _bad("prompt", "this model has no tokenizer: send token ids")
                if not x:
                    raise _bad("prompt", "empty prompt: at least one token is needed")
                out.append((x, self.tokenizer.encode(x)))
            else:
                out.append((None, list(x)))
        return out

    def validate_prompts(self, prompts, params: SamplingParams, param: str) -> None:
        for _, ids in prompts:
            try:
                self.engine.validate(ids, params)
            except InvalidRequestError as e:
                raise _from_invalid(e, param) from None

    def check_capacity(self, num: int) -> None:
        try:
            self.engine.check_capacity(num)
        except QueueFullError as e:
            raise APIError(str(e), 429, None, "queue_full", type="rate_limit_error") from None

    # ---------------------------------------------------------------- logprobs
    def completion_logprobs(self, lps: list[dict[int, float]], token_ids: list[int], k: int, offset0: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        off = offset0
        for tid, d in zip(token_ids, lps):
            s = self.token_str(tid)
            tokens.append(s)
            token_lps.append(d.get(tid))
            top = sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else [(tid, d.get(tid))]
            tops.append({self.token_str(t): v for t, v in top})
            offsets.append(off)
            off += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, lps: list[dict[int, float]], token_ids: list[int], k: int) -> dict:
        content = []
        for tid, d in zip(token_ids, lps):
            s = self.token_str(tid)
            top = sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else []
            content.append({
                "token": s, "logprob": d.get(tid), "bytes": list(s.encode("utf-8")),
                "top_logprobs": [{"token": self.token_str(t), "logprob": v,
                                  "bytes": list(self.token_str(t).encode("utf-8"))} for t, v in top],
            })
        return {"content": content}

    # ---------------------------------------------------------------- running requests
    async def _pump(self, idx: int, prompt, params: SamplingParams, rid: str, q: asyncio.Queue) -> None:
        text, ids = prompt
        try:
            async for out in self.engine.generate(ids, params, request_id=rid, prompt=text):
                q.put_nowait((idx, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            q.put_nowait((idx, e))
            return
        q.put_nowait((idx, None))

    async def run(self, prompts, params: SamplingParams, base_id: str):
        """Yield (prompt index, RequestOutput) for every update of every prompt's request."""
        q: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, p, params, f"{base_id}-{i}", q)) for i, p in enumerate(prompts)]
        remaining = len(tasks)
        try:
            while remaining:
                idx, item = await q.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield idx, item
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            # let the cancelled pumps run their finally (which queues the aborts) before we return
            await asyncio.gather(*tasks, return_exceptions=True)

    async def choice_updates(self, prompts, params: SamplingParams, base_id: str, want_logprobs: bool):
        """Stream updates per choice, shared by completions and chat: yields _ChoiceUpdate with the
        text delta (stop strings and partial characters held back), the logprob rows whose text
        is now sent, and the finish reason once the choice ends."""
        states: dict[tuple[int, int], _ChoiceState] = {}
        agen = self.run(prompts, params, base_id)
        try:
            async for pi, out in agen:
                for c in out.outputs:
                    st = states.get((pi, c.index))
                    if st is None:
                        st = states[(pi, c.index)] = _ChoiceState(params.stop)
                    if st.done:
                        continue
                    finished = c.finish_reason is not None
                    delta = st.deltas.update(c.text, finished)
                    rows = None
                    if want_logprobs and c.logprobs is not None:
                        # logprobs of the tokens whose text is now (fully or partly) sent
                        upto = len(c.token_ids) if (finished or delta) else st.lp_sent
                        if upto > st.lp_sent:
                            rows = (c.logprobs[st.lp_sent:upto], c.token_ids[st.lp_sent:upto])
                            st.lp_sent = upto
                    update = _ChoiceUpdate(pi, c.index, delta, rows, st.text_len,
                                           c.finish_reason if finished else None, len(c.token_ids))
                    st.text_len += len(delta)
                    st.done = finished
                    yield update
        finally:
            await agen.aclose()

    async def collect(self, request, prompts, params: SamplingParams, base_id: str) -> list:
        """Run to completion; abort everything if the client disconnects first."""
        finals: list = [None] * len(prompts)

        async def consume():
            agen = self.run(prompts, params, base_id)
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

    # ---------------------------------------------------------------- completions
    async def completions(self, request, body: dict):
        from fastapi.responses import JSONResponse, StreamingResponse

        self.check_model(body)
        if _bool(body, "echo", False):
            raise _bad("echo", "is not supported")
        if body.get("suffix"):
            raise _bad("suffix", "is not supported")
        stream = _bool(body, "stream", False)
        include_usage = _include_usage(body, stream)
        prompts = self.encode_prompts(body)
        k = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        max_tokens = _int(body, "max_tokens", 16, lo=1)
        params = _sampling_params(body, max_tokens=max_tokens, logprobs=k)
        best_of = _int(body, "best_of", None, lo=1)
        if best_of is not None and best_of != params.n:
            raise _bad("best_of", "is not supported (only best_of == n)")
        self.validate_prompts(prompts, params, "prompt")
        self.check_capacity(len(prompts))
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        n = params.n

        if not stream:
            finals = await self.collect(request, prompts, params, cid)
            if finals is None:
                return JSONResponse({}, status_code=499)
            choices, completion_tokens = [], 0
            for pi, out in enumerate(finals):
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    lp = None
                    if k is not None and c.logprobs is not None:
                        lp = self.completion_logprobs(c.logprobs, c.token_ids, k, 0)
                    choices.append({"index": pi * n + c.index, "text": c.text, "logprobs": lp,
                                    "finish_reason": _finish_reason(c.finish_reason)})
            prompt_tokens = sum(len(ids) for _, ids in prompts)
            return JSONResponse({
                "id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens),
            })

        chunk = _chunker("text_completion", cid, created, self.model_name, include_usage)

        async def events():
            completion_tokens = 0
            updates = self.choice_updates(prompts, params, cid, k is not None)
            try:
                async for u in updates:
                    lp = self.completion_logprobs(*u.logprobs, k, u.text_offset) if u.logprobs else None
                    if u.finish_reason is not None:
                        completion_tokens += u.num_tokens
                    if u.delta or u.finish_reason is not None or lp is not None:
                        yield chunk([{"index": u.prompt_index * n + u.index, "text": u.delta, "logprobs": lp,
                                      "finish_reason": _finish_reason(u.finish_reason)}])
                if include_usage:
                    pt = sum(len(ids) for _, ids in prompts)
                    yield chunk([], _usage(pt, completion_tokens))
            except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
                yield _sse(_stream_error(e))
            finally:
                await updates.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---------------------------------------------------------------- chat completions
    async def chat(self, request, body: dict):
        from fastapi.responses import JSONResponse, StreamingResponse

        self.check_model(body)
        stream = _bool(body, "stream", False)
        include_usage = _include_usage(body, stream)
        messages = _messages(body)
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer, so it cannot chat", 400, "messages", "invalid_value")
        template = self.tokenizer.chat_template
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if not template:
            raise APIError("this model has no chat template (tokenizer_config.json has no 'chat_template'); "
                           "use /v1/completions", 400, "messages", "invalid_value")
        add_gen = _bool(body, "add_generation_prompt", True)
        tools = body.get("tools")
        text = _render_chat(template, messages, self.tokenizer, add_gen,
                            {"tools": tools} if tools else None)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        want_lp = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        if top is not None and not want_lp:
            raise _bad("top_logprobs", "needs 'logprobs': true")
        k = (top or 0) if want_lp else None
        max_tokens = _int(body, "max_completion_tokens", None, lo=1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", None, lo=1)
        if max_tokens is None:
            max_tokens = max(self.max_model_len - len(ids), 1)
        params = _sampling_params(body, max_tokens=max_tokens, logprobs=k)
        prompts = [(text, ids)]
        self.validate_prompts(prompts, params, "messages")
        self.check_capacity(1)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        if not stream:
            finals = await self.collect(request, prompts, params, cid)
            if finals is None:
                return JSONResponse({}, status_code=499)
            out = finals[0]
            choices, completion_tokens = [], 0
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = self.chat_logprobs(c.logprobs, c.token_ids, k) if (k is not None and c.logprobs is not None) else None
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": lp, "finish_reason": _finish_reason(c.finish_reason)})
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices,
                "usage": _usage(len(ids), completion_tokens),
            })

        chunk = _chunker("chat.completion.chunk", cid, created, self.model_name, include_usage)

        async def events():
            completion_tokens = 0
            updates = self.choice_updates(prompts, params, cid, k is not None)
            try:
                for i in range(params.n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                async for u in updates:
                    lp = self.chat_logprobs(*u.logprobs, k) if u.logprobs else None
                    if u.delta or lp is not None:
                        yield chunk([{"index": u.index, "delta": {"content": u.delta}, "logprobs": lp,
                                      "finish_reason": None}])
                    if u.finish_reason is not None:
                        completion_tokens += u.num_tokens
                        yield chunk([{"index": u.index, "delta": {}, "logprobs": None,
                                      "finish_reason": _finish_reason(u.finish_reason)}])
                if include_usage:
                    yield chunk([], _usage(len(ids), completion_tokens))
            except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
                yield _sse(_stream_error(e))
            finally:
                await updates.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _ChoiceUpdate(NamedTuple):
    prompt_index: int
    index: int  # choice index within the prompt's request (0 .. n-1)
    delta: str
    logprobs: tuple[list[dict[int, float]], list[int]] | None  # (logprob rows, their token ids) now sent
    text_offset: int  # characters of this choice sent before `delta`
    finish_reason: str | None
    num_tokens: int


class _ChoiceState:
    __slots__ = ("deltas", "lp_sent", "text_len", "done")

    def __init__(self, stops) -> None:
        self.deltas = TextDeltas(stops)
        self.lp_sent = 0
        self.text_len = 0
        self.done = False


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _chunker(obj: str, cid: str, created: int, model: str, include_usage: bool):
    """chunk(choices, usage=None) -> one server-sent event of a streamed response."""
    def chunk(choices: list, usage: dict | None = None) -> str:
        d = {"id": cid, "object": obj, "created": created, "model": model, "choices": choices}
        if usage is not None or include_usage:
            d["usage"] = usage
        return _sse(d)

    return chunk


def _finish_reason(reason: str | None) -> str | None:
    if reason == "abort":
        return "stop"
    return reason


def _include_usage(body: dict, stream: bool) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise _bad("stream_options", "expected an object")
    if not stream:
        raise _bad("stream_options", "is only allowed with 'stream': true")
    return _bool(so, "include_usage", False)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _stream_error(e: BaseException) -> dict:
    if isinstance(e, APIError):
        return e.body()
    if isinstance(e, InvalidRequestError):
        return _from_invalid(e).body()
    logger.error("stream failed: %r", e)
    return APIError(f"internal error: {e!r}", 500, None, None, type="server_error").body()


async def _wait_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _unwrap(llm_or_engine):
    """(Engine, tokenizer, model_dir) from an LLM, an Engine or an AsyncEngine."""
    if isinstance(llm_or_engine, AsyncEngine):
        eng = llm_or_engine.engine
        return llm_or_engine, eng, llm_or_engine.tokenizer, None
    eng = getattr(llm_or_engine, "engine", None)
    if eng is not None:  # an LLM
        return None, eng, getattr(llm_or_engine, "tokenizer", None), getattr(llm_or_engine, "model_dir", None)
    return None, llm_or_engine, getattr(llm_or_engine, "tokenizer", None), None


def default_model_name(model_dir: str | None) -> str:
    from hybrid.llm import DEFAULT_MODEL_DIR

    if not model_dir or os.path.normpath(os.path.abspath(model_dir)) == os.path.normpath(DEFAULT_MODEL_DIR):
        return "hybrid-default"
    return os.path.basename(os.path.normpath(os.path.abspath(model_dir))) or "hybrid"


def build_app(llm_or_engine, served_model_name: str | None = None,
              max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS):
    """A FastAPI app serving `llm_or_engine` (an LLM, an Engine or an AsyncEngine).

    The engine worker thread starts with the app (lifespan) and stops with it.
    max_queued_requests: how many requests may wait beyond the engine's max_num_seqs running
    ones before new requests get 429 (None: no limit)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from hybrid.metrics import ServerMetrics

    async_engine, engine, tokenizer, model_dir = _unwrap(llm_or_engine)
    name = served_model_name or default_model_name(model_dir)
    metrics = ServerMetrics(name)
    if async_engine is None:
        async_engine = AsyncEngine(engine, tokenizer, max_queued_requests=max_queued_requests, metrics=metrics)
    else:
        async_engine.metrics = metrics
        async_engine.max_queued_requests = max_queued_requests
    metrics.bind(async_engine)
    srv = _Server(async_engine, tokenizer, name, engine.max_model_len, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="hybrid", version="0.1.0", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.engine = engine
    app.state.served_model_name = name
    app.state.metrics = metrics

    def error_response(e: APIError) -> JSONResponse:
        if e.status >= 400:
            metrics.on_reject(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, e: InvalidRequestError):
        return error_response(_from_invalid(e))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return error_response(APIError(str(e), 400, None, "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(APIError(str(e.detail), e.status_code, None, code).body(), status_code=e.status_code)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError):
        return JSONResponse(APIError(str(e), 503, None, "engine_dead", type="server_error").body(), status_code=503)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        logger.exception("request failed")
        return JSONResponse(APIError(f"internal error: {e!r}", 500, None, None, type="server_error").body(),
                            status_code=500)

    async def read_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}", 400, None, "invalid_json") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object", 400, None, "invalid_json")
        return body

    @app.get("/health")
    async def health():
        if async_engine.dead is not None:
            return JSONResponse({"status": "error", "error": repr(async_engine.dead)}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": srv.created, "owned_by": "hybrid",
            "root": model_dir, "max_model_len": engine.max_model_len,
        }]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != name:
            raise APIError(f"The model '{model_id}' does not exist", 404, "model", "model_not_found")
        return {"id": name, "object": "model", "created": srv.created, "owned_by": "hybrid"}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await srv.completions(request, await read_body(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await srv.chat(request, await read_body(request))

    return app


# ---------------------------------------------------------------------------------- CLI
def add_serve_parser(subparsers, add_engine_args) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="model name clients pass (default: the checkpoint directory's name)")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help="requests allowed to wait beyond --max-num-seqs running ones; more get 429 "
                        f"(default {DEFAULT_MAX_QUEUED_REQUESTS}; -1: no limit)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_serve)
    return p


def _serve(args: argparse.Namespace) -> int:
    import sys

    import uvicorn

    from hybrid import LLM
    from hybrid.cli import engine_kwargs
    from hybrid.errors import HybridError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        llm = LLM(**engine_kwargs(args))
    except HybridError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or default_model_name(llm.model_dir)
    limit = None if args.max_queued_requests is not None and args.max_queued_requests < 0 else args.max_queued_requests
    app = build_app(llm, served_model_name=name, max_queued_requests=limit)
    logger.info("serving '%s' on http://%s:%d/v1", name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
