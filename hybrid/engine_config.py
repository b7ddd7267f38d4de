"""The engine's configuration: one validated EngineConfig (with its CacheConfig) built once from
the user's arguments by `engine_config(...)`, which LLM(...), `hybrid generate` and `hybrid serve`
all go through, then passed down (LLM -> Engine -> scheduler / resources) instead of keyword lists.

`engine_config` checks every argument (ConfigurationError, a ValueError, naming the bad one) and
resolves what needs no checkpoint: the device ("auto": CUDA when available), the dtypes, the state
sanitizer's switch (HYBRID_CHECK_STATE), async scheduling and the fused ops. The sizes left at None
(max_num_seqs, max_num_batched_tokens, max_model_len) suit the device and the checkpoint; they are
settled at startup (default_sizes, and on CUDA plan_cuda_sizes against the memory plan) and the
engine gets `config.with_sizes(...)`, where every size is known.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from hybrid.errors import CapacityError, ConfigurationError
from hybrid.kv_cache_dtype import parse_kv_cache_dtype
from hybrid.spec_decode import SpeculativeConfig

logger = logging.getLogger("hybrid")

__all__ = ["EngineConfig", "CacheConfig", "engine_config", "resolve_device", "resolve_dtype", "EngineSizes",
           "default_sizes", "smaller_sizes", "fit_max_model_len", "plan_cuda_sizes"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}

# Defaults that suit the device (explicit arguments always win). CPU: a few sequences, small
# steps, at most 4096 tokens of context. CUDA: as vLLM, 256 sequences and 8192-token steps (less
# if the memory plan cannot hold them) and the checkpoint's whole context (max_position_embeddings),
# capped by the KV cache that fits next to the Mamba state.
CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS, CPU_MAX_MODEL_LEN = 8, 256, 4096
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's compilation_config["cudagraph_mode"]: whole-step graphs of decode (and verify) steps ("FULL"), piecewise
# graphs of the other steps (graphs/piecewise.py), both, or none
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "FULL", "NONE")


# vLLM's optimization levels (-O0 .. -O3, LLM(optimization_level=)): the CUDA-graph mode each implies where
# compilation_config names none (its compilation and fusion passes have no counterpart here)
LEVEL_CUDAGRAPH_MODES = {0: "NONE", 1: "PIECEWISE", 2: "FULL_AND_PIECEWISE", 3: "FULL_AND_PIECEWISE"}


def cudagraph_mode_of(compilation_config, optimization_level: int | None = None) -> str:
    """The CUDA-graph mode vLLM's compilation_config names (its "cudagraph_mode", any case), else the one
    `optimization_level` implies, else FULL_AND_PIECEWISE. "FULL" (whole-step graphs of mixed steps too) becomes
    FULL_AND_PIECEWISE: this runtime's whole-step graphs take decode and verify steps only, so its mixed steps go
    piecewise, as vLLM does for an attention backend without full graphs of mixed batches."""
    if optimization_level is not None and (not isinstance(optimization_level, int) or isinstance(
            optimization_level, bool) or optimization_level not in LEVEL_CUDAGRAPH_MODES):
        raise ConfigurationError(f"optimization_level must be 0, 1, 2 or 3, got {optimization_level!r}")
    mode = compilation_config.get("cudagraph_mode") if isinstance(compilation_config, dict) else None
    if mode is None:
        return LEVEL_CUDAGRAPH_MODES[2 if optimization_level is None else optimization_level]
    name = mode.upper() if isinstance(mode, str) else None
    if name not in CUDAGRAPH_MODES:
        raise ConfigurationError(f"compilation_config cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                                 f"got {mode!r}")
    if name == "FULL":
        logger.info("cudagraph_mode FULL: mixed and prefill steps replay piecewise graphs (whole-step graphs take "
                    "decode and verify steps), as FULL_AND_PIECEWISE")
        return "FULL_AND_PIECEWISE"
    return name
CUDA_MAX_NUM_SEQS, CUDA_MAX_NUM_BATCHED_TOKENS = 256, 8192
MIN_DEFAULT_BATCHED_TOKENS = 256  # CUDA: defaulted step sizes shrink no further when memory is short


# ---------------------------------------------------------------------------------- device and dtypes
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


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The weights' dtype: "auto" (or None) is bf16 on CUDA and fp32 on the CPU."""
    if name is None or (isinstance(name, str) and name == "auto"):
        name = "bfloat16" if device.type == "cuda" else "float32"
    return _dtype(name, "dtype")


