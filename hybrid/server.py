"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over the AsyncEngine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as
server-sent events, one token delta per event), GET /v1/models, GET /health, GET /metrics
(Prometheus text format).

    app = build_app(LLM("path/to/checkpoint"))        # or: hybrid serve --model path/to/checkpoint
    uvicorn.run(app, host="127.0.0.1", port=8000)

Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}: 400 for bad requests
(invalid fields, a prompt or max_tokens beyond the context, a request larger than the server
can ever admit), 401 without the API key (--api-key), 403 for a browser request from an origin
not in --allowed-origins, 404 for an unknown model, 413 for a body over --max-request-bytes, 415
for a body that is not application/json, 429 when the admitted sequences would exceed
max_num_seqs + --max-queued-requests, 500 (a generic message; details go to the log).

Every check that can reject a request runs before its response starts, streamed or not: a
stream that got its 200 fails in-band only for errors during generation.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import re
import time
import uuid
from typing import NamedTuple

from fastapi import Request  # noqa: F401 - module level: FastAPI resolves the endpoints' annotations here
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response, StreamingResponse

from hybrid.async_engine import AsyncEngine, EngineDeadError, TextDeltas
from hybrid.errors import HybridError, InvalidRequestError, NonFiniteLogitsError, RequestFailedError
from hybrid.sampling import SamplingParams

logger = logging.getLogger("hybrid.server")

DEFAULT_MAX_QUEUED_REQUESTS = 256
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TOP_LOGPROBS = 20
MAX_N = 128
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")  # OpenAI's
_PARSE_IN_THREAD_BYTES = 256 * 1024  # larger bodies are parsed off the event loop
GENERIC_500 = "The server had an error while processing your request."


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


def _internal_error(where: str, e: BaseException) -> APIError:
    """A 500 that says nothing about the internals; the traceback goes to the log under `ref`."""
    ref = uuid.uuid4().hex[:12]
    logger.error("%s failed (error id %s)", where, ref, exc_info=(type(e), e, e.__traceback__))
    return APIError(f"{GENERIC_500} (error id {ref})", 500, None, None, type="server_error")


def _engine_dead_error() -> APIError:
    return APIError("The engine stopped after an unrecoverable error; see /health and the server log.", 503, None,
                    "engine_dead", type="server_error")


def _request_failed_error(e: RequestFailedError, where: str) -> APIError:
    """A request that failed inside the engine (the engine and the other requests carried on).
    The engine's reason starts with the error's class name; only the non-finite logits case is
    told to the client (it is about the model, not the code); any other cause stays in the log."""
    ref = uuid.uuid4().hex[:12]
    logger.error("%s: %s (error id %s)", where, e, ref)
    reasons = [str(r) for r in e.failed.values()]
    if reasons and all(r.startswith(NonFiniteLogitsError.__name__) for r in reasons):
        why = "the model produced non-finite logits (NaN or Inf) for it"
    else:
        why = "an error in its engine step"
    return APIError(f"The request failed inside the engine ({why}); other requests are unaffected. "
                    f"(error id {ref})", 500, None, "request_failed", type="server_error")


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
            n=_int(body, "n", 1, lo=1, hi=MAX_N),
            max_tokens=max_tokens,
            temperature=_num(body, "temperature", 1.0, lo=0.0),
            top_p=_num(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
            top_k=top_k,
            seed=_int(body, "seed", None),  # any int: the engine reduces it into the generator's range
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


def _lone_surrogate_path(obj) -> str | None:
    """The JSON path of the first string (or key) holding a lone UTF-16 surrogate, or None.
    json.loads turns "\\ud800" into such a string; it is not Unicode text, the tokenizer cannot
    take it, so the request is rejected (never silently altered)."""
    stack: list[tuple[object, str]] = [(obj, "")]
    while stack:
        x, path = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(x, dict):
            for k, v in x.items():
                sub = f"{path}.{k}" if path else str(k)
                stack.append((k, path or "body"))
                stack.append((v, sub))
        elif isinstance(x, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(x) if isinstance(v, (str, dict, list)))
    return None


def _parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", 400, None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", 400, None, "invalid_json")
    bad = _lone_surrogate_path(body)
    if bad is not None:
        raise APIError(f"'{bad}': contains a lone UTF-16 surrogate, which is not valid Unicode text",
                       400, bad, "invalid_value")
    return body


