"""OpenAI's Responses API (`POST /v1/responses`), stateless, as vLLM serves it for agents and SDKs
that speak it: the request is read as the chat request it amounts to (one validation path with
/v1/chat/completions: the same template, tools, structured outputs and sampling fields), and the
output comes back as Responses output items, whole or as the API's semantic stream events.

- input: a string (one user message) or a list of items: messages (`{"role", "content"}`, content a
  string or `input_text` / `output_text` parts), `function_call` and `function_call_output` items
  (an earlier call and its result), `reasoning` items (an earlier thought, given to the template
  as the next assistant message's reasoning_content); `instructions` is a system message first.
- tools: `{"type": "function", "name", "description"?, "parameters"?, "strict"?}`; tool_choice
  "auto" / "none" / "required" / `{"type": "function", "name"}`; text.format: "text",
  "json_object" or `{"type": "json_schema", "name", "schema", "strict"}`.
- output items: `reasoning` (with --reasoning-parser), a `message` with one `output_text` part, and
  `function_call` items; status "incomplete" (reason max_output_tokens) when the budget ran out.
Responses are stored (ResponseStore, below): `previous_response_id` continues a stored conversation.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from hybrid.server.api_errors import APIError, bad, error_for
from hybrid.server.protocol import ChatRequest, check_user, get_bool, parse_chat
from hybrid.server.reasoning import ReasoningMode
from hybrid.server.streaming import AdmittedStream, Prompt, choice_updates, collect, finish_reason
from hybrid.server.tool_calls import ToolMode
from hybrid.server.tool_tags import MarkedText, MarkerTokens

# chat fields the Responses fields become (by prefix): a chat error names the Responses field
_RENAMED = (("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
            ("max_tokens", "max_output_tokens"))
# sampling fields passed through as they are (OpenAI's and vLLM's extensions)
_PASSED = ("temperature", "top_p", "seed", "stop", "top_k", "min_p", "min_tokens", "repetition_penalty",
           "presence_penalty", "frequency_penalty", "ignore_eos", "stop_token_ids", "logit_bias",
           "structured_outputs", "chat_template_kwargs", "parallel_tool_calls", "skip_special_tokens",
           "include_stop_str_in_output", "allowed_token_ids", "bad_words", "guided_json", "guided_regex",
           "guided_choice", "guided_grammar", "truncate_prompt_tokens")


def _responses_param(param: str) -> str:
    """The Responses field a chat field came from (messages[i] -> input: items do not map one to one)."""
    if param.startswith("messages"):
        return "input"
    param = param.replace(".function.", ".")  # tools[i].function.name -> tools[i].name (flat tools)
    for chat_name, name in _RENAMED:
        if param.startswith(chat_name):
            return name + param[len(chat_name):]
    return param


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, at: str, field: str = "content") -> str:
    """A Responses message's content (or a function_call_output's `output`) as text: a string, or
    input_text / output_text parts joined; errors name `{at}.{field}`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{at}.{field}", "expected a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise bad(f"{at}.{field}[{j}]", 'only text parts are supported ({"type": "input_text", "text": ...})')
        texts.append(part["text"])
    return "".join(texts)


