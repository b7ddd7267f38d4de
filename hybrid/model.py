"""The hybrid model: family-specific blocks over shared layers, run on a StepBatch."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.batch import StepBatch
from hybrid.config import ATTENTION, HYBRID, MAMBA, MLP, PARALLEL, ModelConfig
from hybrid.layers import (Attention, DenseMLP, GatedMLP, Linear, LowRankAdapter, Mamba2Mixer, RMSNorm, _param,
                           logits_fp32)
from hybrid.moe import Experts, GraniteMoE, NemotronMoE, add_norm_route
from hybrid.ops import triton_act, triton_moe, triton_norm
from state_pool.util import sm_count


def input_projection(mixer: nn.Module) -> nn.Module | None:
    """The projection that alone reads a mixer's input (Mamba in_proj, attention qkv, dense / gated MLP up), or
    None: an MoE layer's input is read by its router and experts too."""
    if isinstance(mixer, Mamba2Mixer):
        return mixer.in_proj
    if isinstance(mixer, Attention):
        return mixer.qkv_proj
    if isinstance(mixer, DenseMLP):
        return mixer.up_proj
    if isinstance(mixer, GatedMLP):
        return mixer.gate_up_proj
    return None


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
            self.mixer = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act, bias=cfg.mlp_bias)
        else:
            self.mixer = NemotronMoE(cfg.hidden_size, cfg.moe, cfg.mlp_act, shared_bias=cfg.mlp_bias)

    def norm_consumers(self) -> list[tuple[RMSNorm, tuple[nn.Module, ...]]]:
        """Each norm of the block with the projections that alone read its output (use_fused_ops)."""
        proj = input_projection(self.mixer)
        return [(self.norm, (proj,))] if proj is not None else []

    def forward(self, x, residual, batch, ctx):
        if isinstance(self.mixer, NemotronMoE):
            x, residual, routing = add_norm_route(self.norm, x, residual, 1.0, self.mixer, self.mixer.shared)
            return self.mixer(x, routing=routing), residual
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
        # (Granite's shared MLP; none for shared_intermediate_size 0; Bamba's mlp_bias)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act, bias=cfg.mlp_bias) \
            if cfg.intermediate_size > 0 else None
        self.moe = GraniteMoE(cfg.hidden_size, cfg.moe, cfg.mlp_act) if cfg.moe is not None else None

    def norm_consumers(self) -> list[tuple[RMSNorm, tuple[nn.Module, ...]]]:
        """As NemotronHBlock's; ffn_norm's output feeds the MLP alone only without an MoE layer."""
        out = [(self.input_norm, (input_projection(self.mixer),))]
        if self.moe is None and self.mlp is not None:
            out.append((self.ffn_norm, (self.mlp.gate_up_proj,)))
        return out

    def forward(self, x, residual, batch, ctx):
        m = self.residual_multiplier
        x, residual = self.input_norm.add_norm(x, residual, m)
        if self.kind == MAMBA:
            x = self.mixer(x, batch, *ctx.mamba_state(self.mixer.layer_index))
        else:
            x = self.mixer(x, batch, ctx.kv_layer(self.mixer.layer_index), ctx.attention_backend)
        if self.moe is None:
            x, residual = self.ffn_norm.add_norm(x, residual, m)
            return (self.mlp(x) if self.mlp is not None else torch.zeros_like(x)), residual
        x, residual, routing = add_norm_route(self.ffn_norm, x, residual, m, self.moe, self.mlp)
        return self.moe(x, shared=self.mlp, routing=routing), residual


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
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act, bias=cfg.mlp_bias)

    def norm_consumers(self) -> list[tuple[RMSNorm, tuple[nn.Module, ...]]]:
        """As NemotronHBlock's: input_norm's output feeds two projections, Mamba's in_proj and the attention's
        qkv (rounded for them only when they share a scheme: RMSNorm._round_for)."""
        return [(self.input_norm, (self.mamba.in_proj, self.attn.qkv_proj)), (self.ffn_norm, (self.mlp.gate_up_proj,))]

    def forward(self, x, residual, batch, ctx):
        x, residual = self.input_norm.add_norm(x, residual)
        m = self.mamba(x, batch, *ctx.mamba_state(self.mamba.layer_index))
        a = self.attn(x, batch, ctx.kv_layer(self.attn.layer_index), ctx.attention_backend)
        x, residual = self.ffn_norm.add_norm(m + a, residual)
        return self.mlp(x), residual