def _prompt_inputs(body: dict) -> list[str | list[int]]:
    """The completion prompts as sent (strings or token-id lists), shape-checked, not tokenized."""
    p = body.get("prompt")
    if p is None:
        raise _bad("prompt", "is required")

    def is_ids(x) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(p, str):
        prompts: list = [p]
    elif is_ids(p):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(is_ids(x) for x in p):
        prompts = list(p)
    else:
        raise _bad("prompt", "expected a string, a list of strings, a list of token ids or a list of lists of them")
    if any(isinstance(x, str) and not x for x in prompts):
        raise _bad("prompt", "empty prompt: at least one token is needed")
    return prompts


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
        if m["role"] not in CHAT_ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}; got {json.dumps(m['role'])}")
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


def _chat_template(tokenizer) -> str:
    if tokenizer is None:
        raise APIError("this model has no tokenizer, so it cannot chat", 400, "messages", "invalid_value")
    template = tokenizer.chat_template
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if not template:
        raise APIError("this model has no chat template (tokenizer_config.json has no 'chat_template'); "
                       "use /v1/completions", 400, "messages", "invalid_value")
    return template


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Tokenize `text`; run it in a worker thread. The `tokenizers` library releases the GIL in
    encode_batch but not in encode, so a long prompt tokenized with encode would stall the event
    loop (and /health) even from a thread: go through encode_batch where we can."""
    inner = getattr(tokenizer, "_tok", None)
    if inner is not None and hasattr(inner, "encode_batch"):
        return inner.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


# ---------------------------------------------------------------------------------- admission
class _Admission:
    """Sequences reserved for one HTTP request from its arrival until its response ends.
    release() is idempotent: the handler and the streamed response may both call it."""
    __slots__ = ("_server", "num_seqs")

    def __init__(self, server: "_Server", num_seqs: int) -> None:
        self._server = server
        self.num_seqs = num_seqs

    def release(self) -> None:
        if self._server is not None:
            self._server.reserved_seqs -= self.num_seqs
            self._server.admitted_requests -= 1
            self._server = None


class _AdmittedStream(StreamingResponse):
    """A streamed response that releases its request's admission when it ends, however it ends
    (finished, failed, client gone before or during the stream)."""

    def __init__(self, content, admission: _Admission, **kw) -> None:
        super().__init__(content, **kw)
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.admission.release()


class _Prompt(NamedTuple):
    text: str | None  # None: sent as token ids
    ids: list[int]
    params: SamplingParams  # per prompt: a default max_tokens is fitted to each prompt's room


# ---------------------------------------------------------------------------------- the app
class _Server:
    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, max_model_len: int,
                 max_num_seqs: int, max_queued_requests: int | None, metrics) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.created = int(time.time())
        self._token_str: dict[int, str] = {}
        # Admission: sequences (prompts x n) of the requests being served. Checked and reserved in
        # one synchronous step on the event loop when a request arrives, so concurrent requests
        # (streamed ones included, whose engine work starts only with the response) cannot all
        # slip past the limit. None: no limit.
        self.max_admitted_seqs = None if max_queued_requests is None else max_num_seqs + max_queued_requests
        self.max_num_seqs = max_num_seqs
        self.max_queued_requests = max_queued_requests
        self.reserved_seqs = 0
        self.admitted_requests = 0

    # ---------------------------------------------------------------- helpers
    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           404, "model", "model_not_found")

    def check_alive(self) -> None:
        if getattr(self.engine, "dead", None) is not None:
            raise _engine_dead_error()

    def admit(self, num_seqs: int, param: str) -> _Admission:
        """Reserve `num_seqs` sequences now, or raise: 400 if the request can never be admitted,
        429 if it cannot be admitted now. No await in here: check and reservation are atomic."""
        limit = self.max_admitted_seqs
        if limit is not None:
            if num_seqs > limit:
                raise APIError(
                    f"this request needs {num_seqs} sequences (prompts x n), more than this server ever admits "
                    f"at once ({limit}: max_num_seqs {self.max_num_seqs} + max_queued_requests "
                    f"{self.max_queued_requests}); send fewer prompts or a smaller n", 400, param, "request_too_large")
            if self.reserved_seqs + num_seqs > limit:
                raise APIError(
                    f"the server is overloaded: {self.reserved_seqs} sequences admitted, {num_seqs} more requested, "
                    f"at most {limit} ({self.max_num_seqs} running, {self.max_queued_requests} queued); retry later",
                    429, None, "queue_full", type="rate_limit_error")
        self.reserved_seqs += num_seqs
        self.admitted_requests += 1
        return _Admission(self, num_seqs)

    def token_str(self, tid: int) -> str:
        s = self._token_str.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid], skip_special_tokens=False) if self.tokenizer is not None else str(tid)
            self._token_str[tid] = s
        return s

    def check_prompt(self, ids: list[int], param: str) -> None:
        """Reject a prompt too long for the context as soon as its length is known (right after
        tokenizing it, before anything else is done with it); the rest is checked in validate()."""
        if len(ids) >= self.max_model_len:
            raise APIError(f"prompt of {len(ids)} tokens is longer than the context: max_model_len is "
                           f"{self.max_model_len} and at least one token must be generated", 400, param,
                           "context_length_exceeded")

    def fit_max_tokens(self, params: SamplingParams, ids: list[int], param: str | None) -> SamplingParams:
        """prompt + max_tokens must fit in the context. An explicit max_tokens (param names it) that
        does not fit is a 400, as vLLM answers; a default one is shortened to the room left."""
        room = self.max_model_len - len(ids)
        if params.max_tokens <= room:
            return params
        if param is not None:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} in the "
                f"completion). Please reduce the length of the prompt or of '{param}'.", 400, param,
                "context_length_exceeded")
        try:
            return dataclasses.replace(params, max_tokens=room)
        except InvalidRequestError as e:  # e.g. min_tokens > the room left
            raise _from_invalid(e) from None

    def validate(self, prompts: list[_Prompt], param: str) -> None:
        """Everything Engine.add_request would reject later, on the worker, where a streamed
        request has its 200 already: run it now."""
        for p in prompts:
            try:  # AsyncEngine.validate: every check of Engine.add_request, the vocabulary's too
                self.engine.validate(p.ids, p.params)
            except InvalidRequestError as e:
                raise _from_invalid(e, param) from None
        self.check_alive()

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # off the event loop: a long prompt must not stall other requests and /health
        return await asyncio.to_thread(_encode, self.tokenizer, text, add_special_tokens)

    async def completion_prompts(self, inputs: list, params: SamplingParams,
                                 explicit_max_tokens: bool) -> list[_Prompt]:
        out = []
        for x in inputs:
            if isinstance(x, str):
                if self.tokenizer is None:
                    raise _bad("prompt", "this model has no tokenizer: send token ids")
                ids = await self.encode(x, True)
                text = x
            else:
                ids, text = list(x), None
            self.check_prompt(ids, "prompt")  # right away: before tokenizing the next prompt
            fitted = self.fit_max_tokens(params, ids, "max_tokens" if explicit_max_tokens else None)
            out.append(_Prompt(text, ids, fitted))
        return out

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
    async def _pump(self, idx: int, prompt: _Prompt, rid: str, q: asyncio.Queue) -> None:
        try:
            async for out in self.engine.generate(prompt.ids, prompt.params, request_id=rid, prompt=prompt.text):
                q.put_nowait((idx, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            q.put_nowait((idx, e))
            return
        q.put_nowait((idx, None))

    async def run(self, prompts: list[_Prompt], base_id: str):
        """Yield (prompt index, RequestOutput) for every update of every prompt's request."""
        q: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, p, f"{base_id}-{i}", q)) for i, p in enumerate(prompts)]
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

    async def choice_updates(self, prompts: list[_Prompt], base_id: str, want_logprobs: bool):
        """Stream updates per choice, shared by completions and chat: yields _ChoiceUpdate with the
        text delta (stop strings and partial characters held back), the logprob rows whose text
        is now sent, and the finish reason once the choice ends."""
        states: dict[tuple[int, int], _ChoiceState] = {}
        agen = self.run(prompts, base_id)
        try:
            async for pi, out in agen:
                for c in out.outputs:
                    st = states.get((pi, c.index))
                    if st is None:
                        st = states[(pi, c.index)] = _ChoiceState(prompts[pi].params.stop)
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

    async def collect(self, request, prompts: list[_Prompt], base_id: str) -> list | None:
        """Run to completion; abort everything if the client disconnects first (None)."""
        finals: list = [None] * len(prompts)

        async def consume():
            agen = self.run(prompts, base_id)
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

    def stream(self, events, admission: _Admission) -> _AdmittedStream:
        return _AdmittedStream(events, admission, media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---------------------------------------------------------------- completions
    async def completions(self, request, body: dict):
        self.check_model(body)
        if _bool(body, "echo", False):
            raise _bad("echo", "is not supported")
        if body.get("suffix"):
            raise _bad("suffix", "is not supported")
        stream = _bool(body, "stream", False)
        include_usage = _include_usage(body, stream)
        inputs = _prompt_inputs(body)
        k = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        max_tokens = _int(body, "max_tokens", None, lo=1)
        params = _sampling_params(body, max_tokens=max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, logprobs=k)
        best_of = _int(body, "best_of", None, lo=1)
        if best_of is not None and best_of != params.n:
            raise _bad("best_of", "is not supported (only best_of == n)")
        n = params.n
        # before the (possibly long) tokenization
        admission = self.admit(len(inputs) * n, "prompt" if len(inputs) > 1 else "n")
        try:
            prompts = await self.completion_prompts(inputs, params, max_tokens is not None)
            self.validate(prompts, "prompt")
            cid = f"cmpl-{uuid.uuid4().hex}"
            created = int(time.time())
            prompt_tokens = sum(len(p.ids) for p in prompts)

            if not stream:
                finals = await self.collect(request, prompts, cid)
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
                return JSONResponse({
                    "id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": choices,
                    "usage": _usage(prompt_tokens, completion_tokens),
                })

            chunk = _chunker("text_completion", cid, created, self.model_name, include_usage)

            updates = self.choice_updates(prompts, cid, k is not None)

            async def events():
                completion_tokens = 0
                async for u in updates:
                    lp = self.completion_logprobs(*u.logprobs, k, u.text_offset) if u.logprobs else None
                    if u.finish_reason is not None:
                        completion_tokens += u.num_tokens
                    if u.delta or u.finish_reason is not None or lp is not None:
                        yield chunk([{"index": u.prompt_index * n + u.index, "text": u.delta, "logprobs": lp,
                                      "finish_reason": _finish_reason(u.finish_reason)}])
                if include_usage:
                    yield chunk([], _usage(prompt_tokens, completion_tokens))

            response, admission = self.stream(_sse_events(events(), updates), admission), None  # it releases it
            return response
        finally:
            if admission is not None:
                admission.release()

    # ---------------------------------------------------------------- chat completions
    async def chat(self, request, body: dict):
        self.check_model(body)
        stream = _bool(body, "stream", False)
        include_usage = _include_usage(body, stream)
        messages = _messages(body)
        template = _chat_template(self.tokenizer)
        add_gen = _bool(body, "add_generation_prompt", True)
        tools = body.get("tools")
        want_lp = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        if top is not None and not want_lp:
            raise _bad("top_logprobs", "needs 'logprobs': true")
        k = (top or 0) if want_lp else None
        max_tokens, max_tokens_param = _int(body, "max_completion_tokens", None, lo=1), "max_completion_tokens"
        if max_tokens is None:
            max_tokens, max_tokens_param = _int(body, "max_tokens", None, lo=1), "max_tokens"
        if max_tokens is None:
            max_tokens_param = None  # default: the rest of the context
        params = _sampling_params(body, max_tokens=max_tokens or self.max_model_len, logprobs=k)
        admission = self.admit(params.n, "n")  # before rendering and tokenizing
        try:
            # off the event loop: rendering and tokenizing a long conversation takes a while
            text = await asyncio.to_thread(_render_chat, template, messages, self.tokenizer, add_gen,
                                           {"tools": tools} if tools else None)
            ids = await self.encode(text, False)
            self.check_prompt(ids, "messages")
            prompts = [_Prompt(text, ids, self.fit_max_tokens(params, ids, max_tokens_param))]
            self.validate(prompts, "messages")
            cid = f"chatcmpl-{uuid.uuid4().hex}"
            created = int(time.time())

            if not stream:
                finals = await self.collect(request, prompts, cid)
                if finals is None:
                    return JSONResponse({}, status_code=499)
                out = finals[0]
                choices, completion_tokens = [], 0
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    lp = (self.chat_logprobs(c.logprobs, c.token_ids, k)
                          if (k is not None and c.logprobs is not None) else None)
                    choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                    "logprobs": lp, "finish_reason": _finish_reason(c.finish_reason)})
                return JSONResponse({
                    "id": cid, "object": "chat.completion", "created": created, "model": self.model_name,
                    "choices": choices,
                    "usage": _usage(len(ids), completion_tokens),
                })

            chunk = _chunker("chat.completion.chunk", cid, created, self.model_name, include_usage)

            updates = self.choice_updates(prompts, cid, k is not None)

            async def events():
                completion_tokens = 0
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

            response, admission = self.stream(_sse_events(events(), updates), admission), None  # it releases it
            return response
        finally:
            if admission is not None:
                admission.release()


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


