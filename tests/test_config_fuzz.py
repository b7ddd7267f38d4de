"""Config variants where the runtime once diverged from transformers, plus a few representative ones.

Each case is a tiny checkpoint built with transformers' own classes from an explicit config (written
out here, not drawn, so the cases do not move when tests/config_fuzz.py's sampler changes), saved in
the real format and served by hybrid.LLM on the CPU in fp32; greedy tokens, the top-5 logprobs of
every generated token and the prompt logprobs must match transformers' greedy generate and its
no-cache forward (tests/config_fuzz.run_case; "noisy": off by more than 1e-4 but no further from an
fp64 transformers run than transformers' own fp32 run is). tests/config_fuzz.py draws hundreds of
such variants at random (a script run by hand); these are the ones it found bugs with:

- hidden_act (Bamba, Granite, Falcon-H1) / mamba_hidden_act (NemotronH) other than silu: transformers
  applies it after the Mamba causal conv, too (we always used silu);
- NemotronH tie_word_embeddings true: transformers' NemotronH ties nothing (we used the embeddings);
- a tied checkpoint that stores an lm_head.weight of its own: transformers does not tie it then;
- mlp_bias (NemotronH '-' layers and shared experts, Bamba, Falcon-H1) and Falcon-H1 projectors_bias
  != mamba_proj_bias: refused (an "unexpected tensor" error, or "not supported") though transformers
  implements them;
- Bamba partial RoPE with an odd rotary dim (head_dim 6 * 0.5): transformers rotates one dim more
  (a crash here); Granite / Falcon-H1 partial_rotary_factor: transformers' RoPE ignores it;
- Zamba2 tie_word_embeddings false: transformers ties no shared block either, every hybrid layer has
  its own (refused: "unexpected tensor");
- Granite shared_intermediate_size 0 (refused), conv_kernel 1 (a crash);
- keys left out of config.json meaning something else than transformers' defaults (also checked key by
  key, without building models, in tests/test_config_defaults.py).
"""
from __future__ import annotations

import pytest
import torch

import config_fuzz

torch.set_num_threads(1)

_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 512}

BASE = {
    "nemotron_h": dict(_IDS, vocab_size=128, hidden_size=48, hybrid_override_pattern="M*-E",
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
                       mamba_num_heads=6, mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4,
                       chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                       moe_intermediate_size=16, moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5,
                       tie_word_embeddings=False),
    "granitemoehybrid": dict(_IDS, vocab_size=160, hidden_size=48, num_hidden_layers=4,
                             layer_types=["mamba", "attention", "mamba", "mamba"], num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=16, shared_intermediate_size=64,
                             num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=6, mamba_n_groups=2,
                             mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
                             embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 16,
                             logits_scaling=8.0, position_embedding_type="nope", tie_word_embeddings=True),
    "bamba": dict(_IDS, vocab_size=200, hidden_size=48, num_hidden_layers=4, attn_layer_indices=[1],
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, mamba_n_heads=6,
                  mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
                  time_step_limit=(0.0, 0.15), tie_word_embeddings=False),
    "falcon_h1": dict(_IDS, vocab_size=160, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_d_ssm=96, mamba_n_heads=6,
                      mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, embedding_multiplier=1.7,
                      lm_head_multiplier=0.8, key_multiplier=0.7, ssm_multipliers=[0.9, 1.1, 0.8, 1.25, 0.7],
                      mlp_multipliers=[1.2, 0.75], tie_word_embeddings=False),
    "zamba2": dict(_IDS, vocab_size=128, hidden_size=48, num_hidden_layers=5,
                   layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"], num_attention_heads=4,
                   num_key_value_heads=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2,
                   n_mamba_heads=6, chunk_size=8, intermediate_size=64, num_mem_blocks=2,
                   use_shared_attention_adapter=True, adapter_rank=4, tie_word_embeddings=True),
}

