"""Tool-call parsers: a model's generated text split into content and OpenAI tool calls, one class
per output format, chosen by name (`hybrid serve --enable-auto-tool-choice --tool-call-parser NAME`,
the names vLLM uses):

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one call per block (Hermes,
  Qwen 2.5/3, IBM Granite 4.0 and many others);
- granite: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (IBM Granite 3.x; 3.1 writes
  `<tool_call>[...]`), a JSON list after the marker, no closing tag;
- nemotron_json: `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>` (NVIDIA
  Nemotron-H based Nemotron Nano v2, Llama-Nemotron);
- qwen3_coder: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`
  (NVIDIA Nemotron 3 Nano, Qwen3-Coder); values are typed by the tool's parameter schema.

A parser only says where a call block starts (its markers), where a block that started ends, and
what calls a complete block holds (None: malformed). ToolCallStream does the rest, the same way for a
whole text and for a stream of deltas: text outside the blocks is content, whitespace next to a
call is dropped, a malformed block stays content verbatim (never an error), and an output with no
call in it is its content exactly as generated.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text (of an object, for a parsed call)
    id: str

    def as_dict(self) -> dict:
        """The call as OpenAI's message.tool_calls[i]."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def as_delta(self, index: int) -> dict:
        """The whole call as one streamed delta.tool_calls[i]."""
        return {"index": index, **self.as_dict()}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: Any, arguments: Any) -> ToolCall | None:
    """A call from a parsed name and arguments: a non-empty name; arguments an object, the JSON text
    of one, or absent ({}). None for anything else (the block is then malformed)."""
    if not isinstance(name, str) or not name.strip():
        return None
    if arguments is None or arguments == "":
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # (RecursionError: JSON nested past the parser's depth)
            return None
    if not isinstance(arguments, dict):
        return None
    try:  # NaN / Infinity (which json.loads reads) are not JSON: arguments a client could not parse
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None
    try:  # a "\ud800" escape in the model's JSON is a lone surrogate, which no response can carry
        (name + text).encode("utf-8")
    except UnicodeEncodeError:
        return None
    return ToolCall(name.strip(), text, new_call_id())


def calls_of_json(value: Any) -> list[ToolCall] | None:
    """The calls of a JSON value: one {"name", "arguments"} object or a non-empty list of them
    ("parameters" is taken for "arguments" too). None if any of them is not a call."""
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        args = item["arguments"] if "arguments" in item else item.get("parameters")
        call = make_call(item.get("name"), args)
        if call is None:
            return None
        calls.append(call)
    return calls


def json_value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at text[start] closes (the index past it), by its
    brackets outside strings; None while it is still open. Whether it is valid JSON is for json.loads."""
    depth, in_string, escaped = 0, False, False
    for j in range(start, len(text)):
        ch = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth <= 0:
                return j + 1
    return None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


# ---------------------------------------------------------------------------------- the parsers
class ToolParser:
    """One output format. `start_markers`: the texts that open a call block; `tags`: every fixed
    tag of the format (markers and closing tags), which the server keeps in the text when the
    tokenizer has them as special tokens (decoding would drop them). `tools`: the request's tools
    (a format whose values are untyped text reads their types from the parameter schemas)."""

    name = ""
    start_markers: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []

    def marker_at(self, text: str) -> str:
        """The start marker `text` begins with."""
        return next(m for m in self.start_markers if text.startswith(m))

    def block_end(self, text: str, final: bool) -> int | None:
        """`text` starts with a start marker: the end of its call block (an index into text) once the
        block is complete, None while it may still grow. final: the output has ended (the block is
        then whatever there is)."""
        raise NotImplementedError

    def parse_block(self, block: str) -> list[ToolCall] | None:
        """The calls of a complete block, None if it is malformed."""
        raise NotImplementedError


def _calls_of_json_text(body: str) -> list[ToolCall] | None:
    """The calls of a block's JSON text (one call object or a list of them), None if it is not JSON."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return calls_of_json(value)


class TaggedJsonParser(ToolParser):
    """JSON between an opening and a closing tag (an unclosed block at the end of the output is
    taken up to the end): one call object, or a list of them. A subclass names its two tags; its
    start marker and tags follow from them."""

    start_tag = end_tag = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.start_markers = (cls.start_tag,)
        cls.tags = (cls.start_tag, cls.end_tag)

    def block_end(self, text, final):
        at = text.find(self.end_tag, len(self.start_tag))
        if at != -1:
            return at + len(self.end_tag)
        return len(text) if final else None

    def parse_block(self, block):
        body = block[len(self.start_tag):]
        if body.endswith(self.end_tag):
            body = body[:-len(self.end_tag)]
        return _calls_of_json_text(body)


class HermesToolParser(TaggedJsonParser):
    name = "hermes"
    start_tag, end_tag = "<tool_call>", "</tool_call>"


class NemotronJsonToolParser(TaggedJsonParser):
    name = "nemotron_json"
    start_tag, end_tag = "<TOOLCALL>", "</TOOLCALL>"


class GraniteToolParser(ToolParser):
    """A marker, then a JSON list of calls (or one call object); nothing closes it, but a closing
    `</tool_call>` right after the JSON is taken as part of the block."""

    name = "granite"
    close_tag = "</tool_call>"
    start_markers = ("<|tool_call|>", "<tool_call>")
    tags = ("<|tool_call|>", "<tool_call>", close_tag)

    def block_end(self, text, final):
        marker = self.marker_at(text)
        i = _skip_space(text, len(marker))
        if i == len(text):
            return len(text) if final else None
        if text[i] not in "[{":  # not a call: the marker alone (stays content)
            return len(marker)
        end = json_value_end(text, i)
        if end is None:
            return len(text) if final else None
        j = _skip_space(text, end)
        rest = text[j:]
        if rest.startswith(self.close_tag):
            return j + len(self.close_tag)
        if not final and self.close_tag.startswith(rest):  # (the closing tag may be on its way)
            return None
        return end

    def parse_block(self, block):
        body = block[len(self.marker_at(block)):].strip()
        if body.endswith(self.close_tag):
            body = body[:-len(self.close_tag)]
        return _calls_of_json_text(body)