async def _sse_events(body, updates):
    """A streamed response's SSE body, for both endpoints: `body`'s events, an in-band error event if
    it fails (the status line is already sent), then [DONE]; the engine updates closed either way
    (also when the client goes away mid-stream)."""
    try:
        async for event in body:
            yield event
    except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
        yield _sse(_stream_error(e))
    finally:
        await updates.aclose()
    yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error_for(e: BaseException, where: str) -> APIError:
    """The APIError a client sees for `e`: our own errors as they are, the engine's deliberate
    errors (HybridError: written for users) with their message, anything else generic."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return _from_invalid(e)
    if isinstance(e, EngineDeadError):  # its message carries the failed step's repr: log it only
        logger.error("%s: %s", where, e)
        return _engine_dead_error()
    if isinstance(e, RequestFailedError):
        return _request_failed_error(e, where)
    if isinstance(e, HybridError):
        logger.error("%s: %s", where, e)
        return APIError(str(e), 500, None, None, type="server_error")
    return _internal_error(where, e)


def _stream_error(e: BaseException) -> dict:
    return _error_for(e, "stream").body()


async def _wait_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _unwrap(llm_or_engine):
    """(AsyncEngine or None, Engine, tokenizer, model_dir) from an LLM, an Engine or an AsyncEngine."""
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


# ---------------------------------------------------------------------------------- origin and key
def _with_headers(send, extra: dict[str, str]):
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]

    async def wrapped(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *raw]}
        await send(message)

    return wrapped


class _Guard:
    """ASGI middleware in front of every route (pure ASGI, so streams pass through untouched).

    Cross-origin: a browser request carries an Origin header; one from an origin not in
    `allowed_origins` is refused (403), so no web page can drive the server, and allowed ones get
    CORS headers (preflights answered here). Clients outside a browser send no Origin.
    API key: with `api_key` set, every /v1 route needs `Authorization: Bearer <key>` (401
    otherwise); /health and /metrics stay open."""

    def __init__(self, app, *, api_key: str | None, allowed_origins: list[str] | None, metrics) -> None:
        self.app = app
        self.api_key = api_key.encode("utf-8") if api_key else None
        origins = [o.strip().rstrip("/").lower() for o in (allowed_origins or []) if o.strip()]
        self.any_origin = "*" in origins
        self.allowed_origins = frozenset(origins)
        self.metrics = metrics

    def origin_allowed(self, origin: str) -> bool:
        return self.any_origin or origin.rstrip("/").lower() in self.allowed_origins

    def authorized(self, header: str | None) -> bool:
        if not header:
            return False
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode("utf-8"), self.api_key)

    async def reject(self, scope, receive, send, e: APIError, headers: dict[str, str]) -> None:
        self.metrics.on_reject(e.status)
        await JSONResponse(e.body(), status_code=e.status, headers=headers)(scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        cors: dict[str, str] = {}
        origin = headers.get("origin")
        if origin is not None:
            if not self.origin_allowed(origin):
                await self.reject(scope, receive, send, APIError(
                    f"cross-origin requests from {origin!r} are not allowed (see --allowed-origins)", 403, None,
                    "origin_not_allowed", type="permission_error"), {"Vary": "Origin"})
                return
            cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                # a preflight: answered here, without the key (browsers never send it on one)
                await Response(status_code=204, headers={
                    **cors, "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": headers.get("access-control-request-headers")
                    or "Authorization, Content-Type",
                    "Access-Control-Max-Age": "600"})(scope, receive, send)
                return
        path = scope["path"]
        if self.api_key is not None and (path == "/v1" or path.startswith("/v1/")):
            if not self.authorized(headers.get("authorization")):
                await self.reject(scope, receive, send, APIError(
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", 401, None,
                    "invalid_api_key"), {**cors, "WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, _with_headers(send, cors) if cors else send)


async def _read_json(request, max_bytes: int) -> dict:
    """The request's JSON object: application/json only (a cross-site form or text/plain POST is
    refused), at most max_bytes read (413 past it, before reading more), parsed off the event
    loop when large."""
    ctype = request.headers.get("content-type")
    if (ctype or "").split(";")[0].strip().lower() != "application/json":
        raise APIError(f"the request body must be 'application/json', got {ctype!r}", 415, None,
                       "unsupported_media_type")
    too_large = APIError(f"the request body is larger than the limit of {max_bytes} bytes (--max-request-bytes)",
                         413, None, "request_too_large")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError("invalid Content-Length header", 400, None, "invalid_request")
        if int(length) > max_bytes:
            raise too_large
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if len(raw) > _PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(_parse_body, raw)
    return _parse_body(raw)


# ---------------------------------------------------------------------------------- the app factory
def build_app(llm_or_engine, served_model_name: str | None = None,
              max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS, *,
              api_key: str | None = None, allowed_origins: list[str] | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
    """A FastAPI app serving `llm_or_engine` (an LLM, an Engine or an AsyncEngine).

    The engine worker thread starts with the app (lifespan) and stops with it.
    max_queued_requests: how many sequences may wait beyond the engine's max_num_seqs running
    ones before new requests get 429 (None: no limit). api_key: required as a Bearer token on
    /v1/* (None: open). allowed_origins: origins whose browser requests are served ("*": any;
    default none). max_request_bytes: the largest request body accepted (413 past it)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from hybrid.metrics import ServerMetrics

    if max_request_bytes < 1:
        raise ValueError("max_request_bytes must be >= 1")
    async_engine, engine, tokenizer, model_dir = _unwrap(llm_or_engine)
    name = served_model_name or default_model_name(model_dir)
    metrics = ServerMetrics(name)
    if async_engine is None:
        async_engine = AsyncEngine(engine, tokenizer, max_queued_requests=max_queued_requests, metrics=metrics)
    else:
        async_engine.metrics = metrics
        async_engine.max_queued_requests = max_queued_requests
    srv = _Server(async_engine, tokenizer, name, engine.max_model_len, engine.max_num_seqs,
                  max_queued_requests, metrics)
    metrics.bind(async_engine, admitted_requests=lambda: srv.admitted_requests,
                 admitted_seqs=lambda: srv.reserved_seqs)

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
    app.state.server = srv
    app.add_middleware(_Guard, api_key=api_key, allowed_origins=allowed_origins, metrics=metrics)

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

    @app.exception_handler(HybridError)
    async def _hybrid(request: Request, e: HybridError):  # EngineDeadError, a failed request, ...
        return error_response(_error_for(e, f"{request.method} {request.url.path}"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return error_response(_internal_error(f"{request.method} {request.url.path}", e))

    @app.get("/health")
    async def health():
        dead = async_engine.dead
        if dead is not None:
            # EngineDeadError's message is the engine's own account ("... unrecoverable device error:
            # ..."): say what is known; anything else only by its kind (details in the log)
            why = str(dead) if isinstance(dead, EngineDeadError) else \
                f"the engine stopped ({type(dead).__name__}); see the server log"
            return JSONResponse({"status": "error", "error": why}, status_code=503)
        return {"status": "ok"}

    def model_card() -> dict:
        # root: the served name, never the checkpoint's path on this machine
        return {"id": name, "object": "model", "created": srv.created, "owned_by": "hybrid", "root": name,
                "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != name:
            raise APIError(f"The model '{model_id}' does not exist; this server serves '{name}'.", 404, "model",
                           "model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await srv.completions(request, await _read_json(request, max_request_bytes))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await srv.chat(request, await _read_json(request, max_request_bytes))

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
                   help="sequences allowed to wait beyond --max-num-seqs running ones; more get 429 "
                        f"(default {DEFAULT_MAX_QUEUED_REQUESTS}; -1: no limit)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: env HYBRID_API_KEY; unset: open)")
    p.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGINS",
                   help="comma-separated origins (e.g. http://localhost:3000) whose browser requests are served, "
                        "'*' for any; repeatable (default: none, cross-origin browser requests get 403)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body accepted; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_serve)
    return p


def serve_options(args: argparse.Namespace, environ=os.environ) -> dict:
    """build_app's keyword arguments from `hybrid serve`'s flags (and HYBRID_API_KEY)."""
    limit = args.max_queued_requests
    if limit is not None and limit < 0:
        limit = None
    origins = [o for flag in (args.allowed_origins or []) for o in flag.split(",") if o.strip()]
    if args.max_request_bytes < 1:
        raise ValueError("--max-request-bytes must be >= 1")
    return {"max_queued_requests": limit, "api_key": args.api_key or environ.get("HYBRID_API_KEY") or None,
            "allowed_origins": origins, "max_request_bytes": args.max_request_bytes}


def _serve(args: argparse.Namespace) -> int:
    import sys

    import uvicorn

    from hybrid import LLM
    from hybrid.cli import engine_kwargs

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = serve_options(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        llm = LLM(**engine_kwargs(args))
    except HybridError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or default_model_name(llm.model_dir)
    app = build_app(llm, served_model_name=name, **options)
    logger.info("serving '%s' on http://%s:%d/v1%s", name, args.host, args.port,
                " (API key required)" if options["api_key"] else "")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
