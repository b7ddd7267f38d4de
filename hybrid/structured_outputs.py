"""Structured outputs, as vLLM shapes them: a JSON schema, any JSON object, a regex, a choice of
strings or a Lark grammar constrains what a request may generate.

The grammar engine is llguidance (a small, dependency-free abi3 wheel; vLLM's "guidance" backend).
It reads the checkpoint's tokenizer.json directly, through the same Rust `tokenizers` library
hybrid/tokenizer.py wraps. Each sequence (each branch of a request with n > 1) has its own
matcher (SequenceGrammar), advanced with every token the sequence accepts. Before each step
samples, the host fills one token bitmask row per constrained logits row (llguidance, one bit per
token id), the masks are uploaded and applied to the logits on the device (apply_token_bitmask),
after the forward pass (and any replayed CUDA graph) and before the sampler.

A request's grammar is compiled and checked once, at add_request (GrammarCompiler.matchers): an
invalid schema, regex or grammar is an InvalidRequestError naming the problem.
"""
from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from hybrid.batch import to_device
from hybrid.errors import InvalidRequestError

# JSON whitespace between tokens, where a gap may take some: flexible, as vLLM's, but at most 20 characters
# per gap (unbounded whitespace lets a model spend every token it has on it, a known failure of small models)
DEFAULT_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,20}"

# the constraint fields of StructuredOutputsParams, exactly one of which is set
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's StructuredOutputsParams): exactly one of
    - json: a JSON schema (a dict, or its JSON text);
    - regex: a regular expression (Rust `regex` syntax) the whole output matches;
    - choice: a list of strings, one of which is the whole output;
    - grammar: a Lark grammar (llguidance's dialect; GBNF is accepted too);
    - json_object: True: any JSON object.
    disable_any_whitespace: JSON without optional whitespace (default: flexible whitespace, as vLLM's,
    at most 20 characters per gap, see DEFAULT_WHITESPACE); whitespace_pattern: a regex for that
    whitespace instead;
    disable_additional_properties: objects of the schema take no properties beyond the listed ones
    unless the schema says otherwise (additionalProperties: false wherever it is unset);
    start_after_token_id: the constraint holds only after the output's first such token, the output
    before it is free (a thinking model's end of thought: the server sets it with a reasoning parser,
    so the answer, not the thought, matches the schema)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    start_after_token_id: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Shape checks (the grammar itself is compiled and checked at add_request)."""
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured outputs take exactly one of json, regex, choice, grammar, json_object; got "
                + (", ".join(given) if given else "none"))
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise InvalidRequestError(f"structured outputs: json is not a valid JSON schema: "
                                              f"not JSON text ({e})") from None
            else:
                schema = self.json
                try:
                    json.dumps(schema)
                except (TypeError, ValueError) as e:
                    raise InvalidRequestError(f"structured outputs: json is not a valid JSON schema: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("structured outputs: json must be a JSON schema (an object), "
                                          f"got {type(schema).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise InvalidRequestError(f"structured outputs: regex must be a string, got {type(self.regex).__name__}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise InvalidRequestError("structured outputs: grammar must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("structured outputs: choice must be a non-empty list of strings")
        if self.json_object is not None and self.json_object is not True:
            raise InvalidRequestError("structured outputs: json_object must be true")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"structured outputs: {name} must be a boolean")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise InvalidRequestError("structured outputs: whitespace_pattern must be a string (a regex)")
        t = self.start_after_token_id
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise InvalidRequestError("structured outputs: start_after_token_id must be a token id (an integer >= 0)")

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    def key(self) -> str:
        """A text that identifies the grammar (for the compiled-grammar cache)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        return json.dumps([self.kind, value, self.disable_any_whitespace, self.disable_additional_properties,
                           self.whitespace_pattern])

    def llguidance_grammar(self) -> str:
        """The llguidance grammar text (not yet checked: GrammarCompiler does that)."""
        import llguidance

        options = {"whitespace_flexible": not self.disable_any_whitespace}
        if not self.disable_any_whitespace:
            options["whitespace_pattern"] = self.whitespace_pattern or DEFAULT_WHITESPACE
        kind = self.kind
        try:
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
            if kind == "json":
                schema = self.json
                if self.disable_additional_properties:
                    schema = _no_additional_properties(json.loads(schema) if isinstance(schema, str) else schema)
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            if kind == "choice":
                # one terminal whose alternatives are the choices: the lexer walks them as one automaton.
                # (Alternatives of the start rule, llguidance's own "choice", put every choice in one Earley
                # row, and a row of more than 2,000 fails the request after its first token.)
                alternatives = " | ".join(json.dumps(c) for c in self.choice)
                return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {alternatives}")
            if kind == "regex":
                # \d and \w as ASCII classes, as vLLM's default grammar engine and JSON schemas' patterns read them
                # (the regex crate's are Unicode: \d{4} gave digits of any script)
                return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(self.regex, 'dw')}/")
            return llguidance.grammar_from("grammar", self.grammar)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"structured outputs: invalid {kind}: {e}") from None


