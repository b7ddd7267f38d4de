"""Piecewise CUDA graphs: steps the full graphs do not take (prefill, mixed, large decode batches) of at most
`max_tokens` tokens.

The host issues a few hundred launches for such a step (norms, projections, MLPs, experts, a Mamba layer's
conv and scan), which on a short prefill takes longer than the GPU's work. Only the layers' cores
(hybrid/step_cores.py: a Mamba layer's conv, scan and state writes, an attention layer's rope, KV write and
attention) read the batch; everything else depends on the token count alone. So, per token bucket, the model's
hidden_states is captured as a chain of graphs ("pieces") split at each core, and a step of n <= bucket tokens
runs:

    fill the bucket's input ids (rows n.. are padding: token 0)
    replay piece 0; run core 0 eagerly on the real batch, its inputs the first n rows piece 0 wrote, and copy
    its output into the rows piece 1 reads (padding rows zero); replay piece 1; ... ; replay the last piece
    logits of the real rows from the last piece's output, eagerly

Padding tokens never reach a core, so they read and write no Mamba slot and no KV page; within the pieces every
operation is row-wise (a padding row's routing picks some expert for itself alone), so real rows do not see them.

Memory: the pieces are captured into the runner's graph pool. A tensor that crosses a core (the core's inputs
and output) is held only as a non-owning view, so the pool reuses its memory after its last use in capture
order, exactly as within one graph; replays run in capture order, so the reuse is safe. Only the last piece's
output stays owned. On the CPU (tests) the same padded step runs eagerly (`run_padded`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from graphs.padding import bucket_for, token_bucket_batch
from hybrid.step_cores import Core, core_boundary

logger = logging.getLogger("hybrid")


DEFAULT_MAX_TOKENS = 512


def default_piecewise_max_tokens() -> int:
    """The largest piecewise bucket with graphs on: HYBRID_PIECEWISE_MAX_TOKENS, 512 by default (a second turn after
    a prefix-cache hit and the short prefills of chat traffic; 0: none). Measured with `bash bench/run_device.sh
    piecewise` (the GPU tests and the prefix-hit A/B) and `piecewise-state`."""
    value = os.environ.get("HYBRID_PIECEWISE_MAX_TOKENS", str(DEFAULT_MAX_TOKENS))
    try:
        tokens = int(value)
    except ValueError:
        raise ValueError(f"HYBRID_PIECEWISE_MAX_TOKENS must be a whole number of tokens, got {value!r}") from None
    if tokens < 0:
        raise ValueError(f"HYBRID_PIECEWISE_MAX_TOKENS must be >= 0, got {tokens}")
    return tokens


def piecewise_sizes(max_tokens: int) -> list[int]:
    """The token buckets: 8, 16, then every multiple of 32 up to max_tokens (the last bucket max_tokens).
    Multiples of 32 keep a padded prefill within 32 tokens of its length (its GEMMs pay for the padding)."""
    sizes = [s for s in (8, 16) if s < max_tokens] + list(range(32, max_tokens, 32))
    return sorted(set(sizes + [max_tokens])) if max_tokens >= 1 else []


def weak_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory (same offset, shape and strides) that does not keep that memory allocated."""
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is None:  # (older torch: an owning view; the pool then keeps the crossing tensors)
        return t.detach()
    storage = t.untyped_storage()
    view = torch.empty(0, dtype=t.dtype, device=t.device)
    view.set_(make(storage.data_ptr(), t.device, storage.nbytes()), t.storage_offset(), t.shape, t.stride())
    return view


@dataclasses.dataclass
class CoreCall:
    """One core of a captured step: its inputs and output, bucket rows each."""
    core: Core
    tokens: tuple[torch.Tensor, ...]
    out: torch.Tensor

    def run(self, batch, n: int) -> None:
        """The core on the real batch (its n tokens); the output's padding rows zero (finite inputs for the
        next piece)."""
        o = self.core(batch, *(t[:n] for t in self.tokens))
        self.out[:n].copy_(o.reshape(self.out[:n].shape))
        if n < self.out.shape[0]:
            self.out[n:].zero_()


class _RunPadded:
    """Core boundary of an eager padded step: each core runs on the real batch at once."""

    def __init__(self, batch, n: int) -> None:
        self.batch, self.n = batch, n

    def __call__(self, core: Core, _batch, tokens, out_tail, out_dtype) -> torch.Tensor:
        out = torch.empty((tokens[0].shape[0], *out_tail), dtype=out_dtype, device=tokens[0].device)
        CoreCall(core, tokens, out).run(self.batch, self.n)
        return out


class _SkipCores:
    """Core boundary of the warm-up before a capture: no core runs (zeros instead); the pieces' kernels compile."""

    def __call__(self, core: Core, _batch, tokens, out_tail, out_dtype) -> torch.Tensor:
        return torch.zeros((tokens[0].shape[0], *out_tail), dtype=out_dtype, device=tokens[0].device)