def _check_int(name: str, value, lo: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ConfigurationError(f"{name} must be an integer >= {lo}, got {value!r}")


# ---------------------------------------------------------------------------------- the config
@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The Mamba state slots and KV pages: their layout, the memory they may take, prefix caching."""
    page_size: int = 16
    num_kv_pages: int | None = None  # None: enough for max_num_seqs full-length sequences (CUDA: what fits)
    mamba_ssm_dtype: torch.dtype = torch.float32
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype; float8_e4m3fn (hybrid/kv_cache_dtype.py)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = False
    prefix_cache_entries: int | None = None  # None: max_num_seqs
    prefix_cache_interval: int = 0

    def prefix_cache_slots(self, max_num_seqs: int) -> int:
        """The state slots the prefix cache holds beyond max_num_seqs (0: prefix caching is off)."""
        if not self.enable_prefix_caching:
            return 0
        return max_num_seqs if self.prefix_cache_entries is None else self.prefix_cache_entries


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything LLM, the engine, the scheduler and the resource manager are configured with.
    Built (and validated) by engine_config(); the sizes are None until settled at startup."""
    model: str | None = None  # as given: a checkpoint directory, a cached hub repo id, None (the bundled model)
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    seed: int = 0
    enforce_eager: bool = False
    speculative: SpeculativeConfig | None = None
    check_state: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    cudagraph_mode: str = "FULL_AND_PIECEWISE"  # one of CUDAGRAPH_MODES but FULL (NONE: enforce_eager)
    # vLLM's max_cudagraph_capture_size: the largest decode graph's batch and piecewise bucket's tokens (None: ours)
    max_cuda_graph_size: int | None = None
    mamba_decode_kernels: str = "triton"
    fused_ops: bool = False
    async_scheduling: bool = False
    check_weights: bool = False
    tensor_parallel_size: int = 1  # > 1: the model sharded over that many processes (hybrid/parallel/)
    warmup: bool = False  # throw-away requests at startup, so the first batch compiles nothing (hybrid/warmup.py)
    # default sampling: "auto" (the checkpoint's generation_config.json), "vllm" (none), or a folder's
    generation_config: str = "auto"
    # "fcfs": requests run in arrival order; "priority": by (priority, arrival), lower values first (vLLM's)
    scheduling_policy: str = "fcfs"
    cache: CacheConfig = CacheConfig()

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @property
    def full_cuda_graphs(self) -> bool:
        """Whole-step graphs of decode and verify steps (graphs/runner.py)."""
        return self.cudagraph_mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")

    @property
    def piecewise_cuda_graphs(self) -> bool:
        """Piecewise graphs of the other steps (graphs/piecewise.py)."""
        return self.cudagraph_mode in ("FULL_AND_PIECEWISE", "PIECEWISE")

    @property
    def sizes_known(self) -> bool:
        return None not in (self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len)

    @property
    def prefix_cache_slots(self) -> int:
        """The prefix cache's state slots (sizes known)."""
        return self.cache.prefix_cache_slots(self.max_num_seqs)

    def with_sizes(self, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                   num_kv_pages: int | None = None) -> "EngineConfig":
        """This config with the sizes settled at startup (and the KV pages, when they are known)."""
        cache = self.cache if num_kv_pages is None else dataclasses.replace(self.cache, num_kv_pages=num_kv_pages)
        return dataclasses.replace(self, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=max_model_len, cache=cache)


def engine_config(
    model: str | None = None,
    device: str | torch.device | None = "auto",
    dtype: str | torch.dtype | None = "auto",
    max_num_seqs: int | None = None,
    page_size: int = 16,
    seed: int | None = 0,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    num_kv_pages: int | None = None,
    enforce_eager: bool = False,
    mamba_ssm_dtype: str | torch.dtype = "float32",
    speculative_config: dict | SpeculativeConfig | None = None,
    check_state: bool | None = None,
    gpu_memory_utilization: float = 0.9,
    cuda_graph_sizes: list[int] | None = None,
    mamba_decode_kernels: str = "triton",
    fused_ops: bool | None = None,
    async_scheduling: bool | None = None,
    enable_prefix_caching: bool = False,
    prefix_cache_entries: int | None = None,
    prefix_cache_interval: int = 0,
    check_weights: bool = False,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str | torch.dtype = "auto",
    warmup: bool | None = None,
    generation_config: str = "auto",
    scheduling_policy: str = "fcfs",
) -> EngineConfig:
    """The EngineConfig for LLM's arguments (the same keywords and defaults; see LLM and README),
    validated: ConfigurationError names the first bad argument."""
    _check_int("page_size", page_size, 1)
    for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
        _check_int(name, value, 1, optional=True)
    _check_int("max_model_len", max_model_len, 2, optional=True)  # a prompt token and a generated one
    _check_int("num_kv_pages", num_kv_pages, 2, optional=True)  # page 0 is the reserved dummy page
    _check_int("prefix_cache_entries", prefix_cache_entries, 0, optional=True)
    _check_int("prefix_cache_interval", prefix_cache_interval, 0)
    _check_int("tensor_parallel_size", tensor_parallel_size, 1)
    if seed is None:  # (vLLM's None: unseeded requests differ from one run to the next)
        seed = int.from_bytes(os.urandom(8), "little")
    if not isinstance(seed, int) or isinstance(seed, bool):  # any int (reduced as sampling seeds are)
        raise ConfigurationError(f"seed must be an integer or None, got {seed!r}")
    if not isinstance(gpu_memory_utilization, (int, float)) or not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigurationError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ConfigurationError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                                 f"got {scheduling_policy!r}")
    if mamba_decode_kernels not in ("triton", "library"):
        raise ConfigurationError(f"mamba_decode_kernels must be 'triton' or 'library', got {mamba_decode_kernels!r}")
    try:
        spec = SpeculativeConfig.from_dict(speculative_config)
    except ValueError as e:
        raise ConfigurationError(str(e)) from None
    if cuda_graph_sizes is not None:
        try:
            cuda_graph_sizes = tuple(cuda_graph_sizes)
        except TypeError:
            raise ConfigurationError(f"cuda_graph_sizes must be a list of batch sizes, got {cuda_graph_sizes!r}") \
                from None
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    ssm_dtype = _dtype(mamba_ssm_dtype, "mamba_ssm_dtype")
    kv_dtype = parse_kv_cache_dtype(kv_cache_dtype)
    if kv_dtype is not None and tensor_parallel_size > 1:
        raise ConfigurationError("kv_cache_dtype='fp8' with tensor_parallel_size > 1 is not supported yet")
    if enable_prefix_caching and prefix_cache_entries is not None and prefix_cache_entries < 1:
        raise ConfigurationError("prefix_cache_entries must be >= 1 with enable_prefix_caching")
    if check_state is None:
        check_state = os.environ.get("HYBRID_CHECK_STATE", "0") not in ("", "0", "false", "False")
    if fused_ops is None:  # on where the kernels compile; on CPU only through Triton's interpreter
        fused_ops = device.type == "cuda" and _fused_kernels_available()
    if async_scheduling is None:  # on CPU every op runs synchronously anyway: nothing to overlap
        async_scheduling = device.type == "cuda"
    if warmup is None:  # on CPU nothing is compiled at first use
        warmup = device.type == "cuda"
    if not isinstance(generation_config, (str, os.PathLike)) or (
            os.fspath(generation_config) not in ("auto", "vllm") and not os.path.isdir(generation_config)):
        raise ConfigurationError(f"generation_config must be 'auto' (the checkpoint's generation_config.json), "
                                 f"'vllm' (no model defaults) or a folder holding a generation_config.json; "
                                 f"got {generation_config!r}")
    if tensor_parallel_size > 1:
        if device.type == "cuda" and (device.index or 0) + tensor_parallel_size > torch.cuda.device_count():
            raise ConfigurationError(f"tensor_parallel_size={tensor_parallel_size} needs that many GPUs from "
                                     f"{device}; this machine has {torch.cuda.device_count()}")
        # the workers get each batch from the host: decode inputs cannot come from the device's last step
        async_scheduling = False
    cache = CacheConfig(page_size=page_size, num_kv_pages=num_kv_pages, mamba_ssm_dtype=ssm_dtype, kv_cache_dtype=kv_dtype,
                        gpu_memory_utilization=float(gpu_memory_utilization),
                        enable_prefix_caching=bool(enable_prefix_caching), prefix_cache_entries=prefix_cache_entries,
                        prefix_cache_interval=prefix_cache_interval)
    return EngineConfig(
        model=None if model is None else os.fspath(model), device=device, dtype=dtype, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, seed=seed,
        enforce_eager=bool(enforce_eager), speculative=spec, check_state=bool(check_state),
        cuda_graph_sizes=cuda_graph_sizes, mamba_decode_kernels=mamba_decode_kernels, fused_ops=bool(fused_ops),
        # drafts need the latest tokens on the host, so speculation runs synchronously
        async_scheduling=bool(async_scheduling) and spec is None, check_weights=bool(check_weights),
        tensor_parallel_size=tensor_parallel_size, warmup=bool(warmup), cache=cache,
        generation_config=os.fspath(generation_config), scheduling_policy=scheduling_policy)