def input_messages(body: dict) -> list[dict]:
    """The chat messages of `instructions` and `input`."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "expected a string")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input", "expected a string or a non-empty list of input items")
    thought = None  # a reasoning item: the thought of the assistant message after it
    calls_made: set[str] = set()  # the call_ids of the function_call items so far
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(at, "expected an input item (an object)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{at}.role", f'must be "user", "system", "developer" or "assistant"; got {json.dumps(role)}')
            message = {"role": role, "content": _text_of(item.get("content"), at)}
            if role == "assistant" and thought is not None:
                message["reasoning_content"], thought = thought, None
            messages.append(message)
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not isinstance(args, str):
                raise bad(at, "a function_call item needs 'name', 'call_id' and 'arguments' (JSON text)")
            try:
                json.loads(args or "{}")
            except (ValueError, RecursionError) as e:
                raise bad(f"{at}.arguments", f"is not valid JSON text: {e}") from None
            calls_made.add(call_id)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None \
                    and not last["content"]:
                last["tool_calls"].append(call)  # consecutive calls: one assistant turn
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if thought is not None:
                    message["reasoning_content"], thought = thought, None
                messages.append(message)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad(f"{at}.call_id", "is required: the call_id of the function_call it answers")
            if call_id not in calls_made:  # (as OpenAI: an output answers a call of the conversation)
                raise bad(f"{at}.call_id", f"no function_call with call_id {json.dumps(call_id)} comes before it "
                                           "(in this input or the stored conversation of previous_response_id)")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, at, "output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise bad(f"{at}.content", "expected a list of reasoning_text parts")
            thought = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise bad(f"{at}.type", f'must be "message", "function_call", "function_call_output" or "reasoning"; '
                                    f"got {json.dumps(kind)}")
    if not any(m["role"] != "system" for m in messages):  # (e.g. only a reasoning item: nothing to answer)
        raise bad("input", "needs at least one message or function call item")
    return messages


def _chat_tools(body: dict) -> list | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", 'expected a list of {"type": "function", "name", "parameters"}')
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise bad(f"tools[{i}].type", 'only function tools are supported ({"type": "function", "name", ...})')
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if t.get(k) is not None}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(body: dict) -> dict | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text", 'expected an object {"format": {...}}')
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad("text.format", 'expected {"type": "text" | "json_object" | "json_schema", ...}')
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return {"type": fmt["type"]}


@dataclass(frozen=True)
class ResponsesRequest:
    chat: ChatRequest  # what the request amounts to on the chat endpoint
    echo: dict  # the request's fields the response object repeats


def parse_responses(body: dict, max_model_len: int, defaults: dict | None = None) -> ResponsesRequest:
    """`body` with a previous_response_id has its stored conversation in `input` already (ResponseStore)."""
    if body.get("background"):
        raise bad("background", "is not supported")
    if body.get("top_logprobs"):
        raise bad("top_logprobs", "is not supported on /v1/responses; use /v1/chat/completions")
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(v, str) for v in include)):
        raise bad("include", "expected a list of strings")
    if include and "message.output_text.logprobs" in include:
        raise bad("include", "message.output_text.logprobs is not supported on /v1/responses; use "
                             "/v1/chat/completions with logprobs")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise bad("truncation", 'only "disabled" is supported (a prompt longer than the context is a 400)')
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("metadata", "expected an object")
    # the fields the response object repeats: their own types only, so the echo keeps OpenAI's schema
    check_user(body)
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise bad("reasoning", 'expected an object such as {"effort": "low"}')
    chat = {"messages": input_messages(body), "stream": body.get("stream", False)}
    chat.update({k: body[k] for k in _PASSED if k in body})
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = _chat_tools(body)
    if tools is not None:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    rf = _response_format(body)
    if rf is not None and rf["type"] != "text":
        chat["response_format"] = rf
    try:
        req = parse_chat(chat, max_model_len, defaults)
    except APIError as e:
        if e.param is not None:
            renamed = _responses_param(e.param)
            if renamed != e.param and e.message.startswith(f"'{e.param}'"):  # the message names the field too
                e.message = f"'{renamed}'" + e.message[len(e.param) + 2:]
                e.args = (e.message,)
            e.param = renamed
        raise
    if req.constraint_field is not None:  # (a grammar that fails later is blamed on the Responses field)
        req = dataclasses.replace(req, constraint_field=_responses_param(req.constraint_field))
    echo = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
            "temperature": req.params.temperature, "top_p": req.params.top_p,  # (the values used)
            "tool_choice": body.get("tool_choice", "auto" if tools else "none"), "tools": body.get("tools") or [],
            "text": body.get("text") or {"format": {"type": "text"}}, "user": body.get("user"),
            "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
            "previous_response_id": body.get("previous_response_id"), "store": get_bool(body, "store", True)}
    return ResponsesRequest(req, echo)


# ---------------------------------------------------------------------------------- output items
def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else [],
            "encrypted_content": None}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponsesWriter:
    """One response's output: its items whole (output()), or the stream events of its text deltas
    (stream_state()), from the same reasoning split and tool parsing as the chat endpoint."""

    def __init__(self, response_id: str, model: str, req: ResponsesRequest, tools: ToolMode | None,
                 reasoning: ReasoningMode | None, think_end_id: int | None, markers: MarkerTokens | None) -> None:
        self.id, self.model, self.req = response_id, model, req
        self.tools, self.reasoning, self.think_end_id = tools, reasoning, think_end_id
        self.marked = MarkedText(markers) if markers is not None and markers.ids else None
        self.created = int(time.time())
        self.seq = 0
        self.token_ids: list[int] = []  # the output's tokens so far

    def text_of(self, key, c) -> str:
        """The output's text to parse (tags that are special tokens kept, see tool_tags)."""
        self.token_ids = c.token_ids
        if self.marked is None:
            return c.text
        return self.marked.text(c.token_ids, c.text, c.stop_reason, c.finish_reason is not None)

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 reason: str | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
                "model": self.model, "output": output, "previous_response_id": None, "store": False,
                "truncation": "disabled", "usage": usage, **self.req.echo}

    def usage(self, prompt_tokens: int, token_ids: list[int], cached_tokens: int = 0) -> dict:
        reasoning_tokens = 0  # the tokens before </think> (all of them if the output ended inside the thought)
        if self.reasoning is not None:
            ids = list(token_ids)
            if self.think_end_id in ids:
                reasoning_tokens = ids.index(self.think_end_id)
            elif self.reasoning.in_reasoning:
                reasoning_tokens = len(ids)
        return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
                "output_tokens": len(token_ids), "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": prompt_tokens + len(token_ids)}

    def output(self, text: str, cut: bool = False) -> list[dict]:
        """The output items of a whole output text; `cut` (max_output_tokens ended it): its last message or
        function_call item is "incomplete", as OpenAI marks it."""
        items = []
        thought = None
        if self.reasoning is not None:
            thought, text = self.reasoning.split(text)
        if thought is not None:
            items.append(reasoning_item(_new_id("rs"), thought))
        calls = []
        if self.tools is not None:
            text, calls = self.tools.read(text or "")
        if text:
            items.append(message_item(_new_id("msg"), text))
        items += [call_item(_new_id("fc"), c.id, c.name, c.arguments) for c in calls]
        if cut and items and items[-1]["type"] != "reasoning":
            items[-1]["status"] = "incomplete"
        return items

    # ------------------------------------------------------------ streaming
    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def stream_state(self) -> "_StreamState":
        return _StreamState(self)


