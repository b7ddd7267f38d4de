"""The offline generation API, shaped like vLLM's `LLM`."""
from __future__ import annotations

import dataclasses
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
from hybrid.model_source import DEFAULT_MODEL_DIR, resolve_model
from hybrid.outputs import RequestOutput
from hybrid.sampling import SamplingParams
from hybrid.spec_decode import SpeculativeConfig
from state_pool.pool import MambaStatePool, StateShapes

logger = logging.getLogger("hybrid")

__all__ = ["LLM", "DEFAULT_MODEL_DIR", "resolve_device", "default_sizes", "smaller_sizes", "fit_max_model_len",
           "plan_cuda_sizes"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}

# Defaults that suit the device (explicit arguments always win). CPU: a few sequences, small
# steps, at most 4096 tokens of context. CUDA: as vLLM, 256 sequences and 8192-token steps (less
# if the memory plan cannot hold them) and the checkpoint's whole context (max_position_embeddings),
# capped by the KV cache that fits next to the Mamba state.
CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS, CPU_MAX_MODEL_LEN = 8, 256, 4096
CUDA_MAX_NUM_SEQS, CUDA_MAX_NUM_BATCHED_TOKENS = 256, 8192
MIN_DEFAULT_BATCHED_TOKENS = 256  # CUDA: defaulted step sizes shrink no further when memory is short


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


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """The device to run on: "auto" (or None) is CUDA when it is available, else the CPU; anything
    else must name a cpu or cuda device (ConfigurationError otherwise, or if CUDA is missing)."""
    if name is None or (isinstance(name, str) and name == "auto"):
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return _device(name)


@dataclasses.dataclass(frozen=True)
class EngineSizes:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None  # None: from the checkpoint, capped by the memory plan (CUDA)


def default_sizes(device_type: str, max_position_embeddings: int, *, max_num_seqs: int | None = None,
                  max_num_batched_tokens: int | None = None, max_model_len: int | None = None) -> EngineSizes:
    """The engine sizes for a device: the given values, the device's defaults for the others."""
    if device_type == "cuda":
        return EngineSizes(CUDA_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs,
                           CUDA_MAX_NUM_BATCHED_TOKENS if max_num_batched_tokens is None else max_num_batched_tokens,
                           max_model_len)
    return EngineSizes(CPU_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs,
                       CPU_MAX_NUM_BATCHED_TOKENS if max_num_batched_tokens is None else max_num_batched_tokens,
                       min(max_position_embeddings, CPU_MAX_MODEL_LEN) if max_model_len is None else max_model_len)


