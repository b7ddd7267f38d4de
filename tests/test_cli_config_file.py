"""vLLM command habits: `--config FILE` (a YAML file of flags, the command line taking precedence), `-tp`,
`--mamba-cache-dtype` and `--hf-token`."""
from __future__ import annotations

import pytest

from hybrid.cli import engine_kwargs, parse_args
from hybrid.errors import ConfigurationError
from hybrid.llm import _vllm_spellings


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_flags_are_defaults_the_command_line_overrides(tmp_path):
    path = _yaml(tmp_path, "max_num_seqs: 3\nmax-model-len: 4096\nenforce-eager: true\nenable-prefix-caching: true\n"
                           "cuda-graph-sizes: [1, 2]\ncompilation-config: {cudagraph_mode: PIECEWISE}\n"
                           "speculative_config:\n  method: ngram\n  num_speculative_tokens: 3\n")
    args = parse_args(["generate", "--prompt", "x", "--config", path, "--max-num-seqs", "5",
                       "--no-enable-prefix-caching"])
    assert args.max_num_seqs == 5 and args.max_model_len == 4096 and args.enforce_eager
    assert args.enable_prefix_caching is False and args.cuda_graph_sizes == [1, 2]
    assert args.compilation_config == {"cudagraph_mode": "PIECEWISE"}
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    kw = engine_kwargs(args)
    assert kw["max_num_seqs"] == 5 and kw["enforce_eager"] and kw["cuda_graph_sizes"] == [1, 2]
    # without the file: the parser's own defaults (set_defaults went to that parser only)
    plain = parse_args(["generate", "--prompt", "x"])
    assert plain.max_num_seqs is None and not plain.enforce_eager and plain.cuda_graph_sizes is None


def test_config_file_false_and_null(tmp_path):
    path = _yaml(tmp_path, "enable-prefix-caching: false\nenforce-eager: false\nmax-model-len: null\n")
    args = parse_args(["generate", "--prompt", "x", "--enable-prefix-caching", f"--config={path}"])
    assert args.enable_prefix_caching is True and not args.enforce_eager and args.max_model_len is None
    args = parse_args(["generate", "--prompt", "x", "--config", path])
    assert args.enable_prefix_caching is False


@pytest.mark.parametrize("text, message", [("max-num-sequences: 4\n", "unrecognized arguments: --max-num-sequences"),
                                           ("- 1\n- 2\n", "expected a mapping"),
                                           ("max-num-seqs: [\n", "config")])
def test_a_bad_config_file_is_an_error_naming_it(tmp_path, capsys, text, message):
    path = _yaml(tmp_path, text)
    with pytest.raises(SystemExit):
        parse_args(["generate", "--prompt", "x", "--config", path])
    assert message in capsys.readouterr().err


def test_a_missing_config_file_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["generate", "--prompt", "x", "--config", str(tmp_path / "none.yaml")])
    assert "none.yaml" in capsys.readouterr().err


def test_tp_and_hf_token_spellings():
    assert parse_args(["generate", "--prompt", "x", "-tp", "2"]).tensor_parallel_size == 2
    assert parse_args(["generate", "--prompt", "x", "--hf-token"]).hf_token is True
    assert parse_args(["generate", "--prompt", "x", "--hf-token", "abc"]).hf_token == "abc"


def test_mamba_cache_dtype_sets_the_ssm_states_dtype():
    kw = engine_kwargs(parse_args(["generate", "--prompt", "x", "--mamba-cache-dtype", "bfloat16"]))
    assert kw["mamba_ssm_dtype"] == "bfloat16"
    kw = engine_kwargs(parse_args(["generate", "--prompt", "x", "--mamba-cache-dtype", "bfloat16",
                                   "--mamba-ssm-cache-dtype", "float32"]))
    assert kw["mamba_ssm_dtype"] == "float32"  # the SSM state's own flag wins, as in vLLM
    assert "mamba_ssm_dtype" not in engine_kwargs(parse_args(["generate", "--prompt", "x"]))
    # LLM's keyword: the same rule
    assert _vllm_spellings("float32", None, 16, None, "bfloat16")[0] == "bfloat16"
    assert _vllm_spellings("float32", "float32", 16, None, "bfloat16")[0] == "float32"
    assert _vllm_spellings("float32", None, 16, None, "auto")[0] == "float32"
    with pytest.raises(ConfigurationError, match="name one setting"):
        _vllm_spellings("float16", None, 16, None, "bfloat16")


def test_llm_takes_mamba_cache_dtype(tiny_ckpt, make_llm):
    import torch

    llm = make_llm(tiny_ckpt("nemotron_h"), mamba_cache_dtype="bfloat16")
    assert llm.state_pool.ssm_state.dtype == torch.bfloat16


def test_mamba_block_size_is_the_prefix_caches_interval(tiny_ckpt, make_llm):
    kw = engine_kwargs(parse_args(["generate", "--prompt", "x", "--enable-prefix-caching", "--mamba-block-size", "64"]))
    assert kw["prefix_cache_interval"] == 64
    assert "prefix_cache_interval" not in engine_kwargs(parse_args(["generate", "--prompt", "x"]))
    llm = make_llm(tiny_ckpt("nemotron_h"), enable_prefix_caching=True, mamba_block_size=32, page_size=16)
    assert llm.engine_config.cache.prefix_cache_interval == 32
    with pytest.raises(ConfigurationError, match="name one setting"):
        make_llm(tiny_ckpt("nemotron_h"), mamba_block_size=32, prefix_cache_interval=48)
    for bad in (0, -16, "64"):
        with pytest.raises(ConfigurationError, match="mamba_block_size must be an integer >= 1"):
            make_llm(tiny_ckpt("nemotron_h"), mamba_block_size=bad)
