"""config.json -> ModelConfig: each supported family's keys, defaults and layer layout.

Each supported family spells its hyper-parameters differently in config.json; this module maps
them onto one `ModelConfig` (hybrid/config.py) so the layers never look at family-specific keys.
`parse_config` translates a config dict, `load_config` a checkpoint directory's config.json (and
generation_config.json); the typed field getters are in hybrid/config_fields.py.
"""
from __future__ import annotations

import math
import os
from typing import Any

from hybrid.config import (
    ATTENTION, GATE_ONLY, GATE_THEN_NORM, HYBRID, MAMBA, MLP, MOE, NORM_THEN_GATE, PARALLEL, AttentionConfig,
    FalconMultipliers, MambaConfig, ModelConfig, MoEConfig, SharedBlockConfig,
)
from hybrid.config_fields import (
    _act, _bool, _check_divides, _dt_limit, _eos_ids, _float, _floats, _int, _json_kind, _need, _rope,
    _time_step_min, _token_id, read_json,
)
from hybrid.errors import CheckpointError

SUPPORTED_FAMILIES = ("nemotron_h", "granitemoehybrid", "bamba", "falcon_h1", "zamba2")

# NemotronH layer letters and the layer-type names transformers writes (old and new spellings).
_NEMOTRON_PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
# NemotronHConfig's legacy key for each new one: when present, the legacy key wins (its __post_init__)
_NEMOTRON_LEGACY = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "chunk_size": "mamba_chunk_size",
                    "use_conv_bias": "mamba_conv_bias", "time_step_limit": "mamba_dt_limit"}
_KV_HEADS_DEFAULT_8 = ("nemotron_h", "bamba", "falcon_h1")
_MAX_POSITIONS_DEFAULT = {"nemotron_h": 4096, "granitemoehybrid": 2048, "bamba": 262144, "falcon_h1": 8192,
                          "zamba2": 4096}
_LAYER_TYPE_ALIASES = {
    "mamba": MAMBA, "linear_attention": MAMBA, "M": MAMBA,
    "attention": ATTENTION, "full_attention": ATTENTION, "*": ATTENTION,
    "mlp": MLP, "-": MLP, "moe": MOE, "E": MOE,
}


