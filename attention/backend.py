"""Attention backends over the paged KV cache.

A backend writes the step's new K/V into the cache and computes attention of the new queries
against each request's whole KV sequence (causal within the new tokens). The torch backend is
the CPU reference (attention/reference.py); the trtllm backend (FlashInfer, attention/trtllm.py)
plugs into the same interface on CUDA. The trtllm backend takes its fallback from
attention/reference.py, not from here, so the lazy import of it below closes no import loop.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from attention.reference import TorchAttentionBackend, gather_kv, write_kv

if TYPE_CHECKING:
    from state_pool.step_batch import StepBatch

__all__ = ["AttentionBackend", "TorchAttentionBackend", "select_backend", "write_kv", "gather_kv"]


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_layer: torch.Tensor,  # [num_pages, 2, num_kv_heads, page_size, head_dim]
        batch: "StepBatch",
        scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),  # (k_scale, v_scale) of an FP8 cache: stored = x / scale
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        ...

    def must_stay_zero(self) -> list[tuple[str, torch.Tensor]]:
        """(name, region) of every workspace region that must be zero between calls (the sanitizer
        checks them after each step)."""
        ...

    def clear_regions(self) -> None:
        """Zero those regions again."""
        ...


def select_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """The attention backend for a device: 'torch' on CPU, 'trtllm' (FlashInfer) on CUDA when available."""
    if name in (None, "auto"):
        name = "trtllm" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "trtllm":
        from attention.trtllm import TrtllmAttentionBackend  # imports flashinfer: CUDA only

        return TrtllmAttentionBackend()
    raise ValueError(f"unknown attention backend '{name}'")
