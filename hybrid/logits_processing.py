"""Logits processing before sampling: the per-request changes to a step's logits rows that OpenAI /
vLLM users know, namely min_tokens (EOS and stop ids masked), logit_bias, and the repetition,
frequency and presence penalties over the request's prompt and output tokens. Greedy rows get them
too; the sampler (hybrid/sampling.py) then draws from the processed rows.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from hybrid.batch import to_device
from hybrid.sampling import SamplingParams


def process_logits(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], generated: list[int],
                   histories: list[tuple[list[int], list[int]]], banned: list[list[int]],
                   pending: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
    """A copy of `logits` [R, V] with, on each listed row (params[j] for logits row rows[j]): the
    tokens of banned[j] (EOS and stop ids) masked while fewer than min_tokens are generated
    (generated[j] counts them), the logit bias added, then the repetition, frequency and presence
    penalties over histories[j] = (prompt ids, output ids). `pending` = (positions j, the tokens on
    the device) adds to a row's output a token sampled by the step still in flight (async
    scheduling), so nothing waits for it on the host."""
    out = logits.clone()
    dev = logits.device
    ban_r, ban_t, bias_r, bias_t, bias_v = [], [], [], [], []
    for j, (r, p) in enumerate(zip(rows, params)):
        if generated[j] < p.min_tokens:
            ban_r += [r] * len(banned[j])
            ban_t += banned[j]
        if p.logit_bias:
            bias_r += [r] * len(p.logit_bias)
            bias_t += list(p.logit_bias)
            bias_v += list(p.logit_bias.values())
    if ban_r:
        out[to_device(ban_r, torch.long, dev), to_device(ban_t, torch.long, dev)] = float("-inf")
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
        at = {j: k for k, j in enumerate(pending[0])}
        has = [(i, at[j]) for i, j in enumerate(pen) if j in at]
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