def _no_additional_properties(schema: Any) -> Any:
    """A copy of the schema with additionalProperties: false on every object schema that leaves it unset."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (node.get("type") == "object" or "properties" in node) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    return schema


def check_available() -> None:
    """InvalidRequestError if llguidance (a base dependency) is not installed."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        raise InvalidRequestError("structured outputs need the llguidance package: pip install llguidance") from None


class SequenceGrammar:
    """One sequence's matcher: the state of its grammar after the tokens it has accepted. With
    `waiting_for` set the grammar is not active yet: the output is free until that token comes (see
    StructuredOutputsParams.start_after_token_id), and the matcher starts after it."""

    __slots__ = ("matcher", "waiting_for")

    def __init__(self, matcher, waiting_for: int | None = None) -> None:
        self.matcher = matcher
        self.waiting_for = waiting_for

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (its mask applies)."""
        return self.waiting_for is None

    def accept(self, token: int) -> bool:
        """Advance past an accepted token; False (the matcher then stays in its error state) if the
        grammar does not allow it."""
        if self.waiting_for is not None:
            if token == self.waiting_for:
                self.waiting_for = None
            return True
        return self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but EOS may follow (the sequence stops here)."""
        return self.waiting_for is None and self.matcher.is_stopped()

    def error(self) -> str:
        return self.matcher.get_error()

    @property
    def failed(self) -> bool:
        """The matcher hit an error of its own (e.g. a grammar too large to lex at this position): its mask
        then allows only the end, so the output would stop as if complete."""
        return self.waiting_for is None and self.matcher.is_error()

    def fork(self) -> SequenceGrammar:
        return SequenceGrammar(self.matcher.deep_copy(), self.waiting_for)


def _one_line(error: str) -> str:
    """llguidance's error message on one line, without its source listing and caret lines."""
    lines = [ln.strip() for ln in error.splitlines()]
    return " ".join(ln for ln in lines if ln and not re.fullmatch(r"\^+|\d+ \|.*", ln))


