"""Chat templates: a conversation rendered to prompt text with the checkpoint's jinja2 template,
as transformers' apply_chat_template renders it (a sandboxed environment with trim_blocks and
lstrip_blocks, the loopcontrols extension, `tojson`, `raise_exception`, `strftime_now`, and the
bos/eos tokens of tokenizer_config.json). Used by LLM.chat (and meant for the server's chat endpoint).
"""
from __future__ import annotations

import functools
import json
import time

from hybrid.errors import InvalidRequestError


def _special(config: dict, name: str) -> str:
    t = config.get(name)
    return t.get("content") if isinstance(t, dict) else (t or "")


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """The template compiled once (a large template takes milliseconds to parse)."""
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
    return env.from_string(template)


# the variables a rendering sets itself (the conversation, its options, the tokenizer's special tokens): never
# taken from chat_template_kwargs
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize",
                               "chat_template", "bos_token", "eos_token")


def reserved_template_kwargs(kwargs: dict | None) -> list[str]:
    """The keys of chat_template_kwargs that name a variable the rendering sets itself, sorted."""
    return sorted(set(kwargs or ()) & set(RESERVED_TEMPLATE_VARIABLES))


def check_chat_template(template: str) -> None:
    """ValueError naming the problem if `template` is not a jinja2 template that compiles."""
    import jinja2

    if not isinstance(template, str) or not template.strip():
        raise ValueError("the chat template must be a non-empty jinja2 template text")
    try:
        _compiled(template)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from None


def render_chat(template: str, messages: list[dict], tokenizer_config: dict | None = None,
                add_generation_prompt: bool = True, extra: dict | None = None,
                continue_final_message: bool = False) -> str:
    """`messages` rendered with `template`. `tokenizer_config` (tokenizer_config.json) gives
    bos_token / eos_token; `extra` more template variables (tools=..., chat_template_kwargs).
    continue_final_message: the text ends right after the last message's content (no end of turn),
    so the reply continues that message (as transformers' option of the same name).
    InvalidRequestError when the template does not compile or refuses the conversation
    (raise_exception), e.g. roles out of order."""
    import jinja2

    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be set: "
                                  "the reply either continues the last message or starts a new one")
    cfg = tokenizer_config or {}
    variables = dict(bos_token=_special(cfg, "bos_token"), eos_token=_special(cfg, "eos_token"), **(extra or {}))
    variables.update(messages=messages, add_generation_prompt=add_generation_prompt)
    if continue_final_message:
        variables["continue_final_message"] = True
    try:
        text = _compiled(template).render(**variables)
        if continue_final_message:
            return _cut_after_final_message(template, variables, text, messages)
    except jinja2.exceptions.TemplateError as e:
        raise InvalidRequestError(f"the chat template could not be rendered: {e}") from None
    return text


# marks the end of the last message's content in a second rendering (continue_final_message)
_FINAL_MESSAGE_END = "\x00hybrid-final-message-end\x00"


def _cut_after_final_message(template: str, variables: dict, text: str, messages: list[dict]) -> str:
    """The rendered conversation up to the end of its last message's content: what the template
    writes after it (the end-of-turn tokens) is cut, so generation continues the message. The end is
    found by rendering again with a marker after the content: searching the text for the content
    itself can land on a later copy of it (a content "end" inside an end-of-turn token)."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequestError("continue_final_message needs a last message with text to continue")
    marked = _compiled(template).render(**{**variables, "messages": [
        *messages[:-1], {**messages[-1], "content": content + _FINAL_MESSAGE_END}]})
    at = marked.rfind(_FINAL_MESSAGE_END)
    if at != -1:
        for prefix in (marked[:at], marked[:at].rstrip()):  # (a template that strips the content it writes)
            if text.startswith(prefix):
                return prefix
    for needle in (content, content.strip()):  # a template may strip the content it writes
        at = text.rfind(needle)
        if at != -1:
            return text[:at + len(needle)]
    raise InvalidRequestError("continue_final_message: the chat template does not write the last message's "
                              "content as given, so there is no place to continue it from")


# the content parts read as text, and the key of each one's text (as vLLM reads them: the Responses API's
# input_text / output_text, an assistant's refusal, a thinking part)
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}


def _part_texts(parts: list, what: str) -> list[str]:
    """The texts of a content list: plain strings and TEXT_PARTS (a part whose text is null is skipped);
    InvalidRequestError naming the first part that is neither."""
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
            continue
        key = TEXT_PARTS.get(part.get("type")) if isinstance(part, dict) else None
        if key is None:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"{what}[{j}]: only text content parts are supported "
                                      f"({', '.join(TEXT_PARTS)} or a string), not {kind!r}")
        text = part.get(key)
        if text is None:
            continue
        if not isinstance(text, str):
            raise InvalidRequestError(f"{what}[{j}].{key} must be a string")
        texts.append(text)
    return texts


def normalize_messages(messages, what: str = "messages") -> list[dict]:
    """A conversation checked and normalised for rendering: a non-empty list of dicts, each with a
    string 'role'; 'content' a string, None (-> "") or a list of text parts (strings or TEXT_PARTS, joined
    by newlines, as vLLM joins them). Other keys (name, tool_calls, ...) are kept. InvalidRequestError
    otherwise."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError(f"{what} must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"{what}[{i}]: each message must be a dict with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(_part_texts(content, f"{what}[{i}].content"))
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequestError(f"{what}[{i}].content must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out
