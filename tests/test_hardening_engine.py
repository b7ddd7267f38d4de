"""Hardening of the engine and the Python API (issue 12): large seeds, lone surrogates, generate()
validating everything before queueing anything, failed steps that fail only their requests, and
non-finite logits."""
from __future__ import annotations

import pytest
import torch

from hybrid import SamplingParams
from hybrid.errors import HybridError, InvalidRequestError

torch.set_num_threads(1)

GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------------------------------------
# 5. seeds of any size
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [2**62, 2**63, 2**64 - 1, 2**70, 3 * 10**15, -1, -(2**70)])
def test_any_int_seed_samples_deterministically(seed, tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2)
    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=seed, ignore_eos=True)
    a = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert len(a) == 6 and a == b


def test_seed_is_reduced_modulo_2_64(tiny_ckpt, make_llm):
    """Documented: seeds that differ by a multiple of 2**64 sample the same tokens; others do not."""
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2)

    def run(seed):
        sp = SamplingParams(temperature=1.0, max_tokens=8, seed=seed, ignore_eos=True)
        return llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids

    assert run(2**70 + 3) == run(2**70 + 3 + 2**64) == run(2**70 + 3 - 5 * 2**64)
    assert len({tuple(run(s)) for s in (1, 2, 3, 2**70)}) > 1


def test_engine_seed_of_any_size(tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2, seed=2**80)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("seed", [True, 1.5, "7"])
def test_non_int_seed_is_invalid(seed):
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=seed)


# ---------------------------------------------------------------------------------------------
# 6. lone UTF-16 surrogates
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_llm():
    from hybrid import LLM

    return LLM(None, device="cpu", dtype="float32", max_num_seqs=4)


@pytest.mark.parametrize("text", ["abc\ud800def", "\udfff", "ok \ud83d"])
def test_lone_surrogate_prompt_is_invalid(text, default_llm):
    with pytest.raises(InvalidRequestError, match=r"surrogate U\+D[89A-F]"):
        default_llm.generate(text, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="surrogate"):
        default_llm.tokenizer.encode(text)
    assert not default_llm.engine.has_unfinished_requests()


def test_valid_astral_characters_still_encode(default_llm):
    out = default_llm.generate("In the beginning \U0001F600", SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# ---------------------------------------------------------------------------------------------
# 8. generate() validates everything before queueing anything
# ---------------------------------------------------------------------------------------------

def _ok(n=4):
    return SamplingParams(max_tokens=n, **GREEDY)


@pytest.mark.parametrize("bad", [
    SamplingParams(max_tokens=4, logit_bias={99999: 1.0}),  # vocabulary-dependent: only the engine knows
    SamplingParams(max_tokens=4, logit_bias={-1: 1.0}),
])
def test_bad_params_in_a_batch_leave_nothing_queued(bad, default_llm):
    llm = default_llm
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate(["a", "b", "c"], [_ok(), bad, _ok()], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    # the next call runs its own prompts only, and they match a fresh run
    got = llm.generate(["d"], _ok(), use_tqdm=False)
    assert len(got) == 1 and got[0].prompt == "d"


@pytest.mark.parametrize("prompts", [["a", "b\ud800"], ["a", 42], ["a", ""], ["a", [1, 10**9]], ["a", [True]]])
def test_bad_prompt_in_a_batch_leaves_nothing_queued(prompts, default_llm):
    with pytest.raises(InvalidRequestError, match="prompt 1"):
        default_llm.generate(prompts, _ok(), use_tqdm=False)
    assert not default_llm.engine.has_unfinished_requests() and not default_llm.engine.requests


@pytest.mark.parametrize("args", [(42,), (None,), (3.5,), ({"a": 1},), (["a"], "x"), (["a"], 5), (["a"], [None]),
                                  (["a", "b"], [SamplingParams()]), (["a"], {"max_tokens": 3})])
def test_generate_wrong_types_are_invalid_requests(args, default_llm):
    with pytest.raises(InvalidRequestError):
        default_llm.generate(*args, use_tqdm=False)
    assert not default_llm.engine.has_unfinished_requests() and not default_llm.engine.requests


def test_params_mutated_into_invalid_values_are_caught(default_llm):
    sp = _ok()
    sp.max_tokens = "many"
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        default_llm.generate(["a", "b"], [_ok(), sp], use_tqdm=False)
    assert not default_llm.engine.requests


def test_engine_add_request_validates_types(default_llm):
    eng = default_llm.engine
    with pytest.raises(InvalidRequestError):
        eng.add_request("x", 42, _ok())
    with pytest.raises(InvalidRequestError):
        eng.add_request("x", [5, 6], "params")
    assert not eng.requests and not eng.has_unfinished_requests()


def test_async_validate_checks_vocabulary_dependent_params(default_llm):
    """AsyncEngine.validate (what the server calls before answering) refuses what add_request would."""
    from hybrid.async_engine import AsyncEngine

    ae = AsyncEngine(default_llm.engine)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        ae.validate([5, 6], SamplingParams(max_tokens=2, logit_bias={99999: 5.0}))
