"""From sampled tokens to what users see: incremental detokenisation, stop checks, and the
RequestOutput each request gets back after a step, as its output kind says.

It decides whether a token ends its sequence; freeing what the sequence holds is the scheduler's
job (Scheduler.finish), done by the engine with the decision returned here.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

from hybrid.outputs import CompletionOutput, RequestOutput
from hybrid.request import Request, ScheduledChunk, Sequence

if TYPE_CHECKING:
    from hybrid.launcher import StepResult

logger = logging.getLogger(__name__)


def _held_back(text: str, stops: list[str] | None) -> int:
    """How many trailing characters of `text` may still turn into (part of) a stop string or a
    complete character, and so must not be sent yet."""
    hold = 0
    if text.endswith("\ufffd"):
        hold = len(text) - len(text.rstrip("\ufffd"))
    if stops:
        for s in stops:
            # longest proper prefix of s that is a suffix of text
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
    return hold


class TextDeltas:
    """Incremental text of one sequence from successive full decoded texts: a trailing U+FFFD (a multi-byte
    character cut in the middle) and any tail that could begin a stop string are held back, so a stop string
    never leaks into a stream and the deltas add up to the final (stop-truncated) text. `include_stops`
    (SamplingParams.include_stop_str_in_output): the engine cuts the text right after a stop string,
    never before text it has shown, so nothing needs holding back for stop strings; without it (the
    default, always safe) their possible beginnings wait until resolved, and the last delta brings
    whatever the final text has, a kept stop string included."""

    def __init__(self, stops: list[str] | None, include_stops: bool = False) -> None:
        self.stops = [] if include_stops else list(stops or [])
        self.sent = ""
        self.num_tokens_sent = 0

    def update(self, text: str, finished: bool) -> str:
        if finished:
            safe = text
        else:
            safe = text[: len(text) - _held_back(text, self.stops)]
        if not safe.startswith(self.sent):
            # The decoder changed earlier characters (not prefix-stable); never resend text.
            if finished:
                logger.debug("final text does not extend the streamed text")
            return ""
        delta = safe[len(self.sent):]
        self.sent = safe
        return delta


# What Engine.step() returns for a request (Engine.add_request(output_kind=...)):
# - "cumulative": after every step that changed it, everything so far (copies grow with the output);
# - "delta": after every step that changed it, the new tokens and their logprobs (text stays the
#   whole text so far: stop-string handling may still shorten it, and a str costs nothing to pass);
# - "final": one output, when it finishes. LLM.generate uses "final", the server "delta": their
#   per-step host time does not grow with the length of what was generated;
# - "text_delta": vLLM's RequestOutputKind.DELTA (SamplingParams.output_kind): "delta" with the text new since
#   the last output too (the possible beginnings of a stop string and partial characters held back).
OUTPUT_KINDS = ("cumulative", "delta", "final", "text_delta")

# (finish_reason, stop_reason): how a token ended its sequence
Stop = tuple[str, "int | str | None"]


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int, stats: dict[str, int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        # the tokenizer's own end-of-sequence token: ending on it leaves stop_reason None, as vLLM reports it (the
        # checkpoint's other EOS ids, from config.json / generation_config.json, are reported as stop tokens)
        self.primary_eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.max_model_len = max_model_len
        self.stats = stats

    def append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> Stop | None:
        """Add a sampled token (and its logprobs) to the sequence and its text; return how it ends the
        sequence, or None if the sequence goes on."""
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
        seq.output_token_ids.append(token)
        self.stats["generated_tokens"] += 1
        return self._check_stop(seq, token)

    @staticmethod
    def append_prompt_logprobs(c: ScheduledChunk, result: StepResult) -> None:
        """The chunk's prompt logprobs, in prompt order; positions already filled (a chunk rebuilt
        after a preemption) are not added twice."""
        seq = c.seq
        first_row, first_pos, count = c.prompt_rows
        for j in range(count):
            pos = first_pos + j  # scores prompt token pos + 1
            if pos + 1 == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append(result.prompt_logprobs_at(first_row + j, seq.prompt_token_ids[pos + 1],
                                                                     seq.params.prompt_logprobs))

    def update_text(self, seq: Sequence) -> None:
        """Extend seq.text with the new tokens' text, decoding only a short window of tokens (the
        previous token(s) as context, then the new ones) instead of the whole output every step.
        Text that ends in a partial UTF-8 character is held back until the next token completes it."""
        ids = seq.output_token_ids
        skip = seq.params.skip_special_tokens
        before = self.tokenizer.decode(ids[seq.detok_prefix:seq.detok_read], skip_special_tokens=skip)
        after = self.tokenizer.decode(ids[seq.detok_prefix:], skip_special_tokens=skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            seq.text += after[len(before):]
            seq.detok_prefix, seq.detok_read = seq.detok_read, len(ids)

    def _check_stop(self, seq: Sequence, token: int) -> Stop | None:
        p = seq.params
        if self.tokenizer is not None and p.detokenize:
            self.update_text(seq)
        if (not p.ignore_eos and token in self.eos_token_ids) or (p.stop_token_ids and token in p.stop_token_ids):
            # as vLLM: the stopping token's text (a special token's when skip_special_tokens=False) is
            # part of the output only with include_stop_str_in_output
            stop_reason = None if token == self.primary_eos_token_id and not p.ignore_eos else token
            return self._final_text(seq, "stop", stop_reason, drop_last=not p.include_stop_str_in_output)
        if p.stop and self.tokenizer is not None and len(seq.output_token_ids) <= p.min_tokens:
            # as vLLM: no stop string ends an output within its first min_tokens tokens, nor later in their text
            seq.stop_search_from = len(seq.text)
        elif p.stop and self.tokenizer is not None:
            for s in p.stop:
                at = seq.text.find(s, max(0, seq.stop_search_from - len(s) + 1))
                if at != -1:  # the text ends before the stop string, or right after it
                    seq.text = seq.text[:at + len(s) if p.include_stop_str_in_output else at]
                    return "stop", s
        if seq.grammar is not None and seq.grammar.finished:  # structured outputs: the grammar is complete
            return self._final_text(seq, "stop")
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return self._final_text(seq, "length")
        return None

    def _final_text(self, seq: Sequence, reason: str, stop_reason: int | None = None, drop_last: bool = False) -> Stop:
        if self.tokenizer is not None and seq.params.detokenize:  # the plain decode of every output token (but a stop token)
            ids = seq.output_token_ids[:-1] if drop_last else seq.output_token_ids
            seq.text = self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
        return reason, stop_reason

    def request_outputs(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """The outputs of requests a step changed, as their output kinds say ("final": only finished ones)."""
        return [self.request_output(req) for req in requests if req.output_kind != "final" or req.finished]

    @staticmethod
    def request_output(req: Request) -> RequestOutput:
        """The request's output now; "delta" outputs carry only the tokens (and their logprobs) that
        no earlier output carried, and mark them as sent."""
        delta = req.output_kind in ("delta", "text_delta")
        outputs = []
        for s in req.seqs:
            start = s.num_sent if delta else 0
            text = s.text
            if req.output_kind == "text_delta":
                if s.text_deltas is None:
                    s.text_deltas = TextDeltas(s.params.stop, s.params.include_stop_str_in_output)
                text = s.text_deltas.update(s.text, s.finish_reason is not None)
            outputs.append(CompletionOutput(
                index=s.index, text=text, token_ids=s.output_token_ids[start:],
                finish_reason=s.finish_reason,
                logprobs=s.logprobs[start:] if s.logprobs is not None else None,
                stop_reason=s.stop_reason,
            ))
            if delta:
                s.num_sent = len(s.output_token_ids)
        plp = req.seqs[0].prompt_logprobs
        if plp is None or len(plp) < len(req.prompt_token_ids) or (delta and req.prompt_logprobs_sent):
            plp = None
        elif delta:
            req.prompt_logprobs_sent = True
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=outputs, finished=req.finished, error=req.error, prompt_logprobs=plp,
                             num_cached_tokens=req.seqs[0].num_cached_tokens or 0)
