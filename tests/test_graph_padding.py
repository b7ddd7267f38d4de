"""Decode batches padded to a CUDA-graph bucket (graphs/padding.py), run eagerly on CPU.

Padding rows carry PAD_SLOT_ID, the dummy KV page and seq_len 1. A padded run must leave every
live slot's conv and SSM state bit-identical to the unpadded run of the same batch, touch no
live KV page, and give the same logits for the real rows.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from attention.kv_cache import DUMMY_PAGE
from graphs.padding import bucket_for, default_capture_sizes, pad_decode_batch
from graphs.runner import ModelRunner
from hybrid.batch import StepBatch
from state_pool.pool import PAD_SLOT_ID

NUM_SLOTS = 6
PAGE = 16
SIZES = [1, 2, 4, 8]


def decode_batch(slots, seq_lens, pages, vocab, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(slots)
    page_table = torch.full((n, width), DUMMY_PAGE, dtype=torch.int32)
    loc = []
    for i, (s, p) in enumerate(zip(seq_lens, pages)):
        page_table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
        pos = s - 1
        loc.append(p[pos // PAGE] * PAGE + pos % PAGE)
    return StepBatch(
        input_ids=torch.randint(4, vocab, (n,), generator=g), positions=torch.tensor([s - 1 for s in seq_lens]),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        page_table=page_table, kv_write_loc=torch.tensor(loc), state_slot=torch.tensor(slots),
        has_initial_state=torch.ones(n, dtype=torch.bool), logits_indices=torch.arange(n),
        num_decodes=n, num_prefills=0, query_lens_cpu=[1] * n, seq_lens_cpu=list(seq_lens),
        state_slot_cpu=list(slots), has_initial_state_cpu=[True] * n,
    )


@pytest.fixture(scope="module", params=["nemotron_h", "granite_moe"])  # both with MoE layers
def llm(request, tiny_ckpt):
    from hybrid import LLM

    return LLM(tiny_ckpt(request.param), device="cpu", dtype="float32", max_num_seqs=NUM_SLOTS, page_size=PAGE,
               max_model_len=64)


class _RowwiseF:
    """torch.nn.functional with a row-independent `linear`.

    CPU GEMMs round differently for different numbers of rows (MKL blocking), and vectorised
    elementwise kernels (exp, softplus) round the scalar tail of a tensor differently from its
    SIMD body, so an unpadded and a padded batch would differ in the last bits for reasons that
    have nothing to do with padding. With products computed row by row and ATen's scalar CPU
    kernels (ATEN_CPU_CAPABILITY=default, set in a child process), the padded run must match the
    unpadded one bit for bit.
    """

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def linear(x, weight, bias=None):
        out = (x.unsqueeze(-2) * weight).sum(-1)
        return out + bias if bias is not None else out


@pytest.fixture
def rowwise(monkeypatch):
    import hybrid.layers
    import hybrid.model
    import hybrid.moe

    monkeypatch.setattr(hybrid.layers, "F", _RowwiseF())
    monkeypatch.setattr(hybrid.model, "F", _RowwiseF())
    monkeypatch.setattr(hybrid.moe, "F", _RowwiseF())


def randomize(llm, seed):
    g = torch.Generator().manual_seed(seed)
    pool, kv = llm.state_pool, llm.kv_cache
    pool.conv_state.copy_(torch.randn(pool.conv_state.shape, generator=g))
    pool.ssm_state.copy_(torch.randn(pool.ssm_state.shape, generator=g) * 0.3)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=g))


def snapshot(llm):
    return (llm.state_pool.conv_state.clone(), llm.state_pool.ssm_state.clone(), llm.kv_cache.kv.clone())


def restore(llm, snap):
    llm.state_pool.conv_state.copy_(snap[0])
    llm.state_pool.ssm_state.copy_(snap[1])
    llm.kv_cache.kv.copy_(snap[2])


def test_buckets():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_for(3, SIZES) == 4 and bucket_for(8, SIZES) == 8 and bucket_for(9, SIZES) is None


def test_pad_decode_batch_fields():
    b = decode_batch([5, 0], [3, 20], [[1], [2, 3]], 100, 4)
    p = pad_decode_batch(b, 4, PAGE)
    assert p.num_decodes == 4 and p.num_real_requests == 2 and p.num_requests == 4
    assert p.state_slot.tolist() == [5, 0, PAD_SLOT_ID, PAD_SLOT_ID]
    assert p.state_slot_cpu == [5, 0, PAD_SLOT_ID, PAD_SLOT_ID]
    assert p.seq_lens.tolist() == [3, 20, 1, 1] and p.seq_lens_cpu == [3, 20, 1, 1]
    assert p.page_table[2:].eq(DUMMY_PAGE).all() and torch.equal(p.page_table[:2], b.page_table)
    assert p.kv_write_loc[2:].tolist() == [DUMMY_PAGE * PAGE] * 2
    assert p.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert p.logits_indices.tolist() == [0, 1, 2, 3]


_CHILD = os.environ.get("HYBRID_BITEXACT_CHILD") == "1"


def test_padded_decode_bit_identical():
    """Runs the bit-exact cases below in a child process with ATen's scalar CPU kernels."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", HYBRID_BITEXACT_CHILD="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
                           "-k", "bitexact_child"], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "8 passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.bitexact_child  # collected only in the child process (tests/conftest.py deselects it otherwise)