def _layer_types(raw: Any, family: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        raise CheckpointError(f"config.json of a {family} model: layer types must be a list of strings, got {raw!r}")
    out = []
    for t in raw:
        if t not in _LAYER_TYPE_ALIASES:
            raise CheckpointError(f"config.json of a {family} model has an unknown layer type '{t}'")
        out.append(_LAYER_TYPE_ALIASES[t])
    return tuple(out)


def parse_config(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    if not isinstance(cfg, dict):
        raise CheckpointError(f"config.json must hold a JSON object, found {_json_kind(cfg)}")
    family = cfg.get("model_type")
    if not isinstance(family, str) or family not in SUPPORTED_FAMILIES:
        archs = cfg.get("architectures")
        raise CheckpointError(
            f"unknown model_type '{family}' (architectures {archs}); supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    hidden = _int(cfg, "hidden_size", family)
    n_heads = _int(cfg, "num_attention_heads", family)
    # transformers: null means one kv head per query head; a missing key is the config class's default
    # (8 for NemotronH, Bamba and Falcon-H1; the head count for Granite and Zamba2)
    n_kv = _int(cfg, "num_key_value_heads", family,
                n_heads if "num_key_value_heads" in cfg or family not in _KV_HEADS_DEFAULT_8 else 8)
    gen = generation_config or {}
    # a missing eos / bos key is the config class's default (2 / 1 in every family), null is none
    eos = _eos_ids(gen.get("eos_token_id", cfg.get("eos_token_id", 2)))
    common = dict(
        family=family,
        vocab_size=_int(cfg, "vocab_size", family),
        hidden_size=hidden,
        max_position_embeddings=_int(cfg, "max_position_embeddings", family, _MAX_POSITIONS_DEFAULT[family]),
        eos_token_ids=eos,
        bos_token_id=_token_id(gen.get("bos_token_id", cfg.get("bos_token_id", 1)), "bos_token_id"),
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        raw=cfg,
    )

    if family == "nemotron_h":
        if cfg.get("layers_block_type") is not None:
            layer_types = _layer_types(cfg["layers_block_type"], family)
        elif cfg.get("hybrid_override_pattern") is not None:
            pattern = cfg["hybrid_override_pattern"]
            if not isinstance(pattern, str):
                raise CheckpointError(f"config.json: 'hybrid_override_pattern' must be a string, got {pattern!r}")
            bad = set(pattern) - set(_NEMOTRON_PATTERN)
            if bad:
                raise CheckpointError(f"hybrid_override_pattern has unknown layer letters {sorted(bad)}")
            layer_types = tuple(_NEMOTRON_PATTERN[c] for c in pattern)
        else:
            raise CheckpointError("config.json of a nemotron_h model has neither layers_block_type nor hybrid_override_pattern")
        if not layer_types:
            raise CheckpointError("config.json of a nemotron_h model lists no layers")
        nh = _int(cfg, "mamba_num_heads", family, 128)
        # transformers' NemotronHConfig reads the legacy mamba_* spellings in preference to the new keys
        key = {new: (old if old in cfg else new) for new, old in _NEMOTRON_LEGACY.items()}
        mamba = MambaConfig(
            num_heads=nh,
            head_dim=_int(cfg, "mamba_head_dim", family, 64),
            n_groups=_int(cfg, key["n_groups"], family, 8),
            state_size=_int(cfg, "ssm_state_size", family, 128),
            conv_kernel=_int(cfg, key["conv_kernel"], family, 4),
            chunk_size=_int(cfg, key["chunk_size"], family, 128),
            conv_bias=_bool(cfg, key["use_conv_bias"], True),
            proj_bias=_bool(cfg, "use_bias", False),
            norm_eps=_float(cfg, "layer_norm_epsilon", 1e-5, positive=True),
            # the prefill clamps dt to time_step_limit, as NVIDIA's published implementation does
            # (older transformers releases clamped from time_step_min instead, whatever the limit)
            dt_limit=_dt_limit(cfg, key["time_step_limit"]),
            conv_act=_act(cfg, "mamba_hidden_act", "silu"),
        )
        # a missing head_dim is the config class's 128 (null: hidden / heads); no attention bias
        # whatever attention_bias says (transformers' NemotronH projections have none)
        head_dim = _int(cfg, "head_dim", family, 128 if "head_dim" not in cfg else 0, lo=0) or hidden // n_heads
        attention = AttentionConfig(n_heads, n_kv, head_dim, head_dim**-0.5, False, None, 0)
        moe = None
        if MOE in layer_types:
            moe = MoEConfig(
                num_experts=_int(cfg, "n_routed_experts", family, _int(cfg, "num_local_experts", family, 8)),
                top_k=_int(cfg, "num_experts_per_tok", family, 2),
                intermediate_size=_int(cfg, "moe_intermediate_size", family, 7688),
                shared_intermediate_size=_int(cfg, "moe_shared_expert_intermediate_size", family, 7688),
                n_group=_int(cfg, "n_group", family, 1),
                topk_group=_int(cfg, "topk_group", family, 1),
                norm_topk_prob=_bool(cfg, "norm_topk_prob", True),
                routed_scaling_factor=_float(cfg, "routed_scaling_factor", 1.0),
                latent_size=_int(cfg, "moe_latent_size", family, None),
            )
        _bool(cfg, "tie_word_embeddings", False)  # (type-checked; not used, see below)
        return _checked(ModelConfig(
            layer_types=layer_types,
            norm_eps=_float(cfg, "layer_norm_epsilon", 1e-5, positive=True),
            mamba=mamba,
            attention=attention,
            intermediate_size=_int(cfg, "intermediate_size", family, 21504),
            mlp_act=_act(cfg, "mlp_hidden_act", "relu2"),
            moe=moe,
            # transformers' NemotronHForCausalLM ties nothing (its _tied_weights_keys is empty): the
            # LM head is lm_head.weight even where the config says tie_word_embeddings
            tie_word_embeddings=False,
            mlp_bias=_bool(cfg, "mlp_bias", False),  # the '-' MLPs and the MoE shared experts
            **common,
        ))

    if family == "zamba2":
        return _checked(_parse_zamba2(cfg, common, hidden, n_heads, n_kv))
    n_layers = _int(cfg, "num_hidden_layers", family, 32)  # (the config classes' default)
    if family == "falcon_h1":
        return _checked(_parse_falcon_h1(cfg, common, hidden, n_heads, n_kv, n_layers))

    # Bamba and GraniteMoeHybrid share the Mamba keys.
    if family == "bamba":
        if cfg.get("layers_block_type") is not None:
            layer_types = _layer_types(cfg["layers_block_type"], family)
        else:
            attn = cfg.get("attn_layer_indices") or []
            if not isinstance(attn, list) or not all(isinstance(i, int) for i in attn):
                raise CheckpointError(f"config.json: 'attn_layer_indices' must be a list of layer indices, got {attn!r}")
            attn = set(attn)
            layer_types = tuple(ATTENTION if i in attn else MAMBA for i in range(n_layers))
    else:
        raw_types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n_layers
        layer_types = _layer_types(raw_types, family)
    if len(layer_types) != n_layers:
        raise CheckpointError(f"config.json lists {len(layer_types)} layer types for {n_layers} layers")
    if set(layer_types) - {MAMBA, ATTENTION}:
        raise CheckpointError(f"{family} layers must be mamba or attention, got {sorted(set(layer_types))}")
    expand = _int(cfg, "mamba_expand", family, 2)
    mamba_inner = expand * hidden
    nh = _int(cfg, "mamba_n_heads", family, 128)
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = mamba_inner // nh if d_head in (None, "auto") else _int(cfg, "mamba_d_head", family)
    if d_head * nh != mamba_inner:
        raise CheckpointError(f"mamba_n_heads * mamba_d_head = {nh * d_head} != mamba_expand * hidden_size = {mamba_inner}")
    mamba = MambaConfig(
        num_heads=nh,
        head_dim=d_head,
        n_groups=_int(cfg, "mamba_n_groups", family, 1),
        state_size=_int(cfg, "mamba_d_state", family, 256),
        conv_kernel=_int(cfg, "mamba_d_conv", family, 4),
        chunk_size=_int(cfg, "mamba_chunk_size", family, 256),
        conv_bias=_bool(cfg, "mamba_conv_bias", True),
        proj_bias=_bool(cfg, "mamba_proj_bias", False),
        norm_eps=_float(cfg, "rms_norm_eps", 1e-5 if family == "bamba" else 1e-6, positive=True),
        dt_limit=_dt_limit(cfg, "time_step_limit"),
        conv_act=_act(cfg, "hidden_act", "silu"),  # transformers' Bamba / Granite mixers use hidden_act there too
    )
    head_dim = _int(cfg, "head_dim", family, 0, lo=0) or hidden // n_heads
    if family == "bamba":
        theta, rotary_dim = _rope(cfg, head_dim, default_partial=0.5)
        attention = AttentionConfig(n_heads, n_kv, head_dim, head_dim**-0.5, _bool(cfg, "attention_bias", False),
                                    theta, rotary_dim)
        return _checked(ModelConfig(
            layer_types=layer_types, norm_eps=_float(cfg, "rms_norm_eps", 1e-5, positive=True), mamba=mamba,
            attention=attention, intermediate_size=_int(cfg, "intermediate_size", family, 14336),
            mlp_act=_act(cfg, "hidden_act", "silu"), mlp_bias=_bool(cfg, "mlp_bias", False),
            moe=None, tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False), **common,
        ))
    # granitemoehybrid
    pos = cfg.get("position_embedding_type", "nope")
    if pos == "rope":
        theta, rotary_dim = _rope(cfg, head_dim, default_partial=None)
    elif pos in (None, "nope"):
        theta, rotary_dim = None, 0
    else:
        raise CheckpointError(f"unsupported position_embedding_type '{pos}'")
    attention = AttentionConfig(
        # the attention scale is attention_multiplier itself (transformers' default 1.0, not head_dim^-0.5)
        n_heads, n_kv, head_dim, _float(cfg, "attention_multiplier", 1.0, positive=True),
        _bool(cfg, "attention_bias", False), theta, rotary_dim,
    )
    n_experts = _int(cfg, "num_local_experts", family, 8, lo=0)
    moe = None
    if n_experts > 0:
        moe = MoEConfig(
            num_experts=n_experts, top_k=_int(cfg, "num_experts_per_tok", family, 2),
            intermediate_size=_int(cfg, "intermediate_size", family, 11008),
            shared_intermediate_size=_int(cfg, "shared_intermediate_size", family, 1024, lo=0),
        )
    return _checked(ModelConfig(
        layer_types=layer_types, norm_eps=_float(cfg, "rms_norm_eps", 1e-6, positive=True), mamba=mamba,
        # shared_intermediate_size 0: no shared MLP (transformers' is zero-width: adds nothing)
        attention=attention, intermediate_size=_int(cfg, "shared_intermediate_size", family, 1024, lo=0),
        mlp_act=_act(cfg, "hidden_act", "silu"),
        moe=moe, tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
        embedding_multiplier=_float(cfg, "embedding_multiplier", 1.0),
        residual_multiplier=_float(cfg, "residual_multiplier", 1.0),
        logits_scaling=_float(cfg, "logits_scaling", 1.0),
        **common,
    ))


def _checked(cfg: ModelConfig) -> ModelConfig:
    """Relations between sizes that the layers rely on (each size alone was checked when read)."""
    if cfg.attention_layers:
        a = cfg.attention
        _check_divides("grouped-query attention", a.num_heads, a.num_kv_heads, "num_attention_heads",
                       "num_key_value_heads")
        if a.head_dim < 1:
            raise CheckpointError(f"config.json: attention head_dim is {a.head_dim} "
                                  f"(hidden_size {cfg.hidden_size} / num_attention_heads {a.num_heads})")
    if cfg.mamba_layers:
        m = cfg.mamba
        _check_divides("Mamba2 groups", m.num_heads, m.n_groups, "the Mamba head count", "the Mamba group count")
    if cfg.moe is not None and cfg.moe.top_k > cfg.moe.num_experts:
        raise CheckpointError(f"config.json: num_experts_per_tok ({cfg.moe.top_k}) exceeds the number of experts "
                              f"({cfg.moe.num_experts})")
    if cfg.moe is not None and cfg.moe.n_group > 1:
        _check_divides("grouped routing", cfg.moe.num_experts, cfg.moe.n_group, "the number of experts", "n_group")
    return cfg


def _parse_falcon_h1(cfg: dict[str, Any], common: dict[str, Any], hidden: int, n_heads: int, n_kv: int,
                     n_layers: int) -> ModelConfig:
    family = "falcon_h1"
    # mamba_d_ssm: a missing key is FalconH1Config's 1024, null means mamba_expand * hidden_size
    inner = _int(cfg, "mamba_d_ssm", family, None if "mamba_d_ssm" in cfg else 1024)
    inner = inner if inner is not None else _int(cfg, "mamba_expand", family, 2) * hidden
    nh = _int(cfg, "mamba_n_heads", family, 128)
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = inner // nh if d_head in (None, "auto") else _int(cfg, "mamba_d_head", family)
    if d_head * nh != inner:
        raise CheckpointError(f"mamba_n_heads * mamba_d_head = {nh * d_head} != mamba_d_ssm = {inner}")
    if not _bool(cfg, "mamba_rms_norm", False):
        gate = GATE_ONLY
    else:
        gate = NORM_THEN_GATE if _bool(cfg, "mamba_norm_before_gate", True) else GATE_THEN_NORM
    mamba = MambaConfig(
        num_heads=nh, head_dim=d_head, n_groups=_int(cfg, "mamba_n_groups", family, 1),
        state_size=_int(cfg, "mamba_d_state", family, 256), conv_kernel=_int(cfg, "mamba_d_conv", family, 4),
        chunk_size=_int(cfg, "mamba_chunk_size", family, 256), conv_bias=_bool(cfg, "mamba_conv_bias", True),
        proj_bias=_bool(cfg, "mamba_proj_bias", False), norm_eps=_float(cfg, "rms_norm_eps", 1e-5, positive=True),
        dt_limit=_dt_limit(cfg, "time_step_limit"), gate=gate,
        conv_act=_act(cfg, "hidden_act", "silu"),  # (transformers' FalconH1Mixer uses hidden_act after the conv)
        out_proj_bias=_bool(cfg, "projectors_bias", False),  # in_proj's is mamba_proj_bias
    )
    head_dim = _int(cfg, "head_dim", family, 0, lo=0) or hidden // n_heads
    theta, rotary_dim = _rope(cfg, head_dim, default_partial=None)
    attention = AttentionConfig(n_heads, n_kv, head_dim, head_dim**-0.5, _bool(cfg, "attention_bias", False),
                                theta, rotary_dim)
    zxbcdt = _floats(cfg, "ssm_multipliers", 5, (1.0,) * 5)
    mlp = _floats(cfg, "mlp_multipliers", 2, (1.0, 1.0))
    mup = FalconMultipliers(
        ssm_in=_float(cfg, "ssm_in_multiplier", 1.0), ssm_zxbcdt=zxbcdt,
        ssm_out=_float(cfg, "ssm_out_multiplier", 1.0),
        attention_in=_float(cfg, "attention_in_multiplier", 1.0), key=_float(cfg, "key_multiplier", 1.0),
        attention_out=_float(cfg, "attention_out_multiplier", 1.0), mlp_gate=mlp[0], mlp_down=mlp[1],
    )
    return ModelConfig(
        layer_types=(PARALLEL,) * n_layers, norm_eps=_float(cfg, "rms_norm_eps", 1e-5, positive=True), mamba=mamba,
        attention=attention, intermediate_size=_int(cfg, "intermediate_size", family, 14336),
        mlp_act=_act(cfg, "hidden_act", "silu"), mlp_bias=_bool(cfg, "mlp_bias", False), moe=None,
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
        embedding_multiplier=_float(cfg, "embedding_multiplier", 1.0),
        lm_head_multiplier=_float(cfg, "lm_head_multiplier", 1.0), mup=mup, **common,
    )


# Zamba2 layer names: transformers' current ones and the legacy "mamba" that hub configs use
_ZAMBA2_LAYER_TYPES = {"mamba": MAMBA, "linear_attention": MAMBA, "hybrid": HYBRID}


def _parse_zamba2(cfg: dict[str, Any], common: dict[str, Any], hidden: int, n_heads: int,
                  n_kv: int) -> ModelConfig:
    family = "zamba2"
    raw = _need(cfg, "layers_block_type", family)
    if not isinstance(raw, list) or not raw or not all(isinstance(t, str) for t in raw):
        raise CheckpointError(f"config.json: 'layers_block_type' must be a non-empty list of strings, got {raw!r}")
    bad = sorted(set(raw) - set(_ZAMBA2_LAYER_TYPES))
    if bad:
        raise CheckpointError(f"config.json of a zamba2 model has unknown layer types {bad} (mamba or hybrid)")
    layer_types = tuple(_ZAMBA2_LAYER_TYPES[t] for t in raw)
    n_layers = _int(cfg, "num_hidden_layers", family, len(layer_types))
    if n_layers != len(layer_types):
        raise CheckpointError(f"config.json lists {len(layer_types)} layer types for {n_layers} layers")
    inner = _int(cfg, "mamba_expand", family, 2) * hidden
    nh = _int(cfg, "n_mamba_heads", family, 8)
    _check_divides("Mamba2 head dim", inner, nh, "mamba_expand * hidden_size", "n_mamba_heads")
    mamba = MambaConfig(
        num_heads=nh, head_dim=inner // nh, n_groups=_int(cfg, "mamba_ngroups", family, 1),
        state_size=_int(cfg, "mamba_d_state", family, 64), conv_kernel=_int(cfg, "mamba_d_conv", family, 4),
        chunk_size=_int(cfg, "chunk_size", family, 256),
        conv_bias=True,  # transformers' Zamba2 conv1d always has a bias (use_conv_bias is not read)
        proj_bias=_bool(cfg, "add_bias_linear", False),
        norm_eps=1e-5,  # the gated norm's eps is fixed, not rms_norm_eps
        # transformers' Zamba2 ignores time_step_limit: the prefill clamps from time_step_min upwards
        dt_limit=(_time_step_min(cfg), math.inf),
    )
    # attention runs on cat(h, embeddings): 2H wide, head dim 2H / heads, scale (head_dim / 2)^-0.5
    _check_divides("attention head dim", 2 * hidden, n_heads, "2 * hidden_size", "num_attention_heads")
    head_dim = 2 * hidden // n_heads
    theta, rotary_dim = None, 0
    if _bool(cfg, "use_mem_rope", False):
        # transformers' Zamba2 rotates whole heads (partial_rotary_factor is not read)
        theta, rotary_dim = _rope(cfg, head_dim, default_partial=None)
    attention = AttentionConfig(n_heads, n_kv, head_dim, (head_dim / 2) ** -0.5, False, theta, rotary_dim)
    shared = SharedBlockConfig(
        num_mem_blocks=_int(cfg, "num_mem_blocks", family, 1), adapter_rank=_int(cfg, "adapter_rank", family, 128),
        attention_adapters=_bool(cfg, "use_shared_attention_adapter", False),
        tied=_bool(cfg, "tie_word_embeddings", True),
    )
    if shared.attention_adapters and n_kv != n_heads:
        # the adapters output 2H columns, the k / v projections n_kv * head_dim (transformers fails too)
        raise CheckpointError("config.json: zamba2 with use_shared_attention_adapter needs num_key_value_heads "
                              f"({n_kv}) == num_attention_heads ({n_heads})")
    if _bool(cfg, "use_long_context", False):
        common = dict(common, max_position_embeddings=16384)  # what transformers sets (RoPE unchanged)
    return ModelConfig(
        layer_types=layer_types, norm_eps=_float(cfg, "rms_norm_eps", 1e-5, positive=True), mamba=mamba,
        attention=attention, intermediate_size=_int(cfg, "intermediate_size", family, 4 * hidden),
        mlp_act=_act(cfg, "hidden_act", "gelu"), moe=None,
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", True), shared_blocks=shared, **common,
    )


def load_config(model_dir: str) -> ModelConfig:
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"checkpoint directory not found: {model_dir}")
    path = os.path.join(model_dir, "config.json")
    cfg = read_json(path)
    gen_path = os.path.join(model_dir, "generation_config.json")
    gen = read_json(gen_path) if os.path.isfile(gen_path) else None
    try:
        parsed = parse_config(cfg, gen)
        _check_declared_biases(model_dir, parsed)
        return parsed
    except CheckpointError as e:
        msg = str(e)
        raise CheckpointError(f"{path}: {msg.removeprefix('config.json: ')}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as e:
        # a value of a shape no check above foresaw: still the checkpoint's fault, not a crash
        raise CheckpointError(f"{path}: invalid configuration ({type(e).__name__}: {e})") from None


def _check_declared_biases(model_dir: str, cfg: ModelConfig) -> None:
    """Falcon-H1's optional biases (mlp_bias, projectors_bias) named as config keys when the checkpoint
    lacks them (transformers would start them at zero; the loader would only name the missing tensor)."""
    if cfg.family != "falcon_h1" or not (cfg.mlp_bias or (cfg.mamba.out_bias and not cfg.mamba.proj_bias)):
        return
    from hybrid.loader import weight_files  # (reads the safetensors headers only)

    names = weight_files(model_dir)
    wanted = []
    if cfg.mlp_bias:
        wanted.append(("mlp_bias", "model.layers.0.feed_forward.down_proj.bias"))
    if cfg.mamba.out_bias and not cfg.mamba.proj_bias:
        wanted.append(("projectors_bias", "model.layers.0.mamba.out_proj.bias"))
    for key, name in wanted:
        if name not in names:
            raise CheckpointError(f"config.json: '{key}' is true but the checkpoint holds no such bias "
                                  f"(no tensor '{name}')")