def _token_table(tok, tokenizer_json: str):
    """llguidance's view of a tokenizer whose decoder it cannot read: the bytes of every token
    (Tokenizer.token_bytes: its text decoded alone, or its own bytes where it is part of a UTF-8
    character, which decodes alone as U+FFFD), its special tokens, and its encoder."""
    import llguidance

    added = json.loads(tokenizer_json).get("added_tokens") or []

    class Table:
        eos_token_id = min(tok.eos_token_ids) if tok.eos_token_ids else None
        bos_token_id = tok.bos_token_id
        tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        special_token_ids = sorted(t["id"] for t in added if t.get("special"))

        def __call__(self, text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

    return llguidance.TokenizerWrapper(Table())


class GrammarCompiler:
    """One per engine: the llguidance view of the tokenizer (built on first use), compiled grammars
    (a small cache: a request repeated with the same schema compiles once), and the executor that
    fills the bitmasks of a step."""

    CACHE_SIZE = 64

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._executor = None
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key -> a fresh matcher (deep-copied for use)
        self._lock = threading.Lock()  # validate_request may run on another thread than the engine
        self.mask_words = 0

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance

            tok = self.tokenizer
            n_vocab = max(self.vocab_size, tok.vocab_size)
            text = tok.to_json()
            eos = self.eos_token_ids or None
            try:
                self._ll_tokenizer = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
            except ValueError:  # a decoder llguidance does not read (e.g. Fuse): from each token's text
                self._ll_tokenizer = llguidance.LLTokenizer(_token_table(tok, text), n_vocab=n_vocab, eos_token=eos)
            self.mask_words = (n_vocab + 31) // 32
        return self._ll_tokenizer

    def matchers(self, params: StructuredOutputsParams, n: int) -> list[SequenceGrammar]:
        """n matchers of the request's grammar in its initial state (one per branch); InvalidRequestError
        naming the problem if the grammar does not compile."""
        if self.tokenizer is None:
            raise InvalidRequestError("structured outputs need the checkpoint's tokenizer (tokenizer.json)")
        check_available()
        import llguidance

        key = params.key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
            else:
                tok = self._tokenizer()
                grammar = params.llguidance_grammar()
                error = llguidance.LLMatcher.validate_grammar(grammar, tok)
                if error:
                    raise InvalidRequestError(f"structured outputs: invalid {params.kind}: {_one_line(error)}")
                template = llguidance.LLMatcher(tok, grammar, log_level=0)
                # the first mask builds the lexer states every copy starts from (a second for some regexes):
                # here, on the validating thread, rather than in a step that other requests share
                template.compute_bitmask()
                if template.is_error():
                    raise InvalidRequestError(f"structured outputs: invalid {params.kind}: "
                                              f"{_one_line(template.get_error())}")
                self._cache[key] = template
                if len(self._cache) > self.CACHE_SIZE:
                    self._cache.popitem(last=False)
        return [SequenceGrammar(template.deep_copy(), params.start_after_token_id) for _ in range(n)]

    def fill_bitmasks(self, grammars: list[SequenceGrammar], pin: bool) -> torch.Tensor:
        """The allowed tokens of each grammar's next position: [len(grammars), mask_words] int32 on the
        host (bit t % 32 of word t // 32 set: token t allowed)."""
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        masks = torch.empty((len(grammars), self.mask_words), dtype=torch.int32, pin_memory=pin)
        self._executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)],
                                               masks.data_ptr(), self.mask_words * 4, len(grammars))
        return masks


_BIT = {}


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` [R, V] with every token that masks[j] (host, [len(rows), words] int32) does
    not allow set to -inf on row rows[j]. The masks travel to the device without a host sync."""
    dev = logits.device
    vocab = logits.shape[-1]
    mask = masks.to(dev, non_blocking=True) if dev.type == "cuda" else masks
    bit = _BIT.get(dev)
    if bit is None:
        bit = _BIT[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((mask[:, :, None] >> bit) & 1).reshape(mask.shape[0], -1)
    if allowed.shape[1] < vocab:  # (a mask narrower than the logits: the rest is not allowed)
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    allowed = allowed[:, :vocab].bool()
    index = to_device(rows, torch.long, dev)
    return logits.index_copy(0, index, logits[index].masked_fill(~allowed, float("-inf")))


def GuidedDecodingParams(*, backend: str | None = None, disable_fallback: bool | None = None,  # noqa: N802
                         **fields) -> StructuredOutputsParams:
    """vLLM's older name for StructuredOutputsParams (SamplingParams(guided_decoding=...)), for code written
    against it. Its `backend` and `disable_fallback` are accepted and change nothing: llguidance compiles
    every constraint here."""
    return StructuredOutputsParams(**fields)
