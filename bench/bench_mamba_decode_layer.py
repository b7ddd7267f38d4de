"""One Mamba layer's decode step, op by op, at the MoE shapes' Mamba dims (Nemotron-3-Nano-30B-A3B,
Granite-4.0-H-Tiny) and the 8B shape's: the default chain (in_proj on cuBLAS, conv-state update, SSM
update, gated norm, out_proj on cuBLAS) against the fused ops of the decode switches
(HYBRID_DECODE_IN_PROJ_CONV: triton_gemv.in_proj_conv; HYBRID_DECODE_GATED_OUT_PROJ:
triton_mamba.selective_state_update_gated + triton_gemv.gated_out_proj), each op alone and each chain
whole, so a switch that loses in the model can be traced to the op that loses.

Timing: bench/cuda_timing.graph_us_per_call over several layers' own weights and states (so they
stream from HBM, as in a decode step); figures are microseconds per layer.

    python3 bench/bench_mamba_decode_layer.py [--batches 1 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.cuda_timing import graph_us_per_call  # noqa: E402
from hybrid.config import MambaConfig  # noqa: E402
from hybrid.ops.mamba_cuda import ssm_operands  # noqa: E402


def mamba_config(heads: int, groups: int) -> MambaConfig:
    """A released shape's Mamba dims (head dim 64, state 128, conv width 4) as the model's config."""
    return MambaConfig(num_heads=heads, head_dim=64, n_groups=groups, state_size=128, conv_kernel=4, chunk_size=256,
                       conv_bias=True, proj_bias=False, norm_eps=1e-5, dt_limit=(0.0, float("inf")))


@dataclass(frozen=True)
class MambaDims:
    hidden: int
    mamba: MambaConfig

    @property
    def in_width(self) -> int:
        """in_proj's output width: [z | xBC | dt]."""
        m = self.mamba
        return m.intermediate_size + m.conv_dim + m.num_heads


SHAPES = {
    "nemotron-nano": MambaDims(2688, mamba_config(heads=64, groups=8)),
    "granite-tiny": MambaDims(1536, mamba_config(heads=48, groups=1)),
    "nemotron-h-8b": MambaDims(4096, mamba_config(heads=128, groups=8)),
}


class Layer:
    """One Mamba layer's decode operands on the GPU (random), state for `slots` requests."""

    def __init__(self, d: MambaDims, slots: int, dev: torch.device, state_dtype: torch.dtype):
        bf, m = torch.bfloat16, d.mamba
        self.d = d
        self.w_in = torch.randn(d.in_width, d.hidden, device=dev, dtype=bf) * d.hidden ** -0.5
        self.w_out = torch.randn(d.hidden, m.intermediate_size, device=dev, dtype=bf) * m.intermediate_size ** -0.5
        self.conv_w = torch.randn(m.conv_dim, m.conv_kernel, device=dev, dtype=bf) * 0.5
        self.conv_b = torch.randn(m.conv_dim, device=dev, dtype=bf) * 0.1
        self.conv_state = torch.randn(slots, m.conv_dim, m.conv_kernel - 1, device=dev, dtype=bf)
        self.ssm_state = (torch.randn(slots, m.num_heads, m.head_dim, m.state_size, device=dev) * 0.1).to(state_dtype)
        self.A = -torch.rand(m.num_heads, device=dev) - 0.5
        self.D = torch.randn(m.num_heads, device=dev)
        self.dt_bias = torch.randn(m.num_heads, device=dev) * 0.1
        self.norm_w = (1 + 0.1 * torch.randn(m.intermediate_size, device=dev)).to(bf)


