"""Falcon-H1 specifics: its muP multipliers fold into the weights at load time, its three Mamba
gate / norm orders, and clear errors for what is not supported. (Token-for-token parity with
transformers for two Falcon-H1 variants runs in test_hf_parity.py with the other families.)"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

import hf_oracle
from tiny_checkpoints import build_falcon_h1
from hybrid import SamplingParams
from hybrid.config import GATE_ONLY, GATE_THEN_NORM, NORM_THEN_GATE, PARALLEL
from hybrid.config_parse import load_config
from hybrid.errors import CheckpointError

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower


def _disk(path, name):
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


def test_multipliers_fold_into_the_weight_rows(tiny_ckpt, make_llm):
    path = tiny_ckpt("falcon_h1")
    cfg = load_config(path)
    assert cfg.layer_types == (PARALLEL,) * 3 and cfg.mamba.gate == GATE_ONLY
    assert len(cfg.mamba_layers) == len(cfg.attention_layers) == 3
    assert load_config(tiny_ckpt("falcon_h1_norm")).mamba.gate == NORM_THEN_GATE
    mup, m = cfg.mup, cfg.mamba
    model = make_llm(path).model
    block = model.layers[1]
    # in_proj rows: [z | x | B | C | dt] sections, each times its multiplier and the input multiplier
    sizes = [m.intermediate_size, m.intermediate_size, m.n_groups * m.state_size, m.n_groups * m.state_size,
             m.num_heads]
    scale = torch.cat([torch.full((n,), v * mup.ssm_in) for n, v in zip(sizes, mup.ssm_zxbcdt)])
    disk = _disk(path, "model.layers.1.mamba.in_proj.weight")
    assert torch.equal(block.mamba.in_proj.weight, disk * scale[:, None])
    # keys: attention input times key multiplier; queries and values: attention input only
    q = cfg.attention.num_heads * cfg.attention.head_dim
    k_disk = _disk(path, "model.layers.1.self_attn.k_proj.weight")
    kv = k_disk.shape[0]
    assert torch.equal(block.attn.qkv_proj.weight[q:q + kv], k_disk * (mup.attention_in * mup.key))
    assert torch.equal(block.attn.o_proj.weight, _disk(path, "model.layers.1.self_attn.o_proj.weight") * mup.attention_out)
    gate = _disk(path, "model.layers.1.feed_forward.gate_proj.weight")
    assert torch.equal(block.mlp.gate_up_proj.weight[:gate.shape[0]], gate * mup.mlp_gate)
    assert torch.equal(block.mlp.gate_up_proj.weight[gate.shape[0]:], _disk(path, "model.layers.1.feed_forward.up_proj.weight"))
    assert block.mamba.norm_weight is None  # no gated norm in this variant, nothing loaded for it


def test_gate_then_norm_variant_matches_transformers(tmp_path, make_llm):
    """The third gate order (grouped norm of y * silu(z)); the other two are in test_hf_parity."""
    path = str(build_falcon_h1(tmp_path / "f", seed=8, num_layers=2, rms_norm=True, norm_before_gate=False))
    assert load_config(path).mamba.gate == GATE_THEN_NORM
    prompts = [[5, 9, 17, 33, 8, 12, 40, 41, 42, 7, 6], [60]]
    outs = make_llm(path, max_num_batched_tokens=8).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_oracle.oracle_run(path, prompt, 12).tokens


@pytest.mark.parametrize("change, message", [
    ({"mlp_bias": True}, "mlp_bias"),
    ({"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers"),
    ({"mamba_d_ssm": 96}, "mamba_d_ssm"),
    ({"projectors_bias": True}, "projectors_bias"),
])
def test_unsupported_or_inconsistent_config_is_named(tiny_ckpt, tmp_path, change, message):
    path = tmp_path / "bad"
    shutil.copytree(tiny_ckpt("falcon_h1"), path)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(change)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        load_config(str(path))


def test_stored_but_unused_mamba_norm_is_ignored(tiny_ckpt, tmp_path, make_llm):
    """Without mamba_rms_norm, a checkpoint that still stores mamba.norm.weight loads (transformers
    ignores it too) and generates as before."""
    from safetensors.torch import load_file, save_file

    src = tiny_ckpt("falcon_h1")
    path = tmp_path / "extra_norm"
    shutil.copytree(src, path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mamba.norm.weight"] = torch.full((128,), 3.0)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = make_llm(src).generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert make_llm(str(path)).generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids == want
