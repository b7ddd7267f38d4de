"""Between the scheduler and the device: a SchedulerOutput becomes a StepBatch; after the forward,
sampling and the copy of its results to the host are queued (a LaunchedStep); once those are
done they are read back (a StepResult) for the engine to apply.

Nothing here waits for the device except read_back: batch uploads are pinned and non-blocking,
and the tokens of a step still in flight are read on the device (async scheduling).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from attention.kv_cache import DUMMY_PAGE
from hybrid.batch import StepBatch, to_device
from hybrid.errors import InvalidRequestError, NonFiniteLogitsError, StateCorruptionError
from hybrid.logits_processing import process_logits
from hybrid.request import ScheduledChunk, Sequence
from hybrid.resources import ResourceManager
from hybrid.sampling import SamplingParams, logprob_dict, logprob_rows, sample_row, sample_tokens, top_logprobs
from hybrid.scheduler import SchedulerOutput
from hybrid.structured_outputs import GrammarCompiler, apply_token_bitmask


@dataclass
class LaunchedStep:
    """A step whose forward pass and sampling are queued on the device; its tokens are read back
    (and the requests updated) by Engine._finish_step."""
    index: int  # launch count: resources released while this step may still run are freed after it
    chunks: list[ScheduledChunk]
    batch: StepBatch  # kept until the step is finished (the sanitizer tests inspect what is in flight)
    logits: torch.Tensor  # [R, V] fp32, read back only by verify rows and forks (never overlapped)
    tokens: torch.Tensor  # [R] int64 on the device: the next decode step reads pending tokens here
    host: dict[str, torch.Tensor]  # tokens, finite flags (and logprobs, state NaN flags) on their way to the host
    done: torch.cuda.Event | None  # recorded after the copies to `host`; None on CPU
    overlappable: bool = False  # the next step may be launched before this one is finished


@dataclass
class StepResult:
    """A finished step's results on the host."""
    tokens: list[int]  # the token sampled from each logits row (verify rows: the argmax)
    bad_rows: list[bool] | None  # per logits row: logits not finite; None when every row is finite
    made_nan: list[bool] | None  # sanitizer: per batch row, state NaN after the step
    state_nan: torch.Tensor | None  # sanitizer: per batch row, state NaN before the step
    # logits row -> (token's logprob, top values, top ids, token's rank)
    logprobs: dict[int, tuple[float, list[float], list[int], int]]
    # prompt logprobs: (first prompt logits row, each row's prompt-token logprob, top values, top ids, token ranks)
    prompt_lp: tuple[int, list[float], list[list[float]], list[list[int]], list[int]] | None = None
    checks: dict[str, list] | None = None  # sanitizer: device-side check results (StepSanitizer.device_checks)
    # per logits row: the model's logits were finite, the request's own constraints left no token (set with bad_rows)
    excluded: list[bool] | None = None

    def prompt_logprobs_at(self, row: int, token: int, k: int) -> dict[int, float]:
        first, token_lp, values, ids, ranks = self.prompt_lp
        j = row - first
        return logprob_dict(token, token_lp[j], values[j][:k], ids[j][:k], ranks[j])

    def failure(self, c: ScheduledChunk, row: int) -> str | None:
        """Why batch row `row` (chunk `c`) fails its request, or None if it does not."""
        rows = c.num_tokens if c.draft else 1
        if (c.samples and self.bad_rows is not None and any(self.bad_rows[c.logits_row:c.logits_row + rows])) \
                or (self.made_nan is not None and self.made_nan[row]):
            if self.excluded is not None and c.samples and self.excluded[c.logits_row] \
                    and not (self.made_nan is not None and self.made_nan[row]):
                return (f"{InvalidRequestError.__name__}: no token is left to sample for {c.seq.label}: its "
                        "allowed_token_ids, bad_words, logit_bias, min_tokens and structured output together "
                        "exclude every token")
            return nonfinite_reason(c.seq, row, self.state_nan)
        return None

    def logprobs_of(self, c: ScheduledChunk, token: int) -> dict[int, float] | None:
        if c.seq.logprobs is None:
            return None
        token_lp, values, ids, rank = self.logprobs[c.logits_row]
        k = c.seq.params.logprobs
        return logprob_dict(token, token_lp, values[:k], ids[:k], rank)


