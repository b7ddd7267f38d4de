"""The model runner: the one call the engine makes per step.

`execute(batch)` picks the path:
- decode-only batches whose size fits a bucket: on CUDA with graphs enabled, the batch is copied
  into persistent buffers (padding rows as in graphs/padding.py) and the bucket's captured graph
  is replayed; with `pad_decode=True` and no graphs (CPU tests) the padded batch runs eagerly;
- speculative verify steps (verify rows only, at most VERIFY_GRAPH_MAX_ROWS of them): with verify
  graphs on (the default with graphs; HYBRID_VERIFY_GRAPHS=0 turns them off) every row is padded
  to K+1 tokens and the batch to a bucket (graphs/padding.pad_verify_batch) and the bucket's verify
  graph is replayed; with `pad_verify=True` and no graphs (CPU tests) the padded batch runs eagerly;
- other steps (prefill, mixed, sizes above the largest bucket) of up to piecewise_max_tokens tokens: with graphs
  on, the token bucket's piecewise graphs are replayed around the layers' cores (graphs/piecewise.py); with
  `pad_piecewise=True` and no graphs (CPU tests) the same padded step runs eagerly;
- everything else: eager.
Only the real rows' (real tokens') logits are returned, whatever path ran.

Graphs are captured per bucket, largest first, into one shared memory pool, with every row a
padding row (so capture writes no live Mamba slot and only the dummy KV page).

Decode buckets of at most CONTEXT_BUCKET_MAX_BATCH rows get a graph per context bucket too: the page
table's width is what the decode attention kernel takes as the longest sequence (XQA splits every
sequence into blocks by it), so a batch whose longest context is far below max_model_len replays a
graph captured with a narrower table (context_widths: CONTEXT_BUCKET_MIN tokens, doubling, up to
max_model_len). HYBRID_GRAPH_CONTEXT_BUCKETS=0 keeps one full-width graph a bucket.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch

from attention.kv_cache import DUMMY_PAGE
from graphs.padding import (
    CONTEXT_BUCKET_MAX_BATCH, bucket_for, context_widths, default_capture_sizes, is_plain_decode, is_plain_verify,
    pad_decode_batch, pad_verify_batch, padding_batch, padding_row, padding_verify_batch, verify_graph_sizes,
    verify_graphs_requested, verify_page_columns, width_for,
)
from graphs.piecewise import PiecewiseGraphs, default_piecewise_max_tokens
from state_pool.util import cdiv

if TYPE_CHECKING:
    from state_pool.step_batch import StepBatch

logger = logging.getLogger("hybrid")


class _Buffers:
    """Persistent inputs of the captured graphs, sized for the largest bucket."""

    FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "page_table", "kv_write_loc", "state_slot",
              "has_initial_state", "logits_indices")

    def __init__(self, size: int, max_pages: int, page_size: int, device: torch.device,
                 widths: list[int] | None = None) -> None:
        # every row starts as a padding row (capture runs on these): graphs/padding.py defines them
        self.padding = padding_batch(size, page_size, device, pages_per_row=max_pages)
        for field in self.FIELDS:
            setattr(self, field, getattr(self.padding, field))
        # one page table per context bucket width (contiguous rows: the attention kernel's layout)
        pad_page = padding_row(page_size)["page_table"]
        self.page_tables = {w: torch.full((size, w), pad_page, dtype=torch.int32, device=device)
                            for w in (widths or []) if w != max_pages}
        self.page_tables[max_pages] = self.page_table

    def batch(self, size: int, width: int | None = None) -> StepBatch:
        """The first `size` rows as a batch (views of the buffers), all of them padding rows; its page
        table the `width` bucket's (default the full one)."""
        views = {f: getattr(self, f)[: size + 1 if f == "query_start_loc" else size] for f in self.FIELDS}
        if width is not None:
            views["page_table"] = self.page_tables[width][:size]
        p = self.padding
        return dataclasses.replace(p, **views, num_decodes=size, query_lens_cpu=p.query_lens_cpu[:size],
                                   seq_lens_cpu=p.seq_lens_cpu[:size], state_slot_cpu=p.state_slot_cpu[:size],
                                   has_initial_state_cpu=p.has_initial_state_cpu[:size])

    def fill(self, batch: StepBatch, size: int, page_size: int, width: int | None = None) -> None:
        """Copy a real decode batch into rows [0, n) and padding into rows [n, size), in place; its
        page table into the `width` bucket's table (default the full one), whose pages must hold every
        row's sequence (the columns past them are unused: DUMMY_PAGE in the engine's table)."""
        n = batch.num_requests
        table = self.page_tables[width] if width is not None else self.page_table
        cols = min(batch.page_table.shape[1], table.shape[1])
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        table[:n, :cols].copy_(batch.page_table[:, :cols], non_blocking=True)
        if cols < table.shape[1]:
            table[:n, cols:].fill_(DUMMY_PAGE)
        self.kv_write_loc[:n].copy_(batch.kv_write_loc, non_blocking=True)
        self.state_slot[:n].copy_(batch.state_slot, non_blocking=True)
        self.has_initial_state[:n].copy_(batch.has_initial_state, non_blocking=True)
        if size > n:
            for field, value in padding_row(page_size).items():
                (table if field == "page_table" else getattr(self, field))[n:size].fill_(value)


