"""Logits processing before sampling: the per-request changes to a step's logits rows that OpenAI /
vLLM users know, namely allowed_token_ids (every other token masked), bad_words (their tokens
masked), min_tokens (EOS and stop ids masked), logit_bias, and the repetition, frequency and
presence penalties over the request's prompt and output tokens. Greedy rows get them too; the
sampler (hybrid/sampling.py) then draws from the processed rows.

The masks come first: a masked logit is -inf, which the bias and the penalties leave at -inf.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from hybrid.batch import to_device
from hybrid.errors import InvalidRequestError
from hybrid.sampling import SamplingParams


def bad_words_token_ids(words: list[str], tokenizer, vocab_size: int) -> list[list[int]]:
    """The token-id sequences SamplingParams.bad_words stand for, as vLLM forms them: each word with
    its leading whitespace removed, and that with one leading space (how a word is tokenized in the
    middle of a text by most BPE tokenizers), without special tokens; the same sequence once.
    InvalidRequestError (naming bad_words) for a word that has no tokens or a token outside the vocabulary."""
    def bad(why: str) -> InvalidRequestError:  # (the word, not the whole list: a list may hold thousands)
        return InvalidRequestError(f"invalid sampling parameter bad_words: {why}")

    if tokenizer is None:
        raise bad("this model has no tokenizer to turn the words into tokens")
    seqs: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()  # (a set: a list's membership test made long lists quadratic)
    for word in words:
        found = False
        for text in (word.lstrip(), " " + word.lstrip()):
            try:
                ids = list(tokenizer.encode(text, add_special_tokens=False))
            except InvalidRequestError as e:  # e.g. a lone surrogate
                raise bad(f"{word!r} is not valid text: {e}") from None
            outside = [t for t in ids if not 0 <= t < vocab_size]
            if outside:
                raise bad(f"{word!r} has token id {outside[0]}, outside the vocabulary [0, {vocab_size})")
            found = found or bool(ids)
            if ids and tuple(ids) not in seen:
                seen.add(tuple(ids))
                seqs.append(ids)
        if not found:
            raise bad(f"{word!r} has no tokens")
    return seqs


def process_logits(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], generated: list[int],
                   histories: list[tuple[list[int], list[int]]], banned: list[list[int]],
                   pending: tuple[list[int], torch.Tensor] | None = None,
                   bad_words: list[list[list[int]] | None] | None = None) -> torch.Tensor:
    """A copy of `logits` [R, V] with, on each listed row (params[j] for logits row rows[j]): every
    token outside allowed_token_ids masked, the bad words' tokens masked (bad_words[j]: their token-id
    sequences, bad_words_token_ids; a one-token word always, a longer one where the output so far
    ends with the word's tokens before its last), the tokens of banned[j] (EOS and stop ids) masked
    while fewer than min_tokens are generated (generated[j] counts them), the logit bias added, then
    the repetition, frequency and presence penalties over histories[j] = (prompt ids, output ids).
    `pending` = (positions j, the tokens on the device) adds to a row's output a token sampled by the
    step still in flight (async scheduling), so nothing waits for it on the host."""
    out = logits.clone()
    dev = logits.device
    inf = float("-inf")
    allow = [j for j, p in enumerate(params) if p.allowed_token_ids is not None]
    if allow:  # one [rows, V] mask of the allowed tokens, the rest of each row set to -inf
        keep = torch.zeros(len(allow), logits.shape[-1], dtype=torch.bool, device=dev)
        keep[_row_token_index([params[j].allowed_token_ids for j in allow], dev)] = True
        index = to_device([rows[j] for j in allow], torch.long, dev)
        out[index] = out[index].masked_fill(~keep, inf)
    pending_at = {j: k for k, j in enumerate(pending[0])} if pending is not None else {}
    ban_r, ban_t, bias_r, bias_t, bias_v = [], [], [], [], []
    # bad words whose prefix ends with the token still on the device: (row, token to mask, the token the
    # pending one must be, its position in pending[1]), decided on the device (no sync)
    if_r, if_t, if_want, if_src = [], [], [], []
    for j, (r, p) in enumerate(zip(rows, params)):
        if generated[j] < p.min_tokens:
            ban_r += [r] * len(banned[j])
            ban_t += banned[j]
        if p.logit_bias:
            bias_r += [r] * len(p.logit_bias)
            bias_t += list(p.logit_bias)
            bias_v += list(p.logit_bias.values())
        if bad_words is not None and bad_words[j]:
            output = histories[j][1]
            has_pending = j in pending_at
            for word in bad_words[j]:
                n = len(word) - 1  # the tokens before the one to mask
                if n > len(output) + has_pending:
                    continue  # the output is too short to end with them
                if not has_pending:
                    if output[len(output) - n:] == word[:n]:  # (n == 0: always)
                        ban_r.append(r)
                        ban_t.append(word[-1])
                elif n == 0:
                    ban_r.append(r)
                    ban_t.append(word[-1])
                elif output[len(output) - (n - 1):] == word[:n - 1]:  # the host part matches; the pending token decides
                    if_r.append(r)
                    if_t.append(word[-1])
                    if_want.append(word[n - 1])
                    if_src.append(pending_at[j])
    if ban_r:
        out[to_device(ban_r, torch.long, dev), to_device(ban_t, torch.long, dev)] = inf
    if if_r:  # add -inf where the pending token completes the prefix, 0 elsewhere (accumulate: repeats are fine)
        hit = pending[1][to_device(if_src, torch.long, dev)] == to_device(if_want, torch.long, dev)
        add = torch.zeros(len(if_r), dtype=out.dtype, device=dev).masked_fill_(hit, inf)
        out.index_put_((to_device(if_r, torch.long, dev), to_device(if_t, torch.long, dev)), add, accumulate=True)
    if bias_r:
        out.index_put_((to_device(bias_r, torch.long, dev), to_device(bias_t, torch.long, dev)),
                       to_device(bias_v, out.dtype, dev), accumulate=True)
    pen = [j for j, p in enumerate(params) if p.penalised]
    if not pen:
        return out
    n, vocab = len(pen), logits.shape[-1]
    counts = torch.zeros(n, vocab, dtype=out.dtype, device=dev)  # output-token counts per penalised row
    prompt_seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
    out_r, out_t = _row_token_index([histories[j][1] for j in pen], dev)
    counts.index_put_((out_r, out_t), torch.ones(len(out_r), dtype=out.dtype, device=dev), accumulate=True)
    if pending is not None:
        has = [(i, pending_at[j]) for i, j in enumerate(pen) if j in pending_at]
        if has:
            dst, src = zip(*has)
            counts.index_put_((to_device(list(dst), torch.long, dev), pending[1][to_device(list(src), torch.long, dev)]),
                              torch.ones(len(dst), dtype=out.dtype, device=dev), accumulate=True)
    prompt_seen[_row_token_index([histories[j][0] for j in pen], dev)] = True
    index = to_device([rows[j] for j in pen], torch.long, dev)
    sub = out[index]
    rep_p = to_device([params[j].repetition_penalty for j in pen], out.dtype, dev)[:, None]
    seen = prompt_seen | (counts > 0)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep_p, sub * rep_p), sub)
    freq = to_device([params[j].frequency_penalty for j in pen], out.dtype, dev)[:, None]
    pres = to_device([params[j].presence_penalty for j in pen], out.dtype, dev)[:, None]
    out[index] = sub - freq * counts - pres * (counts > 0).to(out.dtype)
    return out


def _row_token_index(token_lists: list[list[int]], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors of every token in token_lists[row], for scatters into [rows, V]."""
    rows = np.repeat(np.arange(len(token_lists)), [len(t) for t in token_lists])
    tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=len(rows))
    return to_device(rows, torch.long, dev), to_device(tokens, torch.long, dev)
