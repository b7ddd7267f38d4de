"""Paged KV cache and attention backends."""
from attention.backend import AttentionBackend, TorchAttentionBackend, select_backend
from attention.kv_cache import DUMMY_PAGE, PageAllocator, PagedKVCache

__all__ = [
    "AttentionBackend", "TorchAttentionBackend", "select_backend",
    "DUMMY_PAGE", "PageAllocator", "PagedKVCache",
]
