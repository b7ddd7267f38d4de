"""The released checkpoints' configs (tests/data/released_configs.json) parse to the shapes their
sources state, and build, at full depth and as few-layer versions, as HybridModel (on the meta
device: no memory, milliseconds) and as transformers' own classes.

`expect` in the table is written out from the sources independently of hybrid.config_parse, so a parser
that reads the wrong key, applies the wrong default or derives a head dim the wrong way fails here.
The few-layer versions (tests/released_shapes.py) are what the GPU test
(tests/gpu/test_released_shapes.py) saves and serves; here they are checked to keep every per-layer
dim, and to come back out of transformers' config serialization as the same shapes.
"""
from __future__ import annotations

import collections
import math

import pytest
import torch

import released_shapes
from hybrid.config import ATTENTION, MAMBA, MLP, MOE, PARALLEL
from hybrid.config_parse import load_config, parse_config
from hybrid.model import HybridModel

ENTRIES = released_shapes.entries()
IDS = [e["name"] for e in ENTRIES]
REQUIRED = {"nemotron-h-8b", "nemotron-h-47b", "nemotron-h-56b", "nemotron-nano-9b-v2", "nemotron-nano-12b-v2",
            "nemotron-3-nano-30b-a3b", "granite-4.0-h-350m", "granite-4.0-h-1b", "granite-4.0-h-tiny",
            "granite-4.0-h-small", "bamba-9b", "falcon-h1-0.5b", "falcon-h1-1.5b", "falcon-h1-7b", "falcon-h1-34b"}


def test_table_is_well_formed():
    table = released_shapes.load_table()
    assert set(IDS) >= REQUIRED and len(IDS) == len(set(IDS))
    for e in ENTRIES:
        assert {"name", "repo", "source", "config", "expect"} <= set(e), e["name"]
        assert e["source"].strip() and isinstance(e.get("cross_checked", []), list)
        assert isinstance(e.get("unconfirmed", {}), dict)
        assert e["config"]["model_type"] in ("nemotron_h", "granitemoehybrid", "bamba", "falcon_h1")
    assert isinstance(table["not_found"], list)


def _kinds(cfg) -> dict[str, int]:
    return dict(collections.Counter(cfg.layer_types))


@pytest.mark.parametrize("e", ENTRIES, ids=IDS)
def test_parses_to_the_stated_shapes(e):
    cfg = parse_config(e["config"])
    x = e["expect"]
    assert cfg.num_layers == x["layers"]
    assert _kinds(cfg) == x["kinds"]
    a, xa = cfg.attention, x["attention"]
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (xa["heads"], xa["kv_heads"], xa["head_dim"])
    assert a.num_heads % a.num_kv_heads == 0  # a GQA group size exists (5, 16, 3, ...)
    assert a.rope_theta == xa["rope_theta"] and a.rotary_dim == xa["rotary_dim"]
    m, xm = cfg.mamba, x["mamba"]
    assert (m.num_heads, m.head_dim, m.n_groups, m.state_size, m.conv_kernel, m.chunk_size) == \
        (xm["heads"], xm["head_dim"], xm["groups"], xm["state"], xm["conv"], xm["chunk"])
    assert m.num_heads % m.n_groups == 0
    assert m.conv_dim == m.num_heads * m.head_dim + 2 * m.n_groups * m.state_size
    if "gate" in xm:
        assert m.gate == xm["gate"]
    assert cfg.intermediate_size == x["mlp_width"]
    if x["moe"] is None:
        assert cfg.moe is None
    else:
        mo, xo = cfg.moe, x["moe"]
        assert (mo.num_experts, mo.top_k, mo.intermediate_size, mo.shared_intermediate_size) == \
            (xo["experts"], xo["top_k"], xo["width"], xo["shared_width"])
        for k in ("n_group", "topk_group", "routed_scaling_factor"):
            if k in xo:
                assert getattr(mo, k) == xo[k], k
    assert cfg.vocab_size == x["vocab"] and cfg.tie_word_embeddings == x["tie"]


def _layer_param_shapes(model: HybridModel, index: int) -> dict[str, tuple]:
    return {n: tuple(p.shape) for n, p in model.layers[index].named_parameters()}


def _first_layer_of(cfg, kind: str) -> int:
    return cfg.layer_types.index(kind)


