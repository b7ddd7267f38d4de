"""Tokenizer over the `tokenizers` library: tokenizer.json plus tokenizer_config.json.

Besides its own methods it has the part of Hugging Face's PreTrainedTokenizer surface that vLLM
users write against (LLM.get_tokenizer() returns it): eos_token_id, len(), tokenizer(text),
convert_ids_to_tokens, batch_decode, tokenize, apply_chat_template(tokenize=True),
return_tensors="pt" ...; names and defaults are transformers' unless a docstring says otherwise."""
from __future__ import annotations

import functools
import os
import re
from typing import Any

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


class BatchEncoding(dict):
    """What tokenizer(text) returns, as transformers' BatchEncoding: a dict ("input_ids",
    "attention_mask") whose keys also read as attributes (enc.input_ids)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


# transformers' model_max_length when tokenizer_config.json sets none (tokenization_utils_base.VERY_LARGE_INTEGER)
VERY_LARGE_INTEGER = int(1e30)
# the return_tensors values served: torch's and numpy's (transformers also has "mlx"; TF / JAX are gone from it)
_TENSOR_TYPES = ("pt", "np")


def _check_return_tensors(return_tensors) -> str | None:
    """return_tensors as "pt" / "np" / None (transformers' TensorType enum members are str, so they pass);
    ValueError for anything else, before any work is done."""
    if return_tensors is None:
        return None
    if return_tensors not in _TENSOR_TYPES:
        raise ValueError(f"return_tensors={return_tensors!r} is not supported: use 'pt' (torch), 'np' (numpy) "
                         "or None (lists)")
    return "pt" if return_tensors == "pt" else "np"


def _as_tensor(rows: list[list[int]], return_tensors: str, key: str = "input_ids"):
    """A [len(rows), n] int64 tensor of `rows`; ValueError, as transformers' "pt" without padding, if they
    differ in length (for "np" too, where transformers would make a ragged object array)."""
    width = len(rows[0]) if rows else 0
    if any(len(r) != width for r in rows):
        raise ValueError(f"Unable to create tensor: the texts' `{key}` differ in length "
                         f"({sorted({len(r) for r in rows})}) and this tokenizer does not pad; "
                         "pass texts of one length, or return_tensors=None for lists")
    if return_tensors == "pt":
        import torch

        return torch.tensor(rows, dtype=torch.long).reshape(len(rows), width)
    import numpy as np

    return np.array(rows, dtype=np.int64).reshape(len(rows), width)


# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES), in its order
SPECIAL_TOKENS_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_str(value) -> str | None:
    """A special token of tokenizer_config.json (a string or an AddedToken dict) as its string; None
    if absent or malformed (only eos/bos are checked strictly, as before: the others are optional)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _gpt2_byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the character that stands for each byte -> the byte. Printable
    Latin-1 bytes stand for themselves; the other 68 are mapped, in order, to U+0100 onwards."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(kept)
    extra = 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(kept, chars)}


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
        # HF's name_or_path: the directory as given; its model_max_length / padding_side / truncation_side
        self.name_or_path: str = os.fspath(model_dir)
        max_len = self.config.get("model_max_length")
        if isinstance(max_len, float) and max_len.is_integer():
            max_len = int(max_len)  # 1e+30 as some older files write it
        self.model_max_length: int = max_len if isinstance(max_len, int) and not isinstance(max_len, bool) \
            else VERY_LARGE_INTEGER
        self.padding_side: str = self._side(cfg_path, "padding_side")
        self.truncation_side: str = self._side(cfg_path, "truncation_side")
        self.eos_token_ids: set[int] = set(eos_token_ids)
        eos = self._special(self.config.get("eos_token"), cfg_path, "eos_token")
        if eos is not None:
            self.eos_token_ids.add(eos)
        self.bos_token_id = self._special(self.config.get("bos_token"), cfg_path, "bos_token")
        self.chat_template: str | None = _chat_template(self.config.get("chat_template"), cfg_path)
        # HF's special_tokens_map: the named special tokens tokenizer_config.json sets
        self.special_tokens_map: dict[str, str] = {
            k: t for k in SPECIAL_TOKENS_ATTRIBUTES if (t := _token_str(self.config.get(k))) is not None}
        # HF's eos_token_id is tokenizer_config.json's eos_token; without one, a single EOS id that
        # config.json / generation_config.json name is as good (HF would say None)
        if eos is None and len(self.eos_token_ids) == 1:
            eos = next(iter(self.eos_token_ids))
            if (eos_str := self._tok.id_to_token(eos)) is not None:
                self.special_tokens_map.setdefault("eos_token", eos_str)
        self.eos_token_id: int | None = eos
        self.eos_token: str | None = self.special_tokens_map.get("eos_token")
        self.bos_token: str | None = self.special_tokens_map.get("bos_token")
        self.pad_token: str | None = self.special_tokens_map.get("pad_token")
        self.unk_token: str | None = self.special_tokens_map.get("unk_token")
        self.pad_token_id: int | None = self.token_to_id(self.pad_token) if self.pad_token else None
        self.unk_token_id: int | None = self.token_to_id(self.unk_token) if self.unk_token else None

    def _side(self, cfg_path: str, key: str) -> str:
        """tokenizer_config.json's padding_side / truncation_side: "right" (the default) or "left"."""
        side = self.config.get(key, "right")
        if side not in ("right", "left"):
            raise CheckpointError(f"{cfg_path}: '{key}' must be 'right' or 'left', got {side!r}")
        return side

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
        """The number of ids, added tokens included (= len(tokenizer)). Unlike HF's vocab_size,
        which leaves the added tokens out: the structured-output engine relies on every id."""
        return self._tok.get_vocab_size()

    def __len__(self) -> int:
        """The vocabulary size with the added tokens, as HF's len(tokenizer)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        """Always true, as HF's: with __len__ defined, `if tokenizer:` would otherwise ask len()."""
        return True

    @functools.cached_property
    def max_token_id(self) -> int:
        """The largest id, added tokens included (vLLM's tokenizer attribute: len(tokenizer) - 1 for a
        vocabulary without gaps)."""
        return max(self.get_vocab().values(), default=-1)

    def get_vocab(self) -> dict[str, int]:
        """token -> id, added tokens included (as HF's get_vocab)."""
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def all_special_tokens(self) -> list[str]:
        """As HF's: the named special tokens (bos, eos, unk, sep, pad, cls, mask order), then the
        config's extra/additional special tokens, each once."""
        extra = self.config.get("extra_special_tokens") or self.config.get("additional_special_tokens") or []
        tokens = list(self.special_tokens_map.values())
        if isinstance(extra, list):
            tokens += [t for t in map(_token_str, extra) if t is not None]
        return list(dict.fromkeys(tokens))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in self.convert_tokens_to_ids(self.all_special_tokens) if i is not None]

    def encode(self, text: str, add_special_tokens: bool = True, *, return_tensors: str | None = None) -> Any:
        """Token ids of `text` (a list; with return_tensors="pt" / "np" a [1, n] tensor, as HF's).
        InvalidRequestError for a non-str or for text that is not valid Unicode (a lone UTF-16
        surrogate, e.g. from JSON "\\ud800"), which `tokenizers` refuses with a bare TypeError."""
        return_tensors = _check_return_tensors(return_tensors)
        check_text(text)
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids if return_tensors is None else _as_tensor([ids], return_tensors)

    def tokenize(self, text: str, pair: str | None = None, add_special_tokens: bool = False) -> list[str]:
        """The token strings of `text` (and `pair`), as HF's tokenize: no special tokens added by default."""
        check_text(text)
        if pair is not None:
            check_text(pair, "pair")
        return self._tok.encode(text, pair, add_special_tokens=add_special_tokens).tokens

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, *,
                 return_tensors: str | None = None) -> BatchEncoding:
        """HF's tokenizer(text) / tokenizer([texts]): {"input_ids", "attention_mask"} (all ones: no
        padding), a list per text for a list of texts. return_tensors="pt" / "np": [1, n] tensors for
        one text, [B, n] for B texts (ValueError if their lengths differ: nothing is padded)."""
        return_tensors = _check_return_tensors(return_tensors)
        batched = isinstance(text, (list, tuple))
        rows = [self.encode(t, add_special_tokens) for t in (text if batched else [text])]
        masks = [[1] * len(r) for r in rows]
        if return_tensors is not None:
            return BatchEncoding(input_ids=_as_tensor(rows, return_tensors),
                                 attention_mask=_as_tensor(masks, return_tensors, "attention_mask"))
        return BatchEncoding(input_ids=rows if batched else rows[0], attention_mask=masks if batched else masks[0])

    def decode(self, ids: int | list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids` (or of one id). NB skip_special_tokens defaults to True here (HF: False):
        the server and the engine rely on that."""
        return self._tok.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, tid: int) -> bytes:
        """The bytes token `tid` stands for: its decoded text's, except where that text is a partial UTF-8
        character (a byte-level BPE or byte-fallback token, decoded alone as U+FFFD), where they are the token's
        own bytes (the GPT-2 byte alphabet's, or <0xHH>'s). The bytes of consecutive tokens then join into
        the text they make."""
        text = self.decode([tid], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        raw = self._tok.id_to_token(tid)
        m = _BYTE_FALLBACK.fullmatch(raw or "")
        if m is not None:
            return bytes([int(m.group(1), 16)])
        byte_of = _gpt2_byte_decoder()
        if raw and all(c in byte_of for c in raw):
            return bytes(byte_of[c] for c in raw)
        return text.encode("utf-8")

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        """decode() of each sequence; skip_special_tokens defaults to False, as HF's batch_decode."""
        return self._tok.decode_batch([list(s) for s in sequences], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int],
                              skip_special_tokens: bool = False) -> str | None | list[str | None]:
        """The token string of an id (None for an id outside the vocabulary), or a list of them."""
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tok.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """The id of a token string, or a list of them; an unknown token gives the unk token's id
        (None without one), as HF's."""
        if isinstance(tokens, str):
            tid = self._tok.token_to_id(tokens)
            return self.unk_token_id if tid is None else tid
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what the structured-output grammar engine reads)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, conversation: list[dict] | list[list[dict]], *, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            tokenize: bool = True, return_dict: bool = False, return_tensors: str | None = None,
                            **kwargs) -> Any:
        """One conversation (or a list of them) rendered with the checkpoint's chat template (or
        `chat_template`), as transformers' apply_chat_template: by default its token ids (no special
        tokens added: the template writes those it wants), with tokenize=False the text, with
        return_dict=True (and tokenize) tokenizer()'s {"input_ids", "attention_mask"}; return_tensors="pt" /
        "np" (with tokenize) gives a [1, n] tensor for one conversation, [B, n] for B of one length.
        Differences from transformers 5: add_generation_prompt defaults to True (vLLM's chat does so)
        and return_dict to False (transformers 4's default, which vLLM-era code expects).
        continue_final_message: the text stops after the last message's content, to be continued.
        tools / documents (when given) and `kwargs` are template variables (e.g. enable_thinking=False).
        InvalidRequestError if there is no template or it refuses the messages."""
        from hybrid.chat_template import normalize_messages, render_chat

        return_tensors = _check_return_tensors(return_tensors)
        template = chat_template if chat_template is not None else self.chat_template
        if not template:
            raise InvalidRequestError("this checkpoint has no chat template (tokenizer_config.json has no "
                                      "'chat_template'): pass chat_template=..., or prompts to generate()")
        # only given ones are defined in the template, as LLM.chat and the server render them
        variables = {**kwargs, **{k: v for k, v in (("tools", tools), ("documents", documents)) if v is not None}}
        batched = (isinstance(conversation, (list, tuple)) and bool(conversation)
                   and all(isinstance(c, (list, tuple)) for c in conversation))
        texts = [render_chat(template, normalize_messages(c), self.config, add_generation_prompt, variables,
                             continue_final_message) for c in (conversation if batched else [conversation])]
        rendered: str | list[str] = texts if batched else texts[0]
        if not tokenize:
            return rendered
        enc = self(rendered, add_special_tokens=False, return_tensors=return_tensors)
        return enc if return_dict else enc["input_ids"]
