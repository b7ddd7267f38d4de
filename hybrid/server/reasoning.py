"""Reasoning outputs: a thinking model's chain of thought split from its answer, as vLLM's
`--reasoning-parser` does, into the chat message's `reasoning` (also sent as `reasoning_content`,
the older name many clients read) and `content`.

The models served here think between `<think>` and `</think>` (NVIDIA Nemotron 3 Nano and Nemotron
Nano v2, Falcon-H1R, and the Qwen3 / DeepSeek-R1 convention their names come from). Where the output
starts is read from the rendered prompt, not guessed from the output:
- the prompt's last `<think>` is still open (a template that opens the thought itself, as Nemotron 3's
  does with thinking on): the output starts inside the reasoning;
- the prompt closed it (`<think></think>`, thinking turned off by chat_template_kwargs) or has none:
  the output is the answer, unless it opens a thought itself first.
The reasoning runs until `</think>`; an output that ends before it (max_tokens) is all reasoning and
has no content. Whitespace at the edges of the reasoning and before the answer is dropped.

ReasoningStream does this the same way for a whole text and for a stream of deltas, so a streamed
choice and the same choice returned whole carry the same reasoning and content.
"""
from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"

# vLLM's names for this format (they differ there only in guesses this module does not make)
REASONING_PARSERS = ("deepseek_r1", "qwen3", "nemotron_v3", "nano_v3")


def check_reasoning_parser(name: str | None) -> None:
    """ValueError for a name that is not one of REASONING_PARSERS (None: no parser)."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; the parsers are: {', '.join(REASONING_PARSERS)}")


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt leaves a thought open: its last `<think>` has no `</think>` after it."""
    start = prompt.rfind(THINK_START)
    return start != -1 and prompt.find(THINK_END, start) == -1


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (it may still become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One choice's output, fed as it grows (or whole with final=True), as ordered pieces
    ("reasoning", text) and ("content", text). Text that may still be a tag, and whitespace that may
    be dropped, is held back until it is known."""

    def __init__(self, in_reasoning: bool) -> None:
        # "open": before the output's first non-space, which may be a <think> (a thought opened by the
        # output, or opened again by a model whose template opened it already); then "reasoning" or
        # "content", as the prompt left it when there is no tag
        self.phase = "open"
        self.after_open = "reasoning" if in_reasoning else "content"
        self.buf = ""
        self.started = False  # reasoning text given out (leading whitespace is dropped until then)
        self.answer_started = False  # content given out (leading whitespace after </think> is dropped)

    def feed(self, delta: str, final: bool = False) -> list[tuple[str, str]]:
        pieces: list[tuple[str, str]] = []
        self.buf += delta
        while True:
            if self.phase == "open":
                body = self.buf.lstrip()
                if body.startswith(THINK_START):
                    self.buf = body[len(THINK_START):]
                    self.phase = "reasoning"
                    continue
                if not final and (not body or THINK_START.startswith(body)):
                    break  # may still open a thought
                self.phase = self.after_open
                # an answer from the start keeps its text exactly (whitespace is dropped only after </think>)
                self.answer_started = self.phase == "content"
                continue
            if self.phase == "reasoning":
                end = self.buf.find(THINK_END)
                if end != -1:
                    self._reasoning(pieces, self.buf[:end].rstrip())
                    self.buf = self.buf[end + len(THINK_END):]
                    self.phase = "content"
                    continue
                if final:
                    self._reasoning(pieces, self.buf.rstrip())
                    self.buf = ""
                    break
                keep = _held_prefix(self.buf, THINK_END)
                text = self.buf[:len(self.buf) - keep]
                body = text.rstrip()  # trailing whitespace: dropped if </think> follows
                self._reasoning(pieces, body)
                self.buf = text[len(body):] + self.buf[len(self.buf) - keep:]
                break
            # content
            text = self.buf
            if not self.answer_started:
                text = text.lstrip()
                if not text:
                    self.buf = ""
                    break
                self.answer_started = True
            if text:
                pieces.append(("content", text))
            self.buf = ""
            break
        return pieces

    def _reasoning(self, pieces: list, text: str) -> None:
        if not self.started:
            text = text.lstrip()
            if not text:
                return
            self.started = True
        if text:
            pieces.append(("reasoning", text))


@dataclass(frozen=True)
class ReasoningMode:
    """How one request's output is read: in_reasoning, whether it starts inside a thought (the
    prompt left one open, see prompt_opens_reasoning)."""
    in_reasoning: bool

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""
        reasoning, content = [], []
        for kind, piece in ReasoningStream(self.in_reasoning).feed(text, final=True):
            (reasoning if kind == "reasoning" else content).append(piece)
        return "".join(reasoning) or None, "".join(content) or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.in_reasoning)
