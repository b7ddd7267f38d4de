"""Tokenizer.token_bytes: each token's own bytes, which join into the text also where tokens split a UTF-8
character (a chat logprob's `bytes`), for a byte-level BPE (the bundled model's) and a byte-fallback one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import hybrid
from hybrid.tokenizer import Tokenizer

TEXTS = ["🙂🙂 é", "plain words", "日本語 and ümlauts", "\n\t mixed 🙂x"]


def test_byte_level_bpe():
    tok = Tokenizer(str(Path(hybrid.__file__).parent / "default_model"))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.token_bytes(0) == b"<|endoftext|>"  # (a special token: its text)


def test_byte_fallback(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers, pre_tokenizers  # noqa: F401

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁plain", "▁words", "▁and", "▁mixed", "x", "▁"):
        vocab[piece] = len(vocab)
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    tok = Tokenizer(str(tmp_path))
    for text, chars in (("🙂 mixed", "🙂"), ("plain 日本", "日本")):
        ids = tok.encode(text, add_special_tokens=False)
        partial = [i for i in ids if tok.decode([i]) == "\ufffd"]  # (the case: parts of characters)
        assert partial and b"".join(tok.token_bytes(i) for i in partial) == chars.encode("utf-8")
        # the other tokens: their text alone (a word's leading space is the decoder's to strip, as decode's)
        assert all(tok.token_bytes(i) == tok.decode([i]).encode() for i in ids if i not in partial)
