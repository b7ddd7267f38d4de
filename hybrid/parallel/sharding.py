"""Tensor-parallel sharding rules: which shapes divide, each rank's local config, and which rows
(or columns) of every full parameter a rank holds.

Layout (every rank r of N):
- attention: q heads [r*H/N, (r+1)*H/N); kv heads split the same way when N divides them, else (N a
  multiple of the kv heads) the one kv head its q heads use, replicated on N/kv ranks;
- Mamba mixer: heads [r*nh/N, ...) with their z / x channels and dt; the B / C groups split when N
  divides them, else (N a multiple of the groups) the one group its heads read, replicated; the conv
  and the state pool hold the rank's own x / B / C channels and heads;
- dense / shared / gated MLPs and routed experts: the intermediate dim split (tensor-parallel per
  expert), the down projection row-parallel; LatentMoE's projections to and from the experts'
  width whole on every rank;
- embedding and LM head: vocab-parallel, ceil(V/N) rows per rank (the last rank's padded with zeros).
Row-parallel outputs are summed across the ranks by one all-reduce (hybrid/parallel/layers.py).
"""
from __future__ import annotations

import dataclasses

import torch

from hybrid.config import MLP, ModelConfig
from hybrid.errors import ConfigurationError
from state_pool.util import cdiv

Ranges = list[tuple[int, int]]


