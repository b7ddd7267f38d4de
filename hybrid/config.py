"""Normalised model configuration.

Each supported family spells its hyper-parameters differently in config.json; this module maps
them onto one `ModelConfig` so the layers never look at family-specific keys.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from hybrid.errors import CheckpointError

SUPPORTED_FAMILIES = ("nemotron_h", "granitemoehybrid", "bamba", "falcon_h1")

MAMBA, ATTENTION, MLP, MOE = "mamba", "attention", "mlp", "moe"
PARALLEL = "parallel"  # Falcon-H1: a Mamba2 mixer and attention side by side on the same input, then an MLP

# Where the Mamba gate silu(z) meets the grouped RMSNorm of the SSM output y.
GATE_THEN_NORM = "gate_then_norm"  # norm(y * silu(z)) (NemotronH, Bamba, Granite; Falcon-H1 option)
NORM_THEN_GATE = "norm_then_gate"  # norm(y) * silu(z) (Falcon-H1 option)
GATE_ONLY = "gate_only"  # y * silu(z), no norm (Falcon-H1 default)

# NemotronH layer letters and the layer-type names transformers writes (old and new spellings).
_NEMOTRON_PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
_LAYER_TYPE_ALIASES = {
    "mamba": MAMBA, "linear_attention": MAMBA, "M": MAMBA,
    "attention": ATTENTION, "full_attention": ATTENTION, "*": ATTENTION,
    "mlp": MLP, "-": MLP, "moe": MOE, "E": MOE,
}


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
    rotary_dim: int  # leading dims of each head that are rotated (partial RoPE)


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
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # one mixer kind per layer: mamba | attention | mlp | moe
    norm_eps: float
    mamba: MambaConfig
    attention: AttentionConfig
    intermediate_size: int  # dense MLP width (NemotronH '-', Bamba SwiGLU, Granite shared MLP)
    mlp_act: str  # "relu2" | "silu"
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
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t in (MAMBA, PARALLEL)]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t in (ATTENTION, PARALLEL)]


def _decode_infinity(value: Any) -> Any:
    """config.json may spell infinity as the JSON extension `Infinity` or as {"__float__": "Infinity"}."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _decode_infinity(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_infinity(v) for v in value]
    return value


def read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise CheckpointError(f"missing file: {path}")
    try:
        with open(path) as f:
            # Python's json accepts the Infinity/NaN literals that hub files use.
            return _decode_infinity(json.load(f))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def _need(cfg: dict[str, Any], key: str, family: str) -> Any:
    if key not in cfg:
        raise CheckpointError(f"config.json of a {family} model lacks the key '{key}'")
    return cfg[key]


def _layer_types(raw: list[str], family: str) -> tuple[str, ...]:
    out = []
    for t in raw:
        if t not in _LAYER_TYPE_ALIASES:
            raise CheckpointError(f"config.json of a {family} model has an unknown layer type '{t}'")
        out.append(_LAYER_TYPE_ALIASES[t])
    return tuple(out)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(cfg: dict[str, Any], head_dim: int, default_partial: float) -> tuple[float, int]:
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_partial))
    rope_type = params.get("rope_type", cfg.get("rope_scaling", {}) and cfg["rope_scaling"].get("rope_type", "default"))
    if rope_type not in (None, "default"):
        raise CheckpointError(f"unsupported rope_type '{rope_type}' (only the default RoPE is implemented)")
    return float(theta), int(head_dim * partial)