class SharedTransformerBlock(nn.Module):
    """Zamba2's shared block: t = mlp(ffn_norm(attn(input_norm(cat(h, embeddings))))), no residual
    inside. Run by several hybrid layers (weights stored once); each caller passes its own KV layer
    and adapters."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_norm = RMSNorm(2 * h, cfg.norm_eps, weight_in_fp32=False)
        self.attn = Attention(2 * h, cfg.attention, -1, out_features=h)  # KV layer: the caller's
        self.ffn_norm = RMSNorm(h, cfg.norm_eps, weight_in_fp32=False)
        self.mlp = GatedMLP(h, cfg.intermediate_size, cfg.mlp_act, bias=cfg.mamba.proj_bias)  # add_bias_linear

    def forward(self, h: torch.Tensor, embeddings: torch.Tensor, batch: StepBatch, kv_layer: torch.Tensor,
                backend, qkv_adapter: LowRankAdapter | None, mlp_adapter: LowRankAdapter) -> torch.Tensor:
        x = self.input_norm(torch.cat([h, embeddings], dim=-1))
        a = self.attn(x, batch, kv_layer, backend, adapter=qkv_adapter)
        return self.mlp(self.ffn_norm(a), adapter=mlp_adapter)


class Zamba2Block(nn.Module):
    """Zamba2 layer. mamba: h += mamba(norm(h)). hybrid (the j-th): t = linear(shared_j(h, embeddings))
    with shared_j = shared block j % num_mem_blocks and this layer's adapters, then
    h += mamba(norm(h + t)): t feeds the Mamba input but not the stream. Takes and returns (x, residual)
    like NemotronHBlock, plus the embeddings (the model's input, kept apart from the stream)."""

    residual_multiplier = 1.0
    takes_embeddings = True

    def __init__(self, cfg: ModelConfig, kind: str, mamba_index: int, attn_index: int,
                 shared: SharedTransformerBlock | None = None) -> None:
        super().__init__()
        self.kind = kind
        h = cfg.hidden_size
        self.norm = RMSNorm(h, cfg.norm_eps, weight_in_fp32=False)
        self.mixer = Mamba2Mixer(h, cfg.mamba, mamba_index)
        if kind == HYBRID:
            sb, a = cfg.shared_blocks, cfg.attention
            self.attn_index = attn_index  # this layer's own KV cache row (the attention weights are shared)
            self.linear = Linear(h, h, bias=False, role="shared.linear")
            self.qkv_adapter = (LowRankAdapter(2 * h, sb.adapter_rank, 3, a.num_heads * a.head_dim)
                                if sb.attention_adapters else None)
            self.mlp_adapter = LowRankAdapter(h, sb.adapter_rank, 1, 2 * cfg.intermediate_size)
            # a tuple, so the shared block is not registered (and its weights not named) under each
            # layer: the model owns it once, as shared_blocks.k
            self._shared = (shared,)

    def forward(self, x, residual, batch, ctx, embeddings):
        if self.kind == MAMBA:
            x, residual = self.norm.add_norm(x, residual)
        else:
            residual = x if residual is None else residual + x
            t = self._shared[0](residual, embeddings, batch, ctx.kv_layer(self.attn_index), ctx.attention_backend,
                                self.qkv_adapter, self.mlp_adapter)
            x = self.norm(residual + self.linear(t))
        return self.mixer(x, batch, *ctx.mamba_state(self.mixer.layer_index)), residual


_BLOCKS = {"nemotron_h": NemotronHBlock, "falcon_h1": ParallelBlock, "zamba2": Zamba2Block}


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size)
        blocks = []
        mamba_index = attn_index = 0
        block_cls = _BLOCKS.get(cfg.family, TwoStageBlock)
        # Zamba2: the shared blocks, one per distinct use (at most num_mem_blocks; one per hybrid layer when
        # transformers does not tie them, see SharedBlockConfig.tied)
        n_hybrid = cfg.layer_types.count(HYBRID)
        self.shared_blocks = nn.ModuleList(
            SharedTransformerBlock(cfg) for _ in range(cfg.num_shared_blocks)
        ) if n_hybrid else None
        for kind in cfg.layer_types:
            if kind == HYBRID:
                shared = self.shared_blocks[attn_index % len(self.shared_blocks)]
                blocks.append(block_cls(cfg, kind, mamba_index, attn_index, shared))
            else:
                blocks.append(block_cls(cfg, kind, mamba_index, attn_index))
            mamba_index += kind in (MAMBA, PARALLEL, HYBRID)
            attn_index += kind in (ATTENTION, PARALLEL, HYBRID)
        self.layers = nn.ModuleList(blocks)
        self.takes_embeddings = getattr(block_cls, "takes_embeddings", False)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, weight_in_fp32=cfg.family == "nemotron_h")
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                  role="lm_head")

    def mamba_mixers(self) -> list[Mamba2Mixer]:
        return [m for m in self.modules() if isinstance(m, Mamba2Mixer)]

    def moe_layers(self) -> list[tuple[nn.Module, nn.Module | None]]:
        """(MoE module, the shared MLP its block passes it or None) of every MoE layer."""
        layers = []
        for m in self.modules():
            if isinstance(m, NemotronMoE):
                layers.append((m, None))  # (its shared expert is its own)
            elif isinstance(m, TwoStageBlock) and m.moe is not None:
                layers.append((m.moe, m.mlp))
        return layers

    @torch.inference_mode()
    def warm_up_moe(self, max_tokens: int) -> int:
        """Compile the fused MoE kernels' specialisations now: each distinct MoE layer shape runs once at
        each length of Experts.warmup_lengths, on random activations (the layers hold no state).
        Returns the layer calls run. Skipped under tensor parallelism (the experts' all-reduce needs
        every rank): the workers meet them on first use."""
        seen = set()
        runs = 0
        dtype = self.embed.dtype
        for moe, shared in self.moe_layers():
            experts = moe.experts
            if not experts.fused or getattr(experts, "group", None) is not None:
                continue
            key = (type(moe), repr(moe.cfg), tuple(experts.up.shape), experts.up.dtype, experts.defer_sum,
                   None if shared is None else tuple(p.shape for p in shared.parameters()))
            if key in seen:
                continue
            seen.add(key)
            # the layer's input width (LatentMoE's experts are narrower); NemotronH's shared expert is its own
            device, hidden = experts.up.device, moe.router_weight.shape[1]
            own_shared = shared if shared is not None else getattr(moe, "shared", None)
            for T in experts.warmup_lengths(own_shared, max_tokens, dtype.itemsize, sm_count(device)):
                x = torch.randn(T, hidden, dtype=dtype, device=device)
                out = moe(x) if shared is None else moe(x, shared=shared)
                if isinstance(out, triton_moe.ExpertRows):  # (the sum the next norm would fold in)
                    out.sum()
                runs += 1
        return runs

    # The vocabulary's two ends; tensor parallelism shards them (hybrid/parallel/layers.py).
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, vocab] (hybrid/layers.logits_fp32)."""
        return logits_fp32(h, self.embed if self.lm_head is None else self.lm_head.weight)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, ctx) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in fp32."""
        x, residual = self.hidden_states(batch, ctx)
        return self.logits_of(x, residual, batch.logits_indices)

    def hidden_states(self, batch: StepBatch, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block over the batch's tokens: (the last block's output, the residual stream before it), a row a
        token; the final add and norm are logits_of's. Reads the batch only through the layers' cores
        (hybrid/step_cores.py) and its input_ids, so graphs/piecewise.py can capture it per token count."""
        h = self.embed_tokens(batch.input_ids)
        if self.cfg.embedding_multiplier != 1.0:
            h = h * self.cfg.embedding_multiplier
        x, residual = h, None
        if self.takes_embeddings:
            # Zamba2 reads the embeddings at every hybrid layer: a copy, as the fused add_norm updates
            # the stream (which starts as x) in place
            embeddings = h.clone()
            for block in self.layers:
                x, residual = block(x, residual, batch, ctx, embeddings)
        else:
            for block in self.layers:
                x, residual = block(x, residual, batch, ctx)
        if isinstance(x, triton_moe.ExpertRows):  # an MoE layer last: its sum over k, before the rows are taken
            x = x.sum()
        return x, residual

    def logits_of(self, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits of token rows `rows` from hidden_states' (x, residual)."""
        # the last block's output joins the stream only on the rows that produce logits
        h, _ = self.final_norm.add_norm(x[rows], residual[rows], self.layers[-1].residual_multiplier)
        logits = self.lm_logits(h)
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


