"""Sampling parameters, the sampler and the log-probabilities of what it samples (the logits
processing before it, allowed tokens, bad words, penalties, logit bias and min_tokens, is
hybrid/logits_processing.py).

Each request branch draws from its own counter-based stream (SampleStream): draw i of a stream is
splitmix64 of the stream's key (from `seed`, or from the engine's seed and the request's arrival
order) and of i, computed on the host in Python integers. A sampled row takes exactly one draw per
token, so a seeded request samples the same tokens whatever else is in the batch, whatever the batch
size, on CPU and on CUDA, with or without speculation or preemption. Any Python int is a valid seed:
it is reduced modulo 2**64 (see generator_seed), so seeds that differ by a multiple of 2**64 sample
the same tokens.

How a sampled row picks its token (sample_tokens): temperature, top-k, then top-p over the
top-k-renormalised probabilities, then min-p (relative to the top probability), then one draw from
what is left by inverse CDF over the kept tokens in vocabulary order. The masses are fixed point
(probability * 2**52 as int64), so every sum and cumulative sum is exact, whatever the order or the
device; the floats are the softmax and one multiplication per top-p threshold. The cut-offs are
values: a token is kept when its logit is at least the k-th largest (top-k), when the top-k mass
strictly above its probability is below top_p (top-p), when its probability is at least min_p times
the top one (min-p); tied tokens are kept or dropped together (the sort-order tie-break of a
position-based cut would make the kept set depend on the sort).

No full-vocabulary sort in the common case: the candidates are the top C logits (torch.topk,
C = max(PREFILTER_CANDIDATES, largest top_k + 1)). The thresholds come from them, and the row is
exact from them when they provably hold every token it can keep: the smallest candidate is below the
top-k value, the top-p cut or the min-p floor, or weighs nothing (and the top-k mass top-p divides
by is all among them). A row that fails the check (a flat distribution whose nucleus is wider than
C) is redone over its full row, on CUDA by one Triton kernel with no host sync (_fallback_kernel),
elsewhere from a full sort of only those rows: the same thresholds and the same draw, so the token
does not depend on C or on the path. Rows without top-k/top-p/min-p draw over the full row (no topk).
"""
from __future__ import annotations

import copy
import enum
import logging
import math
import os
from dataclasses import dataclass

import torch

from hybrid.batch import to_device
from hybrid.errors import InvalidRequestError
from hybrid.ops import triton_greedy, triton_sampling
from hybrid.sample_stream import GENERATOR_SEED_RANGE, SampleStream, draw_bits, generator_seed, splitmix64  # noqa: F401
from hybrid.ops.triton_guard import HAS_TRITON, switch
from hybrid.outputs import Logprob
from hybrid.structured_outputs import (  # noqa: F401 (re-exported: hybrid.sampling.StructuredOutputsParams, ...)
    GuidedDecodingParams, StructuredOutputsParams,
)

logger = logging.getLogger(__name__)

# Temperatures below this sample greedily (see SamplingParams.greedy).
GREEDY_TEMPERATURE = 1e-5


# Prefilter size of sample_tokens: the top this-many logits of a row with top-k/top-p/min-p (raised to
# top_k + 1 for larger top_k). A row whose kept tokens do not provably fit is redone over its full row.
PREFILTER_CANDIDATES = 1024

# Fixed point of the sampler's masses: a probability p weighs trunc(p * 2**52) (int64; a row sums to
# at most 2**52 + rounding, far from overflow).
FIXED_ONE = 1 << 52

# SamplingParams(max_tokens=None): the output runs until the context is full, which every bound on it reaches first
UNBOUNDED_MAX_TOKENS = 2**62
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-4, 1e4


