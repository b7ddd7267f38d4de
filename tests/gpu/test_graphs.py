"""CUDA-graph replay == eager for the same batches; padded replays leave live slots bit-identical."""
from __future__ import annotations

import pytest
import torch

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from gpu_util import rel_err, restore, snap

from graphs.padding import pad_decode_batch
from hybrid import LLM

NUM_SLOTS = 8
PAGE = 16


def decode_batch(llm, slots, seq_lens, seed):
    import sys, os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from test_graph_padding import decode_batch as cpu_batch

    pages = [[1 + 2 * i, 2 + 2 * i] for i in range(len(slots))]
    b = cpu_batch(slots, seq_lens, pages, llm.config.vocab_size, llm.engine.max_pages_per_seq, seed=seed)
    dev = llm.device
    import dataclasses

    return dataclasses.replace(b, **{f: getattr(b, f).to(dev) for f in (
        "input_ids", "positions", "query_start_loc", "seq_lens", "page_table", "kv_write_loc", "state_slot",
        "has_initial_state", "logits_indices")})


def randomize(llm, seed):
    g = torch.Generator(device=llm.device).manual_seed(seed)
    p, kv = llm.state_pool, llm.kv_cache
    p.conv_state.copy_(torch.randn(p.conv_state.shape, generator=g, device=llm.device))
    p.ssm_state.copy_(torch.randn(p.ssm_state.shape, generator=g, device=llm.device) * 0.3)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=g, device=llm.device))




@pytest.fixture(scope="module", params=["bamba", "granite_dense", "nemotron_h", "granite_moe", "zamba2"])  # MoE: nemotron_h, granite_moe
def llm(request, tiny_ckpt):
    return LLM(tiny_ckpt(request.param), device="cuda", max_num_seqs=NUM_SLOTS, page_size=PAGE, max_model_len=64,
               cuda_graph_sizes=[1, 2, 4, 8], gpu_memory_utilization=0.5)


def replay_and_padded_eager(llm, slots: list[int], page_size: int):
    """The decode batch of `slots` over randomized state, run twice from the same state: eagerly on
    its padded batch, then through the runner (which must replay a graph). Returns (batch, state
    before, eager logits, state after eager, replay logits, state after replay)."""
    n = len(slots)
    batch = decode_batch(llm, slots, [5 + 3 * i for i in range(n)], seed=n)
    randomize(llm, n)
    s0 = snap(llm)
    size = min(s for s in llm.runner.capture_sizes if s >= n)
    eager = llm.runner.model(pad_decode_batch(batch, size, page_size), llm.runner.ctx)[:n]
    s_eager = snap(llm)
    restore(llm, s0)
    replays = llm.runner.stats["graph_replays"]
    out = llm.runner.execute(batch)
    torch.cuda.synchronize()
    assert llm.runner.stats["graph_replays"] == replays + 1
    return batch, s0, eager, s_eager, out, snap(llm)


@pytest.mark.parametrize("slots", [[NUM_SLOTS - 1], [NUM_SLOTS - 1, 2, 0], [0, 1, 3, 4, NUM_SLOTS - 1],
                                   list(range(NUM_SLOTS))])
def test_replay_equals_eager(llm, slots):
    assert llm.runner.use_graphs and sorted(llm.runner.graphs) == [1, 2, 4, 8]
    batch, s0, eager_padded, s_eager, out, s_graph = replay_and_padded_eager(llm, slots, PAGE)
    restore(llm, s0)
    eager_unpadded = llm.runner.model(batch, llm.runner.ctx)
    s_unpadded = snap(llm)
    live = list(range(NUM_SLOTS))
    # replay == eager run of the same padded batch, bit for bit
    assert torch.equal(out, eager_padded)
    assert torch.equal(s_graph[0][:, live], s_eager[0][:, live]) and torch.equal(s_graph[1][:, live], s_eager[1][:, live])
    assert torch.equal(s_graph[2][:, 1:], s_eager[2][:, 1:])  # KV outside the dummy page
    # slots outside the batch bit-identical to before; real rows close to the unpadded eager run
    other = [s for s in live if s not in slots]
    assert torch.equal(s_graph[0][:, other], s0[0][:, other]) and torch.equal(s_graph[1][:, other], s0[1][:, other])
    assert rel_err(out, eager_unpadded) < 2e-2
    assert rel_err(s_graph[1][:, slots], s_unpadded[1][:, slots]) < 2e-2
    assert torch.equal(out.argmax(-1), eager_unpadded.argmax(-1)) or rel_err(out, eager_unpadded) < 5e-3