def parse_config(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    family = cfg.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        archs = cfg.get("architectures")
        raise CheckpointError(
            f"unknown model_type '{family}' (architectures {archs}); supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    hidden = int(_need(cfg, "hidden_size", family))
    n_heads = int(_need(cfg, "num_attention_heads", family))
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    gen = generation_config or {}
    eos = _eos_ids(gen.get("eos_token_id", cfg.get("eos_token_id")))
    common = dict(
        family=family,
        vocab_size=int(_need(cfg, "vocab_size", family)),
        hidden_size=hidden,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        eos_token_ids=eos,
        bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
        torch_dtype=str(cfg.get("dtype", cfg.get("torch_dtype", "float32"))),
        raw=cfg,
    )

    if family == "nemotron_h":
        if cfg.get("layers_block_type") is not None:
            layer_types = _layer_types(cfg["layers_block_type"], family)
        elif cfg.get("hybrid_override_pattern") is not None:
            pattern = cfg["hybrid_override_pattern"]
            bad = set(pattern) - set(_NEMOTRON_PATTERN)
            if bad:
                raise CheckpointError(f"hybrid_override_pattern has unknown layer letters {sorted(bad)}")
            layer_types = tuple(_NEMOTRON_PATTERN[c] for c in pattern)
        else:
            raise CheckpointError("config.json of a nemotron_h model has neither layers_block_type nor hybrid_override_pattern")
        nh = int(_need(cfg, "mamba_num_heads", family))
        mamba = MambaConfig(
            num_heads=nh,
            head_dim=int(_need(cfg, "mamba_head_dim", family)),
            n_groups=int(cfg.get("n_groups", cfg.get("mamba_n_groups", 8))),
            state_size=int(cfg.get("ssm_state_size", 128)),
            conv_kernel=int(cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4))),
            chunk_size=int(cfg.get("chunk_size", cfg.get("mamba_chunk_size", 128))),
            conv_bias=bool(cfg.get("use_conv_bias", True)),
            proj_bias=bool(cfg.get("use_bias", False)),
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            # NemotronH ignores time_step_limit and clamps from time_step_min upwards.
            dt_limit=(float(cfg.get("time_step_min", 0.001)), math.inf),
        )
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        attention = AttentionConfig(n_heads, n_kv, head_dim, head_dim**-0.5, False, None, 0)
        moe = None
        if MOE in layer_types:
            moe = MoEConfig(
                num_experts=int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 8))),
                top_k=int(cfg.get("num_experts_per_tok", 2)),
                intermediate_size=int(cfg.get("moe_intermediate_size", 7688)),
                shared_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size", 7688)),
                n_group=int(cfg.get("n_group", 1)),
                topk_group=int(cfg.get("topk_group", 1)),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            )
            if cfg.get("moe_latent_size") is not None:
                raise CheckpointError("nemotron_h with moe_latent_size is not supported yet")
        return ModelConfig(
            layer_types=layer_types,
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            mamba=mamba,
            attention=attention,
            intermediate_size=int(cfg.get("intermediate_size", 21504)),
            mlp_act=str(cfg.get("mlp_hidden_act", "relu2")),
            moe=moe,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            **common,
        )

    n_layers = int(_need(cfg, "num_hidden_layers", family))
    if family == "falcon_h1":
        return _parse_falcon_h1(cfg, common, hidden, n_heads, n_kv, n_layers)

    # Bamba and GraniteMoeHybrid share the Mamba keys.
    if family == "bamba":
        if cfg.get("layers_block_type") is not None:
            layer_types = _layer_types(cfg["layers_block_type"], family)
        else:
            attn = set(cfg.get("attn_layer_indices") or [])
            layer_types = tuple(ATTENTION if i in attn else MAMBA for i in range(n_layers))
    else:
        raw_types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n_layers
        layer_types = _layer_types(raw_types, family)
    if len(layer_types) != n_layers:
        raise CheckpointError(f"config.json lists {len(layer_types)} layer types for {n_layers} layers")
    if set(layer_types) - {MAMBA, ATTENTION}:
        raise CheckpointError(f"{family} layers must be mamba or attention, got {sorted(set(layer_types))}")
    expand = int(cfg.get("mamba_expand", 2))
    mamba_inner = expand * hidden
    nh = int(_need(cfg, "mamba_n_heads", family))
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = mamba_inner // nh if d_head in (None, "auto") else int(d_head)
    if d_head * nh != mamba_inner:
        raise CheckpointError(f"mamba_n_heads * mamba_d_head = {nh * d_head} != mamba_expand * hidden_size = {mamba_inner}")
    limit = cfg.get("time_step_limit", (0.0, math.inf))
    mamba = MambaConfig(
        num_heads=nh,
        head_dim=d_head,
        n_groups=int(cfg.get("mamba_n_groups", 1)),
        state_size=int(cfg.get("mamba_d_state", 128)),
        conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        chunk_size=int(cfg.get("mamba_chunk_size", 256)),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        dt_limit=(float(limit[0]), float(limit[1])),
    )
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    if family == "bamba":
        theta, rotary_dim = _rope(cfg, head_dim, default_partial=0.5)
        attention = AttentionConfig(n_heads, n_kv, head_dim, head_dim**-0.5, bool(cfg.get("attention_bias", False)), theta, rotary_dim)
        return ModelConfig(
            layer_types=layer_types, norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), mamba=mamba, attention=attention,
            intermediate_size=int(_need(cfg, "intermediate_size", family)), mlp_act=str(cfg.get("hidden_act", "silu")),
            moe=None, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), **common,
        )
    # granitemoehybrid
    pos = cfg.get("position_embedding_type", "nope")
    if pos == "rope":
        theta, rotary_dim = _rope(cfg, head_dim, default_partial=1.0)
    elif pos in (None, "nope"):
        theta, rotary_dim = None, 0
    else:
        raise CheckpointError(f"unsupported position_embedding_type '{pos}'")
    attention = AttentionConfig(
        n_heads, n_kv, head_dim, float(cfg.get("attention_multiplier", head_dim**-0.5)),
        bool(cfg.get("attention_bias", False)), theta, rotary_dim,
    )
    n_experts = int(cfg.get("num_local_experts", 0))
    moe = None
    if n_experts > 0:
        moe = MoEConfig(
            num_experts=n_experts, top_k=int(cfg.get("num_experts_per_tok", 2)),
            intermediate_size=int(_need(cfg, "intermediate_size", family)),
            shared_intermediate_size=int(_need(cfg, "shared_intermediate_size", family)),
        )
    return ModelConfig(
        layer_types=layer_types, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), mamba=mamba, attention=attention,
        intermediate_size=int(_need(cfg, "shared_intermediate_size", family)), mlp_act=str(cfg.get("hidden_act", "silu")),
        moe=moe, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        **common,
    )


