"""The two generation endpoints over the AsyncEngine: admission, tokenizing and chat rendering
(off the event loop), the checks that need the model (context length, vocabulary), then the one
response path of hybrid/server/streaming.py.

Every check that can reject a request runs before its response starts, streamed or not.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid

from hybrid.async_engine import AsyncEngine
from hybrid.chat_template import check_chat_template, render_chat
from hybrid.errors import InvalidRequestError
from hybrid.request import truncate_prompt
from hybrid.sampling import SamplingParams
from hybrid.server.api_errors import APIError, bad, engine_dead_error, from_invalid
from hybrid.server.beam import BeamSearchEngine, check_beam_request
from hybrid.server.protocol import (
    ReadFields,
    beam_options,
    cache_salt,
    chat_messages,
    get_bool,
    parse_chat,
    parse_completion,
    template_variables,
)
from hybrid.server.reasoning import THINK_END, THINK_START, ReasoningMode, check_reasoning_parser, prompt_opens_reasoning
from hybrid.server.streaming import ChatFormat, CompletionFormat, Prompt, ResponseFormat, respond
from hybrid.server.tool_calls import ToolMode
from hybrid.server.tool_protocol import chat_tools
from hybrid.server.tool_parsers import check_tool_options
from hybrid.server.tool_tags import MarkerTokens

logger = logging.getLogger(__name__)


MAX_CLIENT_REQUEST_ID = 256  # characters


def client_request_id(request, body: dict) -> str | None:
    """The id a client gives its request, as vLLM takes it: the X-Request-Id header, else the body's request_id
    field; None if neither. It names the response (chatcmpl-<id>) for the client's own tracing."""
    value = request.headers.get("x-request-id") if request is not None else None
    field = "X-Request-Id"
    if value is None:
        value, field = body.get("request_id"), "request_id"
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_CLIENT_REQUEST_ID or not value.isprintable():
        raise bad("request_id", f"{field} must be a non-empty printable string of at most {MAX_CLIENT_REQUEST_ID} "
                                "characters")
    return value


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Tokenize `text`; run it in a worker thread. The `tokenizers` library releases the GIL in
    encode_batch but not in encode, so a long prompt tokenized with encode would stall the event
    loop (and /health) even from a thread: go through encode_batch where we can."""
    inner = getattr(tokenizer, "_tok", None)
    if inner is not None and hasattr(inner, "encode_batch"):
        return inner.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


class Admission:
    """Sequences reserved for one HTTP request from its arrival until its response ends. A context
    manager: released on leaving the handler, unless a streamed response took it over
    (streaming.AdmittedStream), which releases it when the stream ends. release() is idempotent."""
    __slots__ = ("_server", "num_seqs", "streaming")

    def __init__(self, server: "Handlers", num_seqs: int) -> None:
        self._server = server
        self.num_seqs = num_seqs
        self.streaming = False

    def release(self) -> None:
        if self._server is not None:
            self._server.reserved_seqs -= self.num_seqs
            self._server.admitted_requests -= 1
            self._server = None

    def __enter__(self) -> "Admission":
        return self

    def __exit__(self, *exc) -> None:
        if not self.streaming:
            self.release()


class Handlers:
    """/v1/completions, /v1/chat/completions, /v1/responses, /tokenize and /detokenize (build_app
    routes them here; app.state.server)."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, max_model_len: int,
                 max_num_seqs: int, max_queued_requests: int | None, metrics, *,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 exclude_tools_when_tool_choice_none: bool = False, reasoning_parser: str | None = None,
                 chat_template: str | None = None, sampling_defaults: dict | None = None,
                 return_tokens_as_token_ids: bool = False, enable_prompt_tokens_details: bool = False,
                 trust_request_chat_template: bool = False, force_include_usage: bool = False,
                 model_aliases: list[str] | None = None, default_chat_template_kwargs: dict | None = None) -> None:
        self.engine = engine
        # --default-chat-template-kwargs: every chat render's variables, under a request's own chat_template_kwargs
        self.default_template_kwargs = dict(default_chat_template_kwargs or {})
        # logprobs' tokens as "token_id:ID" (vLLM's flag; a request's own field wins): exact for clients that
        # map them back to ids, where a text can stand for several tokens or for none (a byte of a character)
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        # usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache gave (vLLM's flag)
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        # the model's recommended sampling (generation_config.json, LLM.default_sampling) for fields a request omits
        self.sampling_defaults = dict(sampling_defaults or {})
        self.chat_template_override = chat_template  # --chat-template: used instead of the checkpoint's
        # a request's own chat_template: only where the operator allows it (a template decides the whole prompt)
        self.trust_request_chat_template = trust_request_chat_template
        self.force_include_usage = force_include_usage  # every stream ends with its usage (vLLM's flag)
        from hybrid.server.responses import ResponseStore

        self.response_store = ResponseStore()  # /v1/responses kept for previous_response_id (OpenAI's store)
        self.model_names = frozenset(model_aliases or [model_name])  # what requests may name (responses: model_name)
        # tool calling: tool_choice "auto" needs enable_auto_tool_choice and a parser (as vLLM's
        # --enable-auto-tool-choice --tool-call-parser); a named or "required" choice needs neither
        self.tool_parser_cls = check_tool_options(enable_auto_tool_choice, tool_call_parser)
        self.auto_tools = enable_auto_tool_choice
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        # reasoning outputs (--reasoning-parser): the thought split from the answer
        check_reasoning_parser(reasoning_parser)
        self.reasoning_parser = reasoning_parser
        # the tags parsed out of a chat output that this tokenizer may drop when decoding (tool_tags)
        tool_tags = self.tool_parser_cls.tags if self.tool_parser_cls else ()
        think_tags = (THINK_START, THINK_END) if reasoning_parser else ()
        self._markers = {(tools, think): MarkerTokens(tokenizer, (tool_tags if tools else ()) + (think_tags if think else ()))
                         for tools in (False, True) for think in (False, True)}
        # the end of a thought as one token: structured outputs start after it (None: not one token)
        self.think_end_id = tokenizer.token_to_id(THINK_END) if reasoning_parser and tokenizer is not None else None
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.created = int(time.time())
        self._token_str: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        self._warned_fields: set[tuple[str, str]] = set()  # (endpoint, field) ignored fields already logged
        # Admission: sequences (prompts x n) of the requests being served. Checked and reserved in
        # one synchronous step on the event loop when a request arrives, so concurrent requests
        # (streamed ones included, whose engine work starts only with the response) cannot all
        # slip past the limit. None: no limit.
        self.max_admitted_seqs = None if max_queued_requests is None else max_num_seqs + max_queued_requests
        self.max_num_seqs = max_num_seqs
        self.max_queued_requests = max_queued_requests
        self.reserved_seqs = 0
        self.admitted_requests = 0

    # ---------------------------------------------------------------- checks
    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad("model", f"expected a string, got {json.dumps(model)[:100]}")
        if model is not None and model not in self.model_names:
            raise APIError(f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           404, "model", "model_not_found")

    def check_alive(self) -> None:
        if getattr(self.engine, "dead", None) is not None:
            raise engine_dead_error()

    def admit(self, num_seqs: int, param: str) -> Admission:
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
        return Admission(self, num_seqs)

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
            raise from_invalid(e) from None

    async def validate(self, prompts: list[Prompt], param: str, constraint_param: str | None = None) -> None:
        """Everything Engine.add_request would reject later, on the worker, where a streamed
        request has its 200 already: run it now. A grammar that does not compile is blamed on
        `constraint_param` (the field it came from) where given, anything else on `param`.
        A request with an output constraint is checked on a worker thread: compiling its grammar
        may take a second (llguidance releases the GIL), and the event loop serves the others."""
        if any(p.params.structured_outputs is not None for p in prompts):
            await asyncio.to_thread(self._validate, prompts, param, constraint_param)
        else:
            self._validate(prompts, param, constraint_param)

    def _validate(self, prompts: list[Prompt], param: str, constraint_param: str | None) -> None:
        for p in prompts:
            try:  # AsyncEngine.validate: every check of Engine.add_request, the vocabulary's too
                self.engine.validate(p.ids, p.params)
            except InvalidRequestError as e:
                grammar = constraint_param is not None and str(e).startswith("structured outputs")
                raise from_invalid(e, constraint_param if grammar else param) from None
            if p.priority != 0:  # (0 is every policy's default)
                try:
                    self.engine.engine.check_priority(p.priority)
                except InvalidRequestError as e:
                    raise from_invalid(e, "priority") from None
        self.check_alive()

    # ---------------------------------------------------------------- tokens and templates
    def logprob_token_str(self, as_ids: bool | None):
        """How a request's logprobs name a token: its text, or "token_id:ID" (`as_ids`: the request's
        return_tokens_as_token_ids, None: the server's default)."""
        if as_ids if as_ids is not None else self.return_tokens_as_token_ids:
            return lambda tid: f"token_id:{tid}"
        return self.token_str

    def token_str(self, tid: int) -> str:
        s = self._token_str.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid], skip_special_tokens=False) if self.tokenizer is not None else str(tid)
            self._token_str[tid] = s
        return s

    def token_bytes(self, tid: int) -> bytes:
        """A chat logprob's `bytes`: the token's own (hybrid.tokenizer.Tokenizer.token_bytes), which join into the
        text even where a token is part of a UTF-8 character (its text alone is U+FFFD)."""
        b = self._token_bytes.get(tid)
        if b is None:
            b = self._token_bytes[tid] = self.tokenizer.token_bytes(tid)
        return b

    def decode(self, ids: list[int]) -> str:
        """Token ids as text (an echoed token-id prompt); without a tokenizer, the token strings joined."""
        if self.tokenizer is None:
            return "".join(self.token_str(t) for t in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # off the event loop: a long prompt must not stall other requests and /health
        return await asyncio.to_thread(_encode, self.tokenizer, text, add_special_tokens)

    def chat_template(self, body: dict | None = None) -> str:
        """The request's own `chat_template` (with --trust-request-chat-template), else the server's
        --chat-template, else the checkpoint's (hybrid.tokenizer.Tokenizer has picked one from a list)."""
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer, so it cannot chat", 400, "messages", "invalid_value")
        own = body.get("chat_template") if body is not None else None
        if own is not None:
            if not self.trust_request_chat_template:
                raise bad("chat_template", "a request's own chat template is refused unless the server is started "
                                           "with --trust-request-chat-template")
            try:
                check_chat_template(own)
            except ValueError as e:
                raise bad("chat_template", str(e)) from None
            return own
        template = self.chat_template_override or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise APIError("this model has no chat template (tokenizer_config.json has no 'chat_template'); "
                           "use /v1/completions", 400, "messages", "invalid_value")
        return template

    def render(self, template: str, messages: list[dict], add_generation_prompt: bool, tools,
               template_kwargs: dict | None = None, continue_final_message: bool = False) -> str:
        extra = {**self.default_template_kwargs, **(template_kwargs or {})}
        if tools:
            extra["tools"] = tools
        try:
            return render_chat(template, messages, getattr(self.tokenizer, "config", None), add_generation_prompt,
                               extra, continue_final_message)
        except InvalidRequestError as e:  # the template does not compile or refuses the conversation
            raise APIError(str(e), 400, "messages", "invalid_value") from None

    def reasoning_mode(self, prompt_text: str) -> ReasoningMode | None:
        """How a chat output is split into reasoning and content (None: no reasoning parser)."""
        if self.reasoning_parser is None:
            return None
        return ReasoningMode(prompt_opens_reasoning(prompt_text))

    def constrain_after_thought(self, params: SamplingParams, reasoning: ReasoningMode | None) -> SamplingParams:
        """A constrained output (response_format, a forced tool call) of a request that starts inside a
        thought: the constraint starts after the thought's end, so the model thinks freely first and
        its answer matches (as vLLM does with a reasoning parser). Left as it is if `</think>` is not
        one token of this tokenizer."""
        so = params.structured_outputs
        if so is None or reasoning is None or not reasoning.in_reasoning or self.think_end_id is None:
            return params
        return dataclasses.replace(params, structured_outputs=dataclasses.replace(
            so, start_after_token_id=self.think_end_id))

    async def completion_prompts(self, inputs: list, params: SamplingParams,
                                 max_tokens_param: str | None, priority: int = 0) -> list[Prompt]:
        out = []
        for x in inputs:
            if isinstance(x, str):
                if self.tokenizer is None:
                    raise bad("prompt", "this model has no tokenizer: send token ids")
                ids = await self.encode(x, True)
                text = x
            else:
                ids, text = list(x), None
            ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
            self.check_prompt(ids, "prompt")  # right away: before tokenizing the next prompt
            out.append(Prompt(text, ids, self.fit_max_tokens(params, ids, max_tokens_param), priority))
        return out

    def tool_mode(self, req) -> ToolMode | None:
        """How the request's output is read for tool calls (None: plain content). tool_choice "auto"
        (the default with tools) on a server started without auto tool choice is a 400, as vLLM answers."""
        kind = req.tool_choice
        if kind == "none":
            return None
        if kind == "auto":
            if not self.auto_tools:
                raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                               "set on the server (tool_choice is \"auto\" by default when 'tools' are given): send "
                               '"tool_choice": "none", "required" or a named function instead', 400, "tool_choice",
                               "invalid_value")
            return ToolMode("auto", req.tools, self.tool_parser_cls, parallel=req.parallel_tool_calls)
        return ToolMode(kind, req.tools, function=req.tool_name, parallel=req.parallel_tool_calls)

    # ---------------------------------------------------------------- the endpoints
    def _respond(self, request, prompts: list[Prompt], fmt: ResponseFormat, req, admission: Admission,
                 client_id: str | None = None, beam_length_penalty: float | None = None):
        """client_id: the request's own id (vLLM's X-Request-Id header or request_id field), the base of the
        response's id; its engine requests still get ids of their own, so two clients sending the same id
        cannot mix their outputs. beam_length_penalty: set for vLLM's use_beam_search (beam_options), whose
        n beams answer instead of n samples (hybrid/server/beam.py)."""
        unique = uuid.uuid4().hex
        request_id = f"{fmt.id_prefix}-{client_id or unique}"
        engine = self.engine
        if beam_length_penalty is not None:
            check_beam_request(req.params, req.prompt_logprobs)
            engine = BeamSearchEngine(self.engine, self.tokenizer, beam_length_penalty)
        include_usage = req.include_usage or (req.stream and self.force_include_usage)
        return respond(engine, request, prompts, fmt, model=self.model_name, stream=req.stream,
                       include_usage=include_usage, continuous_usage=req.continuous_usage, admission=admission,
                       prompt_tokens_details=self.enable_prompt_tokens_details, prompt_logprobs=req.prompt_logprobs,
                       request_id=request_id, engine_id=f"{request_id}-{unique}" if client_id else None,
                       token_ids=req.return_token_ids)

    def warn_ignored(self, endpoint: str, body: ReadFields) -> None:
        """Log the fields a request sent that its parser never read (once per endpoint and field: a
        client sends the same ones with every request)."""
        new = [k for k in body.ignored() if (endpoint, k) not in self._warned_fields]
        if new:
            self._warned_fields.update((endpoint, k) for k in new)
            logger.warning("%s: these request fields were ignored (not supported here): %s (logged once each)",
                           endpoint, ", ".join(new))

    async def completions(self, request, body: dict):
        body = ReadFields(body)
        self.check_model(body)
        client_id = client_request_id(request, body)
        salt, beam = cache_salt(body), beam_options(body)
        req = parse_completion(body, self.sampling_defaults)
        self.warn_ignored("/v1/completions", body)
        n = req.params.n
        # before the (possibly long) tokenization
        with self.admit(len(req.inputs) * n, "prompt" if len(req.inputs) > 1 else "n") as admission:
            prompts = await self.completion_prompts(req.inputs, req.params, req.max_tokens_param, req.priority)
            prompts = [p._replace(cache_salt=salt) for p in prompts]
            await self.validate(prompts, "prompt", req.constraint_field)
            fmt = CompletionFormat(n, req.logprobs, self.logprob_token_str(req.tokens_as_ids), echo=req.echo,
                                   echo_only=req.echo_only,
                                   decode=self.decode)
            return await self._respond(request, prompts, fmt, req, admission, client_id, beam)

    async def chat_prompt(self, req, tools: ToolMode | None, template: str, input_param: str,
                          max_tokens_param: str | None):
        """A chat request's prompt, rendered with `template` and tokenized off the event loop and checked,
        with how its output is read: (Prompt, ReasoningMode or None, MarkerTokens). tools: tool_mode(req);
        input_param: the field a too-long prompt is blamed on."""
        # tool_choice "none": the tools are still rendered (vLLM's default) unless the server says not to
        shown = None if req.tool_choice == "none" and self.exclude_tools_when_tool_choice_none else req.tools
        text = await asyncio.to_thread(self.render, template, req.messages, req.add_generation_prompt,
                                       shown, req.chat_template_kwargs, req.continue_final_message)
        ids = truncate_prompt(await self.encode(text, req.add_special_tokens), req.params.truncate_prompt_tokens,
                              self.max_model_len)
        self.check_prompt(ids, input_param)
        reasoning = self.reasoning_mode(text)
        params = self.constrain_after_thought(req.params, reasoning)
        prompt = Prompt(text, ids, self.fit_max_tokens(params, ids, max_tokens_param), req.priority)
        # (a named or "required" tool_choice compiles the tools' schemas here)
        tool_schemas = req.tool_choice in ("function", "required")
        await self.validate([prompt], "tools" if tool_schemas else input_param,
                            None if tool_schemas else req.constraint_field)
        markers = self._markers[(tools is not None and tools.kind == "auto", reasoning is not None)]
        return prompt, reasoning, markers

    async def chat(self, request, body: dict):
        body = ReadFields(body)
        self.check_model(body)
        client_id = client_request_id(request, body)
        salt, beam = cache_salt(body), beam_options(body)
        req = parse_chat(body, self.max_model_len, self.sampling_defaults)
        self.warn_ignored("/v1/chat/completions", body)
        tools, template = self.tool_mode(req), self.chat_template(body)  # (their 400s before anything is reserved)
        with self.admit(req.params.n, "n") as admission:  # before rendering and tokenizing
            prompt, reasoning, markers = await self.chat_prompt(req, tools, template, "messages",
                                                                req.max_tokens_param)
            last = req.messages[-1]
            echo = last["content"] if req.echo and last["role"] == "assistant" else ""
            as_ids = req.tokens_as_ids if req.tokens_as_ids is not None else self.return_tokens_as_token_ids
            fmt = ChatFormat(req.params.n, req.logprobs, self.logprob_token_str(req.tokens_as_ids), tools, markers,
                             reasoning, echo=echo,
                             token_bytes=self.token_bytes if self.tokenizer is not None and not as_ids else None)
            return await self._respond(request, [prompt._replace(cache_salt=salt)], fmt, req, admission, client_id,
                                       beam)

    async def responses(self, request, body: dict):
        """/v1/responses: the request read as the chat request it amounts to, answered as Responses
        output items (hybrid/server/responses.py)."""
        from hybrid.server.responses import ResponsesWriter, input_items, parse_responses, respond_responses

        body = ReadFields(body)
        self.check_model(body)
        salt = cache_salt(body)
        # a later turn: the stored conversation before its own input (OpenAI's previous_response_id)
        own = input_items(body)
        conversation, stored = own, 0
        if body.get("previous_response_id") is not None:
            if not isinstance(own, list):
                raise bad("input", "expected a string or a list of input items")
            earlier = self.response_store.conversation(body["previous_response_id"])
            conversation, stored = earlier + own, len(earlier)
            body["input"] = conversation
        try:
            rreq = parse_responses(body, self.max_model_len, self.sampling_defaults)
        except APIError as e:
            raise _blame_stored_item(e, stored) from None
        self.warn_ignored("/v1/responses", body)
        req = rreq.chat
        tools, template = self.tool_mode(req), self.chat_template()
        with self.admit(1, "input") as admission:
            prompt, reasoning, markers = await self.chat_prompt(req, tools, template, "input",
                                                                req.max_tokens_param and "max_output_tokens")
            writer = ResponsesWriter(f"resp_{uuid.uuid4().hex}", self.model_name, rreq, tools, reasoning,
                                     self.think_end_id, markers)
            store = rreq.echo["store"]
            return await respond_responses(self.engine, request, prompt._replace(cache_salt=salt), writer, admission,
                                           req.stream, (lambda r: self.response_store.put(r, conversation))
                                           if store else None)

    # ---------------------------------------------------------------- tokenizer endpoints (vLLM's)
    async def tokenize(self, body: dict) -> dict:
        """/tokenize: a prompt's token ids ({"prompt": text, "add_special_tokens": true}) or a
        conversation's as the chat endpoint renders it ({"messages": [...], "add_generation_prompt",
        "continue_final_message", "chat_template_kwargs", "documents", "tools", "chat_template"});
        "return_token_strs" adds each token's text."""
        self.check_model(body)
        if self.tokenizer is None:
            raise bad("prompt", "this model has no tokenizer")
        with_strs = get_bool(body, "return_token_strs", False)
        if body.get("messages") is not None:
            if body.get("prompt") is not None:
                raise bad("prompt", "send either 'prompt' or 'messages', not both")
            # (the chat endpoint's checks: a conversation /tokenize takes, the chat endpoint takes too)
            messages = chat_messages(body)
            add_gen = get_bool(body, "add_generation_prompt", True)
            continue_final = get_bool(body, "continue_final_message", False)
            if continue_final:
                if add_gen and "add_generation_prompt" in body:
                    raise bad("continue_final_message", "cannot be combined with 'add_generation_prompt': true")
                if messages[-1]["role"] != "assistant":
                    raise bad("continue_final_message", "needs the last message to be the assistant's")
                add_gen = False
            tools = chat_tools(body)
            text = await asyncio.to_thread(self.render, self.chat_template(body), messages, add_gen, tools or None,
                                           template_variables(body), continue_final)
            ids = await self.encode(text, get_bool(body, "add_special_tokens", False))
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad("prompt", "expected a string (or send 'messages')")
            ids = await self.encode(prompt, get_bool(body, "add_special_tokens", True))
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": [self.token_str(t) for t in ids] if with_strs else None}

    async def detokenize(self, body: dict) -> dict:
        """/detokenize: {"tokens": [ids]} -> {"prompt": their text}, special tokens kept (as vLLM's: /tokenize's
        ids of a rendered chat come back as the text rendered)."""
        self.check_model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad("tokens", "expected a list of token ids")
        vocab = getattr(getattr(self.engine, "engine", None), "vocab_size", None)
        out_of_range = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if out_of_range:
            raise bad("tokens", f"token id {out_of_range[0]} is not in the vocabulary"
                                + (f" (ids 0 .. {vocab - 1})" if vocab is not None else ""))
        if self.tokenizer is None:
            raise bad("tokens", "this model has no tokenizer")
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, ids, False)}


def _blame_stored_item(e: APIError, stored: int) -> APIError:
    """A /v1/responses error about input item k, where the first `stored` items are previous_response_id's
    stored conversation: one about a stored item names previous_response_id (the client never sent that
    item), the others their index in the client's own input."""
    m = re.match(r"input\[(\d+)\](.*)", e.param or "") if stored else None
    if m is None:
        return e
    k, rest = int(m.group(1)), m.group(2)
    if k >= stored:
        own = f"input[{k - stored}]{rest}"
        return APIError(e.message.replace(f"'{e.param}'", f"'{own}'"), e.status, own, e.code, e.type)
    why = e.message.removeprefix(f"'{e.param}': ")
    return APIError(f"'previous_response_id': item {k} of its stored conversation"
                    f"{f' ({rest[1:]})' if rest.startswith('.') else ''}: {why}", e.status, "previous_response_id",
                    e.code, e.type)