def split_in(m: MambaConfig, zx: torch.Tensor):
    return torch.split(zx, [m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)


def chains(layer: Layer, h: torch.Tensor, slots: torch.Tensor) -> dict:
    """name -> zero-argument callable: the ops alone (on inputs made once) and the whole chains."""
    from hybrid.ops import triton_gemv, triton_mamba as tm, triton_norm

    m, L = layer.d.mamba, layer
    b = h.shape[0]
    eps, inner, groups = m.norm_eps, m.intermediate_size, m.n_groups
    zx = F.linear(h, L.w_in)
    z, xBC, dt = split_in(m, zx)
    xbc = tm.conv_state_update(xBC, L.conv_state, L.conv_w, L.conv_b, slots)
    x, B, C = ssm_operands(m, xbc)
    y = tm.selective_state_update(L.ssm_state, x, dt, L.A, B, C, L.D, L.dt_bias, slots)
    y2 = y.reshape(b, inner)
    _, sq = tm.selective_state_update_gated(L.ssm_state, x, dt, L.A, B, C, L.D, L.dt_bias, slots,
                                            z.reshape(x.shape))
    normed = triton_norm.gated_rms_norm(y2, z, L.norm_w, eps, groups)

    def chain(fuse_conv: bool, out: str, preload: bool = False):
        """One layer's decode: in_proj on cuBLAS then the conv, or in_proj_conv (fuse_conv); then the SSM update
        and `out`: "cublas" / "triton" (the gated norm, then out_proj on cuBLAS / the Triton linear) or "gated"
        (the sums of squares in the SSM update, the norm inside out_proj). `preload`: in_proj_conv and the Triton
        out_proj on the preloading kernels."""
        if fuse_conv:
            z_, xbc_, dt_ = split_in(m, triton_gemv.in_proj_conv(h, L.w_in, None, L.conv_state, L.conv_w, L.conv_b,
                                                                 slots, inner, preload=preload))
        else:
            z_, xBC_, dt_ = split_in(m, F.linear(h, L.w_in))
            xbc_ = tm.conv_state_update(xBC_, L.conv_state, L.conv_w, L.conv_b, slots)
        x_, B_, C_ = ssm_operands(m, xbc_)
        if out == "gated":
            y_, sq_ = tm.selective_state_update_gated(L.ssm_state, x_, dt_, L.A, B_, C_, L.D, L.dt_bias, slots,
                                                      z_.reshape(x_.shape))
            return triton_gemv.gated_out_proj(y_.reshape(b, inner), z_, L.norm_w, eps, groups, sq_, L.w_out)
        y_ = tm.selective_state_update(L.ssm_state, x_, dt_, L.A, B_, C_, L.D, L.dt_bias, slots)
        normed_ = triton_norm.gated_rms_norm(y_.reshape(b, inner), z_, L.norm_w, eps, groups)
        if out == "cublas":
            return F.linear(normed_, L.w_out)
        return triton_gemv.small_m_linear(normed_, L.w_out, preload=preload)

    # the preloading kernels (HYBRID_GEMV_PRELOAD), for steps of up to preload_max_rows() tokens: the default tile
    # and half / twice its weights a program, at 4 and 8 warps
    preload = {}
    if b <= triton_gemv.preload_max_rows():
        for elements in (8192, 16384, 32768):
            for warps in (4, 8):
                tag = f"{elements // 1024}K weights {warps} warps"
                bn_in = triton_gemv.preload_block_n(L.w_in.shape[1], elements)
                bn_out = triton_gemv.preload_block_n(L.w_out.shape[1], elements)
                preload[f"in_proj preload {tag}"] = (
                    lambda bn=bn_in, w=warps: triton_gemv.small_m_linear(h, L.w_in, block_n=bn, num_warps=w,
                                                                         preload=True))
                preload[f"in_proj_conv preload {tag}"] = (
                    lambda bn=bn_in, w=warps: triton_gemv.in_proj_conv(h, L.w_in, None, L.conv_state, L.conv_w,
                                                                       L.conv_b, slots, inner, block_n=bn,
                                                                       num_warps=w, preload=True))
                preload[f"out_proj preload {tag}"] = (
                    lambda bn=bn_out, w=warps: triton_gemv.small_m_linear(normed, L.w_out, block_n=bn, num_warps=w,
                                                                          preload=True))
        preload["chain preload (in_proj_conv, out_proj)"] = lambda: chain(True, "triton", preload=True)

    return {
        "in_proj cuBLAS": lambda: F.linear(h, L.w_in),
        "in_proj small_m_linear": lambda: triton_gemv.small_m_linear(h, L.w_in),
        "in_proj_conv": lambda: triton_gemv.in_proj_conv(h, L.w_in, None, L.conv_state, L.conv_w, L.conv_b,
                                                         slots, inner),
        "conv_state_update": lambda: tm.conv_state_update(xBC, L.conv_state, L.conv_w, L.conv_b, slots),
        "ssm_update": lambda: tm.selective_state_update(L.ssm_state, x, dt, L.A, B, C, L.D, L.dt_bias, slots),
        "ssm_update_gated": lambda: tm.selective_state_update_gated(L.ssm_state, x, dt, L.A, B, C, L.D,
                                                                    L.dt_bias, slots, z.reshape(x.shape)),
        "gated_rms_norm": lambda: triton_norm.gated_rms_norm(y2, z, L.norm_w, eps, groups),
        "out_proj cuBLAS": lambda: F.linear(normed, L.w_out),
        "out_proj small_m_linear": lambda: triton_gemv.small_m_linear(normed, L.w_out),
        # the default's program width (triton_gemv.default_block_n) against both widths at every shape
        "out_proj small_m_linear 32 columns": lambda: triton_gemv.small_m_linear(normed, L.w_out, block_n=32),
        "out_proj small_m_linear 16 columns": lambda: triton_gemv.small_m_linear(normed, L.w_out, block_n=16),
        "gated_norm_linear": lambda: triton_gemv.gated_norm_linear(y2, z, L.norm_w, eps, groups, L.w_out),
        "gated_out_proj": lambda: triton_gemv.gated_out_proj(y2, z, L.norm_w, eps, groups, sq, L.w_out),
        "chain as before 2026-12-05": lambda: chain(False, "cublas"),
        "chain in_proj_conv": lambda: chain(True, "cublas"),
        "chain default (in_proj_conv, out_proj small_m_linear)": lambda: chain(True, "triton"),
        "chain gated_out_proj": lambda: chain(False, "gated"),
        **preload,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--layers", type=int, default=0, help="layers cycled over (default: enough for ~400 MB)")
    ap.add_argument("--ssm-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    state_dtype = getattr(torch, args.ssm_dtype)
    results = []
    for name in args.shapes:
        d = SHAPES[name]
        per_layer = 2 * (d.in_width * d.hidden + d.hidden * d.mamba.intermediate_size)
        n_layers = args.layers or max(4, min(32, (400 << 20) // per_layer))
        slots = max(args.batches) + 1
        layers = [Layer(d, slots, dev, state_dtype) for _ in range(n_layers)]
        for b in args.batches:
            h = torch.randn(b, d.hidden, device=dev, dtype=torch.bfloat16)
            idx = torch.arange(b, device=dev, dtype=torch.int32)
            per = [chains(layer, h, idx) for layer in layers]
            row = dict(shape=name, batch=b, layers=n_layers)
            for op in per[0]:
                row[op] = graph_us_per_call([p[op] for p in per], iters=20)
            results.append(row)
            print(f"[{name}] batch {b} ({n_layers} layers cycled), us per layer: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if isinstance(v, float)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
