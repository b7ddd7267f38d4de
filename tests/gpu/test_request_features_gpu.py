"""Request features whose masks and gates run beside the CUDA graphs and async scheduling: the
same greedy tokens on CUDA as on CPU for allowed_token_ids, bad_words (the newest token still on
the device under async scheduling), a structured output that starts after a token (a thinking
model's </think>), truncate_prompt_tokens and include_stop_str_in_output."""
from __future__ import annotations

import pytest

from hybrid import LLM, SamplingParams, StructuredOutputsParams

PROMPTS = ["And the LORD said unto Moses,", "In the beginning God created", "And it came to pass"]


def _cases(tok):
    gate = tok.encode(" Moses")[0]
    return [
        SamplingParams(max_tokens=24, temperature=0.0, allowed_token_ids=sorted(set(tok.encode(" the LORD God of")))),
        SamplingParams(max_tokens=24, temperature=0.0, bad_words=["LORD", "the land"]),
        SamplingParams(max_tokens=12, temperature=0.0, logit_bias={gate: 100},
                       structured_outputs=StructuredOutputsParams(choice=["yea", "nay"], start_after_token_id=gate)),
        SamplingParams(max_tokens=16, temperature=0.0, truncate_prompt_tokens=3),
        SamplingParams(max_tokens=24, temperature=0.0, stop=["the"], include_stop_str_in_output=True),
        SamplingParams(max_tokens=16, temperature=0.8, seed=5, bad_words=["LORD"], allowed_token_ids=list(range(2000))),
    ]


@pytest.fixture(scope="module")
def cpu_outputs():
    llm = LLM(None, device="cpu", max_num_seqs=8, dtype="float32")
    return [[c.token_ids for c in o.outputs] for o in
            llm.generate(PROMPTS * 2, _cases(llm.tokenizer), use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_cuda_gives_the_cpu_tokens(cpu_outputs, async_scheduling):
    llm = LLM(None, device="cuda", max_num_seqs=8, dtype="float32", async_scheduling=async_scheduling)
    outs = llm.generate(PROMPTS * 2, _cases(llm.tokenizer), use_tqdm=False)
    got = [[c.token_ids for c in o.outputs] for o in outs]
    assert got == cpu_outputs
    assert not llm.engine.has_unfinished_requests()
