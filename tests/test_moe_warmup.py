"""The fused MoE warm-up's step lengths (Experts.warmup_lengths, HybridModel.warm_up_moe): triton_moe.launch_plan
is what fused_experts launches (alignment method, both GEMMs' tiles after fitting and narrowing, the shared
expert's slices), and the lengths cover every plan a step can have, at the released MoE shapes. On the GPU,
tests/gpu/test_warmup_gpu.py checks that no MoE kernel compiles after startup."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hybrid.config import MoEConfig  # noqa: E402
from hybrid.layers import DenseMLP, GatedMLP  # noqa: E402
from hybrid.moe import Experts  # noqa: E402
from hybrid.ops import triton_moe  # noqa: E402
from hybrid.ops import triton_moe_align as talign  # noqa: E402


class LaunchSpy:
    """Stands in for _moe_gemm_kernel (or, one_token, for _one_token_experts_kernel): records each launch's tile
    options, runs nothing."""

    def __init__(self, one_token: bool = False) -> None:
        self.launches: list[tuple] = []
        self.one_token = one_token

    def __getitem__(self, grid):
        def launch(*args, **kw):
            if self.one_token:
                self.launches.append(("one_token", kw["BLOCK_N"], kw["K1"], kw["K2"], kw["K3"]))
            else:
                self.launches.append((kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["GROUP_M"], kw["num_warps"],
                                      kw["num_stages"]))
        return launch


def _moe_cfg(E: int, top_k: int, inter: int, shared: int) -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=top_k, intermediate_size=inter, shared_intermediate_size=shared)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_launch_plan_is_what_fused_experts_launches(monkeypatch, gated, dtype):
    E, top_k, H, inter, S = 8, 2, 32, 16, 2
    spy = LaunchSpy()
    one_token_spy = LaunchSpy(one_token=True)
    methods = []
    real_align = talign.align

    def align(ids, num_experts, block_m, method=None):
        methods.append(method or talign.pick_method(ids.numel()))
        return real_align(ids, num_experts, block_m, "torch")  # (the layout only: torch ops on CPU)

    monkeypatch.setattr(triton_moe, "_moe_gemm_kernel", spy)
    monkeypatch.setattr(triton_moe, "_one_token_experts_kernel", one_token_spy)
    monkeypatch.setattr(talign, "align", align)
    w_up = torch.zeros(E, (2 if gated else 1) * inter, H, dtype=dtype)
    w_down = torch.zeros(E, H, inter, dtype=dtype)
    s_up = torch.zeros((2 if gated else 1) * S * inter, H, dtype=dtype)
    s_down = torch.zeros(H, S * inter, dtype=dtype)
    for T in list(range(1, 40)) + [100, 400, 2047, 2048, 2049, 3000]:
        for shared in (0, S):
            k = top_k + shared
            top_idx = torch.arange(T * k).reshape(T, k) % (E + shared)
            top_w = torch.ones(T, k)
            spy.launches.clear()
            one_token_spy.launches.clear()
            methods.clear()
            triton_moe.fused_experts(torch.zeros(T, H, dtype=dtype), w_up, w_down, top_idx, top_w, gated,
                                     shared_up=s_up if shared else None, shared_down=s_down if shared else None,
                                     defer_sum=True)
            method, up, down, has_shared = triton_moe.launch_plan(T, top_k, E, shared, H, inter, gated,
                                                                  dtype.itemsize, 132)
            launches = spy.launches + one_token_spy.launches
            # (the one-token kernel, the default for a 16-bit step of one token, aligns nothing)
            assert (methods or [method], launches, has_shared) == ([method], [up, down], bool(shared)), T
            assert (up[0] == "one_token") == (T == 1 and not methods), T


def _plans(experts: Experts, shared, max_tokens: int) -> dict:
    E, _, H = experts.up.shape
    return {T: triton_moe.launch_plan(T, experts.top_k, E, experts.shared_slices(shared, T), H, experts.down.shape[2],
                                      experts.gated, 2, 132) for T in range(1, max_tokens + 1)}


@pytest.mark.parametrize("shape", ["nemotron-3-nano", "granite-4.0-h-tiny", "granite-4.0-h-small"])
def test_warmup_lengths_cover_every_plan_of_the_released_moe_shapes(shape):
    # (routed experts, top-k, hidden, expert width, shared width, gated)
    E, top_k, H, inter, shared_width, gated = {
        "nemotron-3-nano": (128, 6, 2688, 1856, 3712, False),
        "granite-4.0-h-tiny": (64, 6, 1536, 512, 1024, True),
        "granite-4.0-h-small": (72, 10, 4096, 768, 1536, True),
    }[shape]
    with torch.device("meta"):
        experts = Experts(H, _moe_cfg(E, top_k, inter, shared_width), "silu" if gated else "relu2", gated)
        shared = (GatedMLP(H, shared_width, "silu") if gated else DenseMLP(H, shared_width, "relu2"))
    experts.fused = True
    max_tokens = 8192
    lengths = experts.warmup_lengths(shared, max_tokens, 2, 132)
    plans = _plans(experts, shared, max_tokens)
    assert {plans[T] for T in lengths} == set(plans.values())
    assert len(lengths) == len(set(plans.values())) and lengths == sorted(lengths)
    assert 1 in lengths and len(lengths) < 40  # (a few dozen layer calls at startup)
    # the steps that compiled after startup before this warm-up: Nemotron-3-Nano's 512-token prompt
    # (decode_wide tiles and their one-program alignment)
    assert plans[512] in {plans[T] for T in lengths}
