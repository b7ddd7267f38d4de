"""The released checkpoints' shapes (tests/data/released_configs.json) and few-layer versions of them.

The table holds, per released checkpoint, the config.json keys that shape a kernel, where they were
read, and what was assumed (see its "about"). This module turns an entry into

* `few_layer_config(entry)`: the same config.json with 2-3 layers, at least one of each layer kind
  the checkpoint has (every per-layer dim unchanged; Zamba2: a Mamba layer and one hybrid layer per
  shared block, so every shared block and its adapters are built);
* `build_checkpoint(entry, path)`: that few-layer model built with transformers' own classes,
  weights re-drawn like tests/tiny_checkpoints.py does (no neutral defaults, unit-scale activations,
  spread-out logits) and saved with `save_pretrained` in the real on-disk format, config.json
  rewritten to the hub's spelling (NemotronH pattern string, Granite's and Zamba2's legacy layer-type
  names, Zamba2's rope_theta);
* `cpu_config(entry)` (Zamba2): that checkpoint's config with the widths cut to CPU size, every
  structural choice kept (for the CPU check in tests/test_released_configs.py).

The saved checkpoints differ from the released ones only where no kernel is shaped:
- vocab is cut to `GPU_VOCAB` (4096): it sizes the embedding and lm_head GEMMs only, not the Mamba
  or attention kernels; bos / eos / pad become 1 / 2 / 0;
- `time_step_limit` is (0, inf), and Zamba2's dt (whose prefill clamps from `time_step_min`
  upwards, whatever the limit) and NemotronH's are drawn well above `time_step_min`, so prefill and
  decode compute one function (no dt clamp) and a teacher-forced check is well-posed;
- Falcon-H1's muP multipliers are 1.0: they fold into the weights at load time, and with random
  weights the real ones (lm_head 0.0078, attention_out 0.0375 ...) leave near-uniform logits.
"""
from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from tests.tiny_checkpoints import _decode_float_tags as decode_float_tags
from tests.tiny_checkpoints import _redraw_weights, hubify_zamba2, scale_zamba2_queries

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "released_configs.json")
GPU_VOCAB = 4096
CPU_VOCAB = 256

_FALCON_MULTIPLIERS = ("embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
                       "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")


def load_table(path: str = TABLE_PATH) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)  # Python's json reads the `Infinity` literal hub files use


def entries() -> list[dict[str, Any]]:
    return load_table()["entries"]


def entry(name: str) -> dict[str, Any]:
    for e in entries():
        if e["name"] == name:
            return e
    raise KeyError(name)


def names() -> list[str]:
    return [e["name"] for e in entries()]


# ----------------------------------------------------------------------------------------------
# few-layer configs
# ----------------------------------------------------------------------------------------------


def _first_of_each(seq) -> list:
    out = []
    for x in seq:
        if x not in out:
            out.append(x)
    return out


def few_layer_config(e: dict[str, Any], *, vocab: int | None = None) -> dict[str, Any]:
    """The entry's config.json with one layer of each kind it has, in the order the kinds first
    appear (NemotronH: e.g. "M-*", "ME*"; Granite: mamba, attention; Bamba: mamba, attention;
    Falcon-H1: two parallel layers; Zamba2: mamba, then one hybrid layer per shared block: hybrid
    layer j runs block j % num_mem_blocks, so both blocks of a two-block model are built, each hybrid
    layer with its own adapters). Every per-layer dim is the released one."""
    cfg = copy.deepcopy(e["config"])
    family = cfg["model_type"]
    if family == "nemotron_h":
        pattern = "".join(_first_of_each(cfg["hybrid_override_pattern"]))
        cfg["hybrid_override_pattern"] = pattern
        cfg["num_hidden_layers"] = len(pattern)
    elif family == "granitemoehybrid":
        cfg["layer_types"] = _first_of_each(cfg["layer_types"])
        cfg["num_hidden_layers"] = len(cfg["layer_types"])
    elif family == "bamba":
        cfg["num_hidden_layers"] = 2
        cfg["attn_layer_indices"] = [1]
    elif family == "falcon_h1":
        cfg["num_hidden_layers"] = 2
    elif family == "zamba2":
        mamba = next(t for t in cfg["layers_block_type"] if t != "hybrid")  # as the entry spells it
        types = [mamba] + ["hybrid"] * int(cfg.get("num_mem_blocks", 1))
        cfg["layers_block_type"] = types
        cfg["num_hidden_layers"] = len(types)
        if "hybrid_layer_ids" in cfg:
            cfg["hybrid_layer_ids"] = [i for i, t in enumerate(types) if t == "hybrid"]
    else:
        raise ValueError(f"unknown family {family}")
    if vocab is not None:
        cfg["vocab_size"] = vocab
        cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"] = 1, 2, 0
    return cfg