def _parse_falcon_h1(cfg: dict[str, Any], common: dict[str, Any], hidden: int, n_heads: int, n_kv: int,
                     n_layers: int) -> ModelConfig:
    family = "falcon_h1"
    inner = cfg.get("mamba_d_ssm")
    inner = int(inner) if inner is not None else int(cfg.get("mamba_expand", 2)) * hidden
    nh = int(_need(cfg, "mamba_n_heads", family))
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = inner // nh if d_head in (None, "auto") else int(d_head)
    if d_head * nh != inner:
        raise CheckpointError(f"mamba_n_heads * mamba_d_head = {nh * d_head} != mamba_d_ssm = {inner}")
    if not cfg.get("mamba_rms_norm", False):
        gate = GATE_ONLY
    else:
        gate = NORM_THEN_GATE if cfg.get("mamba_norm_before_gate", True) else GATE_THEN_NORM
    limit = cfg.get("time_step_limit") or (0.0, math.inf)
    mamba = MambaConfig(
        num_heads=nh, head_dim=d_head, n_groups=int(cfg.get("mamba_n_groups", 1)),
        state_size=int(cfg.get("mamba_d_state", 256)), conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        chunk_size=int(cfg.get("mamba_chunk_size", 256)), conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)), norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        dt_limit=(float(limit[0]), float(limit[1])), gate=gate,
    )
    if bool(cfg.get("projectors_bias", False)) != mamba.proj_bias:
        raise CheckpointError("falcon_h1 with projectors_bias != mamba_proj_bias is not supported")
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    theta, rotary_dim = _rope(cfg, head_dim, default_partial=1.0)
    attention = AttentionConfig(n_heads, n_kv, head_dim, head_dim**-0.5, bool(cfg.get("attention_bias", False)),
                                theta, rotary_dim)
    if bool(cfg.get("mlp_bias", False)):
        raise CheckpointError("falcon_h1 with mlp_bias is not supported")
    zxbcdt = tuple(float(v) for v in (cfg.get("ssm_multipliers") or (1.0,) * 5))
    mlp = tuple(float(v) for v in (cfg.get("mlp_multipliers") or (1.0, 1.0)))
    if len(zxbcdt) != 5 or len(mlp) != 2:
        raise CheckpointError("falcon_h1 ssm_multipliers needs 5 values and mlp_multipliers 2")
    mup = FalconMultipliers(
        ssm_in=float(cfg.get("ssm_in_multiplier", 1.0)), ssm_zxbcdt=zxbcdt,
        ssm_out=float(cfg.get("ssm_out_multiplier", 1.0)),
        attention_in=float(cfg.get("attention_in_multiplier", 1.0)), key=float(cfg.get("key_multiplier", 1.0)),
        attention_out=float(cfg.get("attention_out_multiplier", 1.0)), mlp_gate=mlp[0], mlp_down=mlp[1],
    )
    return ModelConfig(
        layer_types=(PARALLEL,) * n_layers, norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), mamba=mamba,
        attention=attention, intermediate_size=int(_need(cfg, "intermediate_size", family)),
        mlp_act=str(cfg.get("hidden_act", "silu")), moe=None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        lm_head_multiplier=float(cfg.get("lm_head_multiplier", 1.0)), mup=mup, **common,
    )


def load_config(model_dir: str) -> ModelConfig:
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"checkpoint directory not found: {model_dir}")
    cfg = read_json(os.path.join(model_dir, "config.json"))
    gen_path = os.path.join(model_dir, "generation_config.json")
    gen = read_json(gen_path) if os.path.isfile(gen_path) else None
    return parse_config(cfg, gen)