class ModelRunner:
    def __init__(self, model, ctx, enforce_eager: bool = True, *, max_num_seqs: int | None = None,
                 max_model_len: int | None = None, page_size: int | None = None,
                 cuda_graph_sizes: list[int] | None = None, pad_decode: bool | None = None,
                 progress: bool = True, num_speculative_tokens: int = 0, pad_verify: bool | None = None,
                 piecewise_max_tokens: int | None = None, pad_piecewise: bool = False,
                 full_graphs: bool = True) -> None:
        """`piecewise_max_tokens`: steps the full graphs do not take, of at most this many tokens, replay piecewise
        graphs (graphs/piecewise.py; with graphs on; None: default_piecewise_max_tokens(), 0: none); `pad_piecewise`
        (no graphs, CPU tests): such steps run padded to their token bucket, eagerly. `full_graphs=False`: no
        whole-step graphs of decode and verify steps (those steps go piecewise too, or eager)."""
        self.model = model
        self.ctx = ctx
        self.enforce_eager = enforce_eager
        self.page_size = page_size or (ctx.kv_cache.page_size if ctx is not None and ctx.kv_cache is not None else 16)
        self.max_num_seqs = max_num_seqs or 1
        self.max_model_len = max_model_len
        sizes = cuda_graph_sizes if cuda_graph_sizes else default_capture_sizes(self.max_num_seqs)
        self.capture_sizes = sorted({int(s) for s in sizes if int(s) >= 1}) if full_graphs else []
        self.use_graphs = (not enforce_eager) and self._graphs_supported()
        self.pad_decode = self.use_graphs if pad_decode is None else pad_decode
        # bucket size -> page-table width (context bucket) -> (graph, its output)
        self.graphs: dict[int, dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]] = {}
        self.context_widths: list[int] = []
        self.buffers: _Buffers | None = None
        self.stats = {"graph_replays": 0, "padded_eager": 0, "eager": 0, "verify_graph_replays": 0,
                      "padded_verify_eager": 0, "piecewise_replays": 0, "padded_piecewise_eager": 0}
        self._ran: StepBatch | None = None  # the index tensors the last execute ran on
        # speculative verify steps: rows padded to K+1 tokens, graphs per bucket (module docstring)
        self.verify_q_len = num_speculative_tokens + 1 if num_speculative_tokens else 0
        self.verify_sizes = verify_graph_sizes(self.capture_sizes, self.max_num_seqs) if self.verify_q_len else []
        self.verify_graphs_on = (self.use_graphs and bool(self.verify_sizes)
                                 and verify_graphs_requested(num_speculative_tokens, model))
        self.pad_verify = self.verify_graphs_on if pad_verify is None else (pad_verify and bool(self.verify_sizes))
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.verify_buffers: StepBatch | None = None
        if piecewise_max_tokens is None:
            piecewise_max_tokens = default_piecewise_max_tokens() if self.use_graphs else 0
        self.piecewise: PiecewiseGraphs | None = None
        if piecewise_max_tokens and (self.use_graphs or pad_piecewise):
            self.piecewise = PiecewiseGraphs(model, ctx, piecewise_max_tokens, self._device())
            # verify rows go piecewise only where every Mamba layer's kernels run them (the pieces were captured
            # on the kernels' path; the torch path's core runs them itself)
            self.piecewise_verify = all(m.kernels is None or getattr(m.kernels, "supports_verify", False)
                                        for m in model.mamba_mixers())
        self.piecewise_graphs_on = self.use_graphs and self.piecewise is not None
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None  # every graph's: one pool
        if self.use_graphs and self.capture_sizes:
            self.capture(progress=progress)
            if self.verify_graphs_on:
                self.capture_verify()
            if self.piecewise_graphs_on:
                self.piecewise.capture(self.pool, progress=progress)

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

    # ------------------------------------------------------------------ warm-up
    @torch.inference_mode()
    def warm_up_prefill_kernels(self, max_tokens: int, varlen_tokens: int | None = None) -> int:
        """Compile the Mamba prefill kernels' specialisations now (MambaCudaKernels.warm_up_prefill):
        once per distinct layer shape and state dtype, on that layer's own pool tensors (their
        scratch row). `max_tokens`: the longest row (a prefill chunk); `varlen_tokens`: the most tokens a
        step's rows total (default max_tokens). Returns the prefill launches run (0 without the CUDA kernels).
        Under tensor parallelism this runs on the driver's rank only; the workers meet them on first use."""
        seen = set()
        runs = 0
        for mixer in self.model.mamba_mixers():
            if not hasattr(mixer.kernels, "warm_up_prefill"):
                continue
            conv_state, ssm_state = self.ctx.mamba_state(mixer.layer_index)
            key = (repr(mixer.cfg), conv_state.dtype, ssm_state.dtype, tuple(conv_state.shape[1:]))
            if key in seen:
                continue
            seen.add(key)
            runs += mixer.kernels.warm_up_prefill(mixer, conv_state, ssm_state, max_tokens, self.model.embed.dtype,
                                                  varlen_tokens)
        return runs

    def warm_up_moe_kernels(self, max_tokens: int) -> int:
        """Compile the fused MoE kernels' specialisations now (HybridModel.warm_up_moe). Returns the
        MoE layer calls run."""
        return self.model.warm_up_moe(max_tokens)

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        device = self._device()
        max_pages = cdiv(self.max_model_len, self.page_size)
        self.context_widths = context_widths(max_pages, self.page_size)
        self.buffers = _Buffers(max(self.capture_sizes), max_pages, self.page_size, device, self.context_widths)
        if getattr(self, "pool", None) is None:
            self.pool = torch.cuda.graph_pool_handle()
        sizes = sorted(self.capture_sizes, reverse=True)  # largest first: smaller ones reuse its pool
        it = sizes
        if progress:
            from tqdm import tqdm

            it = tqdm(sizes, desc="Capturing CUDA graphs", unit="graph")
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(device)[0]
        for size in it:
            # all padding rows: writes no live slot, only the dummy page; the widest table first
            self.graphs[size] = {w: self._capture_graph(self.buffers.batch(size, w))
                                 for w in reversed(self.widths_of(size))}
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        count = sum(len(g) for g in self.graphs.values())
        buckets = "" if len(self.context_widths) == 1 else \
            (f", sizes <= {CONTEXT_BUCKET_MAX_BATCH} also at contexts of "
             + ", ".join(str(w * self.page_size) for w in self.context_widths[:-1]) + " tokens")
        logger.info("captured %d CUDA graphs (batch sizes %s%s) in %.1f s, %.0f MiB", count,
                    self.capture_sizes, buckets, time.perf_counter() - start, used / 2**20)

    def widths_of(self, size: int) -> list[int]:
        """The page-table widths bucket `size` has graphs for (ascending)."""
        return self.context_widths if size <= CONTEXT_BUCKET_MAX_BATCH else self.context_widths[-1:]

    def _capture_graph(self, batch: StepBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """One graph of the model on `batch` (buffer views) into the shared pool: two eager runs first
        (JIT, autotuning, workspace allocation), then the capture. Returns (graph, its output)."""
        for _ in range(2):
            self.model(batch, self.ctx)
        torch.cuda.synchronize(self._device())
        # the step's Mamba metadata (index tensors derived from the buffers) must be built inside the
        # capture: the copy the eager runs cached lives outside the graph's pool and is freed with the
        # batch, after which the graph would read whatever reuses that memory
        batch.mamba_metadata = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model(batch, self.ctx)
        return graph, out

    @torch.inference_mode()
    def capture_verify(self) -> None:
        """The verify graphs, one per bucket of verify_sizes, on padding rows of K+1 tokens (their
        scratch rows are free: nothing is in flight at startup), into the decode graphs' pool. A
        kernel that cannot run the shape (say, no uniform-query attention for this head layout)
        turns verify graphs off, with a warning: verify steps then run eagerly."""
        device = self._device()
        q, ps = self.verify_q_len, self.page_size
        width = verify_page_columns(cdiv(self.max_model_len, ps), q, ps)
        self.verify_buffers = padding_verify_batch(max(self.verify_sizes), q, ps, device, width,
                                                   self.ctx.state_pool.spec_scratch)
        start = time.perf_counter()
        try:
            for size in sorted(self.verify_sizes, reverse=True):
                self.verify_graphs[size] = self._capture_graph(self._verify_view(size))
        except Exception as e:  # noqa: BLE001 - any kernel refusing the shape: verify steps stay eager
            torch.cuda.synchronize(device)
            self.verify_graphs.clear()
            self.verify_graphs_on = self.pad_verify = False
            logger.warning("verify graphs off (speculative verify steps run eagerly): capture failed: %s", e)
            return
        torch.cuda.synchronize(device)
        logger.info("captured %d verify graphs (batch sizes %s, %d tokens a row) in %.1f s", len(self.verify_graphs),
                    self.verify_sizes, q, time.perf_counter() - start)

    def _verify_view(self, size: int) -> StepBatch:
        """The first `size` rows of the verify buffers as a batch (views)."""
        b, q = self.verify_buffers, self.verify_q_len
        t = size * q
        return dataclasses.replace(
            b, input_ids=b.input_ids[:t], positions=b.positions[:t], kv_write_loc=b.kv_write_loc[:t],
            logits_indices=b.logits_indices[:t], query_start_loc=b.query_start_loc[:size + 1],
            seq_lens=b.seq_lens[:size], page_table=b.page_table[:size], state_slot=b.state_slot[:size],
            has_initial_state=b.has_initial_state[:size], scratch_index=b.scratch_index[:size],
            scratch_index_cpu=b.scratch_index_cpu[:size], num_verify=size, query_lens_cpu=b.query_lens_cpu[:size],
            seq_lens_cpu=b.seq_lens_cpu[:size], state_slot_cpu=b.state_slot_cpu[:size],
            has_initial_state_cpu=b.has_initial_state_cpu[:size])

    def verify_bucket(self, batch: StepBatch) -> int | None:
        """The bucket a speculative verify step is padded to (graph replay or padded eager), or None."""
        if not (self.pad_verify and is_plain_verify(batch)) or max(batch.query_lens_cpu) > self.verify_q_len:
            return None
        return bucket_for(batch.num_requests, self.verify_sizes)

    def replay_verify(self, batch: StepBatch, size: int) -> torch.Tensor:
        graph, out = self.verify_graphs[size]
        with torch.inference_mode():
            padded, rows = pad_verify_batch(batch, size, self.verify_q_len, self.page_size)
            view = self._verify_view(size)
            for f in ("input_ids", "positions", "kv_write_loc", "seq_lens", "state_slot", "scratch_index"):
                getattr(view, f).copy_(getattr(padded, f), non_blocking=True)
            width = padded.page_table.shape[1]
            view.page_table[:, :width].copy_(padded.page_table, non_blocking=True)
            view.page_table[:, width:].fill_(DUMMY_PAGE)
        graph.replay()
        self.stats["verify_graph_replays"] += 1
        # what ran: the buffers, with the host lists of the batch they were filled from (the view's
        # are the capture's padding values)
        self._ran = dataclasses.replace(
            view, seq_lens_cpu=padded.seq_lens_cpu, state_slot_cpu=padded.state_slot_cpu,
            scratch_index_cpu=padded.scratch_index_cpu, num_real_requests=padded.num_real_requests)
        return out[rows]

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
                return self.replay(batch, size)
            if self.pad_decode:
                self.stats["padded_eager"] += 1
                padded = pad_decode_batch(batch, size, self.page_size)
                self._ran = padded
                return self.model(padded, self.ctx)[: batch.num_requests]
        size = self.verify_bucket(batch)
        if size is not None:
            if size in self.verify_graphs and batch.page_table.shape[1] <= cdiv(self.max_model_len, self.page_size):
                return self.replay_verify(batch, size)
            self.stats["padded_verify_eager"] += 1
            padded, rows = pad_verify_batch(batch, size, self.verify_q_len, self.page_size)
            self._ran = padded
            return self.model(padded, self.ctx)[rows]
        size = self.piecewise_bucket(batch)
        if size is not None:
            self._ran = batch  # the cores ran on the batch itself
            if self.piecewise_graphs_on:
                self.stats["piecewise_replays"] += 1
                return self.piecewise.replay(batch, size)
            self.stats["padded_piecewise_eager"] += 1
            return self.piecewise.run_padded(batch, size)
        self.stats["eager"] += 1
        self._ran = batch
        return self.model(batch, self.ctx)

    def piecewise_bucket(self, batch: StepBatch) -> int | None:
        """The token bucket a step runs piecewise at (graphs/piecewise.py), or None."""
        if self.piecewise is None or (batch.num_verify and not self.piecewise_verify):
            return None
        return self.piecewise.bucket(batch.num_tokens)

    def inputs_that_ran(self) -> StepBatch:
        """The index tensors the last `execute` actually ran on: the graph input buffers (their first
        `size` rows, as filled), the padded eager batch, or the batch itself. For the state sanitizer,
        which checks them on the device in stream order (they are not refilled before the next step)."""
        return self._ran

    def replay(self, batch: StepBatch, size: int) -> torch.Tensor:
        width = width_for(batch.seq_lens_cpu, self.widths_of(size), self.page_size)
        graph, out = self.graphs[size][width]
        with torch.inference_mode():  # the buffers were made under inference mode (capture)
            self.buffers.fill(batch, size, self.page_size, width)
        self._ran = self.buffers.batch(size, width)
        graph.replay()
        self.stats["graph_replays"] += 1
        return out[: batch.num_requests].clone()
