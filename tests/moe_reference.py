"""Shared by the CPU-interpreter and GPU tests of the fused MoE kernels: routings of the edge kinds
and the check of `triton_moe.fused_experts` against the torch loop of `moe.Experts`."""
from __future__ import annotations

import torch

from hybrid.config import MoEConfig
from hybrid.moe import Experts

ROUTINGS = ["random", "every_expert", "few_experts", "one_expert"]


def routing(kind: str, T: int, E: int, top_k: int, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(top_idx [T, k] int64, top_w [T, k] fp32) with distinct experts per token."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        idx = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)])
    elif kind == "every_expert":  # token t takes experts t*k .. t*k+k-1 (mod E): all of them hit
        idx = (torch.arange(T)[:, None] * top_k + torch.arange(top_k)[None, :]) % E
    elif kind == "few_experts":  # only experts 0..k: most experts get no pair at all
        idx = torch.stack([torch.randperm(top_k + 1, generator=g)[:top_k] for _ in range(T)])
    elif kind == "one_expert":  # every token's first choice is expert E-1
        rest = torch.stack([torch.randperm(E - 1, generator=g)[: top_k - 1] for _ in range(T)])
        idx = torch.cat([torch.full((T, 1), E - 1), rest], dim=1)
    else:
        raise ValueError(kind)
    w = torch.rand(T, top_k, generator=g) + 0.1
    return idx.to(device), w.to(device)


def tolerance(dtype: torch.dtype) -> float:
    """Bound on max|out - ref| / max|ref| against the float64 loop: fp32 with IEEE dots; bf16 operands
    with the intermediate h rounded to bf16."""
    return 1e-5 if dtype == torch.float32 else 2e-2


def check_fused_experts(kind: str, gated: bool, method: str, *, T: int, E: int, H: int, inter: int, top_k: int,
                        dtype: torch.dtype, device, config=None, with_add: bool = False, shared_slices: int = 0,
                        seed: int = 0) -> None:
    """fused_experts against the float64 torch loop; shared_slices > 0: a shared MLP of that many expert
    widths folded into the launches as pseudo-experts, against the shared MLP module run on its own."""
    from hybrid.layers import DenseMLP, GatedMLP
    from hybrid.ops import triton_moe

    g = torch.Generator().manual_seed(seed)
    experts = Experts(H, MoEConfig(E, top_k, inter, inter), "silu" if gated else "relu2", gated=gated)
    width = 2 * inter if gated else inter
    experts.up = torch.nn.Parameter((torch.randn(E, width, H, generator=g) / H ** 0.5).to(dtype).to(device),
                                    requires_grad=False)
    experts.down = torch.nn.Parameter((torch.randn(E, H, inter, generator=g) / inter ** 0.5).to(dtype).to(device),
                                      requires_grad=False)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    add = torch.randn(T, H, generator=g).to(dtype).to(device) if with_add else None
    top_idx, top_w = routing(kind, T, E, top_k, seed + 1, device)
    shared = None
    if shared_slices:
        width_s = shared_slices * inter
        shared = (GatedMLP if gated else DenseMLP)(H, width_s, "silu" if gated else "relu2")
        up = shared.gate_up_proj if gated else shared.up_proj
        up.weight = torch.nn.Parameter((torch.randn(up.weight.shape, generator=g) / H ** 0.5).to(dtype).to(device),
                                       requires_grad=False)
        shared.down_proj.weight = torch.nn.Parameter(
            (torch.randn(H, width_s, generator=g) / width_s ** 0.5).to(dtype).to(device), requires_grad=False)
    # the reference: the torch loop in float64 on the same (rounded) weights and inputs
    up, down = experts.up.data, experts.down.data
    experts.up.data, experts.down.data = up.double(), down.double()
    ref = experts(x.double(), top_idx, top_w.double(), None if add is None else add.double())
    experts.up.data, experts.down.data = up, down
    s_up = s_down = None
    if shared is not None:
        s_up, s_down = (shared.gate_up_proj if gated else shared.up_proj).weight, shared.down_proj.weight
        ref = ref + shared.double()(x.double())
        shared.to(dtype)
        ids = torch.arange(E, E + shared_slices, device=device).expand(T, shared_slices)
        top_idx = torch.cat([top_idx, ids], dim=1)
        top_w = torch.cat([top_w, torch.ones(T, shared_slices, device=device)], dim=1)
    out = triton_moe.fused_experts(x, experts.up, experts.down, top_idx, top_w, gated, add, config=config,
                                   align_method=method, shared_up=s_up, shared_down=s_down)
    assert out.dtype == dtype and out.shape == (T, H)
    assert torch.isfinite(out).all()
    err = (out.double() - ref.double()).abs().max() / ref.double().abs().max()
    assert err < tolerance(dtype), f"{kind} gated={gated} {method}: relative error {err:.2e}"