class RequestOutputKind(enum.IntEnum):
    """vLLM's: what each output of a request driven step by step (Engine.add_request) carries. CUMULATIVE:
    everything so far; DELTA: the tokens, logprobs and text new since the last output; FINAL_ONLY: one output,
    when it ends. LLM.generate returns finished requests whatever it says, as vLLM's does."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# the engine's output kinds (hybrid.output_processor.OUTPUT_KINDS) of vLLM's
ENGINE_OUTPUT_KIND = {RequestOutputKind.CUMULATIVE: "cumulative", RequestOutputKind.DELTA: "text_delta",
                      RequestOutputKind.FINAL_ONLY: "final"}


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None (as vLLM's): until the context is full
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None  # any int (negative or huge too): reduced modulo 2**64, see generator_seed
    stop_token_ids: list[int] | None = None  # (None becomes [], as vLLM's)
    stop: list[str] | str | None = None  # (a string becomes [it], None [], as vLLM's)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probabilities returned per generated token
    # per prompt token (from the second on): its log-probability given the tokens before it, plus
    # this many top entries (0: only the prompt token's); RequestOutput.prompt_logprobs
    prompt_logprobs: int | None = None
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the top one's
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # ... times the number of times it was generated
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or output: / if > 0, * if < 0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # JSON schema / JSON object / regex / choice / grammar the output must match (hybrid/structured_outputs.py)
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name for structured_outputs
    # The output text: special tokens kept (False) or dropped (True); stop strings are matched on that text
    skip_special_tokens: bool = True
    # Accepted for vLLM compatibility; the `tokenizers` library's decode has no such switch, so the
    # text between special tokens is whatever the tokenizer's own decoder makes of it
    spaces_between_special_tokens: bool = True
    # The stop string (or the text of the EOS / stop_token_ids token) that ended the output stays in the text
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None  # only these tokens can be generated (greedy too)
    # Words never generated: each (and its form with a leading space) as tokens; a one-token word's token is
    # masked always, a longer word's last token when the output ends with the tokens before it
    bad_words: list[str] | None = None
    # Keep only the last k prompt tokens (k >= 1); -1: the longest prompt the context takes (max_model_len - 1,
    # one token must still be generated)
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True  # False (vLLM's): token ids only, no text is made (and no stop strings)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # (vLLM's; see RequestOutputKind)
    extra_args: dict | None = None  # (vLLM's: arguments for custom extensions; kept, not read here)

    def __post_init__(self) -> None:
        self.validate()

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's SamplingParams.clone), to change without touching this one."""
        return copy.deepcopy(self)

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """vLLM's constructor that takes None for "the default" on every field (as OpenAI requests send them)."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def validate(self) -> None:
        def bad(field_name: str, why: str) -> InvalidRequestError:
            value = getattr(self, field_name)
            return InvalidRequestError(f"invalid sampling parameter {field_name}={value!r}: {why}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.max_tokens is None:  # (every use is a bound next to the context's: this one never binds)
            self.max_tokens = UNBOUNDED_MAX_TOKENS
        if self.top_k == 0 and not isinstance(self.top_k, bool):  # vLLM's and transformers' "off"
            self.top_k = -1
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (off) or an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "must be an integer")
        # (-1, as vLLM's: the whole vocabulary; the engine reads it so when the request is added)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < -1):
            raise bad("logprobs", "must be an integer >= 0, or -1 for the whole vocabulary")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool) or self.prompt_logprobs < -1):
            raise bad("prompt_logprobs", "must be an integer >= 0, or -1 for the whole vocabulary")
        if self.stop_token_ids is None:  # (as vLLM's: a list, to extend)
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integers")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.min_p, (int, float)) or not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must be in [0, 1]")
        if not isinstance(self.min_tokens, int) or not (0 <= self.min_tokens <= self.max_tokens):
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not (-2.0 <= v <= 2.0):
                raise bad(name, "must be in [-2, 2]")
        # (> 0 as vLLM asks, within what keeps the penalised fp32 logits finite: 1e-300 is 0 in fp32, and a
        # logit over it is inf)
        if not isinstance(self.repetition_penalty, (int, float)) or isinstance(self.repetition_penalty, bool) \
                or not (MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise bad("repetition_penalty", f"must be a number in [{MIN_REPETITION_PENALTY:g}, "
                                            f"{MAX_REPETITION_PENALTY:g}] (1.0: off)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must map token ids to numbers")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise bad("logit_bias", "must map token ids to numbers") from None
            if any(not (-100.0 <= v <= 100.0) for v in self.logit_bias.values()):
                raise bad("logit_bias", "values must be in [-100, 100]")
        if self.guided_decoding is not None:  # (moved to structured_outputs, so a copy made by replace() agrees)
            if self.structured_outputs is not None:
                raise bad("guided_decoding", "is the older name of structured_outputs: give one of them")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise bad("structured_outputs", f"not a StructuredOutputsParams: {e}") from None
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:  # (as vLLM's: a list, to extend)
            self.stop = []
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        self.stop = list(self.stop)
        if self.stop and self.detokenize is False:
            raise bad("stop", "stop strings are matched on the text: they need detokenize=True")
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                     "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise bad("output_kind", "must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)") from None
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "must be a dict")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be a list of token ids (integers)")
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must not be empty: no token could be generated")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)) \
                    or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise bad("bad_words", "must be a list of strings that are not empty or all whitespace")
            self.bad_words = list(self.bad_words)
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int) or isinstance(self.truncate_prompt_tokens, bool)
                or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)):
            raise bad("truncate_prompt_tokens", "must be an integer >= 1, or -1 (as much of the prompt as fits)")

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE, logits / temperature overflow fp32 (1e-40: inf - inf = NaN in the
        # softmax, a garbage token); such a temperature means argmax anyway (vLLM uses the same 1e-5).
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before sampling (greedy rows too): allowed tokens, bad words,
        bias, min_tokens, penalties."""
        return (bool(self.logit_bias) or self.min_tokens > 0 or self.penalised or self.allowed_token_ids is not None
                or bool(self.bad_words))


