"""The request side of the OpenAI protocol, in one place: the JSON body, its fields, and the two
requests (/v1/completions, /v1/chat/completions) parsed and checked into CompletionRequest and
ChatRequest before anything runs. Every error is an APIError naming the field (400), so a
streamed request is refused with its status, never a 200 and an error event.

What needs the model (tokenizing, the context length, the vocabulary) is checked by the handlers
(hybrid/server/handlers.py) right after, still before the response starts.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

from hybrid.chat_template import normalize_messages, reserved_template_kwargs
from hybrid.errors import InvalidRequestError
from hybrid.beam_search import MAX_LENGTH_PENALTY
from hybrid.request import check_cache_salt
from hybrid.sampling import UNBOUNDED_MAX_TOKENS, SamplingParams, StructuredOutputsParams
from hybrid.server.api_errors import APIError, bad, from_invalid
from hybrid.server.tool_protocol import chat_tool_choice, chat_tools, message_tool_calls, tool_constraint

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TOP_LOGPROBS = 20
MAX_N = 128
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")  # OpenAI's


# ---------------------------------------------------------------------------------- the body
# fields a client may send that change nothing here (OpenAI's bookkeeping): not reported as ignored
ACCEPTED_UNUSED = frozenset({"user", "store", "metadata", "service_tier"})


class ReadFields(dict):
    """A request body that records the fields its parser read: the others were ignored, which the
    server logs (as vLLM does), so that a misspelt or unsupported field does not pass unnoticed."""

    def __init__(self, body: dict) -> None:
        super().__init__(body)
        self.read: set = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def ignored(self) -> list[str]:
        """The fields never read, but those in ACCEPTED_UNUSED."""
        return sorted(k for k in self if k not in self.read and k not in ACCEPTED_UNUSED)


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


MAX_JSON_DEPTH = 128  # nesting levels of a request body: far past any schema or message, far from the parsers' limits


def _not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON number")


def _nesting_depth(obj, limit: int) -> int:
    """How deep `obj` nests (stopping once past `limit`), without recursion."""
    stack, deepest = [(obj, 1)], 0
    while stack and deepest <= limit:
        x, depth = stack.pop()
        if isinstance(x, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (x.values() if isinstance(x, dict) else x))
    return deepest


def parse_body(raw: bytes) -> dict:
    """The request body: a JSON object of Unicode text, no NaN or Infinity (not JSON: a response echoing one
    would not be JSON either), nested at most MAX_JSON_DEPTH deep (400 otherwise)."""
    try:
        body = json.loads(raw, parse_constant=_not_json)
    except (UnicodeDecodeError, ValueError) as e:  # (json.JSONDecodeError is a ValueError)
        raise APIError(f"the request body is not valid JSON: {e}", 400, None, "invalid_json") from None
    except RecursionError:
        raise APIError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", 400, None,
                       "invalid_json") from None
    if _nesting_depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise APIError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", 400, None, "invalid_json")
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", 400, None, "invalid_json")
    bad_path = _lone_surrogate_path(body)
    if bad_path is not None:
        raise APIError(f"'{bad_path}': contains a lone UTF-16 surrogate, which is not valid Unicode text",
                       400, bad_path, "invalid_value")
    return body


# ---------------------------------------------------------------------------------- fields
def get_int(body: dict, name: str, default, *, lo: int | None = None, hi: int | None = None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise bad(name, f"expected an integer, got {json.dumps(v)}")
    if lo is not None and v < lo:
        raise bad(name, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise bad(name, f"must be <= {hi}, got {v}")
    return v


def get_num(body: dict, name: str, default, *, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise bad(name, f"expected a finite number, got {json.dumps(v)}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise bad(name, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise bad(name, f"must be <= {hi}, got {v}")
    return float(v)


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"expected a boolean, got {json.dumps(v)}")
    return v


def _stop(body: dict) -> list[str] | None:
    v = body.get("stop")
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop", "expected a string or a list of strings")
    v = [s for s in v if s]
    return v or None


def _token_ids(body: dict, name: str) -> list[int] | None:
    v = body.get(name)
    if v is not None and (not isinstance(v, list)
                          or not all(isinstance(t, int) and not isinstance(t, bool) for t in v)):
        raise bad(name, "expected a list of integers")
    return v


def _bad_words(body: dict) -> list[str] | None:
    v = body.get("bad_words")
    if v is not None and (not isinstance(v, list) or not all(isinstance(w, str) for w in v)):
        raise bad("bad_words", "expected a list of strings")
    return v or None


def sampling_params(body: dict, *, max_tokens: int, logprobs: int | None,
                    defaults: dict | None = None) -> SamplingParams:
    """The SamplingParams of a request's sampling fields (OpenAI's, and vLLM's extensions top_k,
    min_p, min_tokens, repetition_penalty, ignore_eos, stop_token_ids, skip_special_tokens,
    spaces_between_special_tokens, include_stop_str_in_output, allowed_token_ids, bad_words,
    truncate_prompt_tokens), and its output constraint (response_format, structured_outputs,
    guided_*: see structured_outputs)."""
    constraint = structured_outputs(body)
    d = defaults or {}  # the model's recommended values (generation_config.json) for fields the request leaves out
    top_k = get_int(body, "top_k", d.get("top_k", -1))
    if top_k == 0:
        top_k = -1
    stop_token_ids = _token_ids(body, "stop_token_ids")
    logit_bias = body.get("logit_bias")
    if logit_bias is not None:  # OpenAI spells the token ids as strings
        if not isinstance(logit_bias, dict):
            raise bad("logit_bias", "expected an object mapping token ids to numbers")
        try:
            logit_bias = {int(k): v for k, v in logit_bias.items()}
        except ValueError:
            raise bad("logit_bias", "keys must be token ids") from None
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in logit_bias.values()):
            raise bad("logit_bias", "values must be numbers")
    try:
        return SamplingParams(
            n=get_int(body, "n", 1, lo=1, hi=MAX_N),
            max_tokens=max_tokens,
            temperature=get_num(body, "temperature", d.get("temperature", 1.0), lo=0.0),
            top_p=get_num(body, "top_p", d.get("top_p", 1.0), lo=0.0, hi=1.0, lo_open=True),
            top_k=top_k,
            seed=get_int(body, "seed", None),  # any int: the engine reduces it into the generator's range
            stop=_stop(body),
            stop_token_ids=stop_token_ids,
            ignore_eos=get_bool(body, "ignore_eos", False),
            logprobs=logprobs,
            presence_penalty=get_num(body, "presence_penalty", 0.0),
            frequency_penalty=get_num(body, "frequency_penalty", 0.0),
            repetition_penalty=get_num(body, "repetition_penalty", d.get("repetition_penalty", 1.0)),
            min_p=get_num(body, "min_p", d.get("min_p", 0.0)),
            min_tokens=get_int(body, "min_tokens", 0, lo=0),
            logit_bias=logit_bias or None,
            structured_outputs=constraint,
            skip_special_tokens=get_bool(body, "skip_special_tokens", True),
            spaces_between_special_tokens=get_bool(body, "spaces_between_special_tokens", True),
            include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
            allowed_token_ids=_token_ids(body, "allowed_token_ids"),
            bad_words=_bad_words(body),
            truncate_prompt_tokens=get_int(body, "truncate_prompt_tokens", None, lo=-1),
        )
    except InvalidRequestError as e:
        raise from_invalid(e) from None


# ---------------------------------------------------------------------------------- structured outputs
# vLLM's structured_outputs fields, and its older guided_* spellings
_SO_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
              "disable_additional_properties", "whitespace_pattern")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _response_format(body: dict) -> dict | None:
    """StructuredOutputsParams fields of OpenAI's response_format (None: plain text)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad("response_format", "expected an object with a 'type'")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise bad("response_format.type", f"must be one of text, json_object, json_schema; got {json.dumps(kind)}")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", "expected an object with 'name' and 'schema'")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise bad("response_format.json_schema.strict", "expected a boolean")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema", "is required: a JSON schema (an object)")
    if not isinstance(spec.get("name"), str) or not spec["name"]:  # (required by OpenAI and vLLM alike)
        raise bad("response_format.json_schema.name", "is required: the schema's name (a string)")
    return {"json": schema}


