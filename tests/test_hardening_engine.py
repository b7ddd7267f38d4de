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
