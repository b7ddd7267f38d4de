"""SamplingParams(prompt_logprobs=k): the log-probability of every prompt token given the ones before
it (and the top k), as vLLM returns them, against transformers' own full forward over the prompt
(the oracle), through chunked prefill, preemption, prefix caching, n > 1 and streamed outputs."""
from __future__ import annotations

import pytest
import torch

import hf_oracle
from hybrid import SamplingParams
from hybrid.errors import InvalidRequestError
from hybrid.request import PROMPT_LOGPROBS_ROWS_PER_STEP

torch.set_num_threads(1)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def check_against_oracle(path, ids: list[int], plp, k: int) -> None:
    ref = hf_oracle.full_forward_logprobs(path, ids)
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry = plp[i]
        assert ids[i] in entry
        assert abs(entry[ids[i]] - float(ref[i - 1, ids[i]])) < 1e-4, (i, entry, float(ref[i - 1, ids[i]]))
        top = torch.topk(ref[i - 1], k)
        others = {t: v for t, v in entry.items() if t != ids[i] or len(entry) == k}
        assert len(entry) in (k, k + 1)  # the top k, plus the prompt token when it is not among them
        for t, v in entry.items():
            assert abs(v - float(ref[i - 1, t])) < 1e-4
        assert min(others.values()) >= float(top.values[-1]) - 1e-4  # they are the top k
        # the prompt token's rank: 1 + the tokens more likely than it (within the logits' tolerance)
        v = float(ref[i - 1, ids[i]])
        lo, hi = 1 + int((ref[i - 1] > v + 1e-4).sum()), 1 + int((ref[i - 1] > v - 1e-4).sum())
        assert lo <= entry[ids[i]].rank <= hi, (i, entry[ids[i]].rank, lo, hi)


@pytest.mark.parametrize("name", ["nemotron_h", "granite_moe", "zamba2"])
def test_prompt_logprobs_match_the_full_forward(name, tiny_ckpt, make_llm):
    path = tiny_ckpt(name)
    llm = make_llm(path, max_num_batched_tokens=8)  # prompts of 30 tokens in 8-token chunks
    vocab = llm.config.vocab_size
    prompts = [prompt(30, 1, vocab), prompt(13, 2, vocab), prompt(1, 3, vocab)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        check_against_oracle(path, ids, out.prompt_logprobs, 3)
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_zero_top_entries_and_bad_values(tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("nemotron_h"))
    ids = prompt(9, 4, llm.config.vocab_size)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY), use_tqdm=False)[0]
    assert all(set(e) == {t} for e, t in zip(out.prompt_logprobs[1:], ids[1:]))
    for bad in (-2, 1.5, True):  # (-1 is the whole vocabulary, as vLLM reads it)
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_long_prompt_is_scored_over_several_steps(tiny_ckpt, make_llm):
    """More prompt positions than a step may score: the prefill is cut into steps of at most
    PROMPT_LOGPROBS_ROWS_PER_STEP scored positions, and every position is scored once."""
    path = tiny_ckpt("granite_dense")
    llm = make_llm(path, max_num_batched_tokens=1024, max_model_len=1024)
    ids = prompt(PROMPT_LOGPROBS_ROWS_PER_STEP * 2 + 37, 5, llm.config.vocab_size)
    steps = []
    orig = llm.engine.scheduler.schedule

    def schedule():
        out = orig()
        steps.append(sum(c.num_tokens for c in out.chunks if not c.is_decode))
        return out

    llm.engine.scheduler.schedule = schedule
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY), use_tqdm=False)[0]
    assert max(steps) <= PROMPT_LOGPROBS_ROWS_PER_STEP and sum(steps) == len(ids)
    check_against_oracle(path, ids, out.prompt_logprobs, 1)


def test_preemption_prefix_cache_and_n(tiny_ckpt, make_llm):
    """Preempted and replayed requests keep one entry per prompt token; a prompt that a cached prefix
    covers is still scored in full; n > 1 has one prompt_logprobs list; streamed ("delta") outputs
    carry it once."""
    path = tiny_ckpt("nemotron_h")
    ref_llm = make_llm(path)
    vocab = ref_llm.config.vocab_size
    prompts = [prompt(40, 10 + i, vocab) for i in range(4)]
    sp = SamplingParams(max_tokens=24, prompt_logprobs=2, **GREEDY)
    ref = ref_llm.generate(prompts, sp, use_tqdm=False)

    tight = make_llm(path, max_num_seqs=4, page_size=4, num_kv_pages=40, max_model_len=64)
    got = tight.generate(prompts, sp, use_tqdm=False)
    assert tight.engine.stats["preemptions"] > 0
    for r, g in zip(ref, got):
        assert len(g.prompt_logprobs) == len(r.prompt_logprobs) == len(g.prompt_token_ids)
        for a, b in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)

    cached = make_llm(path, enable_prefix_caching=True)
    cached.generate([prompts[0]], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    again = cached.generate([prompts[0] + [3, 4]], SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY),
                            use_tqdm=False)[0]
    check_against_oracle(path, prompts[0] + [3, 4], again.prompt_logprobs, 2)

    out = ref_llm.generate([prompts[1]], SamplingParams(n=3, max_tokens=4, prompt_logprobs=2, temperature=1.0, seed=1),
                           use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == len(prompts[1])

    eng = ref_llm.engine
    eng.add_request("s", prompts[2], SamplingParams(max_tokens=5, prompt_logprobs=1, **GREEDY), output_kind="delta")
    seen = []
    while eng.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in eng.step() if o.request_id == "s" and o.prompt_logprobs is not None]
    assert len(seen) == 1 and len(seen[0]) == len(prompts[2])
