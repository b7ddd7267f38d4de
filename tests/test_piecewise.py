"""Piecewise steps (graphs/piecewise.py), run padded and eagerly on CPU: what a replay of the captured pieces
computes.

Every step of real engine workloads (chunked prefills, mixed steps, decodes, prefix-cache hits, speculative
verify and replay rows) runs twice from the same state: unpadded (the reference) and padded to its token bucket
with the cores on the real batch. The logits and every Mamba slot and KV page must agree (to the rounding of
GEMMs over more rows); slots and pages the step does not own must not change at all.
"""
from __future__ import annotations

import pytest
import torch

from graphs.padding import token_bucket_batch
from graphs.piecewise import CoreCall, PiecewiseGraphs, piecewise_sizes, weak_view
from graphs.runner import ModelRunner
from hybrid import SamplingParams
from hybrid.step_cores import core_boundary, run_core
from state_pool.pool import PAD_SLOT_ID

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_piecewise_sizes():
    assert piecewise_sizes(512) == [8, 16] + list(range(32, 513, 32))
    assert piecewise_sizes(100) == [8, 16, 32, 64, 96, 100]
    assert piecewise_sizes(16) == [8, 16] and piecewise_sizes(5) == [5] and piecewise_sizes(0) == []


def test_default_max_tokens_reads_the_environment(monkeypatch):
    from graphs.piecewise import default_piecewise_max_tokens

    monkeypatch.delenv("HYBRID_PIECEWISE_MAX_TOKENS", raising=False)
    assert default_piecewise_max_tokens() == 512
    monkeypatch.setenv("HYBRID_PIECEWISE_MAX_TOKENS", "256")
    assert default_piecewise_max_tokens() == 256
    monkeypatch.setenv("HYBRID_PIECEWISE_MAX_TOKENS", "lots")
    with pytest.raises(ValueError, match="HYBRID_PIECEWISE_MAX_TOKENS"):
        default_piecewise_max_tokens()


def test_token_bucket_batch_is_one_padding_prefill_row():
    ids = torch.arange(24)
    b = token_bucket_batch(ids)
    assert b.input_ids is ids and b.num_tokens == 24 and b.num_prefills == 1 and b.num_decodes == 0
    assert b.state_slot_cpu == [PAD_SLOT_ID] and b.state_slot.tolist() == [PAD_SLOT_ID] and b.num_verify == 0


def test_weak_view_aliases_without_owning():
    t = torch.arange(12.0).reshape(3, 4)[:, 1:]
    w = weak_view(t)
    assert w.shape == t.shape and w.stride() == t.stride() and w.data_ptr() == t.data_ptr()
    t[0, 0] = 100.0
    assert w[0, 0] == 100.0
    if hasattr(torch._C, "_construct_storage_from_data_pointer"):
        assert w.untyped_storage()._cdata != t.untyped_storage()._cdata  # a storage of its own, not t's


def test_core_call_copies_the_real_rows_and_zeros_the_padding():
    seen = []

    def core(batch, a, b):
        seen.append((batch, a.shape[0], b.shape[0]))
        return (a + b)[:, :2] * 2

    a, b = torch.ones(8, 3), torch.full((8, 3), 2.0)
    out = torch.full((8, 2), float("nan"))
    CoreCall(core, (a, b), out).run("real", 5)
    assert seen == [("real", 5, 5)]
    assert torch.equal(out[:5], torch.full((5, 2), 6.0)) and torch.equal(out[5:], torch.zeros(3, 2))


def test_run_core_without_a_boundary_calls_the_core():
    assert run_core(lambda batch, x: x * batch, 3, (torch.ones(2),), (), torch.float32).tolist() == [3.0, 3.0]
    calls = []

    def boundary(core, batch, tokens, out_tail, out_dtype):
        calls.append((batch, out_tail, out_dtype))
        return torch.zeros(tokens[0].shape[0], *out_tail, dtype=out_dtype)

    with core_boundary(boundary):
        out = run_core(lambda batch, x: x, "b", (torch.ones(4),), (2,), torch.float64)
    assert calls == [("b", (2,), torch.float64)] and out.shape == (4, 2)
    assert run_core(lambda batch, x: x + 1, None, (torch.zeros(1),), (), torch.float32).tolist() == [1.0]