def nonfinite_reason(seq: Sequence, row: int, state_nan: torch.Tensor | None) -> str:
    """Why a row's logits are not finite, as far as is known."""
    who = f"{seq.label} (Mamba slot {seq.slot})"
    if state_nan is not None and bool(state_nan[row]):
        # the sanitizer fails a request at the step that makes its state NaN, so NaN found before a
        # step was not made by this request: a freed (poisoned) slot was read, or NaN state copied in
        return (f"{StateCorruptionError.__name__}: {who} produced NaN logits: its Mamba state held NaN before "
                f"the step, so it read poisoned (freed) state (or a copy of a failed request's state)")
    if state_nan is not None:
        known = ("its Mamba state was finite before the step, so this is not a read of freed state; "
                 "the forward made them, ")
    else:
        known = "check_state=True tells this apart from a read of freed state; "
    return (f"{NonFiniteLogitsError.__name__}: {who} produced non-finite values (NaN or Inf) in this step's "
            f"forward pass ({known}e.g. from non-finite weights, which LLM(check_weights=True) checks at "
            f"load, or an overflow)")


class StepLauncher:
    def __init__(self, resources: ResourceManager, *, device: torch.device, max_pages_per_seq: int,
                 eos_token_ids: set[int], vocab_size: int, check_state: bool,
                 grammars: GrammarCompiler | None = None) -> None:
        self.resources = resources
        self.device = device
        self.max_pages_per_seq = max_pages_per_seq
        self.page_size = resources.page_size
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.check_state = check_state
        self.grammars = grammars  # structured outputs: fills the token bitmasks of constrained rows

    # ------------------------------------------------------------------ batch building
    def build_batch(self, out: SchedulerOutput, in_flight: LaunchedStep | None) -> StepBatch:
        """The StepBatch of the scheduled chunks; sets each chunk's logits row and scratch row."""
        chunks = out.chunks
        input_ids, starts, logits_rows = [], [], []
        fills: list[tuple[int, int]] = []  # (input position, row in the step in flight) of pending tokens
        query_lens, seq_lens, slots, has_init = [], [], [], []
        snapshots: dict[int, list[tuple[int, int]]] = {}  # prefix-cache states inside prefill chunks
        page_table = np.full((len(chunks), self.max_pages_per_seq), DUMMY_PAGE, dtype=np.int32)
        offset = 0
        ps = self.page_size
        scratch = []
        num_verify = 0
        prompt_rows: list[int] = []  # token rows whose logits score the next prompt token (after logits_rows)
        for row, c in enumerate(chunks):
            seq = c.seq
            start, end = seq.num_computed, seq.num_computed + c.num_tokens
            if c.draft:  # verify: the last sampled token, then the drafts; logits for each of them
                c.scratch_index = num_verify
                num_verify += 1
                scratch.append(c.scratch_index)
                input_ids.extend(seq.token_slice(start, start + 1))
                input_ids.extend(c.draft)
                logits_rows.extend(range(offset, offset + c.num_tokens - 1))
            else:
                scratch.append(-1)
                if seq.scores_prompt:  # positions [lo, hi) score prompt tokens lo+1 .. hi
                    lo = max(start, len(seq.prompt_logprobs) - 1)
                    hi = min(end, len(seq.prompt_token_ids) - 1)
                    if hi > lo:
                        c.prompt_rows = (len(prompt_rows), lo, hi - lo)
                        prompt_rows.extend(range(offset + lo - start, offset + hi - start))
                known = min(end, seq.num_tokens)
                input_ids.extend(seq.token_slice(start, known))
                if end > known:  # the token sampled by the step in flight: filled in on the device
                    fills.append((len(input_ids), seq.pending_row))
                    input_ids.append(0)
            if c.snapshots:
                snapshots[row] = [(point - start, slot) for point, slot in c.snapshots]
            starts.append(start)
            query_lens.append(c.num_tokens)
            seq_lens.append(end)
            slots.append(seq.slot)
            has_init.append(start > 0)
            page_table[row, : len(seq.pages)] = seq.pages
            offset += c.num_tokens
            if c.draft:
                c.logits_row = len(logits_rows) - (c.num_tokens - 1)
                logits_rows.append(offset - 1)
            elif end == seq.num_tokens + seq.pending:  # chunk reaches the last token: sample from it
                c.logits_row = len(logits_rows)
                logits_rows.append(offset - 1)
        if prompt_rows:  # after the sampled rows, whose indices stay as set above
            for c in chunks:
                if c.prompt_rows is not None:
                    c.prompt_rows = (len(logits_rows) + c.prompt_rows[0],) + c.prompt_rows[1:]
            logits_rows.extend(prompt_rows)
        dev = self.device
        qsl = [0] + list(itertools.accumulate(query_lens))
        # positions and KV rows of every token, vectorised (a Python loop over an 8K prompt costs ms)
        q = np.asarray(query_lens, dtype=np.int64)
        token_row = np.repeat(np.arange(len(chunks)), q)
        positions = np.repeat(np.asarray(starts, dtype=np.int64) - np.asarray(qsl[:-1], dtype=np.int64), q) \
            + np.arange(qsl[-1], dtype=np.int64)
        kv_loc = page_table[token_row, positions // ps].astype(np.int64) * ps + positions % ps
        ids = to_device(input_ids, torch.long, dev)
        if fills:  # pending tokens: gathered from the step in flight, in stream order after its sampling
            at, src = zip(*fills)
            ids[to_device(list(at), torch.long, dev)] = in_flight.tokens[to_device(list(src), torch.long, dev)]
        return StepBatch(
            input_ids=ids,
            positions=to_device(positions, torch.long, dev),
            query_start_loc=to_device(qsl, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            page_table=to_device(page_table, torch.int32, dev),
            kv_write_loc=to_device(kv_loc, torch.long, dev),
            state_slot=to_device(slots, torch.long, dev),
            has_initial_state=to_device(has_init, torch.bool, dev),
            logits_indices=to_device(logits_rows, torch.long, dev),
            num_decodes=sum(1 for c in chunks if c.is_decode and not c.draft and not c.replay),
            num_prefills=sum(1 for c in chunks if not c.is_decode),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            state_slot_cpu=slots,
            has_initial_state_cpu=has_init,
            num_verify=num_verify,
            scratch_index=to_device(scratch, torch.long, dev) if num_verify else None,
            scratch_index_cpu=scratch,
            state_scratch=self.resources.verify_scratch if num_verify else None,
            num_replay=sum(1 for c in chunks if c.replay),
            state_snapshots=snapshots,
        )

    # ------------------------------------------------------------------ sampling
    def sample(self, index: int, out: SchedulerOutput, batch: StepBatch, logits: torch.Tensor,
               state_nan: tuple[torch.Tensor, torch.Tensor] | None, in_flight: LaunchedStep | None,
               checks: dict[str, torch.Tensor] | None = None) -> LaunchedStep:
        """Queue the sampling of the step's logits and the copy of its results to the host.
        `state_nan` (sanitizer): per batch row, whether its Mamba state held NaN before the forward
        and after it; `checks` (sanitizer): device-side check results, read back with the tokens
        (StepResult.checks)."""
        chunks = out.chunks
        scoring = [c for c in chunks if c.prompt_rows is not None]  # prompt logprobs: rows after the sampled ones
        num_rows = scoring[0].prompt_rows[0] if scoring else logits.shape[0]
        sampled = logits[:num_rows]
        row_params: list[SamplingParams | None] = [None] * num_rows  # None: argmax (verify rows too)
        row_generators: list[torch.Generator | None] = [None] * num_rows
        lp_rows, lp_ks = [], []
        for c in chunks:
            if c.samples and not c.draft:
                row_params[c.logits_row] = c.seq.params
                row_generators[c.logits_row] = c.seq.generator
                if c.seq.params.logprobs is not None:
                    lp_rows.append(c.logits_row)
                    lp_ks.append(c.seq.params.logprobs)
        processed, masked_rows = self._processed(sampled, chunks, in_flight)
        tokens, finite = sample_tokens(processed, row_params, row_generators)
        excluded = None  # rows whose raw logits are finite but whose request's constraints leave no token
        if masked_rows:  # those rows' raw logits checked too (a mask can hide a NaN); the others' argmax says it
            at = to_device(masked_rows, torch.long, sampled.device)  # (not `index`: the step's launch count)
            raw_finite = torch.ones_like(finite)
            raw_finite[at] = torch.isfinite(sampled[at].max(dim=-1).values)
            excluded = raw_finite & ~finite
            finite = finite & raw_finite
        if self.check_state:  # the sanitizer looks at every raw logit, not just each row's maximum
            finite = finite & torch.isfinite(sampled).all(dim=-1)
        # finite: one flag per logits row, read with the tokens; a row that is not finite fails its request
        device_out = {"tokens": tokens, "finite": finite}  # logprobs: of the model's own distribution (raw logits)
        if excluded is not None:
            device_out["excluded"] = excluded
        if state_nan is not None:  # NaN in a row's state before the forward: it read poisoned state;
            # NaN only after it: this forward made it (rows that sample nothing are caught here too)
            device_out["state_nan"], device_out["state_nan_after"] = state_nan
        for name, value in (checks or {}).items():
            device_out[f"check:{name}"] = value
        if lp_rows:
            rows = to_device(lp_rows, torch.long, logits.device)
            device_out["lp_token"], device_out["lp_rank"], device_out["lp_values"], device_out["lp_ids"] = \
                logprob_rows(logits[rows], tokens[rows], lp_ks)
        if scoring:  # prompt logprobs: each row scores the prompt token after its position (raw logits)
            targets, ks = [], []
            for c in scoring:  # (in chunk order: the order build_batch laid their rows out in)
                _, lo, count = c.prompt_rows
                targets.extend(c.seq.prompt_token_ids[lo + 1:lo + 1 + count])
                ks.extend([c.seq.params.prompt_logprobs] * count)
            device_out["plp_token"], device_out["plp_rank"], device_out["plp_values"], device_out["plp_ids"] = \
                logprob_rows(logits[num_rows:], to_device(targets, torch.long, logits.device), ks)
        done = None
        if logits.is_cuda:
            host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in device_out.items()}
            for k, v in device_out.items():
                host[k].copy_(v, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host = device_out
        return LaunchedStep(index, chunks, batch, logits, tokens, host, done)

    def _processed(self, logits: torch.Tensor, chunks: list[ScheduledChunk],
                   in_flight: LaunchedStep | None) -> tuple[torch.Tensor, list[int]]:
        """(the logits to sample from, the rows changed): allowed tokens, bad words, min_tokens, logit bias
        and penalties applied on the rows whose requests ask for them, then the structured-output masks (the
        logits themselves, and no rows, when none does)."""
        proc = [c for c in chunks if c.samples and not c.draft and c.seq.params.processes_logits]
        out = self._penalised(logits, proc, in_flight)
        constrained = [c for c in chunks if c.samples and not c.draft and c.seq.grammar is not None
                       and c.seq.grammar.active]
        if constrained:  # each row's allowed tokens, from its matcher on the host, applied on the device
            masks = self.grammars.fill_bitmasks([c.seq.grammar for c in constrained], pin=logits.is_cuda)
            out = apply_token_bitmask(out, [c.logits_row for c in constrained], masks)
        return out, sorted({c.logits_row for c in proc + constrained})

    def _penalised(self, logits: torch.Tensor, proc: list[ScheduledChunk],
                   in_flight: LaunchedStep | None) -> torch.Tensor:
        """`proc`: the sampling chunks whose requests process their logits."""
        if not proc:
            return logits
        seqs = [c.seq for c in proc]
        pending = None
        if any(s.pending for s in seqs):  # the token sampled by the step in flight is part of the history
            at = [j for j, s in enumerate(seqs) if s.pending]
            src = to_device([seqs[j].pending_row for j in at], torch.long, logits.device)
            pending = (at, in_flight.tokens[src])
        return process_logits(
            logits, [c.logits_row for c in proc], [s.params for s in seqs],
            [len(s.output_token_ids) + s.pending for s in seqs],
            [(s.prompt_token_ids, s.output_token_ids) for s in seqs], [self.banned(s) for s in seqs], pending,
            [s.bad_words_ids for s in seqs])

    def banned(self, seq: Sequence) -> list[int]:
        """Tokens that would end the output: masked while fewer than min_tokens are generated."""
        if seq.grammar is not None and seq.grammar.finished:
            return []  # the grammar allows nothing but EOS: min_tokens cannot hold it back
        ids = set(seq.params.stop_token_ids or ())
        if not seq.params.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(i for i in ids if 0 <= i < self.vocab_size)

    def sample_one(self, seq: Sequence, seq_logits: torch.Tensor,
                   greedy_token: int) -> tuple[int, dict[int, float] | None]:
        """(token, its logprobs) sampled on the host from one logits row with the sequence's own
        generator (`greedy_token`: the row's argmax, already on the host). For verify rows and forks."""
        p = seq.params
        if p.processes_logits:
            seq_logits_p = process_logits(seq_logits[None], [0], [p], [len(seq.output_token_ids)],
                                          [(seq.prompt_token_ids, seq.output_token_ids)], [self.banned(seq)],
                                          bad_words=[seq.bad_words_ids])[0]
            greedy_token = int(seq_logits_p.argmax())
        else:
            seq_logits_p = seq_logits
        if seq.grammar is not None and seq.grammar.active:
            masks = self.grammars.fill_bitmasks([seq.grammar], pin=False)
            seq_logits_p = apply_token_bitmask(seq_logits_p[None], [0], masks)[0]
            greedy_token = int(seq_logits_p.argmax())
        token = greedy_token if p.greedy else sample_row(seq_logits_p, p, seq.generator)
        logprobs = top_logprobs(seq_logits, token, seq.params.logprobs) if seq.logprobs is not None else None
        return token, logprobs

    # ------------------------------------------------------------------ reading back
    @staticmethod
    def read_back(step: LaunchedStep) -> StepResult:
        """Wait for the step's results and read them on the host."""
        if step.done is not None:
            step.done.synchronize()
        host = step.host
        bad = None if bool(host["finite"].all()) else (~host["finite"]).tolist()
        excluded = host["excluded"].tolist() if bad is not None and "excluded" in host else None
        made_nan = host["state_nan_after"].tolist() if "state_nan_after" in host else None  # (sanitizer)
        lp = {}
        if "lp_token" in host:
            rows = [c.logits_row for c in step.chunks
                    if c.samples and not c.draft and c.seq.params.logprobs is not None]
            token_lp, values, ids = host["lp_token"].tolist(), host["lp_values"].tolist(), host["lp_ids"].tolist()
            ranks = host["lp_rank"].tolist()
            lp = {r: (token_lp[j], values[j], ids[j], ranks[j]) for j, r in enumerate(rows)}
        prompt_lp = None
        if "plp_token" in host:
            first = next(c.prompt_rows[0] for c in step.chunks if c.prompt_rows is not None)
            prompt_lp = (first, host["plp_token"].tolist(), host["plp_values"].tolist(), host["plp_ids"].tolist(),
                         host["plp_rank"].tolist())
        checks = {k[len("check:"):]: v.tolist() for k, v in host.items() if k.startswith("check:")}
        return StepResult(host["tokens"].tolist(), bad, made_nan, host.get("state_nan"), lp, prompt_lp, checks,
                          excluded)