_FUNCTION_RE = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER_RE = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


class Qwen3CoderToolParser(TaggedJsonParser):
    """XML-style calls: each `<function=NAME>` holds `<parameter=KEY>VALUE</parameter>` elements, the
    values plain text, typed here by the tool's JSON schema (a string stays text; integer, number,
    boolean, object, array and null are read as JSON when they parse, else kept as text)."""

    name = "qwen3_coder"
    start_tag, end_tag = "<tool_call>", "</tool_call>"

    def _properties(self, function: str) -> dict:
        for t in self.tools:
            fn = t.get("function") or {}
            if fn.get("name") == function:
                params = fn.get("parameters") or {}
                return (params.get("properties") or {}) if isinstance(params, dict) else {}
        return {}

    @staticmethod
    def _typed(value: str, schema: Any) -> Any:
        types = schema.get("type") if isinstance(schema, dict) else None
        types = [types] if isinstance(types, str) else list(types or [])
        if not types or "string" in types:
            return value
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):  # (RecursionError: JSON nested past the parser's depth)
            if "boolean" in types and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            return value
        ok = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
              "array": lambda v: isinstance(v, list), "null": lambda v: v is None}
        return parsed if any(ok.get(t, lambda v: False)(parsed) for t in types) else value

    def parse_block(self, block):
        body = block[len(self.start_tag):]
        if body.endswith(self.end_tag):
            body = body[:-len(self.end_tag)]
        calls = []
        for m in _FUNCTION_RE.finditer(body):
            name = m.group(1).strip()
            props = self._properties(name)
            args = {}
            for p in _PARAMETER_RE.finditer(m.group(2)):
                value = p.group(2)
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                key = p.group(1).strip()
                args[key] = self._typed(value, props.get(key))
            call = make_call(name, args)
            if call is None:
                return None
            calls.append(call)
        if not calls or body[:body.find("<function=")].strip():
            return None
        return calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, GraniteToolParser, NemotronJsonToolParser, Qwen3CoderToolParser)}


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser registered as `name`; ValueError naming the known ones otherwise."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}; the known parsers are: {', '.join(sorted(TOOL_PARSERS))}")
    return cls


def check_tool_options(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> type[ToolParser] | None:
    """The server's parser class, or ValueError: an unknown parser name, or auto tool choice without one."""
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (one of "
                         f"{', '.join(sorted(TOOL_PARSERS))})")
    return tool_parser_class(tool_call_parser) if tool_call_parser else None


# ---------------------------------------------------------------------------------- one choice's text
def _held_marker_prefix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that a marker starts with (it may become one)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ToolCallStream:
    """One choice's output, fed as it grows (or all at once with final=True), as an ordered list of
    events: ("content", text) and ("call", ToolCall).

    Text is given out as soon as it cannot be part of a call: what could still become a start
    marker is held back, and so is trailing whitespace (it is dropped if a call follows). A call
    block is held from its start marker until it is complete, then given out as its calls, or as
    content verbatim if it is malformed. With no call in the output the content is the text exactly."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.buf = ""
        self.in_call = False
        self.gap = ""  # whitespace before the block held now: dropped if the block is a call
        self.after_call = False  # whitespace right after a call is dropped too ...
        self.sep = ""  # ... but content on both sides of calls stays apart by the first such whitespace
        self.emitted = False
        self.num_calls = 0

    def _content(self, events: list, text: str) -> None:
        if self.after_call:
            body = text.lstrip()
            lead = text[:len(text) - len(body)]
            if not body:
                if self.emitted and not self.sep:
                    self.sep = lead
                return
            text = ((self.sep or lead) if self.emitted else "") + body
            self.sep, self.after_call = "", False
        if text:
            events.append(("content", text))
            self.emitted = True

    def feed(self, delta: str, final: bool = False) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        self.buf += delta
        markers = self.parser.start_markers
        while True:
            if self.in_call:
                end = self.parser.block_end(self.buf, final)
                if end is None:
                    break
                block, self.buf = self.buf[:end], self.buf[end:]
                self.in_call = False
                calls = self.parser.parse_block(block)
                if calls:
                    events.extend(("call", c) for c in calls)
                    self.num_calls += len(calls)
                    if self.emitted and not self.sep:
                        self.sep = self.gap
                    self.gap, self.after_call = "", True
                else:
                    self._content(events, self.gap + block)
                    self.gap = ""
                continue
            found = [(at, m) for m in markers if (at := self.buf.find(m)) != -1]
            if found:
                at = min(found)[0]
                before = self.buf[:at]
                text = before.rstrip()
                self._content(events, text)
                self.gap = before[len(text):]
                self.buf, self.in_call = self.buf[at:], True
                continue
            if final:
                text = self.buf if self.num_calls == 0 else self.buf.rstrip()
                self._content(events, text)
                self.buf = ""
            else:
                head = self.buf[:len(self.buf) - _held_marker_prefix(self.buf, markers)].rstrip()
                self._content(events, head)
                self.buf = self.buf[len(head):]
            break
        return events


def parse_tool_calls(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output: the content None if there are calls and no other text;
    with no calls, the text itself."""
    events = ToolCallStream(parser).feed(text, final=True)
    calls = [v for kind, v in events if kind == "call"]
    if not calls:
        return text, []
    content = "".join(v for kind, v in events if kind == "content")
    return content or None, calls
