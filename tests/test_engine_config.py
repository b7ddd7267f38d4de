"""One validated EngineConfig (issue 16 item 4): engine_config(...) takes LLM's keywords, checks
them all and resolves what needs no checkpoint; LLM, the CLI and `hybrid serve` build it through
that one function, and it is passed down LLM -> Engine -> scheduler / resources."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from hybrid import LLM, ConfigurationError, SamplingParams
from hybrid.engine_config import EngineConfig, engine_config
from hybrid.spec_decode import SpeculativeConfig


def test_engine_config_takes_llms_keywords_and_defaults():
    llm_params = inspect.signature(LLM.__init__).parameters
    cfg_params = inspect.signature(engine_config).parameters
    # LLM's keyword-only tail is vLLM's spellings, folded into the settings above before engine_config
    own = [p for p, v in llm_params.items() if p != "self" and v.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert own == list(cfg_params)
    assert [p for p, v in llm_params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY] == [
        "mamba_ssm_cache_dtype", "block_size", "quantization", "trust_remote_code", "enable_chunked_prefill",
        "disable_log_stats", "swap_space", "tokenizer", "revision", "compilation_config", "override_generation_config",
        "max_logprobs", "load_format", "tokenizer_mode", "cpu_offload_gb", "hf_overrides", "enable_lora",
        "disable_custom_all_reduce", "max_seq_len_to_capture", "download_dir", "task", "runner",
        "pipeline_parallel_size", "distributed_executor_backend", "limit_mm_per_prompt", "kv_cache_memory_bytes",
        "optimization_level", "mamba_cache_dtype", "mamba_block_size"]
    for name, p in cfg_params.items():
        assert p.default == llm_params[name].default, name


def test_resolution(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("HYBRID_CHECK_STATE", raising=False)
    cfg = engine_config()
    assert cfg.device == torch.device("cpu") and cfg.dtype == torch.float32
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len) == (None, None, None)
    assert not cfg.sizes_known and not cfg.async_scheduling and not cfg.fused_ops and not cfg.check_state
    assert cfg.cache.mamba_ssm_dtype == torch.float32 and cfg.cache.page_size == 16
    monkeypatch.setenv("HYBRID_CHECK_STATE", "1")
    cfg = engine_config(device="cpu", dtype="bf16", async_scheduling=True, speculative_config={"method": "ngram"},
                        enable_prefix_caching=True, cuda_graph_sizes=[1, 2])
    assert cfg.dtype == torch.bfloat16 and cfg.check_state and cfg.cuda_graph_sizes == (1, 2)
    assert cfg.speculative == SpeculativeConfig() and cfg.num_speculative_tokens == 3
    assert not cfg.async_scheduling  # drafts need the latest tokens on the host
    settled = cfg.with_sizes(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_kv_pages=33)
    assert settled.sizes_known and settled.cache.num_kv_pages == 33 and settled.prefix_cache_slots == 4
    assert dataclasses.replace(settled, cache=dataclasses.replace(settled.cache, prefix_cache_entries=2)) \
        .prefix_cache_slots == 2
    assert engine_config(device="cpu").with_sizes(max_num_seqs=4, max_num_batched_tokens=8,
                                                   max_model_len=9).prefix_cache_slots == 0


@pytest.mark.parametrize("kw, what", [
    (dict(page_size=0), "page_size"), (dict(max_num_seqs=0), "max_num_seqs"), (dict(max_model_len=1), "max_model_len"),
    (dict(num_kv_pages=1), "num_kv_pages"), (dict(seed=1.5), "seed"), (dict(gpu_memory_utilization=0), "gpu_memory"),
    (dict(mamba_decode_kernels="x"), "mamba_decode_kernels"), (dict(speculative_config={"method": "eagle"}), "eagle"),
    (dict(dtype="int3"), "dtype"), (dict(mamba_ssm_dtype="int3"), "mamba_ssm_dtype"), (dict(device="tpu"), "tpu"),
    (dict(enable_prefix_caching=True, prefix_cache_entries=0), "prefix_cache_entries"),
    (dict(cuda_graph_sizes=4), "cuda_graph_sizes"),
])
def test_bad_arguments_fail_before_anything_loads(kw, what):
    with pytest.raises(ConfigurationError, match=what):
        engine_config(**kw)
    with pytest.raises(ConfigurationError, match=what):
        LLM("/nonexistent", **kw)  # checked before the checkpoint is looked for


def test_llm_from_engine_config_is_llm():
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    a = LLM(device="cpu", max_num_seqs=3, max_num_batched_tokens=32, max_model_len=128)
    b = LLM.from_engine_config(engine_config(device="cpu", max_num_seqs=3, max_num_batched_tokens=32,
                                             max_model_len=128))
    assert a.engine_config == b.engine_config and a.engine.config is a.engine_config
    assert a.engine_config.sizes_known and a.engine_config.cache.num_kv_pages == a.kv_cache.num_pages
    assert a.generate("In the beginning", greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        b.generate("In the beginning", greedy, use_tqdm=False)[0].outputs[0].token_ids
    # passed down: the scheduler and the resources read the same config
    eng = a.engine
    assert (eng.scheduler.max_num_seqs, eng.scheduler.max_num_batched_tokens, eng.scheduler.max_model_len) == (3, 32, 128)
    eng.max_num_seqs = 1  # the admission cap (bench_serving lowers it): the scheduler's
    assert eng.scheduler.max_num_seqs == 1 and eng.max_num_seqs == 1


def test_the_engine_needs_settled_sizes():
    from hybrid.engine import Engine

    llm = LLM(device="cpu", max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match="sizes settled"):
        Engine(llm.runner, llm.state_pool, llm.kv_cache, engine_config(device="cpu"), vocab_size=llm.config.vocab_size,
               eos_token_ids=set())
    assert isinstance(llm.engine_config, EngineConfig)
