"""Decode graphs per context bucket (graphs/runner.py, graphs/padding.py): small decode buckets get a
graph per page-table width, and a replay takes the narrowest width that holds the batch's longest
sequence (the width is the decode attention kernel's max_seq_len). CPU: the CUDA capture is faked."""
from __future__ import annotations

import contextlib

import pytest
import torch

from attention.kv_cache import DUMMY_PAGE
from graphs import padding
from graphs.memory import GRAPH_RESERVE_BYTES, graph_reserve_bytes
from graphs.padding import CONTEXT_BUCKET_MAX_BATCH, context_widths, width_for
from graphs.runner import ModelRunner, _Buffers
from state_pool.pool import PAD_SLOT_ID
from state_pool.step_batch import StepBatch

PAGE = 16


def test_context_widths(monkeypatch):
    monkeypatch.delenv("HYBRID_GRAPH_CONTEXT_BUCKETS", raising=False)
    assert context_widths(516, PAGE) == [256, 516]  # max_model_len 8256: 4096 tokens, then all of it
    assert context_widths(8192, PAGE) == [256, 512, 1024, 2048, 4096, 8192]  # 131072 tokens
    assert context_widths(256, PAGE) == [256] and context_widths(4, PAGE) == [4]  # nothing narrower to add
    assert context_widths(300, 64) == [64, 128, 300]
    monkeypatch.setenv("HYBRID_GRAPH_CONTEXT_BUCKETS", "0")
    assert context_widths(8192, PAGE) == [8192]


def test_width_for_takes_the_narrowest_that_holds_the_longest_sequence():
    widths = [256, 512, 1024]
    assert width_for([1, 4096], widths, PAGE) == 256  # 4096 tokens fill 256 pages exactly
    assert width_for([4097, 3], widths, PAGE) == 512
    assert width_for([9000], widths, PAGE) == 1024
    assert width_for([20000], widths, PAGE) == 1024  # (never past the widest: the runner checks the table)


def test_graph_reserve_counts_the_narrow_graphs_outputs():
    sizes = [1, 2, 4, 8, 16, 24, 32]
    small = sum(s for s in sizes if s <= CONTEXT_BUCKET_MAX_BATCH)
    assert graph_reserve_bytes(sizes, 1000) == GRAPH_RESERVE_BYTES + sum(sizes) * 1000 * 4
    assert graph_reserve_bytes(sizes, 1000, context_buckets=3) == \
        GRAPH_RESERVE_BYTES + (sum(sizes) + 2 * small) * 1000 * 4


def _decode_batch(seq_lens: list[int], max_pages: int) -> StepBatch:
    n = len(seq_lens)
    table = torch.full((n, max_pages), DUMMY_PAGE, dtype=torch.int32)
    for i, s in enumerate(seq_lens):
        pages = -(-s // PAGE)
        table[i, :pages] = torch.arange(1 + 100 * i, 1 + 100 * i + pages, dtype=torch.int32)
    return StepBatch(
        input_ids=torch.arange(5, 5 + n), positions=torch.tensor(seq_lens) - 1,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        page_table=table, kv_write_loc=torch.arange(n) + 7 * PAGE, state_slot=torch.arange(n),
        has_initial_state=torch.ones(n, dtype=torch.bool), logits_indices=torch.arange(n), num_decodes=n,
        num_prefills=0, query_lens_cpu=[1] * n, seq_lens_cpu=list(seq_lens), state_slot_cpu=list(range(n)),
        has_initial_state_cpu=[True] * n)


def test_fill_writes_the_bucket_table_only():
    max_pages = 64
    buffers = _Buffers(8, max_pages, PAGE, torch.device("cpu"), [16, 32, max_pages])
    full_before = buffers.page_table.clone()
    for t in buffers.page_tables.values():  # dirty, as an earlier batch would leave them
        t.fill_(7)
    full_before.fill_(7)
    real = _decode_batch([40, 300, 17], max_pages)
    buffers.fill(real, 4, PAGE, 32)
    table = buffers.page_tables[32]
    assert table.shape == (8, 32) and table.is_contiguous()
    assert torch.equal(table[:3], real.page_table[:, :32])  # the real rows' pages (300 tokens: 19 pages)
    assert (table[3] == DUMMY_PAGE).all()  # the padding row
    assert (table[4:] == 7).all()  # rows past the bucket untouched
    assert torch.equal(buffers.page_table, full_before)  # the full-width table is not the one replayed
    assert buffers.state_slot[3].item() == PAD_SLOT_ID and buffers.seq_lens[3].item() == 1
    view = buffers.batch(4, 32)
    assert view.page_table.shape == (4, 32) and view.page_table.data_ptr() == table.data_ptr()
    assert buffers.batch(4).page_table.shape == (4, max_pages)


class _FakeGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))
    monkeypatch.setattr(ModelRunner, "_device", lambda self: torch.device("cpu"))


def test_capture_and_replay_by_context(fake_cuda, monkeypatch):
    monkeypatch.delenv("HYBRID_GRAPH_CONTEXT_BUCKETS", raising=False)
    widths_seen = []

    def model(batch, ctx):
        widths_seen.append(batch.page_table.shape[1])
        return torch.zeros(batch.num_tokens, 4)

    runner = object.__new__(ModelRunner)
    runner.model, runner.ctx = model, None
    runner.page_size, runner.max_model_len = PAGE, 16384
    runner.capture_sizes = [1, 8, 16, 24]
    runner.graphs, runner.stats = {}, {"graph_replays": 0}
    runner.capture(progress=False)
    assert runner.context_widths == [256, 512, 1024]
    assert {s: sorted(g) for s, g in runner.graphs.items()} == \
        {1: [256, 512, 1024], 8: [256, 512, 1024], 16: [256, 512, 1024], 24: [1024]}
    # each capture ran the model on its own width (two warm-up runs and the capture)
    assert widths_seen[:3] == [1024] * 3 and sorted(set(widths_seen)) == [256, 512, 1024]

    batch = _decode_batch([5000, 40], 1024)  # 5000 tokens: the 8192-token bucket (512 pages)
    runner.replay(batch, 8)
    assert runner.graphs[8][512][0].replays == 1 and runner.graphs[8][1024][0].replays == 0
    ran = runner.inputs_that_ran()
    assert ran.page_table.shape == (8, 512) and torch.equal(ran.page_table[:2], batch.page_table[:, :512])
    runner.replay(_decode_batch([5000, 40], 1024), 24)  # large buckets: the full width only
    assert runner.graphs[24][1024][0].replays == 1
    runner.replay(_decode_batch([16000], 1024), 1)
    assert runner.graphs[1][1024][0].replays == 1
    assert runner.stats["graph_replays"] == 3


def test_buckets_off_keep_one_graph_a_size(fake_cuda, monkeypatch):
    monkeypatch.setenv("HYBRID_GRAPH_CONTEXT_BUCKETS", "0")
    runner = object.__new__(ModelRunner)
    runner.model, runner.ctx = (lambda batch, ctx: torch.zeros(batch.num_tokens, 4)), None
    runner.page_size, runner.max_model_len = PAGE, 16384
    runner.capture_sizes = [1, 8]
    runner.graphs, runner.stats = {}, {"graph_replays": 0}
    runner.capture(progress=False)
    assert {s: sorted(g) for s, g in runner.graphs.items()} == {1: [1024], 8: [1024]}
    assert padding.context_widths(1024, PAGE) == [1024]
