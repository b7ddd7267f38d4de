"""The GPU memory plan's arithmetic (graphs/memory.py), on CPU: every persistent allocation is in
the plan before the KV pages take the rest, so a configuration that does not fit fails at startup
with CapacityError, never with torch.OutOfMemoryError later. An 8B-shaped Nemotron-H (97.4 MiB of
Mamba state a sequence) on an H200 (141 GB)."""
from __future__ import annotations

import pytest
import torch

from attention.kv_cache import PagedKVCache
from graphs.memory import (GRAPH_RESERVE_BYTES, GiB, capture_sizes, graph_reserve_bytes, plan_memory,
                           spec_scratch_bytes, split_budget)
from graphs.padding import default_capture_sizes
from hybrid.config_parse import parse_config
from hybrid.errors import CapacityError
from model_shapes import H200_BYTES, NEMOTRON_H_8B
from state_pool.pool import StateShapes

UTIL = 0.9
MAX_MODEL_LEN, PAGE_SIZE = 16384, 16


@pytest.fixture(scope="module")
def shapes_8b():
    cfg = parse_config(NEMOTRON_H_8B)
    m, a = cfg.mamba, cfg.attention
    sh = StateShapes(len(cfg.mamba_layers), m.conv_dim, m.conv_kernel - 1, m.num_heads, m.head_dim, m.state_size)
    slot = sh.bytes_per_slot(torch.bfloat16, torch.float32)
    page = PagedKVCache.bytes_per_page(len(cfg.attention_layers), PAGE_SIZE, a.num_kv_heads, a.head_dim,
                                       torch.bfloat16)
    weights = 8_100_000_000 * 2  # bf16
    # what plan_memory leaves for state and KV: the budget less weights, a 2 GiB activation peak, graph reserve
    budget = int(H200_BYTES * UTIL) - weights - 2 * 2**30 - 512 * 2**20
    return cfg, slot, page, budget


def _split(budget, slot, page, max_num_seqs, k, **kw):
    return split_budget(budget, slot_bytes=slot, page_bytes=page, page_size=PAGE_SIZE, max_num_seqs=max_num_seqs,
                        max_model_len=MAX_MODEL_LEN, num_speculative_tokens=k, **kw)


def test_slot_size_is_the_8b_one(shapes_8b):
    _, slot, _, _ = shapes_8b
    assert abs(slot / 2**20 - 97.4) < 0.1


def test_spec_scratch_at_256_sequences_is_a_capacity_error(shapes_8b):
    """256 sequences x (K+1 = 4) verify states x 97.4 MiB = 97.4 GiB of scratch: with the slots that is
    more than the H200 holds. Without speculation the same configuration fits."""
    _, slot, page, budget = shapes_8b
    assert spec_scratch_bytes(slot, 256, 3) == 256 * 4 * slot
    assert spec_scratch_bytes(slot, 256, 3) / GiB > 97
    with pytest.raises(CapacityError, match=r"speculative verify scratch \(num_speculative_tokens=3"):
        _split(budget, slot, page, 256, 3)
    state, spec, pages = _split(budget, slot, page, 256, 0)
    assert spec == 0 and state == 257 * slot and pages > MAX_MODEL_LEN // PAGE_SIZE


def test_spec_scratch_is_budgeted_before_the_kv_pages(shapes_8b):
    """A configuration that fits: the scratch is in the plan, and the KV pages get only what is left."""
    _, slot, page, budget = shapes_8b
    n, k = 160, 3  # enough sequences that the KV cache, not its cap, is what the scratch takes from
    state, spec, pages = _split(budget, slot, page, n, k)
    assert spec == n * (k + 1) * slot
    assert state == (n + 1) * slot
    assert state + spec + pages * page <= budget
    _, _, pages_no_spec = _split(budget, slot, page, n, 0)
    assert pages == min(pages_no_spec, (budget - state - spec) // page) < pages_no_spec
    # a fixed num_kv_pages that fits only without the scratch is refused, naming the scratch
    with pytest.raises(CapacityError, match="speculative verify scratch"):
        _split(budget, slot, page, n, k, num_kv_pages=pages_no_spec)


def test_plan_memory_refuses_the_8b_spec_configuration_before_profiling(shapes_8b, monkeypatch):
    """plan_memory itself, with an H200's memory reported: CapacityError before any allocation
    (the model is on the meta device; nothing else of CUDA is touched)."""
    from hybrid.model import HybridModel

    cfg, _, _, _ = shapes_8b
    model = HybridModel(cfg)  # meta parameters: no memory
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (H200_BYTES, H200_BYTES))
    with pytest.raises(CapacityError, match="speculative verify scratch"):
        plan_memory(model, cfg, device=torch.device("cuda"), gpu_memory_utilization=UTIL, max_num_seqs=256,
                    max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=2048, page_size=PAGE_SIZE,
                    kv_dtype=torch.bfloat16, conv_dtype=torch.bfloat16, ssm_dtype=torch.float32,
                    attention_backend=None, num_kv_pages=None, use_graphs=True, num_speculative_tokens=3)


@pytest.mark.parametrize("sizes", [None, [8, 1, 2, 2, 0, 64]])
def test_capture_sizes_are_the_runners(sizes):
    from graphs.runner import ModelRunner

    runner = ModelRunner(None, None, enforce_eager=True, max_num_seqs=256, cuda_graph_sizes=sizes)
    assert capture_sizes(sizes, 256) == runner.capture_sizes


def test_graph_reserve_counts_every_buckets_logits():
    """The default 35 buckets up to 256 keep 4231 rows of fp32 logits over a 131072 vocab alive in the
    graph pool: 2.07 GiB, over four times the fixed reserve alone."""
    sizes = capture_sizes(None, 256)
    assert sizes == default_capture_sizes(256) and len(sizes) == 35 and sum(sizes) == 4231
    outputs = graph_reserve_bytes(sizes, 131072) - GRAPH_RESERVE_BYTES
    assert outputs == 4231 * 131072 * 4
    assert outputs / GiB > 2 and outputs > 4 * GRAPH_RESERVE_BYTES
    assert graph_reserve_bytes([1, 2, 4], 1000) == GRAPH_RESERVE_BYTES + 7 * 1000 * 4