# generation_config.json's sampling fields and what they are here (HF max_new_tokens is max_tokens), as vLLM reads them
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(gen: dict | None, where: str = "generation_config.json") -> dict:
    """The SamplingParams defaults a model's generation_config.json recommends (vLLM applies them to
    every request that does not set the field): temperature, top_p, top_k (0: off), min_p,
    repetition_penalty and max_new_tokens (as max_tokens). InvalidRequestError naming the field if
    one is not a valid value."""
    out: dict = {}
    for name, field_name in GENERATION_FIELDS.items():
        value = (gen or {}).get(name)
        if value is None:
            continue
        if field_name == "top_k" and value == 0:  # transformers: top_k 0 means no top-k filtering
            value = -1
        out[field_name] = value
    try:
        SamplingParams(**out)
    except (InvalidRequestError, TypeError) as e:
        raise InvalidRequestError(f"{where}: {e}") from None
    return out


def generation_overrides(value, where: str = "override_generation_config") -> dict:
    """vLLM's override_generation_config: SamplingParams defaults in generation_config.json's names (over the
    checkpoint's own). ConfigurationError for something else than such a dict, a key that is not one of
    GENERATION_FIELDS, or a bad value."""
    from hybrid.errors import ConfigurationError

    if not isinstance(value, dict):
        raise ConfigurationError(f"{where} must be a dict of sampling defaults, got {value!r}")
    unknown = sorted(set(value) - set(GENERATION_FIELDS))
    if unknown:
        raise ConfigurationError(f"{where}: {', '.join(map(str, unknown))} not among the sampling defaults it sets "
                                 f"({', '.join(GENERATION_FIELDS)})")
    try:
        return generation_defaults(value, where)
    except InvalidRequestError as e:
        raise ConfigurationError(str(e)) from None


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: "SampleStream | torch.Generator | None") -> int:
    """Next token for one request from its fp32 logits row [V] (syncs: for the rare per-row paths).
    Takes one draw from `generator`, as sample_tokens does for the row."""
    return int(sample_tokens(logits[None], [params], [generator])[0][0])


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's argmax [R] int64, whether the logit there is finite [R] bool) of logits [R, V]: on CUDA
    with triton two small launches (hybrid/ops/triton_greedy.py: torch's argmax of a long row is one ~22 us
    kernel; HYBRID_TRITON_GREEDY=0 keeps torch's), elsewhere torch.argmax; the same tokens either way (NaN the
    maximum, ties to the lowest index)."""
    if (logits.is_cuda and HAS_TRITON and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[1]
            and switch("triton_greedy")):
        return triton_greedy.greedy_tokens(logits)
    tokens = logits.argmax(dim=-1)
    return tokens, torch.isfinite(logits.gather(1, tokens[:, None])[:, 0])


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams | None],
                  generators: list["SampleStream | torch.Generator | None"], *,
                  candidates: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of every logits row [R, V] (fp32), on the device and without a host sync, so that a
    step can be launched before the previous one's tokens reach the host (Engine async scheduling).
    Row i follows params[i] (None: argmax) and takes one draw from generators[i] (a SampleStream;
    see _draw for the other kinds): a row's token is a function of its own logits, parameters and
    draw only, never of the other rows (nor of `candidates`, the prefilter size, default
    PREFILTER_CANDIDATES), and sample_row is the same on one row.

    No host sync on CUDA (with triton: rows the prefilter does not cover are redone by a kernel);
    with HYBRID_SAMPLER_FALLBACK=sync, or without triton, finding those rows reads one tensor back
    (see _sample_filtered). On CPU the same host check costs nothing.

    Also returns `finite` [R] (bool): whether the row's maximum is finite. It costs a gather of R
    values on top of the argmax every row needs anyway: argmax propagates NaN (a NaN anywhere in a
    row is its "maximum"), so a row with a NaN or a +Inf is flagged. (-Inf entries are legitimate:
    masked tokens.)"""
    tokens, finite = greedy_tokens(logits)
    rows = [i for i, p in enumerate(params) if p is not None and not p.greedy]
    if not rows:
        return tokens, finite
    dev = logits.device
    draws = [draw_bits(generators[i]) for i in rows]  # one draw per sampled row, on the host
    every = len(rows) == logits.shape[0]
    index = None if every else to_device(rows, torch.long, dev)
    chosen = _sample_rows(logits if every else logits[index], [params[i] for i in rows], draws,
                          PREFILTER_CANDIDATES if candidates is None else candidates)
    if every:
        return chosen, finite
    tokens[index] = chosen
    return tokens, finite


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], draws: list[int], candidates: int) -> torch.Tensor:
    """Token of each row [S, V] of a sampled row (params[j]) from its 53-bit draw."""
    dev = logits.device
    S, V = logits.shape
    temps = to_device([p.temperature for p in params], logits.dtype, dev)
    scaled = logits / temps[:, None]
    probs = torch.softmax(scaled, dim=-1)  # one kernel per row: the same values whatever the batch
    u = to_device([d * 2.0**-53 for d in draws], torch.float64, dev)  # exact: d < 2**53
    filtered = [j for j, p in enumerate(params) if (1 <= p.top_k < V) or p.top_p < 1.0 or p.min_p > 0.0]
    if not filtered:  # temperature only: the draw over the whole row in vocabulary order
        return _draw_kept(None, probs, None, u)
    if len(filtered) == S:
        return _sample_filtered(scaled, probs, params, u, candidates)
    plain = sorted(set(range(S)) - set(filtered))
    out = torch.empty(S, dtype=torch.long, device=dev)
    f, pl = to_device(filtered, torch.long, dev), to_device(plain, torch.long, dev)
    out[pl] = _draw_kept(None, probs[pl], None, u[pl])
    out[f] = _sample_filtered(scaled[f], probs[f], [params[j] for j in filtered], u[f], candidates)
    return out