def _prompt_logprobs(body: dict, stream: bool, params: SamplingParams) -> tuple[int | None, SamplingParams]:
    """vLLM's prompt_logprobs (k: the prompt tokens' logprobs with the top k each, in the non-streamed
    response); the params then score the prompt with at least k top entries."""
    k = get_int(body, "prompt_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if k is None:
        return None, params
    if stream:
        raise bad("prompt_logprobs", "is not available with stream")
    return k, dataclasses.replace(params, prompt_logprobs=max(k, params.prompt_logprobs or 0))


# the request fields that constrain the output, in the order they are looked for
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *_GUIDED)


def _constraints(body: dict) -> list[tuple[str, dict]]:
    """(field, StructuredOutputsParams fields) of every output constraint the request gives, shape-checked
    (400 naming the field); a response_format of type text constrains nothing."""
    found: list[tuple[str, dict]] = []
    rf = _response_format(body)
    if rf is not None:
        found.append(("response_format", rf))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("structured_outputs", "expected an object")
        unknown = sorted(set(so) - set(_SO_FIELDS))
        if unknown:
            raise bad("structured_outputs", f"unknown field {json.dumps(unknown[0])}; the fields are "
                                            + ", ".join(_SO_FIELDS))
        found.append(("structured_outputs", {k: v for k, v in so.items() if v is not None}))
    for name, field in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, {field: body[name]}))
    return found