@pytest.mark.parametrize("slots", [[NUM_SLOTS - 1], [0, NUM_SLOTS - 1], [NUM_SLOTS - 1, 2, 0], [0, 1, 3, 4, NUM_SLOTS - 1]])
def test_bitexact_child(llm, slots, rowwise):
    cfg = llm.config
    width = llm.engine.max_pages_per_seq
    n = len(slots)
    seq_lens = [5 + 6 * i for i in range(n)]  # <= 29 tokens: two pages each
    pages = [[1 + 2 * i, 2 + 2 * i] for i in range(n)]  # live pages 1 .. 2n, page 0 dummy
    batch = decode_batch(slots, seq_lens, pages, cfg.vocab_size, width, seed=n)
    for s in range(NUM_SLOTS):
        if s not in llm.state_pool.live_slots:
            assert llm.state_pool.allocate() is not None
    randomize(llm, seed=7 + n)
    snap = snapshot(llm)

    ref = llm.runner.model(batch, llm.runner.ctx)  # unpadded, eager
    ref_state = snapshot(llm)

    restore(llm, snap)
    runner = ModelRunner(llm.model, llm.runner.ctx, enforce_eager=True, max_num_seqs=max(SIZES), max_model_len=64,
                         page_size=PAGE, cuda_graph_sizes=SIZES, pad_decode=True)
    out = runner.execute(batch)
    assert runner.stats["padded_eager"] == 1
    assert out.shape == ref.shape == (n, cfg.vocab_size)
    conv, ssm, kv = snapshot(llm)
    live = list(range(NUM_SLOTS))  # every request slot, in the batch or not
    assert torch.equal(conv[:, live], ref_state[0][:, live]), "a live slot's conv state changed"
    assert torch.equal(ssm[:, live], ref_state[1][:, live]), "a live slot's SSM state changed"
    scratch = llm.state_pool.scratch_slot
    assert torch.equal(conv[:, scratch], snap[0][:, scratch]) and torch.equal(ssm[:, scratch], snap[1][:, scratch])
    # KV: only the dummy page may differ from the unpadded run
    assert torch.equal(kv[:, 1:], ref_state[2][:, 1:])
    # slots not in the batch are untouched altogether
    for s in set(live) - set(slots):
        assert torch.equal(conv[:, s], snap[0][:, s]) and torch.equal(ssm[:, s], snap[1][:, s])
    assert torch.equal(out, ref), (out - ref).abs().max()


