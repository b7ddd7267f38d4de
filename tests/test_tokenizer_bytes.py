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


def _byte_fallback_tokenizer(path) -> Tokenizer:
    """A SentencePiece-style BPE with byte fallback (<0xHH> pieces) and a Fuse decoder (one llguidance does
    not read: structured outputs then build its token table from Tokenizer.token_bytes)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers, pre_tokenizers  # noqa: F401

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("▁plain", "▁words", "▁and", "▁mixed", "x", "▁"):
        vocab[piece] = len(vocab)
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({}))
    return Tokenizer(str(path))


def test_byte_fallback(tmp_path):
    tok = _byte_fallback_tokenizer(tmp_path)
    for text, chars in (("🙂 mixed", "🙂"), ("plain 日本", "日本")):
        ids = tok.encode(text, add_special_tokens=False)
        partial = [i for i in ids if tok.decode([i]) == "\ufffd"]  # (the case: parts of characters)
        assert partial and b"".join(tok.token_bytes(i) for i in partial) == chars.encode("utf-8")
        # the other tokens: their text alone (a word's leading space is the decoder's to strip, as decode's)
        assert all(tok.token_bytes(i) == tok.decode([i]).encode() for i in ids if i not in partial)


def test_grammar_over_byte_fallback_tokens_from_the_token_table(tmp_path, monkeypatch):
    """A choice of a character that only byte-fallback tokens spell, with llguidance's view built from the token
    table (as for a decoder llguidance does not read; forced here): the grammar allows their bytes in turn and
    completes. (With each token's decoded text, U+FFFD, no token could start it.)"""
    llguidance = pytest.importorskip("llguidance")
    from hybrid.structured_outputs import GrammarCompiler, StructuredOutputsParams

    real = llguidance.LLTokenizer

    def unreadable_decoder(tokenizer, **kw):
        if isinstance(tokenizer, str):  # the tokenizer.json: refused, as an unknown decoder is
            raise ValueError("can't determine decoder type")
        return real(tokenizer, **kw)

    monkeypatch.setattr(llguidance, "LLTokenizer", unreadable_decoder)

    tok = _byte_fallback_tokenizer(tmp_path)
    compiler = GrammarCompiler(tok, tok.vocab_size, {0})
    # (two choices: a single one would be forced along the encoder's tokens, whose first is an empty "▁")
    grammar = compiler.matchers(StructuredOutputsParams(choice=["🙂", "🙃x"]), 1)[0]
    ids = [1 + b for b in "🙂".encode("utf-8")]  # <0xF0> <0x9F> <0x99> <0x82>
    assert all(tok.decode([i]) == "\ufffd" for i in ids)
    for tid in ids:
        mask = compiler.fill_bitmasks([grammar], pin=False)[0]
        allowed = [t for t in range(tok.vocab_size) if (int(mask[t // 32]) >> (t % 32)) & 1]
        assert tid in allowed, (tid, allowed)
        assert grammar.accept(tid)
    assert grammar.finished and not grammar.failed