def test_programmatic_dependent_launch_changes_no_bit(llm, monkeypatch):
    """PDL (hybrid/ops/triton_guard.py) only lets a kernel start before its predecessor ends: a
    replay with it on equals an eager run with it off, logits and every slot bit for bit (a kernel
    that read step data before its wait would race and differ)."""
    from hybrid.ops import triton_guard

    assert triton_guard.pdl_options(llm.device)["PDL"], "PDL is off on this device"
    slots = list(range(NUM_SLOTS))
    batch, s0, _, _, out_on, s_on = replay_and_padded_eager(llm, slots, PAGE)
    monkeypatch.setenv("HYBRID_PDL", "0")
    monkeypatch.setattr(triton_guard, "_pdl_by_device", {})
    assert not triton_guard.pdl_options(llm.device)["PDL"]
    restore(llm, s0)
    out_off = llm.runner.model(pad_decode_batch(batch, NUM_SLOTS, PAGE), llm.runner.ctx)[:NUM_SLOTS]
    s_off = snap(llm)
    assert torch.equal(out_on, out_off)
    assert torch.equal(s_on[0], s_off[0]) and torch.equal(s_on[1], s_off[1]) and torch.equal(s_on[2], s_off[2])


def test_prefill_and_large_batches_run_eager(llm):
    """Steps no full graph takes run eagerly, or on the piecewise graphs where they are on (graphs/piecewise.py)."""
    def off_graph(stats):
        return stats["eager"] + stats["piecewise_replays"]

    e = off_graph(llm.runner.stats)
    out = llm.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13]] * 3, None, use_tqdm=False)
    assert off_graph(llm.runner.stats) > e and all(len(o.outputs[0].token_ids) > 0 for o in out)


def test_capacity_error(tiny_ckpt):
    from hybrid.errors import CapacityError

    with pytest.raises(CapacityError, match="do not fit"):
        LLM(tiny_ckpt("nemotron_h"), device="cuda", max_num_seqs=10**7, max_model_len=64, enforce_eager=True)


@pytest.mark.parametrize("name", ["granite_moe", "nemotron_h"])
def test_context_bucket_graph_equals_eager_at_its_width(name, tiny_ckpt):
    """With max_model_len past twice CONTEXT_BUCKET_MIN, small buckets get graphs at narrower page
    tables; a short-context batch replays the narrowest that holds it, bit for bit the eager run of the
    same padded batch at that width, and within rounding of the full-width eager run (the decode
    kernel's max_seq_len changes how it splits a sequence, not what it computes)."""
    import dataclasses

    from graphs.padding import context_widths

    llm = LLM(tiny_ckpt(name), device="cuda", max_num_seqs=NUM_SLOTS, page_size=PAGE, max_model_len=16384,
              cuda_graph_sizes=[1, 4], gpu_memory_utilization=0.5)
    runner = llm.runner
    widths = context_widths(-(-16384 // PAGE), PAGE)
    assert widths == [256, 512, 1024] and all(sorted(g) == widths for g in runner.graphs.values())
    slots = [0, 3, 5]
    batch = decode_batch(llm, slots, [5, 9, 30], seed=3)  # (two pages a row)
    randomize(llm, 3)
    s0 = snap(llm)
    padded = pad_decode_batch(batch, 4, PAGE)
    narrow = dataclasses.replace(padded, page_table=padded.page_table[:, :256].contiguous())
    eager_narrow = runner.model(narrow, runner.ctx)[:3]
    s_eager = snap(llm)
    restore(llm, s0)
    eager_full = runner.model(padded, runner.ctx)[:3]
    restore(llm, s0)
    out = runner.execute(batch)
    torch.cuda.synchronize()
    assert runner.inputs_that_ran().page_table.shape[1] == 256
    assert torch.equal(out, eager_narrow)
    assert all(torch.equal(a, b) for a, b in zip(snap(llm), s_eager))
    assert rel_err(out, eager_full) < 2e-2
