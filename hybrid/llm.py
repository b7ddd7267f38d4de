"""The offline generation API, shaped like vLLM's `LLM`."""
from __future__ import annotations

import itertools
import logging
import os
import time

import torch

from attention.backend import select_backend
from attention.kv_cache import PagedKVCache
from graphs.padding import default_capture_sizes
from graphs.piecewise import default_piecewise_max_tokens
from graphs.runner import ModelRunner
from hybrid.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from hybrid.chat_template import reserved_template_kwargs
from hybrid.config_parse import load_config
from hybrid.engine import Engine
from hybrid.engine_config import (  # re-exported: the sizing API is known from here
    CPU_MAX_MODEL_LEN, CPU_MAX_NUM_BATCHED_TOKENS, CPU_MAX_NUM_SEQS, CUDA_MAX_NUM_BATCHED_TOKENS, CUDA_MAX_NUM_SEQS,
    MIN_DEFAULT_BATCHED_TOKENS, EngineConfig, EngineSizes, _check_int, default_sizes, engine_config,
    fit_max_model_len, plan_cuda_sizes, resolve_device, smaller_sizes, with_compilation_config,
)
from hybrid.errors import CapacityError, ConfigurationError, InvalidRequestError, RequestFailedError
from hybrid.kv_cache_dtype import kv_cache_dtype_note
from hybrid.loader import load_model
from hybrid.model import ForwardContext, use_fused_ops
from hybrid.model_source import DEFAULT_MODEL_DIR, cached_snapshot, parse_repo_id, resolve_model
from hybrid.outputs import Logprob, RequestOutput
from hybrid.inputs import prompt_ids
from hybrid.request import check_cache_salt
from hybrid.sampling import SamplingParams, generation_defaults, generation_overrides
from state_pool.pool import MambaStatePool, StateShapes
from state_pool.util import cdiv

logger = logging.getLogger("hybrid")

__all__ = ["LLM", "DEFAULT_MODEL_DIR", "EngineConfig", "engine_config", "resolve_device", "EngineSizes",
           "default_sizes", "smaller_sizes", "fit_max_model_len", "plan_cuda_sizes", "CPU_MAX_NUM_SEQS",
           "CPU_MAX_NUM_BATCHED_TOKENS", "CPU_MAX_MODEL_LEN", "CUDA_MAX_NUM_SEQS", "CUDA_MAX_NUM_BATCHED_TOKENS",
           "MIN_DEFAULT_BATCHED_TOKENS"]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class StartupPhases:
    """Wall time of each phase of LLM startup, for the log and `LLM.startup_phases` (benchmarks)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def summary(self) -> str:
        total = self._last - self._start
        return f"startup {total:.1f} s: " + ", ".join(f"{name} {t:.1f} s" for name, t in self.seconds.items())


def _no_lora(lora_request) -> None:
    """vLLM's lora_request argument: None (as code written for vLLM often passes it) is accepted."""
    if lora_request is not None:
        raise InvalidRequestError("lora_request: LoRA adapters are not supported by this runtime")


def vllm_engine_settings(model, cuda_graph_sizes, *, revision=None, compilation_config=None, load_format="auto",
                         tokenizer_mode="auto", cpu_offload_gb=0, hf_overrides=None, enable_lora=False,
                         download_dir=None, task="auto", runner="auto", pipeline_parallel_size=1,
                         kv_cache_memory_bytes=None) -> tuple:
    """vLLM's engine settings that code and commands written for vLLM pass (LLM's keywords, the CLI's flags):
    (model, cuda_graph_sizes) with those that have an effect here folded in (a hub repo id's revision, its
    snapshot in `download_dir` (a hub cache), the compilation config's capture sizes); ConfigurationError for a
    value this runtime cannot honour, instead of running without it."""
    if revision is not None and model is not None and "@" not in str(model) and not os.path.isdir(str(model)):
        model = f"{model}@{revision}"  # (resolve_model reads a hub repo id's revision so)
    if download_dir is not None and model is not None and not os.path.isdir(str(model)):
        parsed = parse_repo_id(str(model))
        snapshot = cached_snapshot(*parsed, cache_dir=str(download_dir)) if parsed is not None else None
        if snapshot is not None:  # (otherwise resolve_model looks in the default cache, and says where it looked)
            model = snapshot
    if compilation_config is not None and not isinstance(compilation_config, (dict, int)):
        raise ConfigurationError(f"compilation_config must be a dict (or a level), got {compilation_config!r}")
    if isinstance(compilation_config, dict) and cuda_graph_sizes is None:
        cuda_graph_sizes = compilation_config.get("cudagraph_capture_sizes")
    for name, value, allowed, why in (
            ("load_format", load_format, ("auto", "safetensors"), "weights load from safetensors"),
            ("tokenizer_mode", tokenizer_mode, ("auto", "hf", "slow"), "tokenizer.json is read with tokenizers"),
            ("cpu_offload_gb", cpu_offload_gb, (0,), "weights stay on the device"),
            ("hf_overrides", hf_overrides or None, (None,), "config.json is read as it is"),
            ("enable_lora", enable_lora, (False,), "LoRA adapters are not supported"),
            ("task", task, ("auto", "generate"), "these models generate text (no pooling or embedding task)"),
            ("runner", runner, ("auto", "generate"), "these models generate text (no pooling runner)"),
            ("pipeline_parallel_size", pipeline_parallel_size, (1,),
             "pipeline parallelism is not implemented (tensor_parallel_size shards the model)"),
            ("kv_cache_memory_bytes", kv_cache_memory_bytes, (None,),
             "size the KV cache with gpu_memory_utilization (or num_kv_pages)")):
        if value not in allowed:
            raise ConfigurationError(f"{name}={value!r} is not supported: {why}")
    return model, cuda_graph_sizes


