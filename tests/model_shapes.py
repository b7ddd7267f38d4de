"""config.json of real-sized models (no weights), for memory-plan arithmetic and GPU startup tests."""

# Nemotron-H-8B's layout and dims (as bench/bench_decode.py's CONFIG): 24 Mamba2 layers, 4 attention
# layers, 97.4 MiB of Mamba state per sequence with a bf16 conv and an fp32 SSM state.
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_H_8B = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072,
    "hidden_size": 4096, "hybrid_override_pattern": NEMOTRON_H_8B_PATTERN,
    "num_hidden_layers": len(NEMOTRON_H_8B_PATTERN),
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
    "mlp_hidden_act": "relu2", "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
    "conv_kernel": 4, "expand": 2, "chunk_size": 128, "mamba_hidden_act": "silu", "use_conv_bias": True,
    "use_bias": False, "mamba_proj_bias": False, "layer_norm_epsilon": 1e-5, "max_position_embeddings": 16384,
    "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0,
    "time_step_limit": [0.0, float("inf")], "residual_in_fp32": False, "rescale_prenorm_residual": True,
    "attention_bias": False, "torch_dtype": "bfloat16",
}

H200_BYTES = 141 * 10**9  # an H200's 141 GB
