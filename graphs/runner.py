"""The model runner: the one call the engine makes per step.

`execute(batch)` picks the path:
- decode-only batches whose size fits a bucket: on CUDA with graphs enabled, the batch is copied
  into persistent buffers (padding rows as in graphs/padding.py) and the bucket's captured graph
  is replayed; with `pad_decode=True` and no graphs (CPU tests) the padded batch runs eagerly;
- everything else (prefill, mixed, speculative verify, sizes above the largest bucket): eager.
Only the real rows' logits are returned, whatever path ran.

Graphs are captured per bucket, largest first, into one shared memory pool, with every row a
padding row (so capture writes no live Mamba slot and only the dummy KV page).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from attention.kv_cache import DUMMY_PAGE
from graphs.padding import (
    bucket_for, default_capture_sizes, is_plain_decode, pad_decode_batch, padding_batch, padding_row,
)
from state_pool.util import cdiv

if TYPE_CHECKING:
    from state_pool.step_batch import StepBatch

logger = logging.getLogger("hybrid")


class _Buffers:
    """Persistent inputs of the captured graphs, sized for the largest bucket."""

    FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "page_table", "kv_write_loc", "state_slot",
              "has_initial_state", "logits_indices")

    def __init__(self, size: int, max_pages: int, page_size: int, device: torch.device) -> None:
        # every row starts as a padding row (capture runs on these): graphs/padding.py defines them
        self.padding = padding_batch(size, page_size, device, pages_per_row=max_pages)
        for field in self.FIELDS:
            setattr(self, field, getattr(self.padding, field))

    def batch(self, size: int) -> StepBatch:
        """The first `size` rows as a batch (views of the buffers), all of them padding rows."""
        import dataclasses

        views = {f: getattr(self, f)[: size + 1 if f == "query_start_loc" else size] for f in self.FIELDS}
        p = self.padding
        return dataclasses.replace(p, **views, num_decodes=size, query_lens_cpu=p.query_lens_cpu[:size],
                                   seq_lens_cpu=p.seq_lens_cpu[:size], state_slot_cpu=p.state_slot_cpu[:size],
                                   has_initial_state_cpu=p.has_initial_state_cpu[:size])

    def fill(self, batch: StepBatch, size: int, page_size: int) -> None:
        """Copy a real decode batch into rows [0, n) and padding into rows [n, size), in place."""
        n = batch.num_requests
        width = batch.page_table.shape[1]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        self.page_table[:n, :width].copy_(batch.page_table, non_blocking=True)
        if width < self.page_table.shape[1]:
            self.page_table[:n, width:].fill_(DUMMY_PAGE)
        self.kv_write_loc[:n].copy_(batch.kv_write_loc, non_blocking=True)
        self.state_slot[:n].copy_(batch.state_slot, non_blocking=True)
        self.has_initial_state[:n].copy_(batch.has_initial_state, non_blocking=True)
        if size > n:
            for field, value in padding_row(page_size).items():
                getattr(self, field)[n:size].fill_(value)


class ModelRunner:
    def __init__(self, model, ctx, enforce_eager: bool = True, *, max_num_seqs: int | None = None,
                 max_model_len: int | None = None, page_size: int | None = None,
                 cuda_graph_sizes: list[int] | None = None, pad_decode: bool | None = None,
                 progress: bool = True) -> None:
        self.model = model
        self.ctx = ctx
        self.enforce_eager = enforce_eager
        self.page_size = page_size or (ctx.kv_cache.page_size if ctx is not None and ctx.kv_cache is not None else 16)
        self.max_num_seqs = max_num_seqs or 1
        self.max_model_len = max_model_len
        sizes = cuda_graph_sizes if cuda_graph_sizes else default_capture_sizes(self.max_num_seqs)
        self.capture_sizes = sorted({int(s) for s in sizes if int(s) >= 1})
        self.use_graphs = (not enforce_eager) and self._graphs_supported()
        self.pad_decode = self.use_graphs if pad_decode is None else pad_decode
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.buffers: _Buffers | None = None
        self.stats = {"graph_replays": 0, "padded_eager": 0, "eager": 0}
        self._ran: tuple[StepBatch | None, int] = (None, 0)  # (batch, rows) of the last execute; None: buffers
        if self.use_graphs:
            self.capture(progress=progress)

    # ------------------------------------------------------------------ capability
    def _device(self) -> torch.device:
        return self.model.embed.device

    def _graphs_supported(self) -> bool:
        if self._device().type != "cuda" or self.max_model_len is None:
            return False
        backend = self.ctx.attention_backend
        dtype = self.model.embed.dtype
        if self.model.cfg.attention_layers:
            if not getattr(backend, "supports_cuda_graphs", False):
                return False
            if hasattr(backend, "graph_safe") and not backend.graph_safe(dtype):
                return False
        from hybrid.moe import Experts

        if any(isinstance(m, Experts) and not m.fused for m in self.model.modules()):
            # The torch reference loops over torch.unique(top_idx) on the host: not capturable.
            logger.info("CUDA graphs off: MoE experts without the fused kernels (fused_ops=False) run eagerly")
            return False
        # The torch Mamba decode path is capturable too, but reads no CPU lists only with kernels.
        return all(m.kernels is not None for m in self.model.mamba_mixers())

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        device = self._device()
        max_pages = cdiv(self.max_model_len, self.page_size)
        self.buffers = _Buffers(max(self.capture_sizes), max_pages, self.page_size, device)
        self.pool = torch.cuda.graph_pool_handle()
        sizes = sorted(self.capture_sizes, reverse=True)  # largest first: smaller ones reuse its pool
        it = sizes
        if progress:
            from tqdm import tqdm

            it = tqdm(sizes, desc="Capturing CUDA graphs", unit="graph")
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(device)[0]
        for size in it:
            batch = self.buffers.batch(size)  # all padding rows: writes no live slot, only the dummy page
            for _ in range(2):  # warm-up: JIT, autotuning, workspace allocation
                self.model(batch, self.ctx)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model(batch, self.ctx)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d CUDA graphs (batch sizes %s) in %.1f s, %.0f MiB", len(sizes),
                    self.capture_sizes, time.perf_counter() - start, used / 2**20)

    # ------------------------------------------------------------------ execute
    def bucket(self, batch: StepBatch) -> int | None:
        """The padded size this runner runs `batch` at (graph replay or padded eager), or None (as is)."""
        if (self.use_graphs or self.pad_decode) and is_plain_decode(batch):
            return bucket_for(batch.num_requests, self.capture_sizes)
        return None

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] (fp32) for the batch."""
        size = self.bucket(batch)
        if size is not None:
            if self.use_graphs and size in self.graphs and \
                    batch.page_table.shape[1] <= self.buffers.page_table.shape[1]:
                self._ran = (None, size)
                return self.replay(batch, size)
            if self.pad_decode:
                self.stats["padded_eager"] += 1
                padded = pad_decode_batch(batch, size, self.page_size)
                self._ran = (padded, size)
                return self.model(padded, self.ctx)[: batch.num_requests]
        self.stats["eager"] += 1
        self._ran = (batch, batch.num_requests)
        return self.model(batch, self.ctx)

    def inputs_that_ran(self) -> StepBatch:
        """The index tensors the last `execute` actually ran on: the graph input buffers (their first
        `size` rows, as filled), the padded eager batch, or the batch itself. For the state sanitizer,
        which checks them on the device in stream order (they are not refilled before the next step)."""
        batch, size = self._ran
        return batch if batch is not None else self.buffers.batch(size)

    def replay(self, batch: StepBatch, size: int) -> torch.Tensor:
        graph, out = self.graphs[size]
        with torch.inference_mode():  # the buffers were made under inference mode (capture)
            self.buffers.fill(batch, size, self.page_size)
        graph.replay()
        self.stats["graph_replays"] += 1
        return out[: batch.num_requests].clone()