def _state(llm):
    return (llm.state_pool.conv_state.clone(), llm.state_pool.ssm_state.clone(),
            llm.kv_cache.kv.clone() if llm.kv_cache is not None else None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _restore(llm, snap):
    llm.state_pool.conv_state.copy_(snap[0])
    llm.state_pool.ssm_state.copy_(snap[1])
    if snap[2] is not None:
        llm.kv_cache.kv.copy_(snap[2])


class _BothWays:
    """The engine's runner for the test: every step the piecewise path takes runs unpadded first (the reference),
    then, from the same state, padded through PiecewiseGraphs.run_padded; the two must agree."""

    def __init__(self, llm, max_tokens: int) -> None:
        self.llm = llm
        self.inner = llm.engine.runner
        self.piecewise = ModelRunner(llm.model, self.inner.ctx, enforce_eager=True, max_num_seqs=llm.max_num_seqs,
                                     max_model_len=llm.max_model_len, page_size=self.inner.page_size,
                                     piecewise_max_tokens=max_tokens, pad_piecewise=True)
        self.kinds: dict[str, int] = {}
        self.padded_rows = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def inputs_that_ran(self):
        return self.piecewise.inputs_that_ran()

    def execute(self, batch):
        llm = self.llm
        size = self.piecewise.piecewise_bucket(batch)
        assert size is not None, f"a step of {batch.num_tokens} tokens has no bucket"
        before = _state(llm)
        ref = llm.model(batch, self.inner.ctx)
        ref_state = _state(llm)
        _restore(llm, before)
        out = self.piecewise.execute(batch)
        after = _state(llm)
        assert self.piecewise.stats["padded_piecewise_eager"] >= 1
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        assert torch.equal(out.argmax(-1), ref.argmax(-1))
        for got, want, old in zip(after, ref_state, before):
            if got is None:
                continue
            # (free slots hold NaN under check_state: compared as bits, or as equal NaNs)
            changed = (_bits(want) != _bits(old)).reshape(want.shape[0], want.shape[1], -1).any(-1)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)
            # rows the reference left alone (other slots, other pages) stay bit for bit
            keep = ~changed
            assert torch.equal(_bits(got).reshape(*changed.shape, -1)[keep], _bits(old).reshape(*changed.shape, -1)[keep])
        kind = ("verify" if batch.num_verify else "replay" if batch.num_replay else
                "mixed" if batch.num_prefills and batch.num_decodes else "prefill" if batch.num_prefills else
                "decode")
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.padded_rows += size - batch.num_tokens
        return out


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


PROMPTS = [[5, 9, 14, 3, 7, 22, 11], [40, 41, 8, 19, 2, 33, 6, 17, 25, 12, 4, 30, 9, 9, 27, 3, 1, 44, 21],
           [13, 15], [7, 29, 31, 36, 5, 2, 8, 11, 18, 6, 24, 3]]


@pytest.mark.parametrize("name", ["nemotron_h", "granite_moe", "bamba", "falcon_h1", "zamba2"])
def test_padded_piecewise_steps_match_unpadded(name, tiny_ckpt, make_llm):
    """Chunked prefills (a 16-token budget), mixed steps and decodes of four requests, two families with MoE."""
    path = tiny_ckpt(name)
    ref = _tokens(make_llm(path, page_size=4, max_num_seqs=4), PROMPTS)
    llm = make_llm(path, page_size=4, max_num_seqs=4, max_num_batched_tokens=16, check_state=True)
    both = llm.engine.runner = _BothWays(llm, max_tokens=16)
    assert _tokens(llm, PROMPTS) == ref
    assert both.kinds.get("prefill") and both.kinds.get("mixed") and both.kinds.get("decode"), both.kinds
    assert both.padded_rows > 0


def test_padded_piecewise_prefix_hits(tiny_ckpt, make_llm):
    """A prefix-cache hit resumes from a snapshot the padded steps wrote (the snapshot is a core's write)."""
    path = tiny_ckpt("nemotron_h")
    base = PROMPTS[1]
    ref_llm = make_llm(path, page_size=4, enable_prefix_caching=True)
    first = _tokens(ref_llm, [base])[0]
    follow = base + first + [50, 51, 52]
    ref = _tokens(ref_llm, [base, follow])
    llm = make_llm(path, page_size=4, enable_prefix_caching=True, check_state=True)
    both = llm.engine.runner = _BothWays(llm, max_tokens=64)
    assert _tokens(llm, [base])[0] == first
    assert _tokens(llm, [base, follow]) == ref
    assert llm.engine.stats["prefix_cache_hits"] == 2 and both.kinds.get("prefill")


def test_padded_piecewise_speculative_verify(tiny_ckpt, make_llm):
    """Speculative verify steps (n-gram drafts) that no verify bucket takes run piecewise too."""
    path = tiny_ckpt("nemotron_h")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], PROMPTS[0]]
    ref = _tokens(make_llm(path, page_size=4, max_num_seqs=2), prompts)
    llm = make_llm(path, page_size=4, max_num_seqs=2, speculative_config=spec, check_state=True)
    both = llm.engine.runner = _BothWays(llm, max_tokens=64)
    assert _tokens(llm, prompts) == ref
    assert both.kinds.get("verify"), both.kinds


def _decode_batch(llm, slots):
    from hybrid.batch import StepBatch

    n, width = len(slots), llm.engine.max_pages_per_seq
    table = torch.zeros(n, width, dtype=torch.int32)
    table[:, 0] = torch.arange(1, n + 1, dtype=torch.int32)
    return StepBatch(
        input_ids=torch.arange(4, 4 + n), positions=torch.full((n,), 2), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.full((n,), 3, dtype=torch.int32), page_table=table, kv_write_loc=table[:, 0].long() * 4 + 2,
        state_slot=torch.tensor(slots), has_initial_state=torch.ones(n, dtype=torch.bool), logits_indices=torch.arange(n),
        num_decodes=n, num_prefills=0, query_lens_cpu=[1] * n, seq_lens_cpu=[3] * n, state_slot_cpu=list(slots),
        has_initial_state_cpu=[True] * n)


