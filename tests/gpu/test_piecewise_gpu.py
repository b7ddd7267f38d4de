"""Piecewise CUDA graphs (graphs/piecewise.py) on the device: every step an engine workload sends them (chunked
prefills, mixed steps, prefix-cache hits, speculative verify rows) replays its token bucket's pieces, and each
replay equals the eager padded run of the same step from the same state bit for bit (logits, every Mamba slot,
every KV page), is within bf16 rounding of the unpadded eager run, and leaves the slots and pages the step does
not own as they were."""
from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

from hybrid import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_util import GREEDY, rel_err, restore, snap  # noqa: E402

MAX_TOKENS = 64


@contextlib.contextmanager
def piecewise_on():
    """HYBRID_PIECEWISE_MAX_TOKENS=MAX_TOKENS while an LLM is built (its runner reads it then), as it was after."""
    old = os.environ.get("HYBRID_PIECEWISE_MAX_TOKENS")
    os.environ["HYBRID_PIECEWISE_MAX_TOKENS"] = str(MAX_TOKENS)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HYBRID_PIECEWISE_MAX_TOKENS", None)
        else:
            os.environ["HYBRID_PIECEWISE_MAX_TOKENS"] = old




def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16) if t.element_size() == 2 \
        else t.view(torch.uint8)


class Checker:
    """The engine's runner: a step the piecewise graphs take runs padded and eagerly, then unpadded and eagerly,
    then (from the same state each time) through the runner, which must replay its bucket's pieces."""

    def __init__(self, llm) -> None:
        self.llm, self.inner = llm, llm.engine.runner
        self.checked = 0
        self.verify_rows = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, batch):
        llm, runner = self.llm, self.inner
        size = runner.piecewise_bucket(batch) if runner.bucket(batch) is None and runner.verify_bucket(batch) is None \
            else None
        if size is None:
            return runner.execute(batch)
        s0 = snap(llm)
        padded = runner.piecewise.run_padded(batch, size)
        s_padded = snap(llm)
        restore(llm, s0)
        unpadded = runner.model(batch, runner.ctx)
        s_unpadded = snap(llm)
        restore(llm, s0)
        replays = runner.stats["piecewise_replays"]
        out = runner.execute(batch)
        torch.cuda.synchronize()
        assert runner.stats["piecewise_replays"] == replays + 1
        s_out = snap(llm)
        assert torch.equal(out, padded), f"replay != padded eager at {batch.num_tokens} tokens (bucket {size})"
        for got, want, before, ref in zip(s_out, s_padded, s0, s_unpadded):
            assert torch.equal(bits(got), bits(want)), "a slot or page differs from the padded eager run"
            moved = (bits(ref) != bits(before)).reshape(ref.shape[0], ref.shape[1], -1).any(-1)
            same = ~moved  # what the unpadded run left alone: the replay too, bit for bit
            assert torch.equal(bits(got).reshape(*moved.shape, -1)[same], bits(before).reshape(*moved.shape, -1)[same])
        assert rel_err(out, unpadded) < 2e-2
        assert rel_err(s_out[1], s_unpadded[1]) < 2e-2
        self.checked += 1
        self.verify_rows += batch.num_verify
        return out


@pytest.fixture(scope="module", params=["nemotron_h", "granite_moe", "bamba", "zamba2", "falcon_h1"])
def llm(request, tiny_ckpt):
    with piecewise_on():
        llm = LLM(tiny_ckpt(request.param), device="cuda", max_num_seqs=4, page_size=16, max_model_len=256,
                  max_num_batched_tokens=MAX_TOKENS, cuda_graph_sizes=[1, 2, 4], gpu_memory_utilization=0.4,
                  enable_prefix_caching=True)
    return llm


def test_buckets_are_captured(llm):
    pw = llm.runner.piecewise
    assert llm.runner.piecewise_graphs_on and pw.sizes == [8, 16, 32, 64] and sorted(pw.steps) == pw.sizes
    for step in pw.steps.values():  # a core a Mamba layer and one an attention call at least; a piece around each
        assert len(step.cores) > len(llm.model.mamba_mixers()) and len(step.pieces) == len(step.cores) + 1


def test_steps_replay_their_pieces(llm):
    prompts = [torch.randint(4, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 90, 17, 40)]
    checker = llm.engine.runner = Checker(llm)
    try:
        # 152 prompt tokens over 64-token steps: chunked prefills beside decodes (three steps at least)
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY),
                                                            use_tqdm=False)]
        first = checker.checked
        # the same prompts again (prefix-cache hits: short suffix steps), then a second turn of one of them
        again = llm.generate(prompts + [prompts[1] + ref[1] + [7, 8, 9]], SamplingParams(max_tokens=12, **GREEDY),
                             use_tqdm=False)
    finally:
        llm.engine.runner = checker.inner
    assert first >= 3 and checker.checked > first, (first, checker.checked)
    assert llm.engine.stats["prefix_cache_hits"] > 0
    assert all(len(o.outputs[0].token_ids) == 12 for o in again)


def test_speculative_verify_rows_replay_pieces(tiny_ckpt):
    """A step with verify rows beside a prefill chunk (never a plain verify step, so no verify graph takes it)
    replays the pieces too: the verify rows' scratch writes are a Mamba core's."""
    with piecewise_on():
        llm = LLM(tiny_ckpt("nemotron_h"), device="cuda", max_num_seqs=4, page_size=16, max_model_len=256,
                  max_num_batched_tokens=MAX_TOKENS, cuda_graph_sizes=[1, 2, 4], gpu_memory_utilization=0.4,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    checker = llm.engine.runner = Checker(llm)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 9, [12, 13] * 20]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)
    assert checker.checked >= 2 and checker.verify_rows > 0, (checker.checked, checker.verify_rows)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)


def test_piecewise_mode_replays_plain_decode_steps_too(tiny_ckpt):
    """cudagraph_mode PIECEWISE (vLLM's): no whole-step graphs, so plain decode steps replay their token bucket's
    pieces as well, each equal to its padded eager run."""
    with piecewise_on():
        llm = LLM(tiny_ckpt("granite_moe"), device="cuda", max_num_seqs=4, page_size=16, max_model_len=256,
                  max_num_batched_tokens=MAX_TOKENS, gpu_memory_utilization=0.4,
                  compilation_config={"cudagraph_mode": "PIECEWISE"})
    assert llm.runner.capture_sizes == [] and not llm.runner.graphs and llm.runner.piecewise_graphs_on
    checker = llm.engine.runner = Checker(llm)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 9, [12, 13] * 20]
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)
    finally:
        llm.engine.runner = checker.inner
    # every step went through the checker: the prefills and 15 decode steps at least
    assert checker.checked >= 16 and llm.runner.stats["graph_replays"] == 0, checker.checked
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