def use_fused_ops(model: nn.Module) -> int:
    """Switch the model's norms (with the residual add before them), the Mamba gated norm, the
    relu2 / SwiGLU activations of the dense MLPs and the routed experts to their Triton kernels (and
    the projections of decode-sized steps, with the "decode_linear" switch: triton_guard); returns
    how many modules. Same math as the torch chains they replace; the norms and activations round
    at the same points, the experts accumulate in fp32 and round once."""
    if not (triton_norm.is_available() and triton_act.is_available() and triton_moe.is_available()):
        raise RuntimeError("triton is not importable: the fused ops are unavailable")
    count = 0
    for m in model.modules():
        if isinstance(m, (RMSNorm, Mamba2Mixer, Linear)) or (isinstance(m, (DenseMLP, GatedMLP, Experts)) and m.can_fuse):
            m.fused = True
            count += 1
        if isinstance(m, Experts) and m.fused:
            m.defer_sum = m.can_defer_sum  # the next RMSNorm.add_norm sums them, one launch fewer a layer
    for block in model.modules():
        for norm, consumers in getattr(block, "norm_consumers", lambda: [])():
            # FP8 projections (Fp8Linear) alone: the norm's launch may round its rows for them
            if consumers and all(hasattr(c, "rounds_rows_first") for c in consumers):
                norm.fp8_consumers = tuple(consumers)
    return count