def with_compilation_config(config: EngineConfig, compilation_config,
                            optimization_level: int | None = None) -> EngineConfig:
    """`config` with vLLM's compilation_config and optimization level folded in (LLM's keywords, the CLI's -cc / -O
    and -O<level>): the CUDA-graph mode (cudagraph_mode_of; NONE runs eagerly) and max_cudagraph_capture_size
    (max_capture_size before vLLM 0.11): the largest decode graph's batch size and the largest piecewise bucket's
    token count. Its capture sizes are cuda_graph_sizes already (hybrid/llm.vllm_engine_settings)."""
    mode = cudagraph_mode_of(compilation_config, optimization_level)
    largest = None
    if isinstance(compilation_config, dict):
        for key in ("max_cudagraph_capture_size", "max_capture_size"):
            value = compilation_config.get(key)
            if value is None:
                continue
            _check_int(f"compilation_config {key}", value, 1)
            largest = value
            break
    return dataclasses.replace(config, cudagraph_mode=mode, enforce_eager=config.enforce_eager or mode == "NONE",
                               max_cuda_graph_size=largest)


def _fused_kernels_available() -> bool:
    from hybrid.ops import triton_act, triton_norm

    return triton_norm.is_available() and triton_act.is_available()


# ---------------------------------------------------------------------------------- sizes
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
