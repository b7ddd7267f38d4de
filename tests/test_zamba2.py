"""Zamba2 specifics: the shared blocks are stored once and their adapters are not folded into them,
each hybrid layer has its own KV cache and every layer its Mamba state, and clear errors for configs
transformers cannot run either. (Token-for-token and logprob parity with transformers for two Zamba2
variants runs in test_hf_parity.py with the other families.)"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

import hf_oracle
from hybrid import SamplingParams
from hybrid.config import HYBRID, MAMBA
from hybrid.config_parse import load_config
from hybrid.errors import CheckpointError

torch.set_num_threads(1)


def test_layers_caches_and_shared_weights(tiny_ckpt, make_llm):
    path = tiny_ckpt("zamba2")
    cfg = load_config(path)
    assert cfg.layer_types == (HYBRID, MAMBA, HYBRID, MAMBA, MAMBA, HYBRID)
    assert len(cfg.mamba_layers) == 6 and len(cfg.attention_layers) == 3  # one KV cache per hybrid layer
    a = cfg.attention
    assert a.head_dim == 2 * cfg.hidden_size // a.num_heads and a.scale == (a.head_dim / 2) ** -0.5
    assert cfg.mamba.dt_limit == (1e-3, float("inf")) and cfg.mamba.norm_eps == 1e-5
    llm = make_llm(path)
    model = llm.model
    assert llm.kv_cache is not None
    # 2 shared blocks for 3 hybrid layers: hybrid layers 0 and 2 run the same module
    assert len(model.shared_blocks) == 2
    hybrid = [b for b in model.layers if b.kind == HYBRID]
    assert hybrid[0]._shared[0] is hybrid[2]._shared[0] is model.shared_blocks[0]
    assert hybrid[1]._shared[0] is model.shared_blocks[1]
    assert [b.attn_index for b in hybrid] == [0, 1, 2]
    # the shared weights are named (and held) once, the adapters per layer, as on disk
    names = [n for n, _ in model.named_parameters()]
    assert sum(".attn.qkv_proj.weight" in n for n in names) == 2
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        src = "model.layers.0.shared_transformer."
        q = f.get_tensor(f"{src}self_attn.q_proj.weight")
        assert torch.equal(model.shared_blocks[0].attn.qkv_proj.weight[:q.shape[0]], q)  # not folded
        down = torch.cat([f.get_tensor(f"{src}self_attn.linear_{n}_adapter_list.2.0.weight") for n in "qkv"])
        assert torch.equal(model.layers[5].qkv_adapter.down, down)
        up = f.get_tensor(f"{src}feed_forward.gate_up_proj_adapter_list.2.1.weight")
        assert torch.equal(model.layers[5].mlp_adapter.up[0], up)


def test_rope_variant_config(tiny_ckpt):
    path = tiny_ckpt("zamba2_rope")
    raw = json.load(open(os.path.join(path, "config.json")))
    assert "mamba" in raw["layers_block_type"] and raw["use_mem_rope"] and raw["num_mem_blocks"] == 1
    cfg = load_config(path)
    assert cfg.attention.rotary_dim == cfg.attention.head_dim and cfg.attention.num_kv_heads == 2
    assert cfg.shared_blocks.num_mem_blocks == 1 and not cfg.shared_blocks.attention_adapters
    assert raw["add_bias_linear"] and cfg.mamba.proj_bias  # also the shared MLP's biases (see the loader)


def test_prefill_and_decode_agree_after_recycling(tiny_ckpt, prompts_for, make_llm):
    """A slot and KV pages reused by a second round of requests give the same tokens (no state leaks
    through the shared blocks' per-layer caches)."""
    name = "zamba2_rope"
    path = tiny_ckpt(name)
    prompts = [prompts_for(name)[n] for n in (5, 17)]
    llm = make_llm(path, max_num_seqs=2, max_num_batched_tokens=7)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params, use_tqdm=False)]
    assert first == second[::-1]
    assert first == [hf_oracle.oracle_run(path, p, 32).tokens[:12] for p in prompts]


def _with_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    p = os.path.join(dst, "config.json")
    cfg = json.load(open(p))
    cfg.update(changes)
    json.dump(cfg, open(p, "w"))
    return str(dst)


@pytest.mark.parametrize("changes, message", [
    ({"num_key_value_heads": 2}, "use_shared_attention_adapter needs num_key_value_heads"),
    ({"layers_block_type": ["mamba", "attention"]}, "unknown layer types"),
    ({"num_hidden_layers": 7}, "layer types for 7 layers"),
    ({"num_attention_heads": 5}, "must be a multiple of num_attention_heads"),
    ({"n_mamba_heads": 3}, "must be a multiple of n_mamba_heads"),
])
def test_bad_configs(tiny_ckpt, tmp_path, changes, message):
    path = _with_config(tiny_ckpt("zamba2"), tmp_path / "bad", **changes)
    with pytest.raises(CheckpointError, match=message):
        load_config(path)