def check_shapes(cfg: ModelConfig, tp: int) -> None:
    """ConfigurationError naming every shape of `cfg` that tensor_parallel_size `tp` cannot split."""
    bad: list[str] = []
    m, a = cfg.mamba, cfg.attention
    if cfg.mamba_layers:
        if m.num_heads % tp:
            bad.append(f"Mamba heads (num_heads={m.num_heads})")
        if m.n_groups % tp and tp % m.n_groups:
            bad.append(f"Mamba groups (n_groups={m.n_groups}: neither divides the other)")
    if cfg.attention_layers:
        if a.num_heads % tp:
            bad.append(f"attention heads (num_attention_heads={a.num_heads})")
        if a.num_kv_heads % tp and tp % a.num_kv_heads:
            bad.append(f"attention kv heads (num_key_value_heads={a.num_kv_heads}: neither divides the other)")
        if cfg.shared_blocks is not None and cfg.shared_blocks.attention_adapters and a.num_kv_heads != a.num_heads:
            bad.append("Zamba2 q/k/v adapters with grouped-query attention")
    has_dense = cfg.family != "nemotron_h" or MLP in cfg.layer_types
    if has_dense and cfg.intermediate_size % tp:
        bad.append(f"MLP width (intermediate_size={cfg.intermediate_size})")
    if cfg.moe is not None:
        if cfg.moe.intermediate_size % tp:
            bad.append(f"routed expert width (moe intermediate_size={cfg.moe.intermediate_size})")
        if cfg.family == "nemotron_h" and cfg.moe.shared_intermediate_size % tp:
            bad.append(f"shared expert width (shared_intermediate_size={cfg.moe.shared_intermediate_size})")
        if cfg.family == "nemotron_h" and cfg.mlp_bias and tp > 1 and cfg.moe.latent_size is None:
            # the shared expert's output is summed with the routed experts' in one all-reduce (LatentMoE
            # reduces it on its own: hybrid/parallel/shard_model.py)
            bad.append("MoE shared-expert biases (mlp_bias)")
    if bad:
        raise ConfigurationError(f"tensor_parallel_size={tp} does not divide this checkpoint's "
                                 + "; ".join(bad))


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config one rank's model is built with: its share of heads, groups, widths and vocab."""
    m, a = cfg.mamba, cfg.attention
    mamba = m
    if cfg.mamba_layers:
        mamba = dataclasses.replace(m, num_heads=m.num_heads // tp,
                                    n_groups=m.n_groups // tp if m.n_groups % tp == 0 else 1)
    attention = a
    if cfg.attention_layers:
        attention = dataclasses.replace(a, num_heads=a.num_heads // tp,
                                        num_kv_heads=a.num_kv_heads // tp if a.num_kv_heads % tp == 0 else 1)
    moe = cfg.moe
    if moe is not None:
        moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // tp,
                                  shared_intermediate_size=moe.shared_intermediate_size // tp)
    has_dense = cfg.family != "nemotron_h" or MLP in cfg.layer_types
    return dataclasses.replace(cfg, vocab_size=cdiv(cfg.vocab_size, tp), mamba=mamba, attention=attention, moe=moe,
                               intermediate_size=cfg.intermediate_size // tp if has_dense else cfg.intermediate_size)


def mamba_group_shared(cfg: ModelConfig, tp: int) -> bool:
    """Whether each Mamba group spans several ranks (its gated-norm statistics need an all-reduce)."""
    return bool(cfg.mamba_layers) and cfg.mamba.n_groups % tp != 0


@dataclasses.dataclass(frozen=True)
class Cut:
    """The part of a full parameter a rank holds: `ranges` (sorted, disjoint) along `dim`; `rows`:
    the length the local parameter has along `dim` (>= the ranges' total: zero padding, vocab only)."""
    dim: int
    ranges: Ranges
    rows: int


class ShardRules:
    """For rank `rank` of `tp`: the Cut of every parameter name of the model (None: replicated)."""

    def __init__(self, cfg: ModelConfig, tp: int, rank: int) -> None:
        self.cfg, self.tp, self.rank = cfg, tp, rank
        m, a = cfg.mamba, cfg.attention
        r = rank
        # Mamba
        inner, nh, P, N = m.intermediate_size, m.num_heads, m.head_dim, m.state_size
        G = m.n_groups
        hl = nh // tp if cfg.mamba_layers else 0
        heads = (r * hl, (r + 1) * hl)
        if cfg.mamba_layers and G % tp == 0:
            groups = (r * (G // tp), (r + 1) * (G // tp))
        elif cfg.mamba_layers:
            g = heads[0] // (nh // G)  # the one group this rank's heads read
            groups = (g, g + 1)
        else:
            groups = (0, 0)
        ch = (heads[0] * P, heads[1] * P)  # z / x channels
        gn = G * N
        bc = (groups[0] * N, groups[1] * N)

        def sh(base: int, span: tuple[int, int]) -> tuple[int, int]:
            return base + span[0], base + span[1]

        self.mamba_in = [sh(0, ch), sh(inner, ch), sh(2 * inner, bc), sh(2 * inner + gn, bc), sh(2 * inner + 2 * gn, heads)]
        self.mamba_conv = [sh(0, ch), sh(inner, bc), sh(inner + gn, bc)]
        self.mamba_heads, self.mamba_ch = [heads], [ch]
        # attention
        if cfg.attention_layers:
            hd, qh, kvh = a.head_dim, a.num_heads // tp, a.num_kv_heads
            q = (r * qh * hd, (r + 1) * qh * hd)
            if kvh % tp == 0:
                k = (r * (kvh // tp) * hd, (r + 1) * (kvh // tp) * hd)
            else:
                j = (r * qh) // (a.num_heads // kvh)  # the kv head this rank's q heads attend with
                k = (j * hd, (j + 1) * hd)
            qs, kvs = a.num_heads * hd, kvh * hd
            self.qkv = [q, sh(qs, k), sh(qs + kvs, k)]
            self.o_cols = [q]
        # MLP widths (local cfg has them divided)
        self.vocab_rows = cdiv(cfg.vocab_size, tp)

    @staticmethod
    def _split(width: int, tp: int, r: int) -> tuple[int, int]:
        w = width // tp
        return r * w, (r + 1) * w

    def cut(self, name: str, shape: torch.Size) -> Cut | None:
        """The Cut of parameter `name` (full shape `shape`), or None if every rank holds it whole."""
        tp, r = self.tp, self.rank
        leaf = name.rsplit(".", 1)[-1]
        parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if name in ("embed", "lm_head.weight"):
            lo = r * self.vocab_rows
            return Cut(0, [(min(lo, shape[0]), min(lo + self.vocab_rows, shape[0]))], self.vocab_rows)
        # Mamba mixer (its parameters sit directly on the mixer, except in/out_proj)
        if parent == "in_proj":  # [z | x | B | C | dt] rows
            return Cut(0, self.mamba_in, _total(self.mamba_in))
        if leaf in ("conv_weight", "conv_bias"):
            return Cut(0, self.mamba_conv, _total(self.mamba_conv))
        if leaf in ("A_log", "D", "dt_bias"):
            return Cut(0, self.mamba_heads, _total(self.mamba_heads))
        if leaf == "norm_weight":
            return Cut(0, self.mamba_ch, _total(self.mamba_ch))
        if parent == "out_proj":
            return Cut(1, self.mamba_ch, _total(self.mamba_ch)) if leaf == "weight" else None
        # attention
        if parent == "qkv_proj":
            return Cut(0, self.qkv, _total(self.qkv))
        if parent == "o_proj":
            return Cut(1, self.o_cols, _total(self.o_cols)) if leaf == "weight" else None
        if parent == "qkv_adapter" and leaf == "up":  # [3, q | k | v part, rank]: each part by q heads
            return Cut(1, self.o_cols, _total(self.o_cols))
        # MLPs: [gate | up] column-parallel in two sections, up_proj whole, down_proj row-parallel
        if parent == "gate_up_proj":
            return _two_sections(shape[0], tp, r, 0)
        if parent == "mlp_adapter" and leaf == "up":  # [1, gate | up, rank]
            return _two_sections(shape[1], tp, r, 1)
        if parent == "up_proj":
            return Cut(0, [self._split(shape[0], tp, r)], shape[0] // tp)
        if parent == "down_proj":
            return Cut(1, [self._split(shape[1], tp, r)], shape[1] // tp) if leaf == "weight" else None
        # routed experts: up [E, I or 2I, H] (gated: [gate | up]), down [E, H, I]
        if parent == "experts" and leaf == "up":
            if "moe.experts" in name:  # Granite: SwiGLU experts
                return _two_sections(shape[1], tp, r, 1)
            return Cut(1, [self._split(shape[1], tp, r)], shape[1] // tp)
        if parent == "experts" and leaf == "down":
            return Cut(2, [self._split(shape[2], tp, r)], shape[2] // tp)
        return None  # norms, routers, Zamba2's linear and adapter down projections, row-parallel biases


def _total(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


def _two_sections(width: int, tp: int, r: int, dim: int) -> Cut:
    half = width // 2
    w = half // tp
    ranges = [(r * w, (r + 1) * w), (half + r * w, half + (r + 1) * w)]
    return Cut(dim, ranges, 2 * w)


__all__ = ["check_shapes", "local_config", "mamba_group_shared", "Cut", "ShardRules"]
