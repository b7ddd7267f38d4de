"""Logit processing before sampling, as OpenAI / vLLM users know it: logit_bias, min_tokens,
presence / frequency / repetition penalties, min_p. Checked against a plain per-row reference, by
their effect on generations, under async scheduling (where the newest token of the history is still
on the device), and for clear errors on bad values."""
from __future__ import annotations

import pytest
import torch

from hybrid import SamplingParams
from hybrid.errors import InvalidRequestError
from hybrid.logits_processing import process_logits
from hybrid.sampling import sample_tokens

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower


def _reference(row: torch.Tensor, p: SamplingParams, generated: int, prompt: list[int], output: list[int],
               banned: list[int]) -> torch.Tensor:
    row = row.clone()
    if generated < p.min_tokens:
        row[banned] = float("-inf")
    for t, v in (p.logit_bias or {}).items():
        row[t] += v
    for t in set(prompt) | set(output):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


def test_process_logits_matches_a_per_row_reference():
    g = torch.Generator().manual_seed(0)
    V = 50
    logits = torch.randn(5, V, generator=g) * 3
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=-0.3),
              SamplingParams(logit_bias={3: 5.0, 7: -2.5}, min_tokens=4, max_tokens=8),
              SamplingParams(presence_penalty=1.5, logit_bias={0: 1.0})]
    rows = [0, 2, 4]
    histories = [([1, 2, 3, 3], [4, 4, 4, 9, 2]), ([5], [6]), ([], [11, 12, 11, 40])]
    generated = [5, 1, 4]
    banned = [[2], [2, 6], [2]]
    # the last output token of row 0 and row 2 is still on the device (async scheduling)
    pending = ([0, 2], torch.tensor([13, 40]))
    got = process_logits(logits, rows, params, generated, histories, banned, pending)
    for j, r in enumerate(rows):
        out = histories[j][1] + ([int(pending[1][pending[0].index(j)])] if j in pending[0] else [])
        want = _reference(logits[r], params[j], generated[j], histories[j][0], out, banned[j])
        torch.testing.assert_close(got[r], want)
    for r in (1, 3):  # rows without processing are untouched
        assert torch.equal(got[r], logits[r])
    assert not torch.equal(got, logits) and torch.equal(logits, logits.clone())  # a copy: the input is kept


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        seen.add(int(sample_tokens(logits, [SamplingParams(min_p=0.4)], [gen])[0][0]))
    assert seen == {0, 1}  # 0.15 and 0.05 are below 0.4 * 0.5


def _gen(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_effects_on_generations(tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("granite_dense"))
    prompt = [[5, 6, 7, 8, 9]]
    plain = _gen(llm, prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].token_ids
    # a +100 bias makes one token win every step
    biased = _gen(llm, prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={17: 100}))
    assert biased[0].token_ids == [17] * 6
    # min_tokens: a stop token the plain run emits at once cannot end the output before min_tokens
    stop = plain[0]
    short = _gen(llm, prompt, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop]))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) == 1
    held = _gen(llm, prompt, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop], min_tokens=5))[0]
    assert len(held.token_ids) >= 5 and stop not in held.token_ids[:4]
    # penalties reduce repetition of what was already generated
    assert len(set(plain)) < len(plain)  # the plain greedy run repeats itself
    rep = _gen(llm, prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                           presence_penalty=2.0, frequency_penalty=2.0))[0].token_ids
    assert len(set(rep)) > len(set(plain))


def test_same_tokens_with_async_scheduling(tiny_ckpt, make_llm):
    """The history's newest token is read from the device while it is still in flight."""
    path = tiny_ckpt("nemotron_h")
    prompts = [[7, 19, 33, 41, 5], [4], [100, 3, 57, 22, 61, 17], [4]]
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, repetition_penalty=1.8,
                             frequency_penalty=0.5),
              SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True, presence_penalty=1.0,
                             min_p=0.05, logit_bias={9: 3.0}),
              SamplingParams(n=2, temperature=0.7, seed=5, max_tokens=10, min_tokens=6, stop_token_ids=[31, 8],
                             repetition_penalty=0.8),
              # unpenalised, greedy repeats its newest token here: the penalty must see that token
              SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, presence_penalty=2.0,
                             frequency_penalty=2.0, repetition_penalty=2.0)]
    ref = [[c.token_ids for c in o.outputs]
           for o in make_llm(path, async_scheduling=False).generate(prompts, params, use_tqdm=False)]
    llm = make_llm(path, async_scheduling=True)
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref and llm.engine.stats["overlapped_steps"] > 0


@pytest.mark.parametrize("kwargs, name", [
    ({"min_p": 1.5}, "min_p"), ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": 1e9}, "repetition_penalty"), ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
])
def test_bad_values_are_named(kwargs, name):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary(tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("granite_dense"))
    with pytest.raises(InvalidRequestError, match="logit_bias.*token id 100000 is outside"):
        llm.engine.add_request("x", [5, 6], SamplingParams(logit_bias={100000: 1.0}))
    assert not llm.engine.has_unfinished_requests()