def constraint_field(body: dict) -> str | None:
    """The field that carries the request's output constraint (what a grammar that fails to compile is
    blamed on), None without one."""
    found = _constraints(body)
    return found[0][0] if found else None


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The request's output constraint, from OpenAI's `response_format` ({"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}), vLLM's `structured_outputs`
    ({"json" | "regex" | "choice" | "grammar" | "json_object", and its options}) or vLLM's older
    `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`: at most one of them. Shape
    checks here (400 naming the field); the grammar itself is compiled by the engine's check."""
    found = _constraints(body)
    if not found:
        return None
    if len(found) > 1:
        raise bad(found[1][0], f"only one output constraint per request; {found[0][0]} is given too")
    name, fields = found[0]
    try:
        return StructuredOutputsParams(**fields)
    except InvalidRequestError as e:
        raise bad(name, str(e)) from None


def _stream_usage(body: dict, stream: bool) -> tuple[bool, bool]:
    """stream_options' (include_usage, continuous_usage_stats): a last chunk with the request's usage,
    and (vLLM's extension, with include_usage) the usage so far on every chunk."""
    so = body.get("stream_options")
    if so is None:
        return False, False
    if not isinstance(so, dict):
        raise bad("stream_options", "expected an object")
    if not stream:
        raise bad("stream_options", "is only allowed with 'stream': true")
    for name in ("include_usage", "continuous_usage_stats"):  # (blamed on their place in the body)
        if so.get(name) is not None and not isinstance(so[name], bool):
            raise bad(f"stream_options.{name}", f"expected a boolean, got {json.dumps(so[name])}")
    include = bool(so.get("include_usage"))
    return include, include and bool(so.get("continuous_usage_stats"))


def _priority(body: dict) -> int:
    """vLLM's request priority (with --scheduling-policy priority; lower runs first)."""
    return get_int(body, "priority", 0, lo=-(2**31), hi=2**31 - 1)


def prompt_inputs(body: dict) -> list[str | list[int]]:
    """The completion prompts as sent (strings or token-id lists), shape-checked, not tokenized."""
    p = body.get("prompt")
    if p is None:
        raise bad("prompt", "is required")

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
        raise bad("prompt", "expected a string, a list of strings, a list of token ids or a list of lists of them")
    if any(isinstance(x, str) and not x for x in prompts):
        raise bad("prompt", "empty prompt: at least one token is needed")
    return prompts


_MESSAGE_PATH = re.compile(r"^(messages(?:\[\d+\])?(?:\.content(?:\[\d+\](?:\.\w+)?)?)?)(?=[:\s]|$)")


def chat_messages(body: dict) -> list[dict]:
    """The conversation, normalised for the chat template (hybrid.chat_template.normalize_messages:
    text content parts joined, None content -> ""), each role one of OpenAI's (the deprecated "function"
    result read as a "tool" message); an assistant
    message's tool_calls with their arguments as objects (see tool_protocol.message_tool_calls), a tool
    message's tool_call_id kept."""
    try:
        messages = normalize_messages(body.get("messages"))
    except InvalidRequestError as e:
        m = _MESSAGE_PATH.match(str(e))
        raise APIError(str(e), 400, m.group(1) if m else "messages", "invalid_value") from None
    for i, m in enumerate(messages):
        if m["role"] == "function":  # OpenAI's deprecated function result: a tool reply, which templates know
            messages[i] = m = {**m, "role": "tool"}
        if m["role"] not in CHAT_ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}; got {json.dumps(m['role'])}")
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise bad(f"messages[{i}].tool_calls", "only an assistant message has tool calls")
            messages[i] = {**m, "tool_calls": message_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")}
        elif "tool_calls" in m:
            messages[i] = {k: v for k, v in m.items() if k != "tool_calls"}
        for name in ("tool_call_id", "name"):
            if m.get(name) is not None and not isinstance(m[name], str):
                raise bad(f"messages[{i}].{name}", "expected a string")
        # an earlier reply's thought, under either name a client may send it back with: templates
        # that render it (Nemotron 3's) read reasoning_content
        for name in ("reasoning_content", "reasoning"):
            if m.get(name) is not None and not isinstance(m[name], str):
                raise bad(f"messages[{i}].{name}", "expected a string")
        thought = m.get("reasoning_content") if m.get("reasoning_content") is not None else m.get("reasoning")
        if thought is not None:
            messages[i] = {**messages[i], "reasoning_content": thought, "reasoning": thought}
    return messages


# ---------------------------------------------------------------------------------- the two requests
@dataclass(frozen=True)
class CompletionRequest:
    inputs: list  # the prompts as sent: strings or token-id lists
    params: SamplingParams  # max_tokens: as given, else DEFAULT_COMPLETION_MAX_TOKENS (fitted per prompt)
    max_tokens_param: str | None  # the field that set max_tokens ("max_tokens"), None if defaulted
    logprobs: int | None  # top logprobs per token, None: none
    stream: bool
    include_usage: bool
    echo: bool = False  # the prompt's text (and, with logprobs, its logprobs) before each choice's
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (one token is run and dropped)
    continuous_usage: bool = False  # the usage so far on every chunk (stream_options.continuous_usage_stats)
    tokens_as_ids: bool | None = None  # return_tokens_as_token_ids (None: the server's default)
    priority: int = 0  # --scheduling-policy priority: lower values run first
    constraint_field: str | None = None  # the field of the output constraint (constraint_field)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: each prompt token's logprob and the top k
    return_token_ids: bool = False  # vLLM's: each choice's token ids (streamed: each chunk's) and the prompt's


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    add_generation_prompt: bool
    tools: list | None
    params: SamplingParams  # max_tokens: as given, else the whole context (fitted to the prompt)
    max_tokens_param: str | None  # "max_completion_tokens" or "max_tokens" if given, None if defaulted
    logprobs: int | None  # top logprobs per token (0: the token's own only), None: none
    stream: bool
    include_usage: bool
    tool_choice: str = "none"  # "none" | "auto" | "required" | "function" (the named tool_name)
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # more template variables (e.g. enable_thinking)
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    continuous_usage: bool = False  # the usage so far on every chunk (stream_options.continuous_usage_stats)
    tokens_as_ids: bool | None = None  # return_tokens_as_token_ids (None: the server's default)
    priority: int = 0  # --scheduling-policy priority: lower values run first
    constraint_field: str | None = None  # the field of the output constraint (constraint_field)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: each prompt token's logprob and the top k
    echo: bool = False  # vLLM's chat echo: the reply's content starts with the last (assistant) message's
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens (BOS) added to the rendered prompt
    return_token_ids: bool = False  # vLLM's: each choice's token ids (streamed: each chunk's) and the prompt's


def check_user(body: dict) -> None:
    """OpenAI's `user` (an end user's id; no effect here): a string, as OpenAI and vLLM type it."""
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", "expected a string")


def parse_completion(body: dict, defaults: dict | None = None) -> CompletionRequest:
    """A /v1/completions request; `defaults`: the model's sampling defaults (generation_config.json)."""
    check_user(body)
    echo = get_bool(body, "echo", False)
    if body.get("suffix"):
        raise bad("suffix", "is not supported")
    stream = get_bool(body, "stream", False)
    include_usage, continuous_usage = _stream_usage(body, stream)
    inputs = prompt_inputs(body)
    k = get_int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    # echo with max_tokens 0 (how evaluation harnesses score a text): the prompt and its logprobs only
    max_tokens = get_int(body, "max_tokens", None, lo=0 if echo else 1)
    echo_only = echo and max_tokens == 0
    # left out: OpenAI's 16; sent as null: the rest of the context, as vLLM reads it (the model's default if any)
    null_max = "max_tokens" in body and body.get("max_tokens") is None
    default_max = (defaults or {}).get("max_tokens",
                                       UNBOUNDED_MAX_TOKENS if null_max else DEFAULT_COMPLETION_MAX_TOKENS)
    params = sampling_params(body, max_tokens=1 if echo_only else max_tokens or default_max, logprobs=k,
                             defaults=defaults)
    if echo and k is not None:
        params = dataclasses.replace(params, prompt_logprobs=k)
    if echo and params.truncate_prompt_tokens is not None:  # the echoed prompt would not be the one run
        raise bad("truncate_prompt_tokens", "is not supported with echo")
    plp, params = _prompt_logprobs(body, stream, params)
    best_of = get_int(body, "best_of", None, lo=1)
    if best_of is not None and best_of != params.n:
        raise bad("best_of", "is not supported (only best_of == n)")
    return CompletionRequest(inputs, params, "max_tokens" if max_tokens is not None else None, k, stream,
                             include_usage, echo, echo_only, continuous_usage,
                             get_bool(body, "return_tokens_as_token_ids", None), _priority(body),
                             constraint_field(body), plp, get_bool(body, "return_token_ids", False) is True)


def parse_chat(body: dict, max_model_len: int, defaults: dict | None = None) -> ChatRequest:
    """A /v1/chat/completions request; `defaults`: the model's sampling defaults (generation_config.json)."""
    check_user(body)
    stream = get_bool(body, "stream", False)
    include_usage, continuous_usage = _stream_usage(body, stream)
    messages = chat_messages(body)
    add_gen = get_bool(body, "add_generation_prompt", True)
    tools = chat_tools(body)
    tool_kind, tool_name = chat_tool_choice(body, tools)
    parallel = get_bool(body, "parallel_tool_calls", True)
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise bad(legacy, "is not supported (OpenAI's deprecated form): send 'tools' and 'tool_choice'")
    want_lp = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and not want_lp:
        raise bad("top_logprobs", "needs 'logprobs': true")
    k = (top or 0) if want_lp else None
    max_tokens, param = get_int(body, "max_completion_tokens", None, lo=1), "max_completion_tokens"
    older = get_int(body, "max_tokens", None, lo=1)  # (checked even where max_completion_tokens wins)
    if max_tokens is None:
        max_tokens, param = older, "max_tokens"
    if max_tokens is None:
        param = None  # default: the rest of the context
    default_max = min((defaults or {}).get("max_tokens", max_model_len), max_model_len)
    params = sampling_params(body, max_tokens=max_tokens or default_max, logprobs=k, defaults=defaults)
    params = tool_constraint(tool_kind, tool_name, tools, params, body, CONSTRAINT_FIELDS, parallel)
    plp, params = _prompt_logprobs(body, stream, params)
    template_kwargs = template_variables(body)
    continue_final = get_bool(body, "continue_final_message", False)
    if continue_final:
        if add_gen and "add_generation_prompt" in body:
            raise bad("continue_final_message", "cannot be combined with 'add_generation_prompt': true")
        add_gen = False
        if messages[-1]["role"] != "assistant":
            raise bad("continue_final_message", "needs the last message to be the assistant's (the text to continue)")
    return ChatRequest(messages, add_gen, tools, params, param, k, stream, include_usage, tool_kind, tool_name,
                       parallel, template_kwargs, continue_final, continuous_usage,
                       get_bool(body, "return_tokens_as_token_ids", None), _priority(body), constraint_field(body),
                       plp, get_bool(body, "echo", False), get_bool(body, "add_special_tokens", False),
                       get_bool(body, "return_token_ids", False) is True)


def beam_options(body: dict) -> float | None:
    """vLLM's use_beam_search: the request's length_penalty (default 1.0) if it asks for beam search, else None."""
    penalty = get_num(body, "length_penalty", 1.0, lo=-MAX_LENGTH_PENALTY, hi=MAX_LENGTH_PENALTY)  # (checked always)
    return penalty if get_bool(body, "use_beam_search", False) else None


def cache_salt(body: dict) -> str | None:
    """vLLM's cache_salt: a request shares cached prefixes only with requests of the same salt (a tenant's
    prompts are not sped up, nor their timing revealed, by another's)."""
    salt = body.get("cache_salt")
    try:
        check_cache_salt(salt)
    except InvalidRequestError as e:
        raise bad("cache_salt", str(e)) from None
    return salt


def template_variables(body: dict) -> dict | None:
    """The chat template's variables a request adds: its chat_template_kwargs, and vLLM's `documents` (a list of
    objects, for templates of retrieval-augmented generation)."""
    kw = chat_template_kwargs(body)
    docs = body.get("documents")
    if docs is None:
        return kw
    if not isinstance(docs, list) or not all(isinstance(d, dict) for d in docs):
        raise bad("documents", "expected a list of objects (each document's fields, e.g. title and text)")
    return {**(kw or {}), "documents": docs}


def chat_template_kwargs(body: dict) -> dict | None:
    """vLLM's chat_template_kwargs: more variables for the chat template (enable_thinking,
    force_nonempty_content, ...), an object whose keys do not override the request's own."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return None
    if not isinstance(kw, dict):
        raise bad("chat_template_kwargs", "expected an object of template variables")
    reserved = reserved_template_kwargs(kw)
    if reserved:
        raise bad("chat_template_kwargs", f"{', '.join(reserved)} cannot be set here: "
                                          "the request's own fields set them")
    return kw
