"""LLM.generate's inputs and outputs in the shapes code written against vLLM uses: prompt dicts
({"prompt"} / {"prompt_token_ids"}), Logprob entries (.logprob, .rank) and cumulative_logprob."""
from __future__ import annotations

import math

import pytest
import torch

from hybrid import LLM, SamplingParams
from hybrid.errors import InvalidRequestError
from hybrid.outputs import Logprob

torch.set_num_threads(1)
PROMPT = "And the LORD said unto Moses,"


@pytest.fixture(scope="module")
def llm():
    return LLM(None, max_num_seqs=4)


def test_prompt_dicts(llm):
    sp = SamplingParams(max_tokens=8, temperature=0)
    ids = llm.tokenizer.encode(PROMPT)
    ref = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    text, tokens, both = llm.generate([{"prompt": PROMPT}, {"prompt_token_ids": ids},
                                       {"prompt": PROMPT, "prompt_token_ids": ids}], sp, use_tqdm=False)
    for out in (text, tokens, both):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.prompt_token_ids == ids
    assert text.prompt == PROMPT and tokens.prompt is None and both.prompt == PROMPT
    one = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)  # a single dict is one prompt
    assert len(one) == 1 and one[0].outputs[0].token_ids == ref.outputs[0].token_ids
    for bad, match in (({"text": PROMPT}, "not supported"), ({"prompt": 5}, "needs 'prompt'"),
                       ({"prompt_token_ids": "1 2"}, "list of token ids"), ({}, "needs 'prompt'")):
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate([bad], sp, use_tqdm=False)


def test_logprob_entries_and_cumulative_logprob(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    total = 0.0
    for tid, entries in zip(out.token_ids, out.logprobs):
        lp = entries[tid]
        assert isinstance(lp, Logprob) and isinstance(lp, float) and lp.logprob == float(lp) <= 0.0
        top = sorted((e for t, e in entries.items() if e.rank is not None), key=lambda e: e.rank)
        assert [e.rank for e in top] == [1, 2, 3] and top[0].logprob >= top[1].logprob >= top[2].logprob
        assert lp.rank is None or entries[tid] is top[lp.rank - 1]
        total += lp.logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-9)
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None
