"""Tokenizer over the `tokenizers` library: tokenizer.json plus tokenizer_config.json."""
from __future__ import annotations

import os

from hybrid.config_fields import read_json
from hybrid.errors import CheckpointError, InvalidRequestError


def check_text(text: str, what: str = "prompt") -> None:
    """Raise InvalidRequestError unless `text` is a str that can be encoded as UTF-8."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")  # a C-speed scan; fails exactly on surrogate code points
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{what} contains a lone UTF-16 surrogate U+{ord(text[e.start]):04X} at character {e.start}: "
            "it is not valid Unicode text") from None


def _chat_template(value, cfg_path: str) -> str | None:
    """The chat template: a string, or (newer tokenizer_config.json files) a list of named templates,
    of which the one named "default" (else the first) is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in value):
        named = {t.get("name"): t["template"] for t in value}
        return named.get("default") or next(iter(named.values()), None)
    raise CheckpointError(f"{cfg_path}: 'chat_template' must be a string or a list of named templates")


class Tokenizer:
    def __init__(self, model_dir: str, eos_token_ids: tuple[int, ...] = ()) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise CheckpointError(f"missing file: {path}")
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception for a corrupt file
            raise CheckpointError(f"{path} is not a valid tokenizer file: {e}") from None
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        self.config: dict = read_json(cfg_path) if os.path.isfile(cfg_path) else {}
        self.eos_token_ids: set[int] = set(eos_token_ids)
        eos = self._special(self.config.get("eos_token"), cfg_path, "eos_token")
        if eos is not None:
            self.eos_token_ids.add(eos)
        self.bos_token_id = self._special(self.config.get("bos_token"), cfg_path, "bos_token")
        self.chat_template: str | None = _chat_template(self.config.get("chat_template"), cfg_path)

    def _special(self, token, cfg_path: str, key: str) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        if not token:
            return None
        if not isinstance(token, str):
            raise CheckpointError(f"{cfg_path}: '{key}' must be a token string, got {token!r}")
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. InvalidRequestError for a non-str or for text that is not valid Unicode
        (a lone UTF-16 surrogate, e.g. from JSON "\\ud800"), which `tokenizers` refuses with a bare TypeError."""
        check_text(text)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what the structured-output grammar engine reads)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            **kwargs) -> str | list[int]:
        """One conversation rendered with the checkpoint's chat template (or `chat_template`), as
        transformers' apply_chat_template: the text, or with tokenize=True its token ids (no special
        tokens added: the template writes those it wants). continue_final_message: the text stops
        after the last message's content, to be continued. `kwargs` are more template variables
        (e.g. tools=[...]). InvalidRequestError if there is no template or it refuses the messages."""
        from hybrid.chat_template import normalize_messages, render_chat

        template = chat_template if chat_template is not None else self.chat_template
        if not template:
            raise InvalidRequestError("this checkpoint has no chat template (tokenizer_config.json has no "
                                      "'chat_template'): pass chat_template=..., or prompts to generate()")
        text = render_chat(template, normalize_messages(messages), self.config, add_generation_prompt, kwargs,
                           continue_final_message)
        return self.encode(text, add_special_tokens=False) if tokenize else text