@pytest.mark.parametrize("e", ENTRIES, ids=IDS)
def test_full_depth_model_builds_on_meta(e):
    cfg = parse_config(e["config"])
    model = HybridModel(cfg)  # parameters are meta tensors until the loader fills them
    assert len(model.layers) == cfg.num_layers
    assert all(p.device.type == "meta" for p in model.parameters())
    m, a, H = cfg.mamba, cfg.attention, cfg.hidden_size
    mixers = model.mamba_mixers()
    assert len(mixers) == len(cfg.mamba_layers)
    shapes = {n: tuple(p.shape) for n, p in mixers[0].named_parameters()}
    # in_proj rows [z: I | xBC: conv_dim | dt: nh] (the HF on-disk layout), depthwise conv over conv_dim
    assert (m.intermediate_size + m.conv_dim + m.num_heads, H) in shapes.values()
    assert (m.conv_dim, m.conv_kernel) in shapes.values() or (m.conv_dim, 1, m.conv_kernel) in shapes.values()
    assert (H, m.intermediate_size) in shapes.values()
    attn_layer = next(mod for mod in model.modules() if type(mod).__name__ == "Attention")
    attn_shapes = {tuple(p.shape) for p in attn_layer.parameters()}
    assert (a.num_heads * a.head_dim, H) in attn_shapes or \
        ((a.num_heads + 2 * a.num_kv_heads) * a.head_dim, H) in attn_shapes
    assert (H, a.num_heads * a.head_dim) in attn_shapes


@pytest.mark.parametrize("e", ENTRIES, ids=IDS)
def test_few_layer_version_keeps_every_per_layer_dim(e):
    full = parse_config(e["config"])
    few_dict = released_shapes.few_layer_config(e)
    few = parse_config(few_dict)
    assert 2 <= few.num_layers <= 4
    assert set(few.layer_types) == set(full.layer_types)  # at least one layer of every kind
    assert few.mamba == full.mamba and few.attention == full.attention and few.moe == full.moe
    assert (few.hidden_size, few.intermediate_size, few.vocab_size) == \
        (full.hidden_size, full.intermediate_size, full.vocab_size)
    full_model, few_model = HybridModel(full), HybridModel(few)
    for kind in set(few.layer_types):
        assert _layer_param_shapes(few_model, _first_layer_of(few, kind)) == \
            _layer_param_shapes(full_model, _first_layer_of(full, kind)), kind


@pytest.mark.parametrize("e", ENTRIES, ids=IDS)
def test_gpu_checkpoint_config_round_trips_through_transformers(e, tmp_path):
    """What tests/gpu/test_released_shapes.py saves: transformers' config class accepts the
    few-layer config, its model has exactly our model's parameter count (built on meta), and the
    config.json it writes (re-spelled the hub's way) parses back to the same shapes."""
    import transformers

    gpu_dict = released_shapes.gpu_config(e)
    ours = parse_config(gpu_dict)
    assert ours.vocab_size == released_shapes.GPU_VOCAB
    assert ours.mamba.dt_limit == (0.0, math.inf) or ours.family == "nemotron_h"
    hf_cfg = released_shapes.hf_config(gpu_dict)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    hf_count = sum(p.numel() for p in hf_model.parameters())  # tied lm_head counted once
    hf_count += sum(b.numel() for mod in hf_model.modules() for n, b in mod._buffers.items()
                    if b is not None and n not in mod._non_persistent_buffers_set)  # e_score_correction_bias
    our_count = sum(p.numel() for p in HybridModel(ours).parameters())
    assert hf_count == our_count
    hf_cfg.save_pretrained(str(tmp_path))
    import json

    saved = json.loads((tmp_path / "config.json").read_text(), object_hook=released_shapes.decode_float_tags)
    released_shapes.hubify(saved)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    back = load_config(str(tmp_path))
    assert back.layer_types == ours.layer_types
    assert back.mamba == ours.mamba and back.attention == ours.attention and back.moe == ours.moe
    assert (back.hidden_size, back.intermediate_size, back.vocab_size, back.tie_word_embeddings) == \
        (ours.hidden_size, ours.intermediate_size, ours.vocab_size, ours.tie_word_embeddings)


def test_kinds_cover_every_family_layer():
    seen = set()
    for e in ENTRIES:
        seen |= set(parse_config(e["config"]).layer_types)
    assert seen == {MAMBA, ATTENTION, MLP, MOE, PARALLEL}