def fixed_point(probs: torch.Tensor) -> torch.Tensor:
    """Probabilities as int64 multiples of 2**-52 (truncated): sums of them are exact, in any order
    and on any device. A token below 2**-52 weighs nothing (a whole 2**17 vocabulary of them 3e-11)."""
    return (probs * FIXED_ONE).to(torch.int64)


def _pick(cum: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Position of each row's draw in its exact cumulative masses cum [S, L] (non-decreasing): the
    first position whose cumulative mass exceeds floor(u * total). A zero-mass position is never picked."""
    total = cum[:, -1]
    target = torch.minimum((u * total.to(torch.float64)).floor().to(torch.int64), total - 1).clamp_(min=0)
    return torch.searchsorted(cum, target[:, None], right=True)[:, 0].clamp_(max=cum.shape[1] - 1)


@dataclass
class _Knobs:
    """Per-row filter parameters on the device (None: no row uses that filter)."""
    top_k: torch.Tensor | None  # [S] int64, 0: off
    top_p: torch.Tensor | None  # [S] float64, 1: off
    min_p: torch.Tensor | None  # [S] float32, 0: off

    def rows(self, index: torch.Tensor) -> "_Knobs":
        return _Knobs(*(None if t is None else t[index] for t in (self.top_k, self.top_p, self.min_p)))


@dataclass
class _Cuts:
    """Each row's kept set as thresholds: a token is kept when its scaled logit is >= kth (top-k), its
    probability >= cut (top-p) and >= floor (min-p). None: no row has that filter."""
    kth: torch.Tensor | None  # [S] fp32, -inf: off
    cut: torch.Tensor | None  # [S] fp32, 0: off
    floor: torch.Tensor | None  # [S] fp32, 0: off

    def drop(self, scaled: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """[S, L]: the tokens (scaled logits, probabilities) the thresholds drop."""
        out = torch.zeros_like(probs, dtype=torch.bool)
        if self.kth is not None:
            out |= scaled < self.kth[:, None]
        if self.cut is not None:
            out |= probs < self.cut[:, None]
        if self.floor is not None:
            out |= probs < self.floor[:, None]
        return out

    def rows(self, index: torch.Tensor) -> "_Cuts":
        return _Cuts(*(None if t is None else t[index] for t in (self.kth, self.cut, self.floor)))


def _cuts(vals: torch.Tensor, probs: torch.Tensor, knobs: _Knobs) -> tuple[_Cuts, torch.Tensor]:
    """(thresholds, covered) of each row from its top-L tokens sorted by value: scaled logits `vals`
    [S, L] (descending; equal values in any order) and their probabilities. `covered` [S]: the
    thresholds are exact and drop every token past the L-th, so the row's kept set is among these L
    (a full row, L = V, always is)."""
    q = fixed_point(probs)
    weightless = q[:, -1] == 0  # the tokens past the L-th weigh nothing (probabilities fall along the row)
    covered = weightless.clone()
    kth = cut = floor = mass_ok = None  # mass_ok: rows whose top-k mass (top-p's total) is all here
    if knobs.top_k is not None:  # keep the top_k largest logits and every logit equal to the k-th
        on = knobs.top_k > 0
        kth = vals.gather(1, (knobs.top_k - 1).clamp(min=0)[:, None])[:, 0]
        kth = torch.where(on, kth, float("-inf"))
        q = q.masked_fill(vals < kth[:, None], 0)
        past_k = on & (vals[:, -1] < kth)  # the top-k set ends before the L-th token
        covered |= past_k
        mass_ok = ~on | past_k | weightless
    if knobs.top_p is not None:  # keep a token if the top-k mass above its probability is below top_p
        cum = q.cumsum(dim=-1)
        above = cum - q  # at a run of equal probabilities the first one's is the mass above them all
        on = knobs.top_p < 1.0
        total = torch.full_like(cum[:, -1], FIXED_ONE)  # without top-k: all of the mass (1)
        if knobs.top_k is not None:
            total = torch.where(knobs.top_k > 0, cum[:, -1], total)
        inside = above.to(torch.float64) < (total.to(torch.float64) * knobs.top_p)[:, None]  # a prefix
        last = inside.sum(dim=-1) - 1  # >= 0: nothing is above the first token
        cut = probs.gather(1, last.clamp(min=0)[:, None])[:, 0]  # the smallest probability kept
        cut = torch.where(on, cut, 0.0)
        covered |= on & (probs[:, -1] < cut)
        if mass_ok is not None:
            mass_ok |= ~on
    if knobs.min_p is not None:  # keep a token if its probability is at least min_p times the top one's
        floor = probs[:, 0] * knobs.min_p
        covered |= (knobs.min_p > 0.0) & (probs[:, -1] < floor)
    if mass_ok is not None and knobs.top_p is not None:
        covered &= mass_ok  # (after min-p: a min-p floor past the L-th token does not make a wrong total right)
    return _Cuts(kth, cut, floor), covered


def _draw_kept(scaled: torch.Tensor | None, probs: torch.Tensor, cuts: _Cuts | None, u: torch.Tensor) -> torch.Tensor:
    """Position of each row's draw [S] among its tokens [S, L] (in vocabulary order): inverse CDF over
    the fixed-point masses of the tokens the thresholds keep."""
    q = fixed_point(probs)
    if cuts is not None:
        q = q.masked_fill(cuts.drop(scaled, probs), 0)
    return _pick(q.cumsum(dim=-1), u)


def _sample_filtered(scaled: torch.Tensor, probs: torch.Tensor, params: list[SamplingParams], u: torch.Tensor,
                     candidates: int) -> torch.Tensor:
    """Rows with top-k, top-p or min-p: the thresholds from the top-C candidates and the draw among
    them (in vocabulary order) where they cover the row; the other rows are redone over the full row.

    The redo, without a host sync: on CUDA (with triton) one kernel, a program per row that returns
    at once for a covered row and otherwise finds the exact top-p cut over the full row by a
    search on the probabilities' bits, then draws (_fallback_kernel). Elsewhere (CPU: no sync to
    avoid) the rows that need it are found on the host and their thresholds taken from a full sort.
    Both draw the same token: the same thresholds, the same fixed-point masses in the same order."""
    dev = scaled.device
    S, V = scaled.shape
    k = [p.top_k if 1 <= p.top_k < V else 0 for p in params]  # 0: no top-k on this row
    C = min(V, max(candidates, max(k) + 1))
    knobs = _Knobs(
        top_k=to_device(k, torch.long, dev) if any(k) else None,
        top_p=to_device([p.top_p for p in params], torch.float64, dev) if any(p.top_p < 1.0 for p in params) else None,
        min_p=to_device([p.min_p for p in params], probs.dtype, dev) if any(p.min_p > 0.0 for p in params) else None)
    if C == V:  # the candidates would be the whole row
        vals, order = torch.sort(scaled, dim=-1, descending=True)
        return _draw_kept(scaled, probs, _cuts(vals, probs.gather(1, order), knobs)[0], u)
    vals, ids = torch.topk(scaled, C, dim=-1)  # sorted by value; the order of equal values is unspecified
    cand_p = probs.gather(1, ids)
    cuts, covered = _cuts(vals, cand_p, knobs)
    ids, by_id = torch.sort(ids, dim=-1)  # the draw runs in vocabulary order
    pos = _draw_kept(vals.gather(1, by_id), cand_p.gather(1, by_id), cuts, u)
    tokens = ids.gather(1, pos[:, None])[:, 0]
    if _use_kernel(scaled):
        _fallback_kernel_launch(scaled, probs, covered, cuts, knobs, u, tokens)
    else:
        _redo_sorted(scaled, probs, covered, knobs, u, tokens)
    return tokens


def _redo_sorted(scaled: torch.Tensor, probs: torch.Tensor, covered: torch.Tensor, knobs: _Knobs, u: torch.Tensor,
                 tokens: torch.Tensor) -> None:
    """Overwrite tokens[r] of every row r not covered by its candidates with its draw over the full
    row, the thresholds from a full sort of only those rows (found on the host: a sync on CUDA)."""
    miss = (~covered).nonzero()[:, 0]
    if miss.numel():
        row_vals, order = torch.sort(scaled[miss], dim=-1, descending=True)
        row_p = probs[miss]
        row_cuts = _cuts(row_vals, row_p.gather(1, order), knobs.rows(miss))[0]
        tokens[miss] = _draw_kept(scaled[miss], row_p, row_cuts, u[miss])


# ---------------------------------------------------------------- the fallback kernel (CUDA)
# "kernel": the redo of uncovered rows in one Triton launch, no sync (CUDA with triton);
# "sync": find them on the host (the CPU path; a host sync on CUDA). HYBRID_SAMPLER_FALLBACK sets it.
FALLBACK = os.environ.get("HYBRID_SAMPLER_FALLBACK", "kernel")
# The kernel's tile, ROWS x EPT consecutive tokens: 256 x 16 = 4096, each thread of its 8 warps reading 16 of
# them in four 16-byte loads (triton_sampling.fallback_kernel's docstring says why)
FALLBACK_TILE = (256, 16)
# The pivots of each pass of its top-p search: a pass divides the interval by this many (a power of 2)
FALLBACK_PIVOTS = 8
_kernel_failed: list[str] = []
# compute capabilities whose float64 runs at half the fp32 rate (P100, V100, A100, H100 / H200, B200): the
# fallback kernel's masses are float64 there, int64 elsewhere (1/64 rate: L4, L40S, RTX); None: by the device
FALLBACK_INT_MASSES: bool | None = None
_FAST_FP64 = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}
_int_masses_by_device: dict[tuple, bool] = {}


def int_masses(device: torch.device) -> bool:
    """Whether the fallback kernel sums its fixed-point masses as int64 on this device (see FALLBACK_INT_MASSES)."""
    if FALLBACK_INT_MASSES is not None:
        return FALLBACK_INT_MASSES
    key = (device.type, device.index)
    if key not in _int_masses_by_device:  # (asked at each sampled step: the capability once a device)
        _int_masses_by_device[key] = (device.type == "cuda"
                                      and torch.cuda.get_device_capability(device) not in _FAST_FP64)
    return _int_masses_by_device[key]


def _use_kernel(t: torch.Tensor) -> bool:
    return t.is_cuda and HAS_TRITON and FALLBACK == "kernel" and not _kernel_failed


def _fallback_kernel_launch(scaled: torch.Tensor, probs: torch.Tensor, covered: torch.Tensor, cuts: _Cuts,
                            knobs: _Knobs, u: torch.Tensor, tokens: torch.Tensor) -> None:
    """Overwrite tokens[r] of every row r not covered by its candidates with its draw over the full
    row (the token _redo_sorted draws), in one launch and without a sync; covered rows return at once."""
    S, V = scaled.shape
    dev = scaled.device
    scaled, probs = scaled.contiguous(), probs.contiguous()
    # One signature for every mix of filters, so the startup warm-up compiles all there are
    # (warm_up_fallback_kernel): top-p and min-p always on, with their neutral values (top_p 1: the
    # search is skipped at run time; floor 0: keeps every probability) where a step has none, every
    # argument in its own dtype; only top-k (which costs the search passes a load of the logits)
    # stays a compile-time choice.
    top_k = knobs.top_k.contiguous() if knobs.top_k is not None else torch.zeros(1, dtype=torch.long, device=dev)
    kth = cuts.kth.contiguous() if cuts.kth is not None else torch.full((1,), -math.inf, dtype=scaled.dtype, device=dev)
    top_p = knobs.top_p.contiguous() if knobs.top_p is not None else torch.ones(S, dtype=torch.float64, device=dev)
    # the prefilter's top-p cut: where top-p is on, the search's upper end (fallback_kernel's docstring says why)
    cut = cuts.cut.contiguous() if cuts.cut is not None else torch.zeros(S, dtype=probs.dtype, device=dev)
    floor = cuts.floor.contiguous() if cuts.floor is not None else torch.zeros(S, dtype=probs.dtype, device=dev)
    try:
        triton_sampling.fallback_kernel[(S,)](
            scaled, probs, covered.to(torch.int32), top_k, kth, top_p, cut, floor, u.contiguous(), tokens,
            V, TOP_K=cuts.kth is not None, TOP_P=True, MIN_P=True, ROWS=FALLBACK_TILE[0], EPT=FALLBACK_TILE[1],
            PIVOTS=FALLBACK_PIVOTS, INT_MASSES=int_masses(probs.device), num_warps=8)
    except Exception as e:  # a compile failure (raised before anything runs): the torch redo from now on
        _kernel_failed.append(repr(e))
        logger.warning("sampler fallback kernel unavailable (%r): uncovered rows are found with a host sync", e)
        _redo_sorted(scaled, probs, covered, knobs, u, tokens)


def warm_up_fallback_kernel(device: torch.device, vocab_size: int) -> None:
    """Compile the fallback kernel's variants (with and without top-k) for this vocabulary before
    serving: one covered row each, which returns at once (nothing is drawn)."""
    if not _use_kernel(torch.empty(0, device=device)):
        return
    scaled = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
    probs = torch.softmax(scaled, dim=-1)
    covered = torch.ones(1, dtype=torch.bool, device=device)
    u = torch.zeros(1, dtype=torch.float64, device=device)
    tokens = torch.zeros(1, dtype=torch.long, device=device)
    for top_k in (None, torch.ones(1, dtype=torch.long, device=device)):
        kth = None if top_k is None else torch.zeros(1, dtype=scaled.dtype, device=device)
        _fallback_kernel_launch(scaled, probs, covered, _Cuts(kth, None, None), _Knobs(top_k, None, None), u, tokens)


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor,
                 ks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows that want logprobs (ks[j] top entries for logits row j): the sampled token's logprob
    [R] and its rank [R] (1 + the tokens more likely than it, as vLLM ranks), and the top max(ks)
    logprobs and their ids [R, max(ks)], all on the device (no sync)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    rank = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    k = min(max(ks), logprobs.shape[-1]) if ks else 0
    if k > 0:
        values, ids = torch.topk(logprobs, k, dim=-1)
    else:
        values = logprobs.new_empty(logprobs.shape[0], 0)
        ids = tokens.new_empty(logprobs.shape[0], 0)
    return chosen, rank, values, ids


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """{token: logprob} plus the top k entries of one logits row [V] (syncs)."""
    tok = torch.tensor([token], dtype=torch.long, device=logits.device)
    chosen, rank, values, ids = logprob_rows(logits[None], tok, [k])
    return logprob_dict(token, float(chosen[0]), values[0, :k].tolist(), ids[0, :k].tolist(), int(rank[0]))


def logprob_dict(token: int, token_logprob: float, top_values: list[float], top_ids: list[int],
                 token_rank: int | None = None) -> dict[int, float]:
    """{token: its logprob} and the top entries, as Logprob floats ranked 1.. in the top's order
    (the token itself, outside them, with `token_rank`)."""
    out = {token: Logprob(token_logprob, token_rank)}
    out.update({int(i): Logprob(v, rank) for rank, (i, v) in enumerate(zip(top_ids, top_values), 1)})
    return out
