"""The tensor plan: for each model parameter, the on-disk (Hugging Face) tensors it is made of.

Every family stores its tensors under its own names and layouts (NemotronH keeps MoE experts one
by one, Bamba splits gate and up projections, conv weights carry a singleton dim). `tensor_plan`
maps each model parameter to its `Source`: the on-disk names and how they assemble (whole, conv,
stacked experts, concatenated rows) and the multipliers folded into them (Falcon-H1's muP). The
loader (hybrid/loader.py) checks a checkpoint's file set against it and reads it; the FP8 plan
(hybrid/quantization.py) and the FP8 KV-cache scales (hybrid/kv_cache_dtype.py) follow it too.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from hybrid.config import ATTENTION, GATE_ONLY, HYBRID, MAMBA, MLP, MOE, ModelConfig


@dataclass
class Source:
    disk_names: list[str]
    how: str  # "whole" | "conv" (drop the singleton dim) | "stack" (experts) | "concat" (rows, e.g. gate|up)
    rows: tuple[int, ...] | None = None  # "concat": rows of each part (None: equal parts)
    # Per-row multipliers folded into the tensor (in fp32, before the cast to the model dtype):
    # Falcon-H1's muP multipliers of a projection's input or output sections
    row_scale: tuple[tuple[int, float], ...] | None = None  # (rows, multiplier) runs, in order
    # of those, the one applied to the projection's input (an FP8 checkpoint's input scale was
    # calibrated on the multiplied input; hybrid/quantization.py)
    input_multiplier: float = 1.0


def _mamba_sources(param_prefix: str, disk_prefix: str, cfg: ModelConfig) -> dict[str, Source]:
    m = cfg.mamba
    out = {
        "in_proj.weight": "in_proj.weight", "out_proj.weight": "out_proj.weight",
        "A_log": "A_log", "D": "D", "dt_bias": "dt_bias",
    }
    if m.gate != GATE_ONLY:
        out["norm_weight"] = "norm.weight"
    if m.proj_bias:
        out["in_proj.bias"] = "in_proj.bias"
    if m.out_bias:
        out["out_proj.bias"] = "out_proj.bias"
    if m.conv_bias:
        out["conv_bias"] = "conv1d.bias"
    plan = {f"{param_prefix}{k}": Source([f"{disk_prefix}{v}"], "whole") for k, v in out.items()}
    plan[f"{param_prefix}conv_weight"] = Source([f"{disk_prefix}conv1d.weight"], "conv")
    return plan


def _attention_sources(param_prefix: str, disk_prefix: str, cfg: ModelConfig) -> dict[str, Source]:
    a = cfg.attention
    rows = (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim)
    plan = {}
    for k in ["weight"] + (["bias"] if a.bias else []):
        # q, k and v projections as one GEMM
        plan[f"{param_prefix}qkv_proj.{k}"] = Source([f"{disk_prefix}{n}.{k}" for n in ("q_proj", "k_proj", "v_proj")],
                                                     "concat", rows)
        plan[f"{param_prefix}o_proj.{k}"] = Source([f"{disk_prefix}o_proj.{k}"], "whole")
    return plan


def _leaves(bias: bool) -> list[str]:
    return ["weight", "bias"] if bias else ["weight"]


def _gated_mlp_sources(param_prefix: str, disk_prefix: str, bias: bool) -> dict[str, Source]:
    """A SwiGLU MLP stored as gate_proj / up_proj / down_proj (Bamba, Falcon-H1): [gate | up] as one."""
    plan = {}
    for leaf in _leaves(bias):
        plan[f"{param_prefix}gate_up_proj.{leaf}"] = Source(
            [f"{disk_prefix}gate_proj.{leaf}", f"{disk_prefix}up_proj.{leaf}"], "concat")
        plan[f"{param_prefix}down_proj.{leaf}"] = Source([f"{disk_prefix}down_proj.{leaf}"], "whole")
    return plan


def tensor_plan(cfg: ModelConfig) -> dict[str, Source]:
    """Model parameter name -> the on-disk tensors that make it."""
    plan: dict[str, Source] = {}
    if cfg.family == "falcon_h1":
        return _falcon_h1_plan(cfg)
    if cfg.family == "zamba2":
        return _zamba2_plan(cfg)
    if cfg.family == "nemotron_h":
        plan["embed"] = Source(["backbone.embeddings.weight"], "whole")
        plan["final_norm.weight"] = Source(["backbone.norm_f.weight"], "whole")
        for i, kind in enumerate(cfg.layer_types):
            p, d = f"layers.{i}.", f"backbone.layers.{i}."
            plan[f"{p}norm.weight"] = Source([f"{d}norm.weight"], "whole")
            if kind == MAMBA:
                plan.update(_mamba_sources(f"{p}mixer.", f"{d}mixer.", cfg))
            elif kind == ATTENTION:
                plan.update(_attention_sources(f"{p}mixer.", f"{d}mixer.", cfg))
            elif kind == MLP:
                for n in ("up_proj", "down_proj"):
                    for leaf in _leaves(cfg.mlp_bias):
                        plan[f"{p}mixer.{n}.{leaf}"] = Source([f"{d}mixer.{n}.{leaf}"], "whole")
            elif kind == MOE:
                e = range(cfg.moe.num_experts)
                plan[f"{p}mixer.router_weight"] = Source([f"{d}mixer.gate.weight"], "whole")
                plan[f"{p}mixer.router_bias"] = Source([f"{d}mixer.gate.e_score_correction_bias"], "whole")
                plan[f"{p}mixer.experts.up"] = Source([f"{d}mixer.experts.{j}.up_proj.weight" for j in e], "stack")
                plan[f"{p}mixer.experts.down"] = Source([f"{d}mixer.experts.{j}.down_proj.weight" for j in e], "stack")
                for n in ("up_proj", "down_proj"):
                    for leaf in _leaves(cfg.mlp_bias):
                        plan[f"{p}mixer.shared.{n}.{leaf}"] = Source([f"{d}mixer.shared_experts.{n}.{leaf}"], "whole")
                if cfg.moe.latent_size is not None:  # LatentMoE's projections to and from the experts' width
                    for ours, theirs in (("latent_in_proj", "fc1_latent_proj"), ("latent_out_proj", "fc2_latent_proj")):
                        for leaf in _leaves(cfg.mlp_bias):
                            plan[f"{p}mixer.{ours}.{leaf}"] = Source([f"{d}mixer.{theirs}.{leaf}"], "whole")
    else:
        plan["embed"] = Source(["model.embed_tokens.weight"], "whole")
        final = "model.final_layernorm.weight" if cfg.family == "bamba" else "model.norm.weight"
        plan["final_norm.weight"] = Source([final], "whole")
        for i, kind in enumerate(cfg.layer_types):
            p, d = f"layers.{i}.", f"model.layers.{i}."
            plan[f"{p}input_norm.weight"] = Source([f"{d}input_layernorm.weight"], "whole")
            if kind == MAMBA:
                plan.update(_mamba_sources(f"{p}mixer.", f"{d}mamba.", cfg))
            else:
                plan.update(_attention_sources(f"{p}mixer.", f"{d}self_attn.", cfg))
            if cfg.family == "bamba":
                plan[f"{p}ffn_norm.weight"] = Source([f"{d}pre_ff_layernorm.weight"], "whole")
                plan.update(_gated_mlp_sources(f"{p}mlp.", f"{d}feed_forward.", cfg.mlp_bias))
            else:
                plan[f"{p}ffn_norm.weight"] = Source([f"{d}post_attention_layernorm.weight"], "whole")
                if cfg.intermediate_size > 0:  # (shared_intermediate_size 0: zero-size tensors, not loaded)
                    plan[f"{p}mlp.gate_up_proj.weight"] = Source([f"{d}shared_mlp.input_linear.weight"], "whole")
                    plan[f"{p}mlp.down_proj.weight"] = Source([f"{d}shared_mlp.output_linear.weight"], "whole")
                if cfg.moe is not None:
                    plan[f"{p}moe.router_weight"] = Source([f"{d}block_sparse_moe.router.layer.weight"], "whole")
                    plan[f"{p}moe.experts.up"] = Source([f"{d}block_sparse_moe.input_linear.weight"], "whole")
                    plan[f"{p}moe.experts.down"] = Source([f"{d}block_sparse_moe.output_linear.weight"], "whole")
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = Source(["lm_head.weight"], "whole")
    return plan


def _falcon_h1_plan(cfg: ModelConfig) -> dict[str, Source]:
    """Falcon-H1: every layer has a Mamba2 mixer and attention in parallel, then a SwiGLU MLP. Its
    muP multipliers scale projections' inputs or output sections, so they fold into weight rows:
    in_proj(x * s_in) * [s_z|s_x|s_B|s_C|s_dt], k_proj(x * s_attn_in) * s_key, act(gate * s_gate), ..."""
    mup, m, a = cfg.mup, cfg.mamba, cfg.attention
    inner, gn, nh = m.intermediate_size, m.n_groups * m.state_size, m.num_heads
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    s_z, s_x, s_b, s_c, s_dt = mup.ssm_zxbcdt
    sections = ((inner, s_z), (inner, s_x), (gn, s_b), (gn, s_c), (nh, s_dt))
    # (weight runs, bias runs): a bias takes only the multipliers applied after the projection
    scales = {
        "mamba.in_proj": ([(n, v * mup.ssm_in) for n, v in sections], list(sections)),
        "mamba.out_proj": ([(cfg.hidden_size, mup.ssm_out)],) * 2,
        "attn.qkv_proj": ([(q, mup.attention_in), (kv, mup.attention_in * mup.key), (kv, mup.attention_in)],
                          [(q, 1.0), (kv, mup.key), (kv, 1.0)]),
        "attn.o_proj": ([(cfg.hidden_size, mup.attention_out)],) * 2,
        "mlp.gate_up_proj": ([(cfg.intermediate_size, mup.mlp_gate), (cfg.intermediate_size, 1.0)],) * 2,
        "mlp.down_proj": ([(cfg.hidden_size, mup.mlp_down)],) * 2,
    }
    plan = {"embed": Source(["model.embed_tokens.weight"], "whole"),
            "final_norm.weight": Source(["model.final_layernorm.weight"], "whole")}
    for i in range(cfg.num_layers):
        p, d = f"layers.{i}.", f"model.layers.{i}."
        plan[f"{p}input_norm.weight"] = Source([f"{d}input_layernorm.weight"], "whole")
        plan[f"{p}ffn_norm.weight"] = Source([f"{d}pre_ff_layernorm.weight"], "whole")
        plan.update(_mamba_sources(f"{p}mamba.", f"{d}mamba.", cfg))
        plan.update(_attention_sources(f"{p}attn.", f"{d}self_attn.", cfg))
        plan.update(_gated_mlp_sources(f"{p}mlp.", f"{d}feed_forward.", cfg.mlp_bias))
        for name, (weight_runs, bias_runs) in scales.items():
            for leaf, runs in (("weight", weight_runs), ("bias", bias_runs)):
                src = plan.get(f"{p}{name}.{leaf}")
                if src is not None and any(v != 1.0 for _, v in runs):
                    src.row_scale = tuple(runs)
        plan[f"{p}mamba.in_proj.weight"].input_multiplier = mup.ssm_in
        plan[f"{p}attn.qkv_proj.weight"].input_multiplier = mup.attention_in
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = Source(["lm_head.weight"], "whole")
    return plan


def _zamba2_plan(cfg: ModelConfig) -> dict[str, Source]:
    """Zamba2. Shared block k is stored once, under the k-th hybrid layer
    (`model.layers.{hybrid[k]}.shared_transformer.*`; the later layers' copies are tied to it and not
    saved; without tie_word_embeddings transformers ties none of them: every hybrid layer then has and
    saves its own, cfg.num_shared_blocks). The adapters of hybrid layer j live inside the block it uses,
    at index j of its adapter lists (`...linear_q_adapter_list.{j}.{0: down, 1: up}`,
    `...gate_up_proj_adapter_list.{j}.*`)."""
    hybrid = [i for i, kind in enumerate(cfg.layer_types) if kind == HYBRID]
    n_shared = cfg.num_shared_blocks  # (one per hybrid layer, stored under it, when not tied)
    bias = ["weight", "bias"] if cfg.mamba.proj_bias else ["weight"]  # add_bias_linear: the MLP too
    plan = {"embed": Source(["model.embed_tokens.weight"], "whole"),
            "final_norm.weight": Source(["model.final_layernorm.weight"], "whole")}
    for k in range(n_shared):
        p, d = f"shared_blocks.{k}.", f"model.layers.{hybrid[k]}.shared_transformer."
        plan[f"{p}input_norm.weight"] = Source([f"{d}input_layernorm.weight"], "whole")
        plan[f"{p}ffn_norm.weight"] = Source([f"{d}pre_ff_layernorm.weight"], "whole")
        plan.update(_attention_sources(f"{p}attn.", f"{d}self_attn.", cfg))
        for leaf in bias:
            for n in ("gate_up_proj", "down_proj"):
                plan[f"{p}mlp.{n}.{leaf}"] = Source([f"{d}feed_forward.{n}.{leaf}"], "whole")
    j = 0
    for i, kind in enumerate(cfg.layer_types):
        p, d = f"layers.{i}.", f"model.layers.{i}."
        if kind == MAMBA:
            plan[f"{p}norm.weight"] = Source([f"{d}input_layernorm.weight"], "whole")
            plan.update(_mamba_sources(f"{p}mixer.", f"{d}mamba.", cfg))
            continue
        plan[f"{p}norm.weight"] = Source([f"{d}mamba_decoder.input_layernorm.weight"], "whole")
        plan.update(_mamba_sources(f"{p}mixer.", f"{d}mamba_decoder.mamba.", cfg))
        plan[f"{p}linear.weight"] = Source([f"{d}linear.weight"], "whole")
        src = f"model.layers.{hybrid[j % n_shared]}.shared_transformer."
        if cfg.shared_blocks.attention_adapters:
            lists = [f"{src}self_attn.linear_{n}_adapter_list.{j}" for n in "qkv"]
            plan[f"{p}qkv_adapter.down"] = Source([f"{a}.0.weight" for a in lists], "concat")
            plan[f"{p}qkv_adapter.up"] = Source([f"{a}.1.weight" for a in lists], "stack")
        mlp = f"{src}feed_forward.gate_up_proj_adapter_list.{j}"
        plan[f"{p}mlp_adapter.down"] = Source([f"{mlp}.0.weight"], "whole")
        plan[f"{p}mlp_adapter.up"] = Source([f"{mlp}.1.weight"], "stack")
        j += 1
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = Source(["lm_head.weight"], "whole")
    return plan


# transformers' own module names for the released tensor names that its load renames (its conversion_mapping):
# NemotronH's `backbone.` is `model.` and each layer's experts are one stacked tensor a projection; Granite
# 4.0's MoE tensors take the experts' and router's module names. save_pretrained(save_original_format=False)
# writes these names; the layouts are the same ([E, rows, cols] experts).
_IN_MEMORY_RENAMES = {
    "nemotron_h": [(re.compile(r"^backbone\."), "model.")],
    "granitemoehybrid": [
        (re.compile(r"\.block_sparse_moe\.input_linear\.weight$"), ".block_sparse_moe.experts.gate_up_proj"),
        (re.compile(r"\.block_sparse_moe\.output_linear\.weight$"), ".block_sparse_moe.experts.down_proj"),
        (re.compile(r"\.block_sparse_moe\.router\.layer\.weight$"), ".block_sparse_moe.router.weight")],
}
_ONE_EXPERT = re.compile(r"^(.*\.mixer\.experts)\.\d+\.(up_proj|down_proj)\.weight$")


def in_memory_names(plan: dict[str, Source], family: str) -> dict[str, Source]:
    """`plan` with its disk names as transformers' modules name them (_IN_MEMORY_RENAMES); the plan itself
    for a family whose names do not change."""
    renames = _IN_MEMORY_RENAMES.get(family)
    if not renames:
        return plan

    def rename(name: str) -> str:
        for pattern, new in renames:
            name = pattern.sub(new, name)
        return name

    out = {}
    for pname, src in plan.items():
        names = [rename(n) for n in src.disk_names]
        experts = [_ONE_EXPERT.match(n) for n in names] if src.how == "stack" else []
        if experts and all(experts):  # NemotronH's experts, one by one on disk: one stacked tensor in memory
            out[pname] = dataclasses.replace(src, disk_names=[f"{experts[0][1]}.{experts[0][2]}"], how="whole")
        else:
            out[pname] = dataclasses.replace(src, disk_names=names)
    return out


def checkpoint_plan(cfg: ModelConfig, names) -> dict[str, Source]:
    """The tensor plan of a checkpoint holding the tensors `names`: under the released names (tensor_plan), or
    under transformers' in-memory ones (in_memory_names) where the checkpoint has more of those."""
    plan = tensor_plan(cfg)
    other = in_memory_names(plan, cfg.family)
    if other is plan:
        return plan
    names = set(names)

    def found(p: dict[str, Source]) -> int:
        return sum(n in names for src in p.values() for n in src.disk_names)

    return other if found(other) > found(plan) else plan