class _StreamState:
    """The items a streamed response has open and done; each piece of text goes to the item it
    belongs to (a new item closes the one before)."""

    def __init__(self, writer: ResponsesWriter) -> None:
        self.w = writer
        self.done: list[dict] = []
        self.open: dict | None = None  # {"kind", "id", "text", ...}
        self.thought = writer.reasoning.stream() if writer.reasoning is not None else None
        self.calls = writer.tools.stream() if writer.tools is not None else None

    def _open(self, kind: str, item: dict, events: list[str], **extra) -> None:
        self._close(events)
        self.open = {"kind": kind, "id": item["id"], "text": "", "index": len(self.done), **extra}
        events.append(self.w.event("response.output_item.added", output_index=self.open["index"], item=item))
        if kind == "message":
            events.append(self.w.event("response.content_part.added", item_id=item["id"],
                                       output_index=self.open["index"], content_index=0,
                                       part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))

    def _close(self, events: list[str], cut: bool = False) -> None:
        """Close the open item; `cut`: the output ends here, cut short (its message or call is "incomplete")."""
        o = self.open
        if o is None:
            return
        self.open = None
        at = dict(item_id=o["id"], output_index=o["index"])
        if o["kind"] == "reasoning":
            events.append(self.w.event("response.reasoning_text.done", **at, content_index=0, text=o["text"]))
            item = reasoning_item(o["id"], o["text"])
        elif o["kind"] == "message":
            part = {"type": "output_text", "text": o["text"], "annotations": [], "logprobs": []}
            events.append(self.w.event("response.output_text.done", **at, content_index=0, text=o["text"],
                                       logprobs=[]))
            events.append(self.w.event("response.content_part.done", **at, content_index=0, part=part))
            item = message_item(o["id"], o["text"])
        else:
            events.append(self.w.event("response.function_call_arguments.done", **at, arguments=o["text"]))
            item = call_item(o["id"], o["call_id"], o["name"], o["text"])
        if cut and o["kind"] != "reasoning":
            item["status"] = "incomplete"
        events.append(self.w.event("response.output_item.done", output_index=o["index"], item=item))
        self.done.append(item)

    def _text(self, kind: str, text: str, events: list[str]) -> None:
        if not text:
            return
        if self.open is None or self.open["kind"] != kind:
            new = reasoning_item(_new_id("rs"), "", "in_progress") if kind == "reasoning" \
                else message_item(_new_id("msg"), None, "in_progress")
            self._open(kind, new, events)
        o = self.open
        o["text"] += text
        at = dict(item_id=o["id"], output_index=o["index"], content_index=0, delta=text)
        if kind == "reasoning":
            events.append(self.w.event("response.reasoning_text.delta", **at))
        else:
            events.append(self.w.event("response.output_text.delta", **at, logprobs=[]))

    def _call_delta(self, d: dict, events: list[str]) -> None:
        o = self.open
        if o is None or o["kind"] != "call" or o["call"] != d["index"]:
            fn = d.get("function") or {}
            item = call_item(_new_id("fc"), d.get("id") or _new_id("call"), fn.get("name") or "", "", "in_progress")
            self._open("call", item, events, call=d["index"], call_id=item["call_id"], name=item["name"])
            o = self.open
        args = (d.get("function") or {}).get("arguments") or ""
        if args:
            o["text"] += args
            events.append(self.w.event("response.function_call_arguments.delta", item_id=o["id"],
                                       output_index=o["index"], delta=args))

    def feed(self, delta: str, final: bool, cut: bool = False) -> list[str]:
        """The events of a text delta; `final`: the output ends with it (`cut`: by max_output_tokens)."""
        events: list[str] = []
        pieces = self.thought.feed(delta, final) if self.thought is not None else [("content", delta)]
        for kind, text in pieces:
            if kind == "reasoning":
                self._text("reasoning", text, events)
            elif self.calls is not None:
                self._apply(self.calls.update(text, False), events)
            else:
                self._text("message", text, events)
        if final:
            if self.calls is not None:
                self._apply(self.calls.update("", True), events)
            self._close(events, cut)
        return events

    def _apply(self, deltas: list[dict], events: list[str]) -> None:
        for d in deltas:
            if d.get("content"):
                self._text("message", d["content"], events)
            for call in d.get("tool_calls") or []:
                self._call_delta(call, events)