def test_steps_past_the_largest_bucket_run_unpadded(tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("nemotron_h"), page_size=4, max_num_seqs=4)
    runner = ModelRunner(llm.model, llm.engine.runner.ctx, enforce_eager=True, max_num_seqs=4,
                         max_model_len=llm.max_model_len, page_size=4, piecewise_max_tokens=8, pad_piecewise=True)
    assert runner.piecewise.sizes == [8]
    batch = _decode_batch(llm, [0, 1])
    runner.execute(batch)
    assert runner.stats["padded_piecewise_eager"] == 1 and runner.stats["eager"] == 0
    assert runner.piecewise.bucket(9) is None


def test_piecewise_graphs_need_graphs_or_padding(tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("nemotron_h"), page_size=4)
    runner = ModelRunner(llm.model, llm.engine.runner.ctx, enforce_eager=True, max_num_seqs=2,
                         max_model_len=llm.max_model_len, page_size=4, piecewise_max_tokens=64)
    assert runner.piecewise is None and not runner.piecewise_graphs_on
    assert isinstance(ModelRunner(llm.model, llm.engine.runner.ctx, enforce_eager=True, max_num_seqs=2,
                                  max_model_len=llm.max_model_len, page_size=4, piecewise_max_tokens=64,
                                  pad_piecewise=True).piecewise, PiecewiseGraphs)


class _FakeGraph:
    """torch.cuda.CUDAGraph on the CPU: records the capture calls (nothing is captured)."""
    log: list[str] = []

    def capture_begin(self, pool=None):
        _FakeGraph.log.append("begin")

    def capture_end(self):
        _FakeGraph.log.append("end")


@pytest.fixture
def fake_capture(monkeypatch):
    """install() -> the capture log: torch.cuda's capture calls faked from then on (after the checkpoint is
    built: transformers reads torch.cuda.Stream at import)."""
    import contextlib
    from types import SimpleNamespace

    def install() -> list[str]:
        _patch(monkeypatch, contextlib, SimpleNamespace)
        return _FakeGraph.log

    return install


def _patch(monkeypatch, contextlib, SimpleNamespace) -> None:
    _FakeGraph.log = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: SimpleNamespace(wait_stream=lambda s: None))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: SimpleNamespace(wait_stream=lambda s: None))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))


@pytest.mark.parametrize("name", ["nemotron_h", "zamba2"])
def test_capture_splits_at_every_core(name, tiny_ckpt, make_llm, fake_capture):
    """A capture is one piece more than its cores: a piece ends at each core and the next begins; each core
    records its inputs and output at the bucket's rows; the last piece's output is the step's hidden state."""
    llm = make_llm(tiny_ckpt(name), page_size=4)
    pw = PiecewiseGraphs(llm.model, llm.engine.runner.ctx, 16, torch.device("cpu"))
    log = fake_capture()
    before = _state(llm)
    pw.capture(pool=None, progress=False)
    assert sorted(pw.steps) == pw.sizes == [8, 16]
    mamba = len(llm.model.mamba_mixers())
    for size, step in pw.steps.items():
        assert len(step.pieces) == len(step.cores) + 1 and len(step.cores) > mamba
        assert all(t.shape[0] == size for c in step.cores for t in (*c.tokens, c.out))
        assert step.x.shape[0] == size and step.residual.shape[0] == size
    # begin, then (end, begin) at each core, then end: per bucket
    expected = []
    for size in (16, 8):
        expected += ["begin"] + ["end", "begin"] * len(pw.steps[size].cores) + ["end"]
    assert log == expected
    after = _state(llm)  # no core ran: the capture touched no slot and no page
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(after, before) if a is not None)


def test_a_failed_capture_leaves_that_bucket_and_larger_ones_eager(tiny_ckpt, make_llm, fake_capture):
    llm = make_llm(tiny_ckpt("nemotron_h"), page_size=4)
    pw = PiecewiseGraphs(llm.model, llm.engine.runner.ctx, 64, torch.device("cpu"))
    log = fake_capture()
    real = llm.model.hidden_states

    def sync_at_32(batch, ctx):  # a kernel that reads a device value on the host at 32 tokens, under capture
        if batch.num_tokens == 32 and log and log[-1] == "begin":
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(batch, ctx)

    llm.model.hidden_states = sync_at_32
    pw.capture(pool=None, progress=False)
    assert pw.sizes == sorted(pw.steps) == [8, 16]
    assert log.count("begin") == log.count("end")  # the failed capture was ended too
    assert pw.bucket(20) is None and pw.bucket(16) == 16
