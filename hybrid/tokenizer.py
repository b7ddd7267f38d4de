"""Tokenizer over the `tokenizers` library: tokenizer.json plus tokenizer_config.json."""
from __future__ import annotations

import json
import os

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


class Tokenizer:
    def __init__(self, model_dir: str, eos_token_ids: tuple[int, ...] = ()) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise CheckpointError(f"missing file: {path}")
        self._tok = _Tokenizer.from_file(path)
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        self.config: dict = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                self.config = json.load(f)
        self.eos_token_ids: set[int] = set(eos_token_ids)
        eos = self._special(self.config.get("eos_token"))
        if eos is not None:
            self.eos_token_ids.add(eos)
        self.bos_token_id = self._special(self.config.get("bos_token"))
        self.chat_template: str | None = self.config.get("chat_template")

    def _special(self, token) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        if not token:
            return None
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

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