class ResponseStore:
    """Responses kept for `previous_response_id` and GET /v1/responses/{id} (OpenAI's `store`, on unless a
    request says false): each response object, and its conversation as input items (the items before it,
    its own input, its output items, which are valid input items too). In memory, the newest MAX_ENTRIES
    holding at most MAX_CHARS characters of text between them (each request may bring megabytes): a later turn
    naming an evicted one is a 400 saying so."""

    MAX_ENTRIES = 512
    MAX_CHARS = 128 * 2**20

    def __init__(self) -> None:
        self._entries: OrderedDict[str, tuple[dict, list, int]] = OrderedDict()  # id -> (response, items, chars)
        self._chars = 0

    def conversation(self, response_id) -> list:
        """The input items a response continues from; a 400 naming previous_response_id if unknown."""
        if not isinstance(response_id, str):
            raise bad("previous_response_id", "expected a string")
        entry = self._entries.get(response_id)
        if entry is None:
            raise bad("previous_response_id", f"Previous response with id '{response_id}' not found (responses "
                                              f"are kept in memory, the newest {self.MAX_ENTRIES}, and only with "
                                              "store true)")
        self._entries.move_to_end(response_id)
        return list(entry[1])

    def get(self, response_id: str) -> dict | None:
        entry = self._entries.get(response_id)
        return None if entry is None else entry[0]

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._chars -= entry[2]
        return entry is not None

    def put(self, response: dict, input_items: list) -> None:
        items = list(input_items) + list(response.get("output") or [])
        chars = _text_chars(items)
        self.delete(response["id"])
        self._entries[response["id"]] = (response, items, chars)
        self._chars += chars
        while self._entries and (len(self._entries) > self.MAX_ENTRIES or self._chars > self.MAX_CHARS):
            self._chars -= self._entries.popitem(last=False)[1][2]