# (id, family, overrides of BASE[family]; "_..." keys: what config_fuzz.build does after save_pretrained)
CASES = [
    # representative variants of each family
    ("nemotron-base", "nemotron_h", {}),
    ("granite-moe-base", "granitemoehybrid", {}),
    ("bamba-base", "bamba", {"_budget": 5}),
    ("falcon-h1-base", "falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": False}),
    ("zamba2-base", "zamba2", {"use_mem_rope": True}),
    # the Mamba conv activation is the config's, not always silu
    ("bamba-gelu", "bamba", {"hidden_act": "gelu"}),
    ("granite-gelu-tanh", "granitemoehybrid", {"hidden_act": "gelu_pytorch_tanh"}),
    ("falcon-h1-gelu-new", "falcon_h1", {"hidden_act": "gelu_new"}),
    ("nemotron-mamba-gelu", "nemotron_h", {"mamba_hidden_act": "gelu", "mlp_hidden_act": "relu"}),
    # tying as transformers does it
    ("nemotron-tied-config", "nemotron_h", {"tie_word_embeddings": True}),
    ("granite-tied-own-head", "granitemoehybrid", {"_own_lm_head": True}),
    ("zamba2-untied-blocks", "zamba2", {"tie_word_embeddings": False, "num_mem_blocks": 2}),
    # biases transformers implements
    ("nemotron-mlp-bias", "nemotron_h", {"mlp_bias": True, "hybrid_override_pattern": "M-E*"}),
    ("bamba-mlp-bias", "bamba", {"mlp_bias": True, "attention_bias": True, "mamba_proj_bias": True}),
    ("falcon-h1-biases", "falcon_h1", {"mlp_bias": True, "projectors_bias": True, "mamba_proj_bias": False,
                                       "attention_bias": True}),
    # RoPE widths
    ("bamba-odd-rotary", "bamba", {"num_attention_heads": 8, "num_key_value_heads": 2, "_budget": 5}),
    ("bamba-quarter-rotary", "bamba", {"head_dim": 12, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                          "partial_rotary_factor": 0.25}}),
    ("granite-rope-partial-ignored", "granitemoehybrid", {
        "position_embedding_type": "rope",
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}}),
    # sizes transformers accepts
    ("granite-no-shared-mlp", "granitemoehybrid", {"shared_intermediate_size": 0}),
    ("nemotron-conv-kernel-1", "nemotron_h", {"conv_kernel": 1, "_budget": 5}),
    # config.json without the keys whose value is transformers' default, and hub spellings
    ("granite-defaults-left-out", "granitemoehybrid", {
        "attention_multiplier": 1.0, "num_local_experts": 8, "num_experts_per_tok": 2, "mamba_d_state": 256,
        "tie_word_embeddings": False, "_drop_defaults": True}),
    ("nemotron-hub-legacy-keys", "nemotron_h", {"num_attention_heads": 16, "num_key_value_heads": 8,
                                                "head_dim": 128, "_hub": True, "_drop_defaults": True}),
]


@pytest.mark.parametrize("family, overrides", [pytest.param(f, o, id=i) for i, f, o in CASES])
def test_variant_matches_transformers(family, overrides, tmp_path):
    cfg = dict(BASE[family], **overrides)
    res = config_fuzz.run_case(family, cfg, seed=7, workdir=tmp_path)
    assert res["status"] in ("ok", "noisy"), res
    assert res["steps"] >= config_fuzz.MAX_NEW  # some prompts' continuations were compared in full


def test_tied_checkpoint_with_its_own_head_under_tensor_parallelism(tmp_path):
    """The stored head of a tied checkpoint whose lm_head.weight differs from the embeddings (not tied,
    as transformers) is used on every tensor-parallel rank too: tp=2 gives tp=1's tokens and logprobs."""
    from hybrid import LLM, SamplingParams

    cfg = dict(BASE["granitemoehybrid"], _own_lm_head=True)
    path = config_fuzz.build("granitemoehybrid", cfg, tmp_path / "ckpt", seed=7)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = {}
    for tp in (1, 2):
        llm = LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=tp)
        assert llm.model.lm_head is not None  # the stored head, not the embeddings
        outs[tp] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, sp, use_tqdm=False)]
        del llm
    for (t1, l1), (t2, l2) in zip(outs[1], outs[2]):
        assert t1 == t2
        for a, b in zip(l1, l2):
            assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) < 2e-4
