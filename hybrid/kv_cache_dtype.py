"""The KV cache's storage dtype (`LLM(kv_cache_dtype=...)`, `--kv-cache-dtype`) and the per-layer
scales of an FP8 cache.

- "auto" (default): the model's dtype.
- "fp8" / "fp8_e4m3": float8_e4m3fn pages, half the bytes of bf16 (so twice the tokens in the same
  memory). Each attention layer stores k / k_scale and v / v_scale, saturated at e4m3's 448, and
  the attention kernels multiply the scales back in (attention/reference.py on CPU, XQA and
  FlashInfer's FP8-KV kernels on CUDA; attention/trtllm.py). The Mamba state is not affected.

Scales: calibrated per-tensor scales in the checkpoint are used when present, under the names the FP8
exporters write them (ModelOpt: `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale`; compressed-tensors
and llm-compressor: `<attn>.k_scale` / `<attn>.v_scale`; older exports: `<attn>.kv_scale` for both, or
`k_proj.output_scale` / `v_proj.output_scale`). Without them the scales are 1.0, as vLLM does, which
suits K and V whose magnitudes stay well under 448; the log says so.
"""
from __future__ import annotations

import logging
import math

import torch

from attention.reference import FP8_KV_DTYPE
from hybrid.errors import CheckpointError, ConfigurationError
from hybrid.quantization import K_SCALE_LEAVES, V_SCALE_LEAVES

logger = logging.getLogger("hybrid")

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def parse_kv_cache_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """The cache's torch dtype, or None for "auto" (the model's dtype)."""
    if value is None or value == "auto":
        return None
    if value in ("fp8", "fp8_e4m3", FP8_KV_DTYPE):
        return FP8_KV_DTYPE
    raise ConfigurationError(f"kv_cache_dtype={value!r} is not supported: one of {', '.join(KV_CACHE_DTYPES)} "
                             f"(fp8_e5m2 is not: XQA and FlashInfer's Hopper kernels read e4m3)")


def attention_disk_prefixes(model: torch.nn.Module, plan: dict) -> dict[str, torch.nn.Module]:
    """On-disk prefix (e.g. 'backbone.layers.3.mixer.') -> the model's Attention module, from the load
    plan (hybrid/tensor_plan.tensor_plan: model parameter -> the disk tensors that make it)."""
    from hybrid.layers import Attention

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            src = plan.get(f"{name}.qkv_proj.weight")
            if src is None:
                continue
            out[src.disk_names[0].removesuffix("q_proj.weight")] = module
    return out


def load_kv_scales(modules: dict[str, torch.nn.Module], files: dict[str, str]) -> int:
    """Set the k_scale / v_scale of every Attention module (`modules`: on-disk prefix -> module, from
    attention_disk_prefixes) from the checkpoint; the number that had calibrated scales (the others
    keep 1.0)."""
    from safetensors import safe_open

    def read(name: str) -> float:
        with safe_open(files[name], framework="pt") as f:
            t = f.get_tensor(name).float()
        if t.numel() != 1:
            raise CheckpointError(f"KV-cache scale '{name}' has shape {tuple(t.shape)}: only per-tensor "
                                  f"(one value) scales are supported")
        value = float(t.reshape(()))
        if not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"KV-cache scale '{name}' is {value}: it must be positive and finite")
        return value

    found = 0
    for prefix, module in modules.items():
        k = next((prefix + leaf for leaf in K_SCALE_LEAVES if prefix + leaf in files), None)
        v = next((prefix + leaf for leaf in V_SCALE_LEAVES if prefix + leaf in files), None)
        if k is None and v is None:
            continue
        if k is None or v is None:
            raise CheckpointError(f"attention module '{prefix[:-1]}' has a KV-cache scale for only one of K and V "
                                  f"({k or v})")
        module.k_scale, module.v_scale = read(k), read(v)
        found += 1
    return found


def kv_cache_dtype_note(model: torch.nn.Module, model_dir: str, cfg, kv_dtype: torch.dtype) -> str:
    """Prepare `model` for a `kv_dtype` cache (an FP8 one: its scales from the checkpoint); what the
    log says about it."""
    from hybrid.loader import weight_files
    from hybrid.tensor_plan import checkpoint_plan

    if kv_dtype != FP8_KV_DTYPE:
        return ""
    files = weight_files(model_dir)
    modules = attention_disk_prefixes(model, checkpoint_plan(cfg, files))
    found = load_kv_scales(modules, files)
    if found:
        return (f"KV cache in FP8 (e4m3) with the checkpoint's K/V scales for {found} of {len(modules)} "
                f"attention modules")
    return ("KV cache in FP8 (e4m3) with K/V scales 1.0: the checkpoint has none, so K and V are stored as "
            "they are, saturating at 448")
