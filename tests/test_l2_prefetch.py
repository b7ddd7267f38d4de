"""The L2 prefetch plan (hybrid/l2_prefetch.py): which weights each point of a decode step asks L2
for, within its budget, and when a point fires. The kernel itself is sm_90 PTX (tests/gpu)."""
from __future__ import annotations

import pytest
import torch

from hybrid import l2_prefetch
from hybrid.layers import Attention, Mamba2Mixer
from hybrid.model import TwoStageBlock
from hybrid.moe import GraniteMoE, NemotronMoE
from hybrid.ops import triton_guard, triton_prefetch


@pytest.fixture
def planned(make_llm, tiny_ckpt, monkeypatch):
    """plan(name, budget) -> the tiny checkpoint's CPU model with its prefetch points set (the plan
    is a no-op off sm_90 devices: the device check is lifted; the experts marked fused, as on CUDA)."""
    monkeypatch.setattr(triton_prefetch, "is_available", lambda device: True)

    def plan(name: str, budget: int = 1 << 40):
        model = make_llm(tiny_ckpt(name)).model
        for p in model.parameters():  # (CPU loads may view an mmap at any offset; CUDA allocations are aligned)
            p.data = p.data.clone()
        for m in model.modules():
            if isinstance(m, (GraniteMoE, NemotronMoE)):
                m.experts.fused = True
        return model, l2_prefetch.plan_l2_prefetch(model, budget)

    return plan


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _first(block) -> list[torch.Tensor]:
    mixer = block.mixer
    return [mixer.in_proj.weight if isinstance(mixer, Mamba2Mixer) else mixer.qkv_proj.weight]


def test_granite_moe_points(planned):
    model, count = planned("granite_moe")
    layers = list(model.layers)
    assert all(isinstance(b, TwoStageBlock) and b.moe is not None for b in layers)
    for i, block in enumerate(layers):
        mixer, mlp = block.mixer, block.mlp
        point = mixer.l2_after_in_proj if isinstance(mixer, Mamba2Mixer) else mixer.l2_after_qkv
        out = mixer.out_proj.weight if isinstance(mixer, Mamba2Mixer) else mixer.o_proj.weight
        # the rest of the block's fixed weights, in the order they are read
        assert _same(point.fixed, [out, mlp.gate_up_proj.weight, mlp.down_proj.weight])
        route = block.moe.l2_after_route
        assert _same(route.stacked, [block.moe.experts.up, block.moe.experts.down])
        assert _same(route.fixed, _first(layers[i + 1]) if i + 1 < len(layers) else [])
        expert_bytes = sum(t[0].numel() * t.element_size() for t in route.stacked)
        assert route.row_bytes == expert_bytes
    assert count == 2 * len(layers)  # every mixer point and every routing point holds something


def test_nemotron_points(planned):
    model, _ = planned("nemotron_h")
    layers = list(model.layers)
    kinds = [type(b.mixer).__name__ for b in layers]
    assert "NemotronMoE" in kinds and "Mamba2Mixer" in kinds
    for i, block in enumerate(layers):
        mixer = block.mixer
        if isinstance(mixer, Mamba2Mixer):
            assert _same(mixer.l2_after_in_proj.fixed, [mixer.out_proj.weight])  # no MLP of its own
        elif isinstance(mixer, Attention):
            assert _same(mixer.l2_after_qkv.fixed, [mixer.o_proj.weight])
        elif isinstance(mixer, NemotronMoE):
            nxt = layers[i + 1].mixer if i + 1 < len(layers) else None
            following = _first(layers[i + 1]) if isinstance(nxt, (Mamba2Mixer, Attention)) else []
            shared = [mixer.shared.up_proj.weight, mixer.shared.down_proj.weight]
            assert _same(mixer.l2_after_route.fixed, shared + following)
            assert _same(mixer.l2_after_route.stacked, [mixer.experts.up, mixer.experts.down])


def test_budget_keeps_the_weights_that_fit_in_order(planned):
    model, _ = planned("granite_moe")
    mixer = next(m for m in model.modules() if isinstance(m, Mamba2Mixer))
    block = next(b for b in model.layers if b.mixer is mixer)
    sizes = [t.numel() * t.element_size() for t in (mixer.out_proj.weight, block.mlp.gate_up_proj.weight,
                                                    block.mlp.down_proj.weight)]
    # room for out_proj and down_proj but not gate_up after out_proj: gate_up is skipped, down kept
    budget = sizes[0] + sizes[2]
    assert sizes[1] > sizes[2]
    model, _ = planned("granite_moe", budget)
    mixer = next(m for m in model.modules() if isinstance(m, Mamba2Mixer))
    block = next(b for b in model.layers if b.mixer is mixer)
    assert _same(mixer.l2_after_in_proj.fixed, [mixer.out_proj.weight, block.mlp.down_proj.weight])
    assert mixer.l2_after_in_proj.fixed_bytes == budget


def test_table_layout():
    a = torch.zeros(3, 40)  # 480 bytes
    stack = torch.zeros(5, 4, 8)  # rows of 128 bytes
    table = triton_prefetch.region_table([a], [stack], torch.device("cpu"))
    assert table.dtype == torch.int64 and table.shape == (2, 4)
    assert table[0].tolist() == [a.data_ptr(), 0, 480, 0]
    assert table[1].tolist() == [stack.data_ptr(), 128, 128, 5]
    odd = torch.zeros(7, dtype=torch.uint8)  # whole bytes rounded down to the bulk prefetch's 16
    assert triton_prefetch.region_table([odd], [], torch.device("cpu"))[0, 2].item() == 0


@pytest.mark.parametrize("mode", ["1", "static", "rows", ""])
def test_issue_follows_the_switches_the_step_size_and_the_budget(mode, monkeypatch):
    monkeypatch.setenv("HYBRID_L2_PREFETCH", mode)
    triton_guard.reset_switches()
    calls = []
    monkeypatch.setattr(triton_prefetch, "prefetch",
                        lambda table, max_bytes, ids=None: calls.append((table, max_bytes, ids)))
    fixed = [torch.zeros(64, 16), torch.zeros(32, 16)]  # 4096 and 2048 bytes
    stacks = [torch.zeros(4, 8, 16), torch.zeros(4, 16, 4)]  # rows of 512 and 256 bytes
    point = l2_prefetch.PrefetchPoint(fixed, stacks, budget=4096 + 2048 + 2 * 768)
    ids = torch.tensor([0, 3], dtype=torch.int32)
    try:
        point.issue(1, ids)
        point.issue(l2_prefetch.MAX_TOKENS + 1, ids)  # past decode sizes: nothing
        point.issue(1, torch.tensor([0, 1, 2], dtype=torch.int32))  # three rows do not fit with the fixed ones
    finally:
        triton_guard.reset_switches()
    if mode == "":
        assert calls == []
        return
    if mode == "1":
        assert [c[0] for c in calls] == [point.all_table, point.fixed_table]
        assert calls[0][1] == 4096 and calls[0][2] is ids
    elif mode == "static":
        assert [c[0] for c in calls] == [point.fixed_table, point.fixed_table]
        assert calls[0][2] is None
    else:  # rows alone: three rows fit without the fixed weights
        assert [c[0] for c in calls] == [point.rows_table, point.rows_table]
        assert calls[0][1] == 512