def _vllm_spellings(mamba_ssm_dtype, mamba_ssm_cache_dtype, page_size, block_size, mamba_cache_dtype=None):
    """(mamba_ssm_dtype, page_size) with vLLM's names for them folded in; ConfigurationError when both
    names of one setting are given different values. vLLM's mamba_cache_dtype (the conv and SSM state's) sets the
    SSM state's dtype where mamba_ssm_cache_dtype does not; the conv state keeps the model's dtype."""
    if mamba_ssm_cache_dtype in (None, "auto") and mamba_cache_dtype not in (None, "auto"):
        mamba_ssm_cache_dtype = mamba_cache_dtype
    if mamba_ssm_cache_dtype is not None and mamba_ssm_cache_dtype != "auto":
        if mamba_ssm_dtype not in ("float32", mamba_ssm_cache_dtype):
            raise ConfigurationError(f"mamba_ssm_cache_dtype={mamba_ssm_cache_dtype!r} and mamba_ssm_dtype="
                                     f"{mamba_ssm_dtype!r} name one setting: give one of them")
        mamba_ssm_dtype = mamba_ssm_cache_dtype
    if block_size is not None:
        if page_size not in (16, block_size):
            raise ConfigurationError(f"block_size={block_size} and page_size={page_size} name one setting: give one")
        page_size = block_size
    return mamba_ssm_dtype, page_size