def gpu_config(e: dict[str, Any]) -> dict[str, Any]:
    """few_layer_config with the GPU test's changes (module docstring): small vocab, no dt clamp
    (Zamba2 ignores time_step_limit: build_checkpoint draws its dt, and NemotronH's, above
    time_step_min instead), Falcon-H1 multipliers at 1."""
    cfg = few_layer_config(e, vocab=GPU_VOCAB)
    cfg["time_step_limit"] = [0.0, math.inf]
    if cfg["model_type"] == "falcon_h1":
        for k in _FALCON_MULTIPLIERS:
            cfg[k] = 1.0
        cfg["mlp_multipliers"] = [1.0, 1.0]
        cfg["ssm_multipliers"] = [1.0] * 5
    return cfg


def cpu_config(e: dict[str, Any]) -> dict[str, Any]:
    """gpu_config with the widths cut to CPU size (Zamba2): hidden 64, 4 attention heads (the
    released KV-head ratio), 8 Mamba heads of 16, state 16, chunk 8, MLP 128, adapter rank 8, vocab
    CPU_VOCAB. The layers, shared blocks, q/k/v adapters, RoPE, Mamba groups, conv width and biases
    stay the released ones: build_checkpoint(e, path, cfg=cpu_config(e)) then runs every step of the
    GPU test's build (transformers' classes, redraw, tying, hub spelling) in seconds on a CPU."""
    cfg = gpu_config(e)
    if cfg["model_type"] != "zamba2":
        raise ValueError(f"cpu_config covers zamba2 only, not {cfg['model_type']}")
    hidden, heads, mamba_heads = 64, 4, 8
    kv = heads * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) // cfg["num_attention_heads"]
    assert kv >= 1 and mamba_heads % cfg.get("mamba_ngroups", 1) == 0, cfg
    cfg.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, n_mamba_heads=mamba_heads,
               mamba_d_state=16, chunk_size=8, intermediate_size=128, adapter_rank=8, vocab_size=CPU_VOCAB)
    expand = cfg.get("mamba_expand", 2)
    derived = {"attention_hidden_size": 2 * hidden, "attention_head_dim": 2 * hidden // heads,
               "mamba_headdim": expand * hidden // mamba_heads, "kv_channels": hidden // heads,
               "num_query_groups": heads, "ffn_hidden_size": cfg["intermediate_size"]}
    cfg.update({k: v for k, v in derived.items() if k in cfg})  # the hub file's derived keys, kept consistent
    return cfg


# ----------------------------------------------------------------------------------------------
# checkpoints in the real HF format
# ----------------------------------------------------------------------------------------------


# the weights are drawn as the tiny checkpoints' are, on the model's device
redraw_weights = _redraw_weights