@pytest.mark.parametrize("slots", [[NUM_SLOTS - 1, 2, 0]])
def test_padded_decode_close_with_blas(llm, slots):
    """With the real (BLAS) GEMMs the padded run agrees with the unpadded one to rounding."""
    n = len(slots)
    batch = decode_batch(slots, [9] * n, [[1 + i] for i in range(n)], llm.config.vocab_size,
                         llm.engine.max_pages_per_seq, seed=1)
    randomize(llm, 11)
    snap = snapshot(llm)
    ref = llm.runner.model(batch, llm.runner.ctx)
    ref_state = snapshot(llm)
    restore(llm, snap)
    runner = ModelRunner(llm.model, llm.runner.ctx, enforce_eager=True, max_num_seqs=8, max_model_len=64,
                         page_size=PAGE, cuda_graph_sizes=SIZES, pad_decode=True)
    out = runner.execute(batch)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    state = snapshot(llm)
    for a, b in zip(state[:2], ref_state[:2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    other = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(state[0][:, other], snap[0][:, other]) and torch.equal(state[1][:, other], snap[1][:, other])


def test_runner_eager_paths_unchanged(llm):
    """Sizes above the largest bucket and non-decode batches run unpadded."""
    runner = ModelRunner(llm.model, llm.runner.ctx, enforce_eager=True, max_num_seqs=2, max_model_len=64,
                         page_size=PAGE, cuda_graph_sizes=[1, 2], pad_decode=True)
    b = decode_batch([0, 1, 2], [4, 4, 4], [[1], [2], [3]], llm.config.vocab_size, llm.engine.max_pages_per_seq)
    randomize(llm, 3)
    out = runner.execute(b)
    assert runner.stats == {"graph_replays": 0, "padded_eager": 0, "eager": 1, "verify_graph_replays": 0,
                            "padded_verify_eager": 0, "piecewise_replays": 0, "padded_piecewise_eager": 0}
    assert out.shape[0] == 3


def test_torch_decode_pad_rows_read_zero_write_nothing():
    from hybrid.ops import mamba_torch

    g = torch.Generator().manual_seed(0)
    conv = torch.randn(4, 6, 3, generator=g)
    before = conv.clone()
    x = torch.randn(3, 6, generator=g)
    w = torch.randn(6, 4, generator=g)
    slots = torch.tensor([1, PAD_SLOT_ID, 2])
    out = mamba_torch.conv_decode(x, conv, slots, w, None)
    assert torch.equal(conv[[0, 3]], before[[0, 3]])  # slot 0 and the scratch row untouched
    zero_hist = torch.cat([torch.zeros(6, 3), x[1][:, None]], -1)
    torch.testing.assert_close(out[1], torch.nn.functional.silu((zero_hist * w).sum(-1)))


def test_graph_buffers_pad_exactly_like_eager_padding():
    """The graph buffers after a fill (graphs/runner.py) and the eager padding (pad_decode_batch) hold
    the same rows field by field: one padding definition (graphs/padding.padding_row) for both."""
    from graphs.runner import _Buffers

    width = 4
    buffers = _Buffers(8, width, PAGE, torch.device("cpu"))
    for f in _Buffers.FIELDS:  # dirty the buffers, as an earlier, larger batch would leave them
        getattr(buffers, f).fill_(7)
    real = decode_batch([5, 0, 2], [3, 20, 9], [[1], [2, 3], [4]], 100, width)
    buffers.fill(real, 8, PAGE)
    padded = pad_decode_batch(real, 8, PAGE)
    for f in ("input_ids", "positions", "seq_lens", "page_table", "kv_write_loc", "state_slot", "has_initial_state"):
        assert torch.equal(getattr(buffers, f), getattr(padded, f)), f
    assert padded.state_slot_cpu[3:] == [PAD_SLOT_ID] * 5
