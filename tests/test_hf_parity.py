"""Token-for-token and logprob parity with Hugging Face transformers (the oracle).

For every family variant (NemotronH with M/*/-/E layers, Granite 4.0-H dense and MoE, Bamba, Falcon-H1,
and a sharded NemotronH checkpoint) the runtime's greedy continuation of each prompt -- all
prompts submitted in ONE `generate` call -- must equal transformers' greedy continuation of
that prompt run alone (eager attention, fp32, batch 1, no padding).

Prompt lengths 1, 5 (< mamba chunk 8), 8 (= chunk), 17 and 27 (several chunks); with
max_num_batched_tokens=16 (or 5: chunk boundaries off the mamba chunk / conv grid) the longer
prompts are prefilled over several engine steps, interleaved with other requests' decodes.

Logprob tolerance: the runtime's returned log-probabilities must match HF's log_softmax of the
fp32 logits within LOGPROB_ATOL + LOGPROB_RTOL * |logprob|. transformers' own fp32 noise
between two numerically different but equivalent paths (cached generate vs a single no-cache
forward) is ~1e-5 on these checkpoints.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import hf_oracle
from tiny_checkpoints import FAMILY_VARIANTS
from hf_oracle import MAX_NEW, PROMPT_LENGTHS, describe_divergence, oracle_run

LOGPROB_ATOL = 1e-4
LOGPROB_RTOL = 1e-5


def _greedy(max_tokens=MAX_NEW, **kw):
    from hybrid import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _check_outputs(path, prompts, outs, n_new=MAX_NEW):
    assert len(outs) == len(prompts)
    problems = []
    for prompt, out in zip(prompts, outs):
        assert out.finished
        assert list(out.prompt_token_ids) == prompt
        assert len(out.outputs) == 1
        comp = out.outputs[0]
        assert comp.finish_reason == "length", comp.finish_reason
        run = oracle_run(path, prompt, n_new)
        d = describe_divergence(run, comp.token_ids, comp.logprobs)
        if d is not None:
            problems.append(d)
    assert not problems, f"{os.path.basename(path)}: runtime != HF greedy\n" + "\n".join(problems)


def _check_logprobs(path, prompts, outs, k, n_new):
    worst = (0.0, None)
    problems = []
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        run = oracle_run(path, prompt, n_new)
        assert comp.logprobs is not None, "logprobs were requested but not returned"
        assert len(comp.logprobs) == len(comp.token_ids) == n_new
        for step, (tok, d) in enumerate(zip(comp.token_ids, comp.logprobs)):
            hf = run.logprobs[step]
            assert tok in d, f"step {step}: sampled token {tok} missing from logprobs {d}"
            # the top-k ids: compare as a set unless HF itself has a near-tie at the k-th place
            top = torch.topk(hf, k + 1)
            hf_top = set(top.indices[:k].tolist())
            ids = set(d) - ({tok} if tok not in hf_top else set())
            if float(top.values[k - 1] - top.values[k]) > 1e-3:
                if ids != hf_top:
                    problems.append(f"prompt len {len(prompt)} step {step}: top-{k} ids {sorted(ids)} "
                                    f"!= HF {sorted(hf_top)}")
            assert len(d) in (k, k + 1)
            for t, v in d.items():
                ref = float(hf[t])
                err = abs(v - ref)
                if err > worst[0]:
                    worst = (err, (len(prompt), step, t, v, ref))
                if err > LOGPROB_ATOL + LOGPROB_RTOL * abs(ref):
                    problems.append(f"prompt len {len(prompt)} step {step} ({'prefill' if step == 0 else 'decode'}) "
                                    f"token {t}: runtime {v:.6f} HF {ref:.6f} |diff| {err:.2e}")
    assert not problems, (f"{os.path.basename(path)}: logprobs differ from HF (worst {worst}):\n  "
                          + "\n  ".join(problems[:20]) + (f"\n  ... {len(problems)} in all" if len(problems) > 20 else ""))
    return worst[0]


# ---------------------------------------------------------------------------------------------
# fixture sanity: the checkpoints really are what the tests claim
# ---------------------------------------------------------------------------------------------


def test_checkpoint_formats(tiny_ckpt):
    nem = tiny_ckpt("nemotron_h")
    cfg = open(os.path.join(nem, "config.json")).read()
    assert "hybrid_override_pattern" in cfg and "Infinity" in cfg and "__float__" not in cfg
    c = json.loads(cfg)
    assert set(c["hybrid_override_pattern"]) == set("M*-E") and c["hybrid_override_pattern"][0] == "M"
    assert os.path.isfile(os.path.join(nem, "tokenizer.json"))

    g = json.load(open(os.path.join(tiny_ckpt("granite_moe"), "config.json")))
    assert g["layer_types"] == ["mamba", "attention", "mamba", "mamba"] and g["num_local_experts"] == 4
    gd = json.load(open(os.path.join(tiny_ckpt("granite_dense"), "config.json")))
    assert gd["num_local_experts"] == 0 and gd["tie_word_embeddings"] and gd["position_embedding_type"] == "nope"
    from safetensors import safe_open

    with safe_open(os.path.join(tiny_ckpt("granite_dense"), "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # tied

    b = json.load(open(os.path.join(tiny_ckpt("bamba"), "config.json")))
    assert b["attn_layer_indices"] == [2] and b["rope_parameters"]["partial_rotary_factor"] == 0.5

    sh = tiny_ckpt("nemotron_h_sharded")
    index = json.load(open(os.path.join(sh, "model.safetensors.index.json")))
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not os.path.exists(os.path.join(sh, "model.safetensors"))
    assert all(os.path.isfile(os.path.join(sh, s)) for s in shards)


@pytest.mark.parametrize("name", FAMILY_VARIANTS)
def test_oracle_is_well_conditioned(name, tiny_ckpt, prompts_for):
    """The HF continuations are non-degenerate and free of near-ties (else parity is ill-posed)."""
    path = tiny_ckpt(name)
    prompts = prompts_for(name)
    distinct = set()
    for p in prompts.values():
        run = oracle_run(path, p, MAX_NEW)
        assert run.min_top2_gap() >= hf_oracle.GAP_MIN
        distinct.update(run.tokens)
        assert len(set(run.tokens)) >= 8, f"degenerate HF continuation {run.tokens}"
    assert len(distinct) >= 40


# ---------------------------------------------------------------------------------------------
# greedy parity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [None, 16, 5], ids=["default_budget", "budget16", "budget5"])
@pytest.mark.parametrize("name", FAMILY_VARIANTS)
def test_greedy_parity(name, budget, tiny_ckpt, prompts_for, make_llm):
    path = tiny_ckpt(name)
    prompts = [prompts_for(name)[n] for n in PROMPT_LENGTHS]
    kwargs = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = make_llm(path, **kwargs)
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    _check_outputs(path, prompts, outs)


def test_greedy_parity_text_prompts(tiny_ckpt, make_llm):
    """Text prompts go through tokenizer.json; ids and detokenized text match the tokenizer."""
    from tokenizers import Tokenizer

    path = tiny_ckpt("nemotron_h")
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    texts = ["The cat sat on the mat.", "hi", "Hello, world! 42 is the answer\nthen more text here"]
    llm = make_llm(path)
    outs = llm.generate(texts, _greedy(), use_tqdm=False)
    problems = []
    for text, out in zip(texts, outs):
        ids = tok.encode(text).ids
        assert out.prompt == text
        assert list(out.prompt_token_ids) == ids
        assert llm.tokenizer.encode(text) == ids
        run = oracle_run(path, ids, MAX_NEW)
        d = describe_divergence(run, out.outputs[0].token_ids)
        if d is not None:
            problems.append(d)
            continue
        # the model never emits <pad>/<s>/<unk> (zeroed lm_head rows) and, for these prompts, no </s>
        assert not set(run.tokens) & {0, 1, 2, 3}
        assert out.outputs[0].text == tok.decode(run.tokens)
        assert llm.tokenizer.decode(run.tokens) == tok.decode(run.tokens)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# logprob parity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILY_VARIANTS)
def test_logprobs_match_hf(name, tiny_ckpt, prompts_for, make_llm):
    """Top-5 logprobs of the prefill token (step 0) and of decode tokens (steps 1..) vs HF."""
    path = tiny_ckpt(name)
    prompts = [prompts_for(name)[n] for n in PROMPT_LENGTHS]
    llm = make_llm(path)
    outs = llm.generate(prompts, _greedy(logprobs=5), use_tqdm=False)
    _check_outputs(path, prompts, outs)
    _check_logprobs(path, prompts, outs, k=5, n_new=MAX_NEW)


def test_logprobs_match_hf_chunked_prefill(tiny_ckpt, prompts_for, make_llm):
    """Same with prefill split over engine steps (budget 16) on the clamp-sensitive Bamba."""
    name = "bamba"
    path = tiny_ckpt(name)
    prompts = [prompts_for(name)[n] for n in PROMPT_LENGTHS]
    llm = make_llm(path, max_num_batched_tokens=16)
    outs = llm.generate(prompts, _greedy(logprobs=3), use_tqdm=False)
    _check_outputs(path, prompts, outs)
    _check_logprobs(path, prompts, outs, k=3, n_new=MAX_NEW)


@pytest.mark.parametrize("page_size", [16, 5])
def test_greedy_parity_long_decode(page_size, tiny_ckpt, make_llm):
    """A longer greedy run (96 new tokens, crossing many KV pages) still matches HF."""
    name = "granite_moe"
    path = tiny_ckpt(name)
    prompts = hf_oracle.select_prompts(path, lengths=(3, 20), max_new_tokens=96)
    prompts = [prompts[3], prompts[20]]
    llm = make_llm(path, page_size=page_size)
    outs = llm.generate(prompts, _greedy(max_tokens=96), use_tqdm=False)
    _check_outputs(path, prompts, outs, n_new=96)
