"""Tool-call tags that a tokenizer has as special tokens: decoding drops them from the output text
(the engine decodes without special tokens), so the server rebuilds a chat choice's text from its
token ids with those tags kept before a tool-call parser (hybrid/server/tool_parsers.py) reads it.
"""
from __future__ import annotations


class MarkerTokens:
    """The format's tags that this tokenizer has as single special tokens, which decoding drops
    from the output text (the engine decodes without special tokens): the output text is rebuilt
    from its token ids with them kept, for parsing. Inactive (the engine's text as it is) when the
    tags are plain text, as in most tokenizers."""

    def __init__(self, tokenizer, tags: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.ids: dict[int, str] = {}
        if tokenizer is None:
            return
        for tag in tags:
            tid = tokenizer.token_to_id(tag)
            if tid is None:
                continue
            try:
                dropped = tokenizer.decode([tid], skip_special_tokens=True) == ""
                kept = tokenizer.decode([tid], skip_special_tokens=False) == tag
            except Exception:  # noqa: BLE001 - an odd tokenizer: leave its text alone
                continue
            if dropped and kept:
                self.ids[tid] = tag

    def decoder(self) -> "MarkedText | None":
        return MarkedText(self) if self.ids else None


class MarkedText:
    """One choice's text with the tag tokens kept, rebuilt as its token ids grow (the text up to the
    last tag token is kept, only the rest is decoded again)."""

    def __init__(self, markers: MarkerTokens) -> None:
        self.markers = markers
        self.upto = 0  # token ids whose text is in `head`
        self.head = ""
        self.seen = False

    def text(self, token_ids: list[int], engine_text: str, stop_reason, finished: bool) -> str:
        ids = self.markers.ids
        decode = self.markers.tokenizer.decode
        for j in range(self.upto, len(token_ids)):
            tag = ids.get(token_ids[j])
            if tag is not None:
                self.head += decode(token_ids[self.upto:j]) + tag
                self.upto = j + 1
                self.seen = True
        if not self.seen:
            return engine_text
        text = self.head + decode(token_ids[self.upto:])
        if not finished:
            text = text.rstrip("\ufffd")  # a partial character: wait for the rest of it
        if isinstance(stop_reason, str) and stop_reason:  # the engine cut its text at the stop string
            at = text.find(stop_reason)
            if at != -1:
                text = text[:at]
        return text
