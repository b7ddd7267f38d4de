"""The request side of tool calling (OpenAI's `tools` and `tool_choice`, an assistant message's
`tool_calls`), checked into what the chat handler needs before anything runs: every error an
APIError naming the field (400). hybrid/server/protocol.py calls it while parsing a chat request;
what the model writes back is hybrid/server/tool_calls.py's and tool_parsers.py's.
"""
from __future__ import annotations

import dataclasses
import json

from hybrid.errors import InvalidRequestError
from hybrid.sampling import SamplingParams, StructuredOutputsParams
from hybrid.server.api_errors import bad
from hybrid.server.tool_calls import named_function_schema, required_schema

def message_tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls as chat templates take them: OpenAI's shape checked, each
    function's arguments (JSON text in the API) parsed to the object, as vLLM hands them to templates
    (transformers' convention; an absent or empty one is {})."""
    if not isinstance(calls, list):
        raise bad(where, "expected a list of tool calls ({id, type: function, function: {name, arguments}})")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise bad(at, "expected an object {id, type: function, function: {name, arguments}}")
        if call.get("type", "function") != "function":
            raise bad(f"{at}.type", f'must be "function", got {json.dumps(call.get("type"))}')
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise bad(f"{at}.id", "expected a string")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{at}.function", "expected an object with a string 'name' and 'arguments'")
        args = fn.get("arguments")
        if args is None or args == "":
            args = {}
        elif isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError) as e:
                raise bad(f"{at}.function.arguments", f"is not valid JSON text: {e}") from None
        elif not isinstance(args, (dict, list)):
            raise bad(f"{at}.function.arguments", "expected JSON text (a string) of the arguments")
        out.append({**call, "type": "function", "function": {**fn, "arguments": args}})
    return out


TOOL_CHOICES = ("none", "auto", "required")


def chat_tools(body: dict) -> list[dict] | None:
    """The request's tools ([{"type": "function", "function": {"name", "description"?,
    "parameters"? (a JSON schema), "strict"?}}]), shape-checked, as given (None: none)."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", 'expected a list of {"type": "function", "function": {"name", "parameters"}}')
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(at, 'expected an object {"type": "function", "function": {"name", "parameters"}}')
        if tool.get("type", "function") != "function":
            raise bad(f"{at}.type", f'must be "function", got {json.dumps(tool.get("type"))}')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{at}.function", "is required: an object with the function's 'name' (and 'parameters')")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise bad(f"{at}.function.name", "is required: a non-empty string")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"{at}.function.description", "expected a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad(f"{at}.function.parameters", "expected a JSON schema (an object)")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise bad(f"{at}.function.strict", "expected a boolean")
        out.append({**tool, "type": "function"})
    return out or None


def chat_tool_choice(body: dict, tools: list[dict] | None) -> tuple[str, str | None]:
    """(kind, function name) of OpenAI's tool_choice: "none", "auto", "required", or "function" for
    {"type": "function", "function": {"name": ...}}. Absent: "auto" with tools, else "none"."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), None
    name = None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad("tool_choice", f'must be "none", "auto", "required" or {{"type": "function", "function": '
                                     f'{{"name": ...}}}}; got {json.dumps(choice)}')
        kind = choice
    elif isinstance(choice, dict):
        if choice.get("type", "function") != "function":
            raise bad("tool_choice.type", f'must be "function", got {json.dumps(choice.get("type"))}')
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise bad("tool_choice.function.name", "is required: the name of one of the functions in 'tools'")
        kind = "function"
    else:
        raise bad("tool_choice", 'expected "none", "auto", "required" or {"type": "function", "function": '
                                 '{"name": ...}}')
    if kind != "none" and not tools:
        raise bad("tool_choice", f"{json.dumps(choice)} needs 'tools' (a non-empty list of functions)")
    if kind == "function" and name not in {t["function"]["name"] for t in tools}:
        raise bad("tool_choice.function.name", f"{json.dumps(name)} is not one of the functions in 'tools'")
    return kind, name


def tool_constraint(kind: str, name: str | None, tools: list[dict] | None, params: SamplingParams,
                    body: dict, constraint_fields: tuple[str, ...], parallel: bool = True) -> SamplingParams:
    """A named or "required" tool_choice constrains the output with structured outputs, as vLLM does:
    to the function's parameter schema, or to a list of calls of the tools. `constraint_fields`: the
    request fields that constrain the output themselves (named in the error when one is combined)."""
    if kind not in ("function", "required"):
        return params
    if params.structured_outputs is not None:
        other = next((f for f in constraint_fields if body.get(f) is not None), constraint_fields[0])
        raise bad("tool_choice", f"{json.dumps(body.get('tool_choice'))} constrains the output itself; it cannot "
                                 f"be combined with '{other}'")
    if kind == "function":
        schema = named_function_schema(next(t for t in tools if t["function"]["name"] == name))
    else:
        try:
            schema = required_schema(tools, parallel)
        except ValueError as e:
            raise bad("tools", str(e)) from None
    try:
        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))
    except InvalidRequestError as e:
        raise bad("tools", f"the tool's parameter schema cannot constrain the output: {e}") from None