class LLM:
    def __init__(
        self,
        model: str | None = None,  # a checkpoint directory, a cached hub repo id ("owner/name[@rev]"), None: bundled
        device: str = "auto",  # "auto": cuda when available, else cpu
        dtype: str | torch.dtype = "auto",
        max_num_seqs: int | None = None,  # None: 256 on CUDA (fewer if memory is short), 8 on CPU
        page_size: int = 16,
        seed: int | None = 0,  # None: a random seed (unseeded requests differ from run to run)
        max_model_len: int | None = None,  # None: the checkpoint's (CUDA: capped by memory; CPU: at most 4096)
        max_num_batched_tokens: int | None = None,  # None: 8192 on CUDA (fewer if memory is short), 256 on CPU
        num_kv_pages: int | None = None,
        enforce_eager: bool = False,
        mamba_ssm_dtype: str | torch.dtype = "float32",
        speculative_config: dict | None = None,  # {"method": "ngram", "num_speculative_tokens": K, ...}
        check_state: bool | None = None,  # state sanitizer; None: env HYBRID_CHECK_STATE=1 turns it on
        gpu_memory_utilization: float = 0.9,  # CUDA: share of GPU memory for weights, activations, state, KV
        cuda_graph_sizes: list[int] | None = None,  # decode batch sizes captured (default 1, 2, 4, 8k..max_num_seqs)
        mamba_decode_kernels: str = "triton",  # CUDA: our Triton decode/prefill-conv kernels, or "library"
        fused_ops: bool | None = None,  # Triton norms (+ residual add), gated norm, relu2/SwiGLU; None: on for CUDA
        async_scheduling: bool | None = None,  # schedule step N+1 while step N runs; None: on for CUDA
        enable_prefix_caching: bool = False,  # prompts that start like an earlier one skip that prefill
        prefix_cache_entries: int | None = None,  # cached prefixes (each a Mamba slot); None: max_num_seqs
        prefix_cache_interval: int = 0,  # also cache every this many prompt tokens (0: each prompt's end only)
        check_weights: bool = False,  # refuse a checkpoint whose weights hold NaN/Inf (see loader.load_model)
        tensor_parallel_size: int = 1,  # > 1: the model sharded over that many processes (hybrid/parallel/)
        kv_cache_dtype: str = "auto",  # "auto": the model's dtype; "fp8": e4m3 pages (hybrid/kv_cache_dtype.py)
        warmup: bool | None = None,  # throw-away requests at startup (hybrid/warmup.py); None: on for CUDA
        generation_config: str = "auto",  # default sampling: "auto" the checkpoint's, "vllm" none, or a folder's
        scheduling_policy: str = "fcfs",  # "priority": requests by generate(priority=...), lower first
        *,
        # vLLM's spellings, for code written against vLLM (see _vllm_spellings)
        mamba_ssm_cache_dtype: str | None = None,  # = mamba_ssm_dtype ("auto": its default)
        block_size: int | None = None,  # = page_size
        quantization: str | None = None,  # must agree with the checkpoint's (hybrid.quantization)
        trust_remote_code: bool = False,  # no effect: no code from a checkpoint is ever run
        enable_chunked_prefill: bool | None = None,  # no effect: prefill is always chunked
        disable_log_stats: bool = False,  # no effect
        swap_space: float | None = None,  # no effect: a preempted request is recomputed, never swapped to the host
        tokenizer: str | None = None,  # must be the checkpoint itself (model cards repeat the model's name here)
        revision: str | None = None,  # a cached hub repo id's revision (model@revision)
        compilation_config: dict | int | None = None,  # cudagraph_capture_sizes (cuda_graph_sizes), cudagraph_mode
        override_generation_config: dict | None = None,  # sampling defaults over generation_config.json's
        max_logprobs: int | None = None,  # no effect: logprobs of any count are returned
        load_format: str = "auto",  # "auto" / "safetensors" only
        tokenizer_mode: str = "auto",  # "auto" / "hf" / "slow": tokenizer.json read with tokenizers
        cpu_offload_gb: float = 0,  # 0 only: weights stay on the device
        hf_overrides: dict | None = None,  # None / {} only: config.json is read as it is
        enable_lora: bool = False,  # False only: no LoRA adapters
        disable_custom_all_reduce: bool = False,  # no effect
        max_seq_len_to_capture: int | None = None,  # no effect: graphs are captured per context width
        download_dir: str | None = None,  # a hub cache to find a repo id's snapshot in (before the default one)
        task: str = "auto",  # "auto" / "generate" only
        runner: str = "auto",  # "auto" / "generate" only
        pipeline_parallel_size: int = 1,  # 1 only
        distributed_executor_backend: str | None = None,  # no effect: tensor-parallel workers are processes
        limit_mm_per_prompt: dict | None = None,  # no effect: text-only models
        kv_cache_memory_bytes: int | None = None,  # None only: gpu_memory_utilization sizes the KV cache
        optimization_level: int | None = None,  # vLLM's -O0..-O3: the CUDA graphs each implies (NONE, PIECEWISE, both)
        mamba_cache_dtype: str | None = None,  # the SSM state's dtype where mamba_ssm_cache_dtype is not given
        mamba_block_size: int | None = None,  # = prefix_cache_interval: a prompt's Mamba state is cached every N tokens
    ) -> None:
        # Bad arguments are ConfigurationError (a ValueError): the CLI prints them as `error: ...`.
        # engine_config takes the same keywords: the one place they are checked and resolved.
        mamba_ssm_dtype, page_size = _vllm_spellings(mamba_ssm_dtype, mamba_ssm_cache_dtype, page_size, block_size,
                                                     mamba_cache_dtype)
        if mamba_block_size is not None:  # (vLLM's grid of cached Mamba states: this prefix cache's interval)
            _check_int("mamba_block_size", mamba_block_size, 1)
            if prefix_cache_interval not in (0, mamba_block_size):
                raise ConfigurationError(f"mamba_block_size={mamba_block_size!r} and prefix_cache_interval="
                                         f"{prefix_cache_interval!r} name one setting: give one of them")
            prefix_cache_interval = mamba_block_size
        if tokenizer is not None and tokenizer != model and (model is None or os.path.abspath(str(tokenizer))
                                                             != os.path.abspath(str(model))):
            raise ConfigurationError(f"tokenizer={tokenizer!r}: only the checkpoint's own tokenizer is supported "
                                     f"(model={model!r}); leave tokenizer out or give the model's name")
        self._quantization = quantization
        model, cuda_graph_sizes = vllm_engine_settings(
            model, cuda_graph_sizes, revision=revision, compilation_config=compilation_config, load_format=load_format,
            tokenizer_mode=tokenizer_mode, cpu_offload_gb=cpu_offload_gb, hf_overrides=hf_overrides,
            enable_lora=enable_lora, download_dir=download_dir, task=task, runner=runner,
            pipeline_parallel_size=pipeline_parallel_size, kv_cache_memory_bytes=kv_cache_memory_bytes)
        overrides = {} if override_generation_config is None else generation_overrides(override_generation_config)
        self._start(with_compilation_config(engine_config(
            model=model, device=device, dtype=dtype, max_num_seqs=max_num_seqs, page_size=page_size, seed=seed,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, num_kv_pages=num_kv_pages,
            enforce_eager=enforce_eager, mamba_ssm_dtype=mamba_ssm_dtype, speculative_config=speculative_config,
            check_state=check_state, gpu_memory_utilization=gpu_memory_utilization,
            cuda_graph_sizes=cuda_graph_sizes, mamba_decode_kernels=mamba_decode_kernels, fused_ops=fused_ops,
            async_scheduling=async_scheduling, enable_prefix_caching=enable_prefix_caching,
            prefix_cache_entries=prefix_cache_entries, prefix_cache_interval=prefix_cache_interval,
            check_weights=check_weights, tensor_parallel_size=tensor_parallel_size, kv_cache_dtype=kv_cache_dtype,
            warmup=warmup, generation_config=generation_config, scheduling_policy=scheduling_policy),
            compilation_config, optimization_level))
        self.default_sampling.update(overrides)

    @classmethod
    def from_engine_config(cls, config: EngineConfig, quantization: str | None = None) -> "LLM":
        """An LLM for an EngineConfig built by hybrid.engine_config.engine_config (as the CLI does), with LLM's
        `quantization` keyword."""
        llm = cls.__new__(cls)
        llm._quantization = quantization
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        """Load the checkpoint, settle the sizes (device defaults; on CUDA the memory plan) and build
        the state pool, the KV cache, the model runner and the engine. On CUDA the Triton compiles
        after it are logged as warnings (hybrid/ops/compile_watch.py)."""
        from hybrid.ops import compile_watch

        watched = config.device.type == "cuda" and compile_watch.install()
        if watched:
            compile_watch.startup_begins()
        try:
            self._build(config)
        finally:
            if watched:
                compile_watch.startup_ends()

    def _build(self, config: EngineConfig) -> None:
        cache = config.cache
        phases = StartupPhases()
        self.device, self.dtype, self.ssm_dtype = config.device, config.dtype, cache.mamba_ssm_dtype
        # a directory, or a hub repo id found in the local Hugging Face cache (never downloaded)
        source = resolve_model(config.model)
        self.model_dir, self.hf_repo_id = source.path, source.repo_id
        self.config = cfg = load_config(self.model_dir)
        quantize_at_load = False
        if getattr(self, "_quantization", None) is not None:  # (before any weight is read)
            from hybrid.quantization import check_quantization_name, quantizes_at_load

            check_quantization_name(self._quantization, self.model_dir, cfg.raw)
            quantize_at_load = quantizes_at_load(self._quantization, self.model_dir, cfg.raw)
            if quantize_at_load and config.tensor_parallel_size > 1:
                raise ConfigurationError(
                    "quantization='fp8' on a checkpoint that is not quantized (FP8 at load) runs with "
                    "tensor_parallel_size=1; for tensor parallelism make an FP8 checkpoint of it first: "
                    "python -m hybrid.tools.quantize_fp8 SRC DST --format modelopt --per-channel --dynamic")
        self.default_sampling = self._generation_defaults(config.generation_config)
        sizes = default_sizes(self.device.type, cfg.max_position_embeddings, max_num_seqs=config.max_num_seqs,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              max_model_len=config.max_model_len)
        if config.max_model_len is not None and config.max_model_len > cfg.max_position_embeddings:
            logger.warning("max_model_len=%d is longer than the checkpoint's max_position_embeddings=%d: the model "
                           "was not trained on positions past it, and its outputs there may degrade",
                           config.max_model_len, cfg.max_position_embeddings)

        from hybrid.tokenizer import Tokenizer

        self.tokenizer = None
        if os.path.isfile(os.path.join(self.model_dir, "tokenizer.json")):
            self.tokenizer = Tokenizer(self.model_dir, cfg.eos_token_ids)
        eos = set(cfg.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else set())

        # tensor parallelism: the workers are spawned and load their shards while rank 0 (here) loads its
        # own; `local` is the config of one rank's shard (its heads, groups, widths)
        self.parallel = local = None
        if config.tensor_parallel_size > 1:
            from hybrid.parallel.driver import TensorParallel

            self.parallel = TensorParallel(config, self.model_dir, cfg)
            local = self.parallel.local_cfg
            self.model = self.parallel.load_model(load_model, self.model_dir, cfg, self.device, self.dtype,
                                                  progress=self.device.type == "cuda",
                                                  check_finite=config.check_weights)
        else:
            self.model = load_model(self.model_dir, cfg, self.device, self.dtype, progress=self.device.type == "cuda",
                                    check_finite=config.check_weights)
        local = local or cfg
        if quantize_at_load:
            from hybrid.online_fp8 import quantize_model_fp8

            projections, experts = quantize_model_fp8(self.model, self.device, self.dtype)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # (the 16-bit weights' memory, before the memory plan measures)
            logger.info("quantization='fp8': %d projections and %d expert layers quantized to FP8 at load "
                        "(per-channel weight scales, dynamic per-token activations)", projections, experts)
        phases.done("load weights")
        self.kv_dtype = cache.kv_cache_dtype or self.dtype
        kv_note = ""
        if cache.kv_cache_dtype is not None:
            kv_note = kv_cache_dtype_note(self.model, self.model_dir, cfg, cache.kv_cache_dtype)
        m = local.mamba
        shapes = StateShapes(len(cfg.mamba_layers), m.conv_dim, m.conv_kernel - 1, m.num_heads, m.head_dim, m.state_size)
        if config.fused_ops:
            use_fused_ops(self.model)
        backend = select_backend(self.device)
        num_spec, page_size, num_kv_pages = config.num_speculative_tokens, cache.page_size, cache.num_kv_pages
        self.memory_plan = None
        if config.max_model_len is not None:
            max_len_note = "given"
        elif self.device.type == "cuda" or cfg.max_position_embeddings <= CPU_MAX_MODEL_LEN:
            max_len_note = f"config max_position_embeddings={cfg.max_position_embeddings}"
        else:
            max_len_note = f"the CPU default cap; config max_position_embeddings={cfg.max_position_embeddings}"
        if self.device.type == "cuda":
            from graphs.memory import plan_memory
            from hybrid.ops.mamba_cuda import attach_kernels

            if attach_kernels(self.model, config.mamba_decode_kernels) is None and cfg.mamba_layers:
                logger.warning("Mamba layers use the torch path: mamba-ssm / causal-conv1d are not importable, or "
                               "the conv is not the kernels' (a conv activation other than silu, conv_kernel 1)")

            def plan_fn(trial: EngineSizes, probe_len: int):
                kwargs = dict(
                    gpu_memory_utilization=cache.gpu_memory_utilization,
                    max_num_seqs=trial.max_num_seqs, max_model_len=probe_len,
                    max_num_batched_tokens=trial.max_num_batched_tokens, page_size=page_size, kv_dtype=self.kv_dtype,
                    conv_dtype=self.dtype, ssm_dtype=self.ssm_dtype,
                    num_kv_pages=num_kv_pages, use_graphs=not config.enforce_eager,
                    extra_state_slots=cache.prefix_cache_slots(trial.max_num_seqs), num_speculative_tokens=num_spec,
                    cuda_graph_sizes=self._graph_sizes(config, trial.max_num_seqs),
                    piecewise_max_tokens=self._piecewise_max_tokens(config, trial.max_num_batched_tokens),
                    full_graphs=config.full_cuda_graphs)
                if self.parallel is not None:  # the workers profile their shards in step (same collectives)
                    self.parallel.broadcast(("plan", kwargs))
                return plan_memory(self.model, local, device=self.device, attention_backend=backend, **kwargs)

            sizes, plan, capped = plan_cuda_sizes(
                plan_fn, sizes, max_position_embeddings=cfg.max_position_embeddings, page_size=page_size,
                num_kv_pages=num_kv_pages, max_num_seqs_given=config.max_num_seqs is not None,
                max_num_batched_tokens_given=config.max_num_batched_tokens is not None,
                extra_state_slots=cache.prefix_cache_slots, num_speculative_tokens=num_spec)
            if capped:
                max_len_note += f", capped to what the KV cache holds next to {sizes.max_num_seqs} Mamba slots"
            self.memory_plan = plan
            num_kv_pages = plan.num_kv_pages
            logger.info(plan.summary(sizes.max_num_seqs, sizes.max_model_len, page_size))
            phases.done("memory plan")  # its profiling forwards are where first-time kernel compiles land
        self.max_num_seqs = max_num_seqs = sizes.max_num_seqs
        self.max_num_batched_tokens = sizes.max_num_batched_tokens
        self.max_model_len = sizes.max_model_len
        cache_entries = cache.prefix_cache_slots(max_num_seqs)
        self.state_pool = MambaStatePool(shapes, max_num_seqs + cache_entries, self.device, conv_dtype=self.dtype,
                                         ssm_dtype=self.ssm_dtype)
        if num_spec:  # the verify scratch, allocated where the memory plan budgets it: before the KV cache
            self.state_pool.enable_spec_scratch(max_num_seqs, num_spec + 1)
        pages_per_seq = cdiv(self.max_model_len, page_size)
        if num_kv_pages is None:
            num_kv_pages = max_num_seqs * pages_per_seq + 1
        if num_kv_pages - 1 < pages_per_seq and cfg.attention_layers:
            raise CapacityError(
                f"num_kv_pages={num_kv_pages} cannot hold one sequence of max_model_len={self.max_model_len} "
                f"({pages_per_seq} pages of {page_size} tokens plus the dummy page)"
            )
        # the config as the engine runs it: every size settled
        self.engine_config = config = config.with_sizes(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, num_kv_pages=num_kv_pages)
        a = local.attention
        self.kv_cache = PagedKVCache(len(cfg.attention_layers), num_kv_pages, page_size, a.num_kv_heads, a.head_dim,
                                     self.device, self.kv_dtype)
        logger.info(
            "LLM: %s on %s; weights %s, Mamba SSM state %s (conv state %s); max_model_len %d (%s); "
            "max_num_seqs %d (Mamba state slots: %d%s); max_num_batched_tokens %d; KV cache %s",
            self.hf_repo_id or self.model_dir, self.device, _name(self.dtype), _name(self.ssm_dtype), _name(self.dtype),
            self.max_model_len, max_len_note, max_num_seqs, max_num_seqs + cache_entries,
            f", {cache_entries} of them for cached prefixes" if cache_entries else "", self.max_num_batched_tokens,
            f"{num_kv_pages - 1} pages x {page_size} tokens = {(num_kv_pages - 1) * page_size} tokens"
            if cfg.attention_layers else "none (no attention layers)")
        if kv_note and cfg.attention_layers:
            logger.info("%s", kv_note)
        ctx = ForwardContext(self.state_pool, self.kv_cache, backend)
        enforce_eager = config.enforce_eager or self.device.type != "cuda"
        if self.parallel is not None:  # the workers build the same pool, cache and runner on their shards
            self.parallel.instrument(self.state_pool, self.kv_cache)
            # (the ranks run each step's collectives in step: without whole-step graphs, every rank runs eagerly)
            self.parallel.setup_workers(self._worker_setup(num_kv_pages, enforce_eager or not config.full_cuda_graphs))
        phases.done("state pool and KV cache")
        self.runner = ModelRunner(self.model, ctx, enforce_eager=enforce_eager,
                                  max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, page_size=page_size,
                                  cuda_graph_sizes=self._graph_sizes(config, max_num_seqs),
                                  num_speculative_tokens=num_spec,
                                  piecewise_max_tokens=self._piecewise_max_tokens(config, self.max_num_batched_tokens),
                                  full_graphs=config.full_cuda_graphs)
        if self.runner.use_graphs:
            phases.done("CUDA graph capture")
        if self.parallel is not None:
            self.parallel.wait_ready()
            self.runner = self.parallel.wrap_runner(self.runner)
        self.engine = Engine(self.runner, self.state_pool, self.kv_cache, config, vocab_size=cfg.vocab_size,
                             eos_token_ids=eos, tokenizer=self.tokenizer)
        self._ids = itertools.count()
        phases.done("engine")
        if config.warmup:
            from hybrid.warmup import warm_up

            warm_up(self.engine, vocab_size=cfg.vocab_size, max_num_batched_tokens=self.max_num_batched_tokens,
                    max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
                    runner_stats=getattr(self.runner, "stats", None))
            phases.done("warm-up")  # the first-use kernel compiles of the step shapes requests meet
        self.startup_phases = phases.seconds
        logger.info("%s", phases.summary())

    def _piecewise_max_tokens(self, config, max_num_batched_tokens: int) -> int:
        """The largest piecewise-graph bucket (graphs/piecewise.py): none eagerly or under tensor parallelism
        (its ranks would each capture their pieces around collectives; not built), else
        HYBRID_PIECEWISE_MAX_TOKENS (graphs/piecewise.default_piecewise_max_tokens), at most the step token budget."""
        if config.enforce_eager or self.device.type != "cuda" or self.parallel is not None \
                or not config.piecewise_cuda_graphs:
            return 0
        largest = default_piecewise_max_tokens() if config.max_cuda_graph_size is None else config.max_cuda_graph_size
        return min(largest, max_num_batched_tokens)

    @staticmethod
    def _graph_sizes(config, max_num_seqs: int) -> tuple[int, ...] | None:
        """The decode batch sizes the whole-step graphs capture: cuda_graph_sizes (None: the runner's default for
        max_num_seqs), at most compilation_config's max_cudagraph_capture_size."""
        largest = config.max_cuda_graph_size
        if largest is None:
            return config.cuda_graph_sizes
        sizes = config.cuda_graph_sizes or default_capture_sizes(max_num_seqs)
        return tuple(s for s in sizes if s <= largest) or (1,)

    def _worker_setup(self, num_kv_pages: int, enforce_eager: bool):
        """The settled sizes the tensor-parallel workers build their state pool, cache and runner with."""
        from hybrid.parallel.protocol import SetupSpec

        pool, c = self.state_pool, self.engine_config
        scratch = None if pool.spec_conv is None else (pool.spec_conv.shape[1], pool.spec_conv.shape[2])
        return SetupSpec(num_slots=pool.num_slots, conv_dtype=pool.conv_state.dtype, ssm_dtype=pool.ssm_state.dtype,
                         spec_scratch=scratch, num_kv_pages=num_kv_pages, page_size=self.kv_cache.page_size,
                         max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len, enforce_eager=enforce_eager,
                         cuda_graph_sizes=self._graph_sizes(c, self.max_num_seqs))

    @staticmethod
    def _prompt_list(prompts) -> list:
        """One prompt (a string, a list of token ids, or a {"prompt"} / {"prompt_token_ids"} dict) or a
        list of them -> a list of prompts."""
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if prompts and all(isinstance(t, int) for t in prompts):
                return [list(prompts)]  # a single prompt of token ids
            return list(prompts)
        raise InvalidRequestError("prompts must be a string, a list of token ids or a list of those, "
                                  f"got {type(prompts).__name__}")

    def _params_list(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if not isinstance(sampling_params, (list, tuple)) \
                or not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise InvalidRequestError("sampling_params must be a SamplingParams or a list of them, "
                                      f"got {type(sampling_params).__name__}")
        if len(sampling_params) != num_prompts:
            raise InvalidRequestError(f"{num_prompts} prompts but {len(sampling_params)} sampling params")
        return list(sampling_params)

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]] | dict | list[dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string, a list of token ids, or as in
        vLLM {"prompt": text} / {"prompt_token_ids": ids}, with vLLM's "cache_salt" (a string: the prompt shares
        cached prefixes only with prompts of the same salt). Every prompt and every parameter (vocabulary-
        dependent ones too) is validated before anything is queued: an InvalidRequestError leaves
        nothing behind. If some requests fail inside the engine (an exception in their step,
        non-finite logits), the others still run to the end and then RequestFailedError is raised:
        its `failed` maps prompt indexes to the errors, its `outputs` holds every output (the failed
        ones finished with finish_reason "error" and `error` set). EngineDeadError if the device is
        lost (the LLM can then no longer generate). `priority` (with scheduling_policy="priority"): one
        integer per prompt, lower values first (as vLLM's)."""
        _no_lora(lora_request)
        prompts = self._prompt_list(prompts)
        params_list = self._params_list(sampling_params, len(prompts))
        if priority is not None and (not isinstance(priority, (list, tuple)) or len(priority) != len(prompts)):
            raise InvalidRequestError(f"priority must be a list of one integer per prompt ({len(prompts)}), "
                                      f"got {priority!r}")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        prepared = [(text, ids, params, prio, salt) for (text, ids), params, prio, salt
                    in zip(self._validated_prompts(prompts, params_list, priorities), params_list, priorities, salts)]
        return self._run(prepared, use_tqdm)

    def _validated_prompts(self, prompts: list, params_list: list[SamplingParams],
                           priorities: list[int] | None = None) -> list[tuple[str | None, list[int]]]:
        """Each prompt's (text, token ids), every prompt checked with its parameters (and priority) before
        anything is queued; the first problem raises InvalidRequestError naming its prompt's index."""
        validated = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                text, ids = prompt_ids(prompt, self.tokenizer)
                self.engine.validate_request(ids, params)
                if isinstance(prompt, dict):
                    check_cache_salt(prompt.get("cache_salt"))
                if priorities is not None:
                    self.engine.check_priority(priorities[i])
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompt {i}: {e}" if len(prompts) > 1 else str(e)) from None
            validated.append((text, ids))
        return validated

    def _run(self, prepared: list[tuple[str | None, list[int], SamplingParams, int, str | None]],
             use_tqdm: bool) -> list[RequestOutput]:
        """Queue the validated (text, ids, params, priority, cache salt) requests, step until all finish, in order."""
        order = []
        try:
            for text, ids, params, priority, salt in prepared:
                rid = str(next(self._ids))  # ("0", "1", ...: vLLM's LLM numbers its requests so)
                self.engine.add_request(rid, ids, params, prompt=text, output_kind="final", priority=priority,
                                        cache_salt=salt)
                order.append(rid)
        except BaseException:  # (validated above: not expected) never leave part of the batch queued
            for rid in order:
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        wanted = set(order)
        bar = None
        if use_tqdm and len(order) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="Generating", unit="req")
        try:
            while len(results) < len(order):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if not self.engine.has_unfinished_requests() and len(results) < len(order):
                    raise RuntimeError("engine stopped with unfinished requests")
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        outputs = [results[rid] for rid in order]
        self._name_logprob_tokens(outputs)
        failed = {i: out.error for i, out in enumerate(outputs) if out.error is not None}
        if failed:  # the others completed: they come with the error, in e.outputs
            first = next(iter(failed))
            raise RequestFailedError(
                f"{len(failed)} of {len(outputs)} requests failed; prompt {first}: {failed[first]}",
                failed=failed, outputs=outputs)
        return outputs

    def _name_logprob_tokens(self, outputs: list[RequestOutput]) -> None:
        """Each Logprob's decoded_token (vLLM's): the token's text, special tokens kept."""
        if self.tokenizer is None:
            return
        texts: dict[int, str] = {}
        for out in outputs:
            rows = [*(out.prompt_logprobs or ()), *(r for c in out.outputs for r in (c.logprobs or ()))]
            for row in rows:
                for tid, lp in (row or {}).items():
                    if isinstance(lp, Logprob) and lp.decoded_token is None:
                        text = texts.get(tid)
                        if text is None:
                            text = texts[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
                        lp.decoded_token = text

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """Beam search (vLLM's LLM.beam_search; hybrid/beam_search.py): one BeamSearchOutput per prompt (a
        string, token ids or a {"prompt"} / {"prompt_token_ids"} dict), its beam_width best sequences first;
        each sequence's `tokens` and `text` hold the prompt and what follows it. Every step runs the live beams
        through generate: with enable_prefix_caching=True each beam's sequence so far comes from the cache.
        (use_tqdm and concurrency_limit, vLLM's, change nothing: every prompt's beams share each step.)"""
        _no_lora(lora_request)
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise InvalidRequestError(f"concurrency_limit must be an integer >= 1, got {concurrency_limit!r}")
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError("beam_search takes a BeamSearchParams (from hybrid.beam_search)")
        prompts = self._prompt_list(prompts)
        # the whole search checked up front as one request per prompt: its full length, and the steps' logprobs
        whole = SamplingParams(max_tokens=params.max_tokens, logprobs=2 * params.beam_width,
                               temperature=params.temperature, ignore_eos=True)
        ids_list = [ids for _, ids in self._validated_prompts(prompts, [whole] * len(prompts))]
        for i, ids in enumerate(ids_list):  # (generate stops at the context; a beam must fit its max_tokens)
            if len(ids) + params.max_tokens > self.max_model_len:
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                raise InvalidRequestError(f"{where}the prompt's {len(ids)} tokens and max_tokens={params.max_tokens} "
                                          f"exceed max_model_len={self.max_model_len}")
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return beam_search(self, ids_list, params, self.engine.eos_token_ids, decode)

    def _generation_defaults(self, setting: str) -> dict:
        """The sampling defaults of generation_config.json ("auto": the checkpoint's; "vllm": none; a
        folder: its file), as vLLM applies them; logged when there are any."""
        if setting == "vllm":
            return {}
        folder = self.model_dir if setting == "auto" else setting
        path = os.path.join(folder, "generation_config.json")
        if not os.path.isfile(path):
            return {}
        from hybrid.config_fields import read_json

        try:
            defaults = generation_defaults(read_json(path), path)
        except InvalidRequestError as e:
            raise ConfigurationError(f"{e} (generation_config='vllm' ignores the file)") from None
        if defaults:
            logger.info("default sampling from %s: %s (a request's own fields win; generation_config='vllm' "
                        "turns these off)", path, defaults)
        return defaults

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a request without its own gets: the model's generation_config.json
        recommendations (see generation_config), else SamplingParams()'s defaults, as vLLM's."""
        return SamplingParams(**self.default_sampling)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (vLLM's LLM.reset_prefix_cache, e.g. between benchmark runs); False
        while requests run."""
        return self.engine.reset_prefix_cache()

    def _pooling_only(self, name: str):
        raise InvalidRequestError(f"LLM.{name}() needs a pooling or scoring model; this runtime serves generative "
                                  "models only: use generate() or chat()")

    def encode(self, *args, **kwargs):
        """Not served (vLLM's pooling API): raises InvalidRequestError saying so."""
        self._pooling_only("encode")

    def embed(self, *args, **kwargs):
        """Not served (vLLM's pooling API): raises InvalidRequestError saying so."""
        self._pooling_only("embed")

    def classify(self, *args, **kwargs):
        """Not served (vLLM's pooling API): raises InvalidRequestError saying so."""
        self._pooling_only("classify")

    def score(self, *args, **kwargs):
        """Not served (vLLM's scoring API): raises InvalidRequestError saying so."""
        self._pooling_only("score")

    def reward(self, *args, **kwargs):
        """Not served (vLLM's pooling API): raises InvalidRequestError saying so."""
        self._pooling_only("reward")

    def get_tokenizer(self):
        """The checkpoint's tokenizer (hybrid.tokenizer.Tokenizer: encode, decode,
        apply_chat_template, eos_token_ids), or None if the checkpoint has no tokenizer.json."""
        return self.tokenizer

    @property
    def llm_engine(self) -> Engine:
        """The engine (vLLM's name for it): add_request (token ids, a string or a prompt dict), step,
        has_unfinished_requests, abort_request, get_tokenizer, as code driving vLLM's LLMEngine calls them."""
        return self.engine

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        lora_request=None,
        chat_template_content_format: str = "auto",
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list
        of conversations, as vLLM's LLM.chat: each is rendered with the checkpoint's chat template
        (or `chat_template`), with the generation prompt added, tokenized without special tokens
        (the template writes those) and run through generate as one batch. One RequestOutput per
        conversation, in order; its `prompt` is the rendered text. InvalidRequestError if there
        is no tokenizer or chat template, a message is malformed or the template refuses it.
        continue_final_message=True (with add_generation_prompt=False): each reply continues its
        conversation's last message (an assistant message started by the caller) instead of
        starting a new turn; chat_template_kwargs are more template variables (enable_thinking=...);
        tools (OpenAI's [{"type": "function", "function": {...}}]) are rendered by the template, as
        vLLM's LLM.chat does (the calls the model writes are in the output text). vLLM's
        chat_template_content_format: "auto" / "string" (a content list's text parts reach the template joined
        as one string, hybrid.chat_template); mm_processor_kwargs: None / {} (text-only models)."""
        _no_lora(lora_request)
        if chat_template_content_format not in ("auto", "string"):
            raise InvalidRequestError(f"chat_template_content_format={chat_template_content_format!r} is not "
                                      "supported: content reaches the template as a string ('auto' or 'string')")
        if mm_processor_kwargs:
            raise InvalidRequestError("mm_processor_kwargs: these models take text only")
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer.json, so it cannot chat")
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(c, (list, tuple)) for c in messages):
            conversations = list(messages)
        elif isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
            conversations = [messages]
        else:
            raise InvalidRequestError("messages must be a conversation (a non-empty list of {'role', 'content'} "
                                      "dicts) or a list of conversations")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise InvalidRequestError("chat_template_kwargs must be a dict")
        reserved = reserved_template_kwargs(chat_template_kwargs)
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise InvalidRequestError("tools must be a list of tool dicts ({'type': 'function', 'function': {...}})")
        template_vars = dict(chat_template_kwargs or {})
        if tools:
            template_vars["tools"] = tools
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs: {', '.join(reserved)} are arguments of chat itself")
        params_list = self._params_list(sampling_params, len(conversations))
        prepared = []
        for i, (conv, params) in enumerate(zip(conversations, params_list)):
            try:
                text = self.tokenizer.apply_chat_template(
                    conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template, tokenize=False,
                    continue_final_message=continue_final_message, **template_vars)
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if not ids:
                    raise InvalidRequestError("the rendered conversation is empty: at least one token is needed")
                self.engine.validate_request(ids, params)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"conversation {i}: {e}" if len(conversations) > 1 else str(e)) from None
            prepared.append((text, ids, params, 0, None))
        return self._run(prepared, use_tqdm)
