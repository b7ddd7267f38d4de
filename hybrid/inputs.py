"""Prompts in vLLM's shapes (`vllm.inputs`): a string, a list of token ids, or a TextPrompt / TokensPrompt
dict, read into (text or None, token ids) by `prompt_ids` for LLM.generate and Engine.add_request alike."""
from __future__ import annotations

from typing import Any, TypedDict

from hybrid.errors import InvalidRequestError

try:
    from typing import NotRequired
except ImportError:  # Python < 3.11
    from typing_extensions import NotRequired

# vLLM's other prompt keys, accepted when empty: code built for several model kinds sends them as None
EMPTY_PROMPT_KEYS = frozenset({"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"})


class TextPrompt(TypedDict):
    """A prompt as text (tokenized with the model's tokenizer)."""
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids (`prompt`, if given, is its text, returned with the output)."""
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt


def prompt_ids(prompt: Any, tokenizer) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt: a string (`tokenizer` encodes it), a list of token ids, or a
    TextPrompt / TokensPrompt dict. InvalidRequestError naming what is wrong otherwise. (Its "cache_salt" is
    the caller's to read.)"""
    if isinstance(prompt, dict):
        unknown = sorted(k for k in set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
                         if not (k in EMPTY_PROMPT_KEYS and not prompt[k]))
        if unknown:
            raise InvalidRequestError(f"a prompt dict takes 'prompt' (text) or 'prompt_token_ids'; "
                                      f"{', '.join(map(repr, unknown))} is not supported")
        if prompt.get("prompt_token_ids") is not None:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise InvalidRequestError("prompt_token_ids must be a list of token ids")
            return prompt.get("prompt"), list(ids)
        if not isinstance(prompt.get("prompt"), str):
            raise InvalidRequestError("a prompt dict needs 'prompt' (a string) or 'prompt_token_ids'")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer.json: pass token ids, not text")
        if prompt == "":
            raise InvalidRequestError("empty prompt: at least one token is needed")
        return prompt, tokenizer.encode(prompt)  # InvalidRequestError for a lone surrogate
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