def smaller_sizes(sizes: EngineSizes, *, max_num_seqs_given: bool,
                  max_num_batched_tokens_given: bool) -> EngineSizes | None:
    """The next sizes to try when the memory plan does not fit: max_num_seqs halved (if it was
    defaulted) down to 1, then max_num_batched_tokens halved (if defaulted) down to
    MIN_DEFAULT_BATCHED_TOKENS. None when nothing defaulted is left to shrink."""
    if not max_num_seqs_given and sizes.max_num_seqs > 1:
        return dataclasses.replace(sizes, max_num_seqs=sizes.max_num_seqs // 2)
    if not max_num_batched_tokens_given and sizes.max_num_batched_tokens > MIN_DEFAULT_BATCHED_TOKENS:
        return dataclasses.replace(
            sizes, max_num_batched_tokens=max(MIN_DEFAULT_BATCHED_TOKENS, sizes.max_num_batched_tokens // 2))
    return None


def fit_max_model_len(*, budget_bytes: int, slot_bytes: int, page_bytes: int, page_size: int, max_num_seqs: int,
                      extra_state_slots: int = 0, num_speculative_tokens: int = 0,
                      num_kv_pages: int | None = None) -> int | None:
    """The longest sequence whose KV pages fit: in what `budget_bytes` leaves after the Mamba slots
    and the speculative scratch (graphs.memory.split_budget's order), or in `num_kv_pages` if given,
    less the dummy page. None without attention layers (page_bytes 0): no KV, any length fits."""
    from graphs.memory import spec_scratch_bytes

    if not page_bytes:
        return None
    state = (max_num_seqs + extra_state_slots + 1) * slot_bytes
    kv_budget = budget_bytes - state - spec_scratch_bytes(slot_bytes, max_num_seqs, num_speculative_tokens)
    pages = kv_budget // page_bytes
    if num_kv_pages is not None:
        pages = min(pages, num_kv_pages)
    return max(0, pages - 1) * page_size


def plan_cuda_sizes(plan, sizes: EngineSizes, *, max_position_embeddings: int, page_size: int,
                    num_kv_pages: int | None, max_num_seqs_given: bool, max_num_batched_tokens_given: bool,
                    extra_state_slots=lambda seqs: 0, num_speculative_tokens: int = 0):
    """The CUDA sizes and memory plan: `plan(sizes, max_model_len)` (graphs.memory.plan_memory)
    is tried at `sizes`, and on CapacityError again at smaller_sizes (only what was defaulted
    shrinks; the last error is raised when nothing is left). An unset max_model_len is planned at
    one chunk (min(config, max(max_num_batched_tokens, page_size)): the profiling forward's size,
    so the same activation peak), then set to max_position_embeddings capped by fit_max_model_len,
    and the KV pages are split again for it. `extra_state_slots(max_num_seqs)`: the prefix
    cache's slots. Returns (sizes with max_model_len set, plan, whether memory capped max_model_len)."""
    from graphs.memory import split_budget

    while True:
        probe_len = sizes.max_model_len or min(max_position_embeddings, max(sizes.max_num_batched_tokens, page_size))
        try:
            memory_plan = plan(sizes, probe_len)
            break
        except CapacityError as e:
            smaller = smaller_sizes(sizes, max_num_seqs_given=max_num_seqs_given,
                                    max_num_batched_tokens_given=max_num_batched_tokens_given)
            if smaller is None:
                raise
            logger.warning("memory plan: %s; trying the smaller default max_num_seqs=%d, max_num_batched_tokens=%d",
                           e, smaller.max_num_seqs, smaller.max_num_batched_tokens)
            sizes = smaller
    if sizes.max_model_len is not None:
        return sizes, memory_plan, False
    extra = extra_state_slots(sizes.max_num_seqs)
    fit = fit_max_model_len(budget_bytes=memory_plan.budget_bytes, slot_bytes=memory_plan.slot_bytes,
                            page_bytes=memory_plan.page_bytes, page_size=page_size, max_num_seqs=sizes.max_num_seqs,
                            extra_state_slots=extra, num_speculative_tokens=num_speculative_tokens,
                            num_kv_pages=num_kv_pages)
    length = max_position_embeddings if fit is None else min(max_position_embeddings, fit)
    _, _, pages = split_budget(memory_plan.budget_bytes, slot_bytes=memory_plan.slot_bytes,
                               page_bytes=memory_plan.page_bytes, page_size=page_size, max_num_seqs=sizes.max_num_seqs,
                               max_model_len=length, extra_state_slots=extra,
                               num_speculative_tokens=num_speculative_tokens, num_kv_pages=num_kv_pages)
    memory_plan = dataclasses.replace(memory_plan, num_kv_pages=pages, max_tokens=(pages - 1) * page_size)
    return dataclasses.replace(sizes, max_model_len=length), memory_plan, length < max_position_embeddings


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_int(name: str, value, lo: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ConfigurationError(f"{name} must be an integer >= {lo}, got {value!r}")


class LLM:
    def __init__(
        self,
        model: str | None = None,  # a checkpoint directory, a cached hub repo id ("owner/name[@rev]"), None: bundled
        device: str = "auto",  # "auto": cuda when available, else cpu
        dtype: str | torch.dtype = "auto",
        max_num_seqs: int | None = None,  # None: 256 on CUDA (fewer if memory is short), 8 on CPU
        page_size: int = 16,
        seed: int = 0,
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
    ) -> None:
        # Bad arguments are ConfigurationError (a ValueError): the CLI prints them as `error: ...`.
        _check_int("page_size", page_size, 1)
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            _check_int(name, value, 1, optional=True)
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
        self.device = resolve_device(device)
        if dtype == "auto":  # bf16 end to end on GPU, fp32 on CPU
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = _dtype(dtype, "dtype")
        self.ssm_dtype = ssm_dtype = _dtype(mamba_ssm_dtype, "mamba_ssm_dtype")
        if enable_prefix_caching and prefix_cache_entries is not None and prefix_cache_entries < 1:
            raise ConfigurationError("prefix_cache_entries must be >= 1 with enable_prefix_caching")
        # a directory, or a hub repo id found in the local Hugging Face cache (never downloaded)
        source = resolve_model(model)
        self.model_dir, self.hf_repo_id = source.path, source.repo_id
        self.config = cfg = load_config(self.model_dir)
        sizes = default_sizes(self.device.type, cfg.max_position_embeddings, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)

        def cache_entries_for(seqs: int) -> int:
            if not enable_prefix_caching:
                return 0
            return seqs if prefix_cache_entries is None else prefix_cache_entries

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
        num_spec = spec.num_speculative_tokens if spec else 0
        self.memory_plan = None
        if max_model_len is not None:
            max_len_note = "given"
        elif self.device.type == "cuda" or cfg.max_position_embeddings <= CPU_MAX_MODEL_LEN:
            max_len_note = f"config max_position_embeddings={cfg.max_position_embeddings}"
        else:
            max_len_note = f"the CPU default cap; config max_position_embeddings={cfg.max_position_embeddings}"
        if self.device.type == "cuda":
            from graphs.memory import plan_memory
            from hybrid.ops.mamba_cuda import attach_kernels

            if attach_kernels(self.model, mamba_decode_kernels) is None and cfg.mamba_layers:
                logger.warning("mamba-ssm / causal-conv1d not importable: Mamba layers use the torch path")

            def plan_fn(trial: EngineSizes, probe_len: int):
                return plan_memory(
                    self.model, cfg, device=self.device, gpu_memory_utilization=gpu_memory_utilization,
                    max_num_seqs=trial.max_num_seqs, max_model_len=probe_len,
                    max_num_batched_tokens=trial.max_num_batched_tokens, page_size=page_size, kv_dtype=self.dtype,
                    conv_dtype=self.dtype, ssm_dtype=ssm_dtype, attention_backend=backend, num_kv_pages=num_kv_pages,
                    use_graphs=not enforce_eager, extra_state_slots=cache_entries_for(trial.max_num_seqs),
                    num_speculative_tokens=num_spec, cuda_graph_sizes=cuda_graph_sizes)

            sizes, plan, capped = plan_cuda_sizes(
                plan_fn, sizes, max_position_embeddings=cfg.max_position_embeddings, page_size=page_size,
                num_kv_pages=num_kv_pages, max_num_seqs_given=max_num_seqs is not None,
                max_num_batched_tokens_given=max_num_batched_tokens is not None,
                extra_state_slots=cache_entries_for, num_speculative_tokens=num_spec)
            if capped:
                max_len_note += f", capped to what the KV cache holds next to {sizes.max_num_seqs} Mamba slots"
            self.memory_plan = plan
            num_kv_pages = plan.num_kv_pages
            logger.info(plan.summary(sizes.max_num_seqs, sizes.max_model_len, page_size))
        self.max_num_seqs = max_num_seqs = sizes.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens = sizes.max_num_batched_tokens
        self.max_model_len = sizes.max_model_len
        cache_entries = cache_entries_for(max_num_seqs)
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
        logger.info(
            "LLM: %s on %s; weights %s, Mamba SSM state %s (conv state %s); max_model_len %d (%s); "
            "max_num_seqs %d (Mamba state slots: %d%s); max_num_batched_tokens %d; KV cache %s",
            self.hf_repo_id or self.model_dir, self.device, _name(self.dtype), _name(ssm_dtype), _name(self.dtype),
            self.max_model_len, max_len_note, max_num_seqs, max_num_seqs + cache_entries,
            f", {cache_entries} of them for cached prefixes" if cache_entries else "", max_num_batched_tokens,
            f"{num_kv_pages - 1} pages x {page_size} tokens = {(num_kv_pages - 1) * page_size} tokens"
            if cfg.attention_layers else "none (no attention layers)")
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
        return self._run(prepared, use_tqdm)

    def _run(self, prepared: list[tuple[str | None, list[int], SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        """Queue the validated (text, ids, params) requests, step until all finish, in order."""
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
        failed = {i: out.error for i, out in enumerate(outputs) if out.error is not None}
        if failed:  # the others completed: they come with the error, in e.outputs
            first = next(iter(failed))
            raise RequestFailedError(
                f"{len(failed)} of {len(outputs)} requests failed; prompt {first}: {failed[first]}",
                failed=failed, outputs=outputs)
        return outputs

    def get_tokenizer(self):
        """The checkpoint's tokenizer (hybrid.tokenizer.Tokenizer: encode, decode,
        apply_chat_template, eos_token_ids), or None if the checkpoint has no tokenizer.json."""
        return self.tokenizer

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list
        of conversations, as vLLM's LLM.chat: each is rendered with the checkpoint's chat template
        (or `chat_template`), with the generation prompt added, tokenized without special tokens
        (the template writes those) and run through generate as one batch. One RequestOutput per
        conversation, in order; its `prompt` is the rendered text. InvalidRequestError if there
        is no tokenizer or chat template, a message is malformed or the template refuses it."""
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
        reserved = sorted(set(chat_template_kwargs or ()) & {"messages", "add_generation_prompt", "tokenize",
                                                              "chat_template"})
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs: {', '.join(reserved)} are arguments of chat itself")
        params_list = self._params_list(sampling_params, len(conversations))
        prepared = []
        for i, (conv, params) in enumerate(zip(conversations, params_list)):
            try:
                text = self.tokenizer.apply_chat_template(
                    conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                    **(chat_template_kwargs or {}))
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if not ids:
                    raise InvalidRequestError("the rendered conversation is empty: at least one token is needed")
                self.engine.validate_request(ids, params)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"conversation {i}: {e}" if len(conversations) > 1 else str(e)) from None
            prepared.append((text, ids, params))
        return self._run(prepared, use_tqdm)