def hubify(cfg: dict) -> None:
    """transformers 5.x writes NemotronH's layers_block_type, Granite's and Zamba2's new layer-type
    names and Zamba2's rope_parameters; the hub files spell them as the released checkpoints do
    (tests/tiny_checkpoints.hubify_*; the Zamba2 hub files say rope_theta). Also used by
    bench/bench_throughput.py for the shapes it saves."""
    if cfg.get("model_type") == "nemotron_h" and "layers_block_type" in cfg:
        rev = {"mamba": "M", "linear_attention": "M", "moe": "E", "attention": "*", "full_attention": "*", "mlp": "-"}
        types = cfg.pop("layers_block_type")
        cfg["hybrid_override_pattern"] = "".join(rev[t] for t in types)
        cfg["num_hidden_layers"] = len(types)
        cfg.pop("mtp_layers_block_type", None)
    elif cfg.get("model_type") == "granitemoehybrid":
        legacy = {"linear_attention": "mamba", "full_attention": "attention"}
        cfg["layer_types"] = [legacy.get(t, t) for t in cfg["layer_types"]]
    elif cfg.get("model_type") == "zamba2" and "layers_block_type" in cfg:
        hubify_zamba2(cfg)
        rope = cfg.get("rope_parameters")
        if isinstance(rope, dict) and rope.get("rope_type", "default") == "default" and \
                set(rope) <= {"rope_type", "rope_theta"} and "rope_theta" in rope:
            cfg.pop("rope_parameters")
            cfg["rope_theta"] = rope["rope_theta"]


def hf_config(cfg: dict[str, Any]):
    """transformers' own config class for a config.json dict."""
    import transformers

    return transformers.AutoConfig.for_model(**copy.deepcopy(cfg))


def build_checkpoint(e: dict[str, Any], path, *, device: str | torch.device = "cpu", seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16, cfg: dict[str, Any] | None = None) -> Path:
    """Save the entry's few-layer model (gpu_config, or `cfg`: e.g. cpu_config) with transformers'
    classes, random weights, in `dtype` (the released checkpoints are bf16), to `path`."""
    import transformers

    cfg = gpu_config(e) if cfg is None else copy.deepcopy(cfg)
    family = cfg["model_type"]
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg)).to(torch.float32).eval()
    kw: dict[str, Any] = {}
    if family == "nemotron_h":
        # dt far above time_step_min (older transformers releases clamped NemotronH's prefill from it)
        kw = dict(dt_range=(0.03, 0.3), lm_head_std=6.0 / math.sqrt(cfg["hidden_size"]))
    elif family == "granitemoehybrid":
        # embedding x12 and residual branches x0.22 (tests/tiny_checkpoints.build_granite_hybrid),
        # but the final norm sized to the width: tied logits emb @ norm(h) / logits_scaling of std
        # ~4. The tiny CPU checkpoints' final norm x60 gives logits of std ~16 at widths of
        # 768-4096: a model so peaked that bf16 rounding moves its choices by nats, and a +20 logit
        # bias no longer decides between tokens.
        embed_std = 0.03
        kw = dict(embed_std=embed_std, branch_out_scale=60.0,
                  final_norm_scale=4.0 * cfg["logits_scaling"] / (embed_std * math.sqrt(cfg["hidden_size"])))
    elif family == "zamba2":
        # branches x2.5 and queries x0.4 as tests/tiny_checkpoints.build_zamba2, dt far above
        # time_step_min (the prefill clamp never bites), and the embedding sized to the width: the
        # stream starts at the embedding and the logits are tied, so an input token's own logit
        # emb . norm(emb + branches) outgrows the others by ~ embed_std * sqrt(H) / 2.5 standard
        # deviations: at unit scale (the tiny checkpoints, H = 64) 3, at H = 2048 18, a model that
        # only repeats its input. embed_std = 1 / sqrt(H) keeps that at 0.4 for any width, and the
        # final norm x4 gives logits of std ~4.
        embed_std = 1.0 / math.sqrt(cfg["hidden_size"])
        kw = dict(dt_range=(0.03, 0.3), embed_std=embed_std, branch_out_scale=2.5,
                  final_norm_scale=4.0 / (embed_std * math.sqrt(cfg["hidden_size"])))
    redraw_weights(model, seed, **kw)
    if family == "zamba2":
        scale_zamba2_queries(model, 0.4)
    if model.config.tie_word_embeddings:  # the config's value, or the class default if it has none
        model.tie_weights()
    model = model.to(dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    del model
    cfg_path = path / "config.json"
    saved = json.loads(cfg_path.read_text(), object_hook=decode_float_tags)
    hubify(saved)
    cfg_path.write_text(json.dumps(saved, indent=2))
    return path