def _text_chars(obj) -> int:
    """The characters of text in a JSON-like object (its strings), without recursion."""
    total, stack = 0, [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            total += len(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return total


def input_items(body: dict) -> list:
    """A request's `input` as a list of items (a string is one user message); as given otherwise (checked later)."""
    items = body.get("input")
    return [{"role": "user", "content": items}] if isinstance(items, str) else items


async def respond_responses(engine, request, prompt: Prompt, writer: ResponsesWriter, admission, stream: bool,
                            on_done=None):
    """The response object (JSON), or its stream of events ending with response.completed (or
    response.incomplete / response.failed). `on_done(response)`: called with a completed or incomplete
    response object (to store it)."""
    prompt_tokens = len(prompt.ids)
    if not stream:
        finals = await collect(engine, request, [prompt], writer.id)
        if finals is None:
            return JSONResponse({}, status_code=499)
        c = finals[0].outputs[0]
        text = writer.text_of((0, 0), c)
        status = "incomplete" if c.finish_reason == "length" else "completed"
        usage = writer.usage(prompt_tokens, c.token_ids, finals[0].num_cached_tokens)
        response = writer.response(status, writer.output(text, cut=status == "incomplete"), usage, c.finish_reason)
        if on_done is not None:
            on_done(response)
        return JSONResponse(response)

    state = writer.stream_state()
    cached: dict[int, int] = {}
    updates = choice_updates(engine, [prompt], writer.id, False, writer.text_of, cached)

    async def events():
        yield writer.event("response.created", response=writer.response("in_progress", []))
        yield writer.event("response.in_progress", response=writer.response("in_progress", []))
        last = None
        try:
            async for batch in updates:
                out = []
                for u in batch:
                    out += state.feed(u.delta, u.finish_reason is not None, u.finish_reason == "length")
                    last = u
                if out:
                    yield "".join(out)
        except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
            err = error_for(e, "POST /v1/responses")
            failed = writer.response("failed", state.done)
            failed["error"] = {"code": err.code or "server_error", "message": err.message}
            yield writer.event("response.failed", response=failed)
            return
        finally:
            await updates.aclose()
        reason = finish_reason(last.finish_reason) if last is not None else None
        usage = writer.usage(prompt_tokens, writer.token_ids, cached.get(0, 0))
        if reason == "length":
            response = writer.response("incomplete", state.done, usage, reason)
            yield writer.event("response.incomplete", response=response)
        else:
            response = writer.response("completed", state.done, usage)
            yield writer.event("response.completed", response=response)
        if on_done is not None:
            on_done(response)

    return AdmittedStream(events(), admission, media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

