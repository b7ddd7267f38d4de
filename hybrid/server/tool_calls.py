"""Tool calls in chat responses, as vLLM's OpenAI server answers them: what a request's tool_choice
makes of each choice's output (ToolMode), whole (message.tool_calls) or streamed (delta.tool_calls).

- "auto": the output is parsed by the server's tool-call parser (hybrid/server/tool_parsers.py);
  the calls found become message.tool_calls, the rest the content (null if there is none),
  finish_reason "tool_calls" when there are calls (but "length" for an output cut short).
- a named function ({"type": "function", "function": {"name": ...}}): generation is constrained to
  the function's parameter schema (structured outputs), and the whole output is the call's
  arguments; finish_reason as generated ("stop"), as vLLM and OpenAI answer a forced function.
- "required": generation is constrained to a JSON list of one or more {"name", "parameters"}
  objects of the given tools (the schema vLLM builds); finish_reason "tool_calls".
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hybrid.server.tool_parsers import ToolCall, ToolCallStream, ToolParser, make_call, new_call_id, parse_tool_calls

_EMPTY_OBJECT = {"type": "object", "properties": {}}


def named_function_schema(tool: dict) -> dict:
    """The JSON schema a named tool_choice constrains the output to: the function's parameters."""
    params = tool["function"].get("parameters")
    return params if params else dict(_EMPTY_OBJECT)


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """The JSON schema of tool_choice "required": a non-empty list of calls of the given tools, each
    {"name": <one of them>, "parameters": <its parameter schema>} (one call only if not parallel).
    The tools' own `$defs` move to the top, where their `#/$defs/...` references (pydantic's) resolve once
    the parameters are nested here, as vLLM merges them; two tools defining one name differently are a
    ValueError."""
    defs: dict = {}

    def one(tool: dict) -> dict:
        fn = tool["function"]
        params = fn.get("parameters") or dict(_EMPTY_OBJECT)
        if isinstance(params, dict) and isinstance(params.get("$defs"), dict):
            for name, definition in params["$defs"].items():
                if defs.setdefault(name, definition) != definition:
                    raise ValueError(f"tools define '$defs/{name}' differently: give the definitions distinct names")
            params = {k: v for k, v in params.items() if k != "$defs"}
        return {"type": "object",
                "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": params},
                "required": ["name", "parameters"], "additionalProperties": False}

    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [one(t) for t in tools]}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _required_calls(text: str) -> list[ToolCall]:
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if not isinstance(value, list):
        return []
    calls = []
    for item in value:
        call = make_call(item.get("name"), item.get("parameters")) if isinstance(item, dict) else None
        if call is None:
            return []
        calls.append(call)
    return calls


@dataclass(frozen=True)
class ToolMode:
    """What a request's tool_choice makes of its output. kind: "auto" (parser_cls parses it),
    "function" (the output is the arguments of `function`) or "required"."""
    kind: str
    tools: list[dict] = field(default_factory=list)
    parser_cls: type[ToolParser] | None = None
    function: str | None = None
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output."""
        if self.kind == "function":
            return None, [ToolCall(self.function, text, new_call_id())]
        if self.kind == "required":
            calls = _required_calls(text)
            return (None, calls[:1] if not self.parallel else calls) if calls else (text, [])
        content, calls = parse_tool_calls(self.parser_cls(self.tools), text)
        return content, calls if self.parallel else calls[:1]

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """"tool_calls" for an output that made calls and ended on its own; a cut ("length") stays one, so that
        an agent loop learns that the output (perhaps a call after the ones read) is incomplete."""
        if reason != "stop" or self.kind == "function" or not called:
            return reason
        return "tool_calls"

    def stream(self) -> "ChoiceStream":
        return {"auto": AutoStream, "function": NamedStream, "required": RequiredStream}[self.kind](self)


class ChoiceStream:
    """One streamed choice: its text deltas in, the `delta` objects of its chunks out."""
    called = False

    def update(self, delta: str, final: bool) -> list[dict[str, Any]]:
        raise NotImplementedError


class AutoStream(ChoiceStream):
    """Content streams as generated; a call is held from its start marker until its block is
    complete, then sent whole in one delta (its id, name and all its arguments at once), which
    OpenAI clients accumulate like any other tool-call delta."""

    def __init__(self, mode: ToolMode) -> None:
        self.stream = ToolCallStream(mode.parser_cls(mode.tools))
        self.parallel = mode.parallel
        self.num_calls = 0

    def update(self, delta, final):
        out = []
        for kind, value in self.stream.feed(delta, final):
            if kind == "content":
                out.append({"content": value})
            elif self.parallel or self.num_calls == 0:
                out.append({"tool_calls": [value.as_delta(self.num_calls)]})
                self.num_calls += 1
                self.called = True
        return out


class NamedStream(ChoiceStream):
    """The named function's call: its id and name first, then the arguments as they are generated."""

    def __init__(self, mode: ToolMode) -> None:
        self.name = mode.function
        self.id = new_call_id()

    def update(self, delta, final):
        if not self.called:
            if not delta and not final:
                return []
            self.called = True
            return [{"tool_calls": [{"index": 0, "id": self.id, "type": "function",
                                     "function": {"name": self.name, "arguments": delta}}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}] if delta else []


class RequiredStream(ChoiceStream):
    """The constrained list of calls is buffered until the output ends, then each call is sent whole
    in one delta (or, if it is not a list of calls after all, the text as content)."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""

    def update(self, delta, final):
        self.text += delta
        if not final:
            return []
        content, calls = self.mode.read(self.text)
        if not calls:
            return [{"content": content}] if content else []
        self.called = True
        return [{"tool_calls": [c.as_delta(i)]} for i, c in enumerate(calls)]
