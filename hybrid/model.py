"""The hybrid model: family-specific blocks over shared layers, run on a StepBatch."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.batch import StepBatch
from hybrid.config import ATTENTION, MAMBA, MLP, PARALLEL, ModelConfig
from hybrid.layers import (
    Attention, DenseMLP, GatedMLP, GraniteMoE, Linear, Mamba2Mixer, NemotronMoE, RMSNorm, _param,
)


class NemotronHBlock(nn.Module):
    """h += mixer(norm(h)); the mixer is one of mamba, attention, mlp, moe.

    Blocks take and return (x, residual): x is the previous block's output not yet added to the
    residual stream, so that the add runs fused with this block's norm (RMSNorm.add_norm)."""

    residual_multiplier = 1.0  # (TwoStageBlock's is the config's; the model reads it for the final add)

    def __init__(self, cfg: ModelConfig, kind: str, mamba_index: int, attn_index: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, weight_in_fp32=True)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba, mamba_index)
        elif kind == ATTENTION:
            self.mixer = Attention(cfg.hidden_size, cfg.attention, attn_index)
        elif kind == MLP:
            self.mixer = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act)
        else:
            self.mixer = NemotronMoE(cfg.hidden_size, cfg.moe, cfg.mlp_act)

    def forward(self, x, residual, batch, ctx):
        x, residual = self.norm.add_norm(x, residual)
        if self.kind == MAMBA:
            x = self.mixer(x, batch, *ctx.mamba_state(self.mixer.layer_index))
        elif self.kind == ATTENTION:
            x = self.mixer(x, batch, ctx.kv_layer(self.mixer.layer_index), ctx.attention_backend)
        else:
            x = self.mixer(x)
        return x, residual


class TwoStageBlock(nn.Module):
    """Bamba / Granite block: h += m * mixer(norm1(h)); h += m * ffn(norm2(h)). Takes and returns
    (x, residual) like NemotronHBlock; x is added to the stream times m by the next norm."""

    def __init__(self, cfg: ModelConfig, kind: str, mamba_index: int, attn_index: int) -> None:
        super().__init__()
        self.kind = kind
        self.residual_multiplier = cfg.residual_multiplier
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, weight_in_fp32=False)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, weight_in_fp32=False)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba, mamba_index)
        else:
            self.mixer = Attention(cfg.hidden_size, cfg.attention, attn_index)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act)
        self.moe = GraniteMoE(cfg.hidden_size, cfg.moe, cfg.mlp_act) if cfg.moe is not None else None

    def forward(self, x, residual, batch, ctx):
        m = self.residual_multiplier
        x, residual = self.input_norm.add_norm(x, residual, m)
        if self.kind == MAMBA:
            x = self.mixer(x, batch, *ctx.mamba_state(self.mixer.layer_index))
        else:
            x = self.mixer(x, batch, ctx.kv_layer(self.mixer.layer_index), ctx.attention_backend)
        x, residual = self.ffn_norm.add_norm(x, residual, m)
        x = self.moe(x, shared=self.mlp) if self.moe is not None else self.mlp(x)
        return x, residual


class ParallelBlock(nn.Module):
    """Falcon-H1 block: x = norm1(h); h += mamba(x) + attention(x); h += mlp(norm2(h)). Its muP
    multipliers (Mamba and attention input / output, keys, MLP gate and output) are folded into the
    projection weights at load time (hybrid/loader.py). Takes and returns (x, residual)."""

    residual_multiplier = 1.0

    def __init__(self, cfg: ModelConfig, kind: str, mamba_index: int, attn_index: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, weight_in_fp32=False)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, weight_in_fp32=False)
        self.mamba = Mamba2Mixer(cfg.hidden_size, cfg.mamba, mamba_index)
        self.attn = Attention(cfg.hidden_size, cfg.attention, attn_index)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act)

    def forward(self, x, residual, batch, ctx):
        x, residual = self.input_norm.add_norm(x, residual)
        m = self.mamba(x, batch, *ctx.mamba_state(self.mamba.layer_index))
        a = self.attn(x, batch, ctx.kv_layer(self.attn.layer_index), ctx.attention_backend)
        x, residual = self.ffn_norm.add_norm(m + a, residual)
        return self.mlp(x), residual


_BLOCKS = {"nemotron_h": NemotronHBlock, "falcon_h1": ParallelBlock}


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size)
        blocks = []
        mamba_index = attn_index = 0
        block_cls = _BLOCKS.get(cfg.family, TwoStageBlock)
        for kind in cfg.layer_types:
            blocks.append(block_cls(cfg, kind, mamba_index, attn_index))
            mamba_index += kind in (MAMBA, PARALLEL)
            attn_index += kind in (ATTENTION, PARALLEL)
        self.layers = nn.ModuleList(blocks)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, weight_in_fp32=cfg.family == "nemotron_h")
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def mamba_mixers(self) -> list[Mamba2Mixer]:
        return [m for m in self.modules() if isinstance(m, Mamba2Mixer)]

    @torch.inference_mode()
    def forward(self, batch: StepBatch, ctx) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in fp32."""
        h = F.embedding(batch.input_ids, self.embed)
        if self.cfg.embedding_multiplier != 1.0:
            h = h * self.cfg.embedding_multiplier
        x, residual = h, None
        for block in self.layers:
            x, residual = block(x, residual, batch, ctx)
        # the last block's output joins the stream only on the rows that produce logits
        rows = batch.logits_indices
        h, _ = self.final_norm.add_norm(x[rows], residual[rows], self.layers[-1].residual_multiplier)
        logits = F.linear(h, self.embed) if self.lm_head is None else self.lm_head(h)
        if self.cfg.logits_scaling != 1.0:
            logits = logits / self.cfg.logits_scaling
        if self.cfg.lm_head_multiplier != 1.0:
            logits = logits * self.cfg.lm_head_multiplier
        return logits.float()


class ForwardContext:
    """What the layers read and write besides activations: the state pool, the KV cache, the backend."""

    def __init__(self, state_pool, kv_cache, attention_backend) -> None:
        self.state_pool = state_pool
        self.kv_cache = kv_cache
        self.attention_backend = attention_backend

    def mamba_state(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.state_pool.layer(index)

    def kv_layer(self, index: int) -> torch.Tensor:
        return self.kv_cache.layer(index)
