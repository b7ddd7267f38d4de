"""The normalised model configuration: `ModelConfig` and its parts (Mamba, attention, MoE, Falcon-H1's
muP multipliers, Zamba2's shared blocks) and the layer kinds, the same for every family, so the
layers never look at family-specific keys. hybrid/config_parse.py builds it from a checkpoint's
config.json.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAMBA, ATTENTION, MLP, MOE = "mamba", "attention", "mlp", "moe"
PARALLEL = "parallel"  # Falcon-H1: a Mamba2 mixer and attention side by side on the same input, then an MLP
HYBRID = "hybrid"  # Zamba2: a shared attention + MLP block (own KV cache) feeding a Mamba2 layer

# Where the Mamba gate silu(z) meets the grouped RMSNorm of the SSM output y.
GATE_THEN_NORM = "gate_then_norm"  # norm(y * silu(z)) (NemotronH, Bamba, Granite; Falcon-H1 option)
NORM_THEN_GATE = "norm_then_gate"  # norm(y) * silu(z) (Falcon-H1 option)
GATE_ONLY = "gate_only"  # y * silu(z), no norm (Falcon-H1 default)


@dataclass(frozen=True)
class MambaConfig:
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    norm_eps: float
    # Prefill clamps dt to this range; the one-token decode recurrence does not (as in transformers).
    dt_limit: tuple[float, float]
    gate: str = GATE_THEN_NORM
    # the activation after the causal conv: transformers' mamba_hidden_act (NemotronH) or hidden_act
    # (Bamba, Granite, Falcon-H1); Zamba2's is always silu
    conv_act: str = "silu"
    # out_proj bias when it differs from the in_proj one (`proj_bias`): Falcon-H1's projectors_bias
    out_proj_bias: bool | None = None

    @property
    def out_bias(self) -> bool:
        return self.proj_bias if self.out_proj_bias is None else self.out_proj_bias

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class AttentionConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    bias: bool
    rope_theta: float | None  # None: no rotary embedding (NoPE)
    rotary_dim: int  # int(head_dim * partial_rotary_factor): the RoPE frequency dim (partial RoPE)

    @property
    def rotary_width(self) -> int:
        """The leading dims of each head that are rotated: one (cos, sin) pair per frequency of
        arange(0, rotary_dim, 2), i.e. rotary_dim rounded up to even (as transformers rotates)."""
        return 2 * ((self.rotary_dim + 1) // 2)


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    # NemotronH grouped sigmoid routing
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # NemotronH LatentMoE (Nemotron 3 Super): the routed experts work in this narrower width, between a
    # projection down from the hidden size and one back up; the router and the shared expert read the
    # full hidden state. None: the experts read and write the hidden size.
    latent_size: int | None = None


@dataclass(frozen=True)
class FalconMultipliers:
    """Falcon-H1's muP multipliers that scale a projection's input or output; each folds exactly
    (up to one rounding of the scaled weight) into the weight rows it multiplies."""

    ssm_in: float  # Mamba input
    ssm_zxbcdt: tuple[float, float, float, float, float]  # in_proj output sections z, x, B, C, dt
    ssm_out: float  # Mamba output
    attention_in: float  # attention input
    key: float  # keys, before RoPE
    attention_out: float  # attention output
    mlp_gate: float  # gate projection, before the activation
    mlp_down: float  # MLP output


@dataclass(frozen=True)
class SharedBlockConfig:
    """Zamba2's shared transformer blocks: hybrid layer j runs block j % num_mem_blocks (weights stored
    once) with its own low-rank adapters on the MLP's gate|up and, optionally, on q, k and v."""

    num_mem_blocks: int
    adapter_rank: int
    attention_adapters: bool  # use_shared_attention_adapter
    # transformers ties the later uses' blocks to the first num_mem_blocks ones only with
    # tie_word_embeddings; without it every hybrid layer has (and saves) a block of its own
    tied: bool = True


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # one mixer kind per layer: mamba | attention | mlp | moe
    norm_eps: float
    mamba: MambaConfig
    attention: AttentionConfig
    intermediate_size: int  # dense MLP width (NemotronH '-', Bamba SwiGLU, Granite shared MLP)
    mlp_act: str  # "relu2" | "silu" | "gelu" | ... (hybrid/layers.activation)
    moe: MoEConfig | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str
    # Granite multipliers (1.0 for the other families)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Falcon-H1: logits times this; its other muP multipliers scale weights (folded in at load time)
    lm_head_multiplier: float = 1.0
    mup: FalconMultipliers | None = None
    shared_blocks: SharedBlockConfig | None = None  # Zamba2
    mlp_bias: bool = False  # biases on the dense / shared MLPs (NemotronH, Bamba, Falcon-H1 mlp_bias)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t in (MAMBA, PARALLEL, HYBRID)]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t in (ATTENTION, PARALLEL, HYBRID)]

    @property
    def num_shared_blocks(self) -> int:
        """Zamba2: how many distinct shared transformer blocks the checkpoint holds (hybrid layer j runs
        block j % this): at most num_mem_blocks, or one per hybrid layer when they are not tied."""
        n_hybrid = self.layer_types.count(HYBRID)
        if self.shared_blocks is None or not n_hybrid:
            return 0
        return min(self.shared_blocks.num_mem_blocks, n_hybrid) if self.shared_blocks.tied else n_hybrid
