"""The released checkpoints' configs (tests/data/released_configs.json) parse to the shapes their
sources state, and build, at full depth and as few-layer versions, as HybridModel (on the meta
device: no memory, milliseconds) and as transformers' own classes; the Zamba2 entries' few-layer
checkpoints are also built at CPU size and served by hybrid.LLM on the CPU against transformers.

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
from hybrid.config import ATTENTION, HYBRID, MAMBA, MLP, MOE, PARALLEL
from hybrid.config_parse import load_config, parse_config
from hybrid.model import HybridModel

ENTRIES = released_shapes.entries()
IDS = [e["name"] for e in ENTRIES]
REQUIRED = {"nemotron-h-8b", "nemotron-h-47b", "nemotron-h-56b", "nemotron-nano-9b-v2", "nemotron-nano-12b-v2",
            "nemotron-3-nano-30b-a3b", "granite-4.0-h-350m", "granite-4.0-h-1b", "granite-4.0-h-tiny",
            "granite-4.0-h-small", "bamba-9b", "falcon-h1-0.5b", "falcon-h1-1.5b", "falcon-h1-7b", "falcon-h1-34b",
            "zamba2-1.2b", "zamba2-2.7b", "zamba2-7b"}
ZAMBA2 = [e for e in ENTRIES if e["config"]["model_type"] == "zamba2"]


def test_table_is_well_formed():
    table = released_shapes.load_table()
    assert set(IDS) >= REQUIRED and len(IDS) == len(set(IDS))
    for e in ENTRIES:
        assert {"name", "repo", "source", "config", "expect"} <= set(e), e["name"]
        assert e["source"].strip() and isinstance(e.get("cross_checked", []), list)
        assert isinstance(e.get("unconfirmed", {}), dict)
        assert e["config"]["model_type"] in ("nemotron_h", "granitemoehybrid", "bamba", "falcon_h1", "zamba2")
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
    if "scale" in xa:  # Zamba2: (head_dim / 2)^-0.5, its heads being 2H / heads wide
        assert math.isclose(a.scale, xa["scale"], rel_tol=1e-12)
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
        for k in ("n_group", "topk_group", "routed_scaling_factor", "latent_size"):  # latent: Nemotron 3 Super
            if k in xo:
                assert getattr(mo, k) == xo[k], k
    assert cfg.vocab_size == x["vocab"] and cfg.tie_word_embeddings == x["tie"]
    if "shared" in x:  # Zamba2's shared transformer blocks
        sb, xs = cfg.shared_blocks, x["shared"]
        assert (sb.num_mem_blocks, sb.adapter_rank, sb.attention_adapters) == \
            (xs["blocks"], xs["adapter_rank"], xs["attention_adapters"])
        assert [i for i, t in enumerate(cfg.layer_types) if t == HYBRID] == xs["hybrid_layers"]
        assert cfg.attention_layers == xs["hybrid_layers"]  # one KV cache per hybrid layer


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
    W = e["expect"]["attention"].get("in_width", H)  # Zamba2 attends over cat(h, embeddings): 2H
    assert (a.num_heads * a.head_dim, W) in attn_shapes or \
        ((a.num_heads + 2 * a.num_kv_heads) * a.head_dim, W) in attn_shapes
    assert (H, a.num_heads * a.head_dim) in attn_shapes
    if "shared" in e["expect"]:
        xs, n_hybrid = e["expect"]["shared"], len(e["expect"]["shared"]["hybrid_layers"])
        assert len(model.shared_blocks) == min(xs["blocks"], n_hybrid)  # stored once, not per layer
        assert sum(type(mod).__name__ == "Attention" for mod in model.modules()) == len(model.shared_blocks)
        layer = model.layers[xs["hybrid_layers"][0]]
        r, inter = xs["adapter_rank"], e["expect"]["mlp_width"]
        assert (tuple(layer.mlp_adapter.down.shape), tuple(layer.mlp_adapter.up.shape)) == ((r, H), (1, 2 * inter, r))
        if xs["attention_adapters"]:
            q = a.num_heads * a.head_dim
            assert (tuple(layer.qkv_adapter.down.shape), tuple(layer.qkv_adapter.up.shape)) == ((3 * r, W), (3, q, r))
        else:
            assert layer.qkv_adapter is None


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
    if full.shared_blocks is not None:  # Zamba2: every shared block, at the released shapes
        assert few.shared_blocks == full.shared_blocks
        assert len(few_model.shared_blocks) == len(full_model.shared_blocks)
        for fb, b in zip(few_model.shared_blocks, full_model.shared_blocks):
            assert {n: p.shape for n, p in fb.named_parameters()} == {n: p.shape for n, p in b.named_parameters()}


@pytest.mark.parametrize("e", ENTRIES, ids=IDS)
def test_gpu_checkpoint_config_round_trips_through_transformers(e, tmp_path):
    """What tests/gpu/test_released_shapes.py saves: transformers' config class accepts the
    few-layer config, its model has exactly our model's parameter count (built on meta), and the
    config.json it writes (re-spelled the hub's way) parses back to the same shapes."""
    import transformers

    gpu_dict = released_shapes.gpu_config(e)
    ours = parse_config(gpu_dict)
    assert ours.vocab_size == released_shapes.GPU_VOCAB
    # Zamba2 clamps from time_step_min whatever the limit (its dt is drawn above it)
    assert ours.mamba.dt_limit == (0.0, math.inf) or ours.family == "zamba2"
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
    assert back.shared_blocks == ours.shared_blocks and back.mlp_act == ours.mlp_act
    assert (back.hidden_size, back.intermediate_size, back.vocab_size, back.tie_word_embeddings) == \
        (ours.hidden_size, ours.intermediate_size, ours.vocab_size, ours.tie_word_embeddings)
    if ours.family == "zamba2":  # the hub's spelling: legacy "mamba" layers, rope_theta
        assert "linear_attention" not in saved["layers_block_type"] and "rope_parameters" not in saved


def test_kinds_cover_every_family_layer():
    seen = set()
    for e in ENTRIES:
        seen |= set(parse_config(e["config"]).layer_types)
    assert seen == {MAMBA, ATTENTION, MLP, MOE, PARALLEL, HYBRID}


@pytest.mark.parametrize("e", ZAMBA2, ids=[e["name"] for e in ZAMBA2])
def test_zamba2_checkpoint_builds_and_serves_on_cpu(e, tmp_path):
    """The GPU test's checkpoint build (released_shapes.build_checkpoint: transformers' classes, the
    redraw, tying, the hub spelling of config.json) for a Zamba2 entry at CPU size (cpu_config: the
    released layers, shared blocks, adapters, RoPE and Mamba groups, widths cut), loaded by
    hybrid.LLM on the CPU and greedy-decoded token for token as transformers decodes it."""
    import json

    import hf_oracle
    from hybrid import LLM, SamplingParams

    cfg = released_shapes.cpu_config(e)
    path = released_shapes.build_checkpoint(e, tmp_path / "ckpt", dtype=torch.float32, cfg=cfg,
                                            seed=11 + released_shapes.names().index(e["name"]))
    saved = json.loads((path / "config.json").read_text())
    assert saved["layers_block_type"] == cfg["layers_block_type"] and "rope_parameters" not in saved
    ours = load_config(str(path))
    full = parse_config(e["config"])
    assert set(ours.layer_types) == set(full.layer_types)
    assert (ours.shared_blocks.num_mem_blocks, ours.shared_blocks.attention_adapters) == \
        (full.shared_blocks.num_mem_blocks, full.shared_blocks.attention_adapters)
    assert (ours.attention.rotary_dim > 0) == (full.attention.rotary_dim > 0)
    assert ours.mamba.n_groups == full.mamba.n_groups and ours.attention.num_heads % ours.attention.num_kv_heads == 0
    prompts = hf_oracle.select_prompts(path, lengths=(1, 11, 21), max_new_tokens=8)
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=3, max_num_batched_tokens=16)
    assert len(llm.model.shared_blocks) == len(ours.layer_types) - 1  # one per hybrid layer here
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(list(prompts.values()), sp, use_tqdm=False)]
    for p, g in zip(prompts.values(), got):
        bad = hf_oracle.describe_divergence(hf_oracle.oracle_run(path, p, 8), g)
        assert bad is None, bad