class _Capture:
    """Core boundary of a capture: ends the current piece, records the core, begins the next piece."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.cores: list[CoreCall] = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        graph, self.graph = self.graph, None
        graph.capture_end()
        self.pieces.append(graph)

    def __call__(self, core: Core, _batch, tokens, out_tail, out_dtype) -> torch.Tensor:
        self.end()
        self.begin()
        # allocated in the next piece's capture: the pool keeps it until the piece's last use of it
        out = torch.empty((tokens[0].shape[0], *out_tail), dtype=out_dtype, device=tokens[0].device)
        self.cores.append(CoreCall(core, tuple(weak_view(t) for t in tokens), weak_view(out)))
        return out


@dataclasses.dataclass
class _CapturedStep:
    pieces: list[torch.cuda.CUDAGraph]
    cores: list[CoreCall]
    x: torch.Tensor  # the last piece's output (owned)
    residual: torch.Tensor


class PiecewiseGraphs:
    """The token buckets' captured steps (capture, replay), and the same steps run padded and eagerly (run_padded:
    the CPU tests, and the reference a replay is checked against)."""

    def __init__(self, model, ctx, max_tokens: int, device: torch.device) -> None:
        self.model, self.ctx = model, ctx
        self.sizes = piecewise_sizes(max_tokens)
        self.input_ids = torch.zeros(max(self.sizes, default=1), dtype=torch.long, device=device)
        self.steps: dict[int, _CapturedStep] = {}

    def bucket(self, num_tokens: int) -> int | None:
        return bucket_for(num_tokens, self.sizes)

    def _fill_ids(self, batch, size: int) -> torch.Tensor:
        n = batch.num_tokens
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        if n < size:
            self.input_ids[n:size].zero_()
        return self.input_ids[:size]

    @torch.inference_mode()
    def run_padded(self, batch, size: int) -> torch.Tensor:
        """The step padded to `size` tokens, eagerly (what a replay computes): logits of the batch's rows."""
        ids = self._fill_ids(batch, size)
        with core_boundary(_RunPadded(batch, batch.num_tokens)):
            x, residual = self.model.hidden_states(token_bucket_batch(ids), self.ctx)
        return self.model.logits_of(x, residual, batch.logits_indices)

    @torch.inference_mode()
    def replay(self, batch, size: int) -> torch.Tensor:
        """The step on bucket `size`'s captured pieces: logits of the batch's rows."""
        step = self.steps[size]
        n = batch.num_tokens
        self._fill_ids(batch, size)
        for i, piece in enumerate(step.pieces):
            piece.replay()
            if i < len(step.cores):
                step.cores[i].run(batch, n)
        return self.model.logits_of(step.x, step.residual, batch.logits_indices)

    @torch.inference_mode()
    def capture(self, pool, progress: bool = True) -> None:
        """Capture every bucket, largest first, into `pool`. A bucket whose capture fails (a kernel that
        synchronises with the host at that size) and every larger one stay eager, with a warning."""
        device = self.input_ids.device
        sizes = sorted(self.sizes, reverse=True)
        it = sizes
        if progress:
            from tqdm import tqdm

            it = tqdm(sizes, desc="Capturing piecewise CUDA graphs", unit="graph")
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(device)[0]
        stream = torch.cuda.Stream(device)
        for size in it:
            try:
                self.steps[size] = self._capture_step(size, pool, stream)
            except Exception as e:  # noqa: BLE001 - any kernel refusing capture: this bucket and larger stay eager
                torch.cuda.synchronize(device)
                self.steps = {s: step for s, step in self.steps.items() if s < size}
                logger.warning("piecewise CUDA graphs: capture at %d tokens failed (steps of more tokens run "
                               "eagerly): %s", size, e)
        self.sizes = sorted(self.steps)  # (a failed bucket and the larger ones are no buckets)
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured piecewise CUDA graphs for %d token buckets (up to %d tokens, %d pieces each) in "
                    "%.1f s, %.0f MiB", len(self.steps), max(self.sizes, default=0),
                    len(next(iter(self.steps.values())).pieces) if self.steps else 0,
                    time.perf_counter() - start, used / 2**20)

    def _capture_step(self, size: int, pool, stream: torch.cuda.Stream) -> _CapturedStep:
        ids = self.input_ids[:size]
        ids.zero_()
        batch = token_bucket_batch(ids)
        with core_boundary(_SkipCores()):  # compile and tune the pieces' kernels at this size first (twice, as the
            for _ in range(2):             # full graphs' captures: first-call-only work settles in the first)
                self.model.hidden_states(batch, self.ctx)
        torch.cuda.synchronize(ids.device)
        capture = _Capture(pool)
        stream.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(stream):
            capture.begin()
            try:
                with core_boundary(capture):
                    x, residual = self.model.hidden_states(batch, self.ctx)
                capture.end()
            except BaseException:
                if capture.graph is not None:
                    try:
                        capture.graph.capture_end()
                    except Exception:  # noqa: BLE001 - the capture is invalid already; the first error is raised
                        pass
                raise
        torch.cuda.current_stream(ids.device).wait_stream(stream)
        return _CapturedStep(capture.pieces, capture.cores, x, residual)
