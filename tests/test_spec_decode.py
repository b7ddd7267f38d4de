"""Prompt-lookup (n-gram) speculative decoding: verify steps, post-verify state commit.

Greedy output with speculation must equal output without it token for token (rejected drafts
leave no trace in the Mamba state or the KV cache), and seeded sampled output too (one draw per
emitted token from the request's own generator, accept iff the draft equals the sampled token).
"""
from __future__ import annotations

import math

import pytest
import torch

from hybrid import SamplingParams
from hybrid.spec_decode import NgramProposer, SpeculativeConfig, verify_drafts

import tiny_checkpoints as tc

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],  # repetitive
    [9, 30, 41, 12, 77, 3, 50],
    [4],
    list(range(10, 40)),
]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def repetitive_ckpt(tmp_path_factory):
    """A NemotronH whose mixer outputs are scaled down (branch_out_scale 0.2): the next token depends
    mostly on the current one, so greedy outputs fall into cycles and n-gram drafts get accepted,
    while Mamba and attention still shape every logit."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        vocab_size=96, hidden_size=64, hybrid_override_pattern="M*M-M", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, expand=2,
        chunk_size=8, layer_norm_epsilon=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(11)
    model = NemotronHForCausalLM(cfg).to(torch.float32).eval()
    tc._redraw_weights(model, 11, branch_out_scale=0.2, lm_head_std=6.0 / math.sqrt(64))
    return str(tc._finish(model, tmp_path_factory.mktemp("rep") / "nemotron_rep"))


def _run(llm, prompts, sp):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.mark.parametrize("sampled, stop_at, expected", [
    ([1, 2, 3, 4], None, (4, 3)),  # every draft accepted, then the bonus token
    ([1, 9, 3, 4], None, (2, 1)),  # first mismatch at position 1: its sampled token is emitted
    ([7, 2, 3, 4], None, (1, 0)),
    ([1, 2, 3, 4], 1, (2, 2)),  # the token at position 1 ended the sequence (a stop token)
])
def test_verify_drafts_acceptance_rule(sampled, stop_at, expected):
    """The rule the engine applies to a verify row (Engine._finish_verify): accept a draft iff it
    equals the token sampled there; stop at the first mismatch or when the sequence ends."""
    emitted = []

    def emit(j):
        emitted.append(j)
        return sampled[j]

    assert verify_drafts([1, 2, 3], emit, lambda: stop_at is not None and emitted[-1] == stop_at) == expected
    assert emitted == list(range(expected[0]))


def test_proposer():
    prop = NgramProposer(SpeculativeConfig.from_dict(SPEC))
    assert prop.propose([1, 2, 3, 9, 1, 2, 3], 5) == [9, 1, 2]  # 3-gram match, K=3 tokens after it
    assert prop.propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # capped by the room left
    assert prop.propose([5, 1, 7, 7, 2, 7], 3) == [2, 7, 2]  # falls back to the 1-gram, periodic
    assert prop.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert prop.propose([4, 4, 4, 4], 3) == [4, 4, 4]
    assert prop.propose([1, 2, 3, 1, 2], 3) == [3, 1, 2]
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.from_dict({"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})


@pytest.mark.parametrize("which", ["repetitive", "nemotron_h"])
def test_greedy_equal_with_and_without_speculation(which, repetitive_ckpt, tiny_ckpt, make_llm):
    path = repetitive_ckpt if which == "repetitive" else tiny_ckpt("nemotron_h")
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = _run(make_llm(path, max_num_seqs=4, page_size=4), PROMPTS, sp)
    drafted = accepted = 0
    for batch_size in (1, 4):
        llm = make_llm(path, max_num_seqs=4, page_size=4, speculative_config=SPEC, check_state=batch_size == 4)
        got = []
        for i in range(0, len(PROMPTS), batch_size):
            got += _run(llm, PROMPTS[i:i + batch_size], sp)
        assert got == ref, f"batch size {batch_size}"
        st = llm.engine.stats
        assert st["spec_verify_rows"] > 0
        drafted += st["spec_draft_tokens"]
        accepted += st["spec_accepted_tokens"]
        assert llm.state_pool.num_free == 4 and llm.kv_cache.allocator.num_free == llm.kv_cache.num_pages - 1
    rate = accepted / drafted
    print(f"{which}: acceptance {accepted}/{drafted} = {rate:.3f}")
    assert 0 < rate < 1  # drafts are both accepted and rejected
    if which == "repetitive":
        assert rate > 0.2
        # fewer forward passes than generated tokens: several tokens per verify step
        assert llm.engine.stats["steps"] < llm.engine.stats["generated_tokens"]


def test_acceptance_rate_reported(repetitive_ckpt, make_llm):
    llm = make_llm(repetitive_ckpt, max_num_seqs=2, page_size=4, speculative_config=SPEC)
    assert llm.engine.spec_acceptance_rate() is None
    _run(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    rate = llm.engine.spec_acceptance_rate()
    assert rate == llm.engine.stats["spec_accepted_tokens"] / llm.engine.stats["spec_draft_tokens"]


def test_seeded_sampling_unchanged_by_speculation(repetitive_ckpt, make_llm):
    """One draw per emitted token from the request's generator: the same tokens as without it."""
    sps = [SamplingParams(temperature=t, top_k=k, max_tokens=30, seed=s, ignore_eos=True, logprobs=2)
           for t, k, s in ((0.3, -1, 1), (0.5, 5, 2), (0.2, -1, 3), (1.0, -1, 4))]
    base = make_llm(repetitive_ckpt, max_num_seqs=4, page_size=4)
    spec = make_llm(repetitive_ckpt, max_num_seqs=4, page_size=4, speculative_config=SPEC, check_state=True)
    ref = base.generate(PROMPTS, sps, use_tqdm=False)
    got = spec.generate(PROMPTS, sps, use_tqdm=False)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == len(r.outputs[0].token_ids)
        for a, b in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert spec.engine.stats["spec_accepted_tokens"] > 0


def test_speculation_with_forks_stops_and_tight_pages(repetitive_ckpt, make_llm):
    """n > 1, max_tokens/stop tokens inside an accepted run, and a page budget that forces
    preemption: still identical to the plain engine."""
    path = repetitive_ckpt
    sps = [SamplingParams(n=2, temperature=0.0, max_tokens=33, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    base = make_llm(path, max_num_seqs=4, page_size=4, max_model_len=64)
    ref = base.generate(PROMPTS, sps, use_tqdm=False)
    stop_tok = ref[2].outputs[0].token_ids[20]
    sps[2] = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_tok])
    ref = base.generate(PROMPTS, sps, use_tqdm=False)
    tight = make_llm(path, max_num_seqs=4, page_size=4, max_model_len=64, num_kv_pages=20,
                     speculative_config=SPEC, check_state=True)
    got = tight.generate(PROMPTS, sps, use_tqdm=False)
    for r, g in zip(ref, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in r.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in r.outputs]
    assert len(got[0].outputs) == 2 and got[2].outputs[0].token_ids[-1] == stop_tok
    assert len(got[1].outputs[0].token_ids) == 17
    assert tight.engine.stats["preemptions"] > 0
    assert tight.engine.stats["spec_accepted_tokens"] > 0
    assert tight.state_pool.num_free == 4 and tight.kv_cache.allocator.num_free == 19
