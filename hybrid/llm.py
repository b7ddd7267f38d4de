"""The offline generation API, shaped like vLLM's `LLM`."""
from __future__ import annotations

import itertools
import logging
import os

import torch

from attention.backend import select_backend
from attention.kv_cache import PagedKVCache
from graphs.runner import ModelRunner
from hybrid.config import load_config
from hybrid.engine import Engine
from hybrid.errors import CapacityError, ConfigurationError, InvalidRequestError, RequestFailedError
from hybrid.layers import use_fused_ops
from hybrid.loader import load_model
from hybrid.model import ForwardContext
from hybrid.outputs import RequestOutput
from hybrid.sampling import SamplingParams
from hybrid.spec_decode import SpeculativeConfig
from state_pool.pool import MambaStatePool, StateShapes

logger = logging.getLogger("hybrid")

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _dtype(name: str | torch.dtype, what: str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ConfigurationError(f"unknown {what} '{name}'; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _device(name: str | torch.device) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ConfigurationError(f"unknown device {name!r}: {e}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigurationError(f"device {name!r}: only cpu and cuda are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(f"device {name!r}: CUDA is not available on this machine")
    return device


def _check_int(name: str, value, lo: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ConfigurationError(f"{name} must be an integer >= {lo}, got {value!r}")


class LLM:
    def __init__(
        self,
        model: str | None = None,
        device: str = "cpu",
        dtype: str | torch.dtype = "auto",
        max_num_seqs: int = 8,
        page_size: int = 16,
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 256,
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
    ) -> None:
        self.model_dir = model or DEFAULT_MODEL_DIR
        # Bad arguments are ConfigurationError (a ValueError): the CLI prints them as `error: ...`.
        for name, value in (("max_num_seqs", max_num_seqs), ("page_size", page_size),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            _check_int(name, value, 1)
        _check_int("max_model_len", max_model_len, 2, optional=True)  # a prompt token and a generated one
        _check_int("num_kv_pages", num_kv_pages, 2, optional=True)  # page 0 is the reserved dummy page
        _check_int("prefix_cache_entries", prefix_cache_entries, 0, optional=True)
        _check_int("prefix_cache_interval", prefix_cache_interval, 0)
        if not isinstance(seed, int) or isinstance(seed, bool):  # any int (reduced as sampling seeds are)
            raise ConfigurationError(f"seed must be an integer, got {seed!r}")
        if not isinstance(gpu_memory_utilization, (int, float)) or not 0.0 < gpu_memory_utilization <= 1.0:
            raise ConfigurationError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        if mamba_decode_kernels not in ("triton", "library"):
            raise ConfigurationError(f"mamba_decode_kernels must be 'triton' or 'library', got {mamba_decode_kernels!r}")
        try:
            SpeculativeConfig.from_dict(speculative_config)
        except ValueError as e:
            raise ConfigurationError(str(e)) from None
        self.device = _device(device)
        if dtype == "auto":  # bf16 end to end on GPU, fp32 on CPU
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = _dtype(dtype, "dtype")
        ssm_dtype = _dtype(mamba_ssm_dtype, "mamba_ssm_dtype")
        cache_entries = (max_num_seqs if prefix_cache_entries is None else prefix_cache_entries) \
            if enable_prefix_caching else 0
        if enable_prefix_caching and cache_entries < 1:
            raise ConfigurationError("prefix_cache_entries must be >= 1 with enable_prefix_caching")
        self.config = cfg = load_config(self.model_dir)
        self.max_model_len = max_model_len or min(cfg.max_position_embeddings, 4096)

        from hybrid.tokenizer import Tokenizer

        self.tokenizer = None
        if os.path.isfile(os.path.join(self.model_dir, "tokenizer.json")):
            self.tokenizer = Tokenizer(self.model_dir, cfg.eos_token_ids)
        eos = set(cfg.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else set())

        self.model = load_model(self.model_dir, cfg, self.device, self.dtype, progress=self.device.type == "cuda",
                                check_finite=check_weights)
        m = cfg.mamba
        shapes = StateShapes(len(cfg.mamba_layers), m.conv_dim, m.conv_kernel - 1, m.num_heads, m.head_dim, m.state_size)
        if fused_ops is None:  # on where the kernels compile; on CPU only through Triton's interpreter
            from hybrid.ops import triton_act, triton_norm

            fused_ops = self.device.type == "cuda" and triton_norm.is_available() and triton_act.is_available()
        if fused_ops:
            use_fused_ops(self.model)
        backend = select_backend(self.device)
        spec = SpeculativeConfig.from_dict(speculative_config)  # (checked above)
        self.memory_plan = None
        if self.device.type == "cuda":
            from graphs.memory import plan_memory
            from hybrid.ops.mamba_cuda import attach_kernels

            if attach_kernels(self.model, mamba_decode_kernels) is None and cfg.mamba_layers:
                logger.warning("mamba-ssm / causal-conv1d not importable: Mamba layers use the torch path")
            self.memory_plan = plan_memory(
                self.model, cfg, device=self.device, gpu_memory_utilization=gpu_memory_utilization,
                max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                max_num_batched_tokens=max_num_batched_tokens, page_size=page_size, kv_dtype=self.dtype,
                conv_dtype=self.dtype, ssm_dtype=ssm_dtype, attention_backend=backend, num_kv_pages=num_kv_pages,
                use_graphs=not enforce_eager, extra_state_slots=cache_entries,
                num_speculative_tokens=spec.num_speculative_tokens if spec else 0, cuda_graph_sizes=cuda_graph_sizes)
            num_kv_pages = self.memory_plan.num_kv_pages
            logger.info(self.memory_plan.summary(max_num_seqs, self.max_model_len, page_size))
        self.state_pool = MambaStatePool(shapes, max_num_seqs + cache_entries, self.device, conv_dtype=self.dtype,
                                         ssm_dtype=ssm_dtype)
        if spec:  # the verify scratch, allocated where the memory plan budgets it: before the KV cache
            self.state_pool.enable_spec_scratch(max_num_seqs, spec.num_speculative_tokens + 1)
        pages_per_seq = -(-self.max_model_len // page_size)
        if num_kv_pages is None:
            num_kv_pages = max_num_seqs * pages_per_seq + 1
        if num_kv_pages - 1 < pages_per_seq and cfg.attention_layers:
            raise CapacityError(
                f"num_kv_pages={num_kv_pages} cannot hold one sequence of max_model_len={self.max_model_len} "
                f"({pages_per_seq} pages of {page_size} tokens plus the dummy page)"
            )
        a = cfg.attention
        self.kv_cache = PagedKVCache(len(cfg.attention_layers), num_kv_pages, page_size, a.num_kv_heads, a.head_dim,
                                     self.device, self.dtype)
        ctx = ForwardContext(self.state_pool, self.kv_cache, backend)
        self.runner = ModelRunner(self.model, ctx, enforce_eager=enforce_eager or self.device.type != "cuda",
                                  max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, page_size=page_size,
                                  cuda_graph_sizes=cuda_graph_sizes)
        self.engine = Engine(
            self.runner, self.state_pool, self.kv_cache,
            vocab_size=cfg.vocab_size, max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, eos_token_ids=eos, tokenizer=self.tokenizer,
            seed=seed, device=self.device,
            check_state=check_state if check_state is not None else os.environ.get("HYBRID_CHECK_STATE", "0")
            not in ("", "0", "false", "False"),
            speculative_config=speculative_config,
            # on CPU every op runs synchronously anyway: nothing to overlap
            async_scheduling=self.device.type == "cuda" if async_scheduling is None else async_scheduling,
            prefix_cache_entries=cache_entries, prefix_cache_interval=prefix_cache_interval,
        )
        self._ids = itertools.count()

    def _prompt_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this checkpoint has no tokenizer.json: pass token ids, not text")
            if prompt == "":
                raise InvalidRequestError("empty prompt: at least one token is needed")
            return prompt, self.tokenizer.encode(prompt)  # InvalidRequestError for a lone surrogate
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    @staticmethod
    def _prompt_list(prompts) -> list:
        """One prompt (a string or a list of token ids) or a list of them -> a list of prompts."""
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if prompts and all(isinstance(t, int) for t in prompts):
                return [list(prompts)]  # a single prompt of token ids
            return list(prompts)
        raise InvalidRequestError("prompts must be a string, a list of token ids or a list of those, "
                                  f"got {type(prompts).__name__}")

    @staticmethod
    def _params_list(sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
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
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Every prompt and every parameter (vocabulary-
        dependent ones too) is validated before anything is queued: an InvalidRequestError leaves
        nothing behind. If some requests fail inside the engine (an exception in their step,
        non-finite logits), the others still run to the end and then RequestFailedError is raised:
        its `failed` maps prompt indexes to the errors, its `outputs` holds every output (the failed
        ones finished with finish_reason "error" and `error` set). EngineDeadError if the device is
        lost (the LLM can then no longer generate)."""
        prompts = self._prompt_list(prompts)
        params_list = self._params_list(sampling_params, len(prompts))
        prepared = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                text, ids = self._prompt_ids(prompt)
                self.engine.validate_request(ids, params)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompt {i}: {e}" if len(prompts) > 1 else str(e)) from None
            prepared.append((text, ids, params))
        order = []
        try:
            for text, ids, params in prepared:
                rid = f"gen-{next(self._ids)}"
                self.engine.add_request(rid, ids, params, prompt=text, output_kind="final")
                order.append(rid)
        except BaseException:  # (validated above: not expected) never leave part of the batch queued
            for rid in order:
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(order) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="Generating", unit="req")
        try:
            while len(results) < len(order):
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
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
        failed = {i: out.error for i, out in enumerate(outputs) if out.error is not None}
        if failed:  # the others completed: they come with the error, in e.outputs
            first = next(iter(failed))
            raise RequestFailedError(
                f"{len(failed)} of {len(outputs)} requests failed; prompt {first}: {failed[first]}",
                failed=failed, outputs=outputs)
        return outputs
