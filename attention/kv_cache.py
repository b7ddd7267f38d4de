"""Paged KV cache: a pool of fixed-size pages with refcounts, and per-layer KV tensors.

Layout per attention layer (the trtllm/FlashInfer "HND" layout):
    kv[layer]: [num_pages, 2, num_kv_heads, page_size, head_dim]   (index 0 = K, 1 = V)
Page 0 is a dummy page that no request owns; padding rows of a page table point at it.
"""
from __future__ import annotations

import torch

DUMMY_PAGE = 0


class PageAllocator:
    """Refcounted pages. A page shared by forks (same prompt prefix) is freed at its last release."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("the KV cache needs at least two pages (page 0 is a reserved dummy)")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._refcount[DUMMY_PAGE] = 1  # never handed out
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            if self._refcount[p] < 1 or p == DUMMY_PAGE:
                raise RuntimeError(f"cannot share page {p}: it is not live")
            self._refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if p == DUMMY_PAGE or self._refcount[p] < 1:
                raise RuntimeError(f"release of page {p} that is not live")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)
        self._free.sort(reverse=True)


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.allocator = PageAllocator(num_pages)
        self.kv = torch.zeros(
            max(num_layers, 1), num_pages, 2, num_kv_heads, page_size, head_dim, device=device, dtype=dtype
        )

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * num_kv_heads * page_size * head_dim * torch.empty((), dtype=dtype).element_size()

    def copy_page(self, src: int, dst: int) -> None:
        """Make page `dst` an exact copy of page `src` in every layer (copy-on-write of a page that
        forks would otherwise share while writing it differently)."""
        self.kv[:, dst].copy_(self.kv[:, src])

    def layer(self, index: int) -> torch.Tensor:
        return self.kv[index]
