"""Padding a decode batch up to a CUDA-graph bucket (runs on CPU too).

Padding rows: token 0 at position 0, seq_len 1, every page-table entry the dummy page (their KV
write lands in the dummy page), Mamba slot PAD_SLOT_ID (the torch path reads zeros and writes
nothing; the CUDA kernels skip them or point them at the pool's scratch row). The padded batch
keeps `num_real_requests`, and only the real rows' logits are returned by the runner.

Speculative verify steps are padded the same way, one level further (pad_verify_batch): every
row's tokens to K+1 (its drafts padded after the real ones), then the batch to a bucket of
padding rows of K+1 tokens, so that a verify step has one shape per bucket (the verify graphs).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from attention.kv_cache import DUMMY_PAGE
from state_pool.pool import PAD_SLOT_ID
from state_pool.step_batch import StepBatch, to_device
from state_pool.util import cdiv


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to and including max_num_seqs (vLLM's buckets)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


CONTEXT_BUCKET_MIN = 4096  # tokens: the narrowest context bucket
CONTEXT_BUCKET_MAX_BATCH = 16  # decode buckets up to this size get the narrower graphs


def context_buckets_on() -> bool:
    """Decode graphs per context bucket (graphs/runner.py), unless HYBRID_GRAPH_CONTEXT_BUCKETS=0."""
    return os.environ.get("HYBRID_GRAPH_CONTEXT_BUCKETS", "1") != "0"


def context_widths(max_pages: int, page_size: int) -> list[int]:
    """The page-table widths (pages) of the context buckets, ascending, the last max_pages:
    CONTEXT_BUCKET_MIN tokens doubling while at most half of max_pages (a bucket close to the full
    width would save little), just max_pages with the buckets off."""
    widths = []
    tokens = CONTEXT_BUCKET_MIN
    while context_buckets_on() and 2 * cdiv(tokens, page_size) <= max_pages:
        widths.append(cdiv(tokens, page_size))
        tokens *= 2
    return widths + [max_pages]


def width_for(seq_lens: list[int], widths: list[int], page_size: int) -> int:
    """The narrowest of `widths` whose pages hold every one of `seq_lens` (the last if none)."""
    need = cdiv(max(seq_lens, default=1), page_size)
    return next((w for w in widths if w >= need), widths[-1])


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """Smallest bucket holding n rows, or None when n is larger than every bucket."""
    for s in sizes:
        if s >= n:
            return s
    return None


def is_plain_decode(batch: StepBatch) -> bool:
    """A batch of one-token decodes only (the shape the graphs capture): no verify, replay or prefill rows."""
    if batch.num_prefills != 0 or batch.num_decodes != batch.num_requests or batch.num_requests == 0:
        return False
    if batch.num_tokens != batch.num_requests or getattr(batch, "num_verify", 0) or getattr(batch, "num_replay", 0):
        return False
    return int(batch.logits_indices.shape[0]) == batch.num_requests


def padding_row(page_size: int) -> dict[str, int | bool]:
    """The one definition of a padding row: its value for each per-row StepBatch field. The graph
    buffers (graphs/runner.py), the eager padding below and the memory plan's profiling decode batch
    (graphs/memory.py) all take their padding from here."""
    return dict(input_ids=0, positions=0, seq_lens=1, page_table=DUMMY_PAGE, kv_write_loc=DUMMY_PAGE * page_size,
                state_slot=PAD_SLOT_ID, has_initial_state=True)


def padding_batch(n: int, page_size: int, device, pages_per_row: int = 1) -> StepBatch:
    """A decode batch of n padding rows only (graph capture shape, memory profiling)."""
    pad = padding_row(page_size)

    def full(field: str, dtype: torch.dtype, *shape: int) -> torch.Tensor:
        return torch.full((n, *shape), pad[field], dtype=dtype, device=device)

    return StepBatch(
        input_ids=full("input_ids", torch.long), positions=full("positions", torch.long),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        seq_lens=full("seq_lens", torch.int32), page_table=full("page_table", torch.int32, pages_per_row),
        kv_write_loc=full("kv_write_loc", torch.long), state_slot=full("state_slot", torch.long),
        has_initial_state=full("has_initial_state", torch.bool),
        logits_indices=torch.arange(n, dtype=torch.long, device=device), num_decodes=n, num_prefills=0,
        query_lens_cpu=[1] * n, seq_lens_cpu=[pad["seq_lens"]] * n, state_slot_cpu=[pad["state_slot"]] * n,
        has_initial_state_cpu=[pad["has_initial_state"]] * n, num_real_requests=0,
    )


def pad_decode_batch(batch: StepBatch, size: int, page_size: int) -> StepBatch:
    """The decode batch with `size - n` padding rows appended (see module docstring)."""
    n = batch.num_requests
    pad = size - n
    if pad < 0:
        raise ValueError(f"cannot pad a batch of {n} requests to {size}")
    if pad == 0:
        return batch
    dev = batch.input_ids.device

    def extend(t: torch.Tensor, fill) -> torch.Tensor:
        return torch.cat([t, torch.full((pad, *t.shape[1:]), fill, dtype=t.dtype, device=dev)])

    qsl = batch.query_start_loc
    extra = qsl[-1:] + torch.arange(1, pad + 1, dtype=qsl.dtype, device=dev)
    row = padding_row(page_size)
    fields = ("input_ids", "positions", "seq_lens", "page_table", "kv_write_loc", "state_slot", "has_initial_state")
    return dataclasses.replace(
        batch,
        **{f: extend(getattr(batch, f), row[f]) for f in fields},
        query_start_loc=torch.cat([qsl, extra]),
        logits_indices=torch.cat([batch.logits_indices,
                                  torch.arange(n, size, dtype=batch.logits_indices.dtype, device=dev)]),
        num_decodes=size,
        num_prefills=0,
        query_lens_cpu=list(batch.query_lens_cpu) + [1] * pad,
        seq_lens_cpu=list(batch.seq_lens_cpu) + [row["seq_lens"]] * pad,
        state_slot_cpu=list(batch.state_slot_cpu) + [row["state_slot"]] * pad,
        has_initial_state_cpu=list(batch.has_initial_state_cpu) + [row["has_initial_state"]] * pad,
        num_real_requests=n,
    )


# ---------------------------------------------------------------------------------- verify steps
# Verify graphs (graphs/runner.py) are captured for buckets up to this many rows: each one's output
# holds the logits of rows x (K+1) tokens, and speculation pays most at small batches.
VERIFY_GRAPH_MAX_ROWS = 16


def verify_graph_sizes(capture_sizes: list[int], max_num_seqs: int) -> list[int]:
    """The buckets verify steps are padded to and their graphs captured for: the capture sizes up to
    VERIFY_GRAPH_MAX_ROWS and up to max_num_seqs, since the verify scratch has one row per sequence
    and a bucket's padding rows take the rows its real ones leave (a larger bucket, e.g. from
    cuda_graph_sizes, would run padding rows past the scratch's end)."""
    cap = min(VERIFY_GRAPH_MAX_ROWS, max_num_seqs)
    return [s for s in capture_sizes if s <= cap]


def verify_graphs_requested(num_speculative_tokens: int, model=None) -> bool:
    """Whether verify graphs are wanted: with speculation, unless HYBRID_VERIFY_GRAPHS=0 (on the
    H200 a batch-1 verify step replays in 5.1 ms against 20.7 ms eagerly, BENCHMARKS.md), and, given
    the model, when its Mamba kernels run verify rows themselves: the library decode kernels
    (mamba_decode_kernels="library") leave them to the torch path, which checks indices on the host
    and so cannot be captured."""
    if not num_speculative_tokens or os.environ.get("HYBRID_VERIFY_GRAPHS", "1") == "0":
        return False
    return model is None or all(getattr(m.kernels, "supports_verify", False) for m in model.mamba_mixers())


def is_plain_verify(batch: StepBatch) -> bool:
    """A batch of speculative verify rows only (each scores its last sampled token and its drafts, a
    logits row for every token): the shape the verify graphs capture, once every row is padded to
    the same q_len (pad_verify_batch)."""
    return (batch.num_requests > 0 and batch.num_verify == batch.num_requests and batch.num_decodes == 0
            and batch.num_prefills == 0 and batch.num_replay == 0 and batch.state_scratch is not None
            and int(batch.logits_indices.shape[0]) == batch.num_tokens)


def verify_page_columns(max_pages: int, q_len: int, page_size: int) -> int:
    """Page-table width of a padded verify batch: a row's padding tokens extend its KV length by up to
    q_len - 1 positions past max_model_len, all in dummy-page columns."""
    return max_pages + -(-q_len // page_size)


def pad_verify_batch(batch: StepBatch, size: int, q_len: int, page_size: int) -> tuple[StepBatch, torch.Tensor]:
    """The verify batch with every row's tokens padded to q_len and size - n padding rows appended;
    returns (padded, rows): rows [T] are the padded batch's token rows of the batch's tokens, in
    order (its logits rows, as is_plain_verify batches want one for every token).

    Padding tokens come after a row's real ones, so under the causal mask no real token sees them;
    they carry the padding token id at the row's last position (RoPE stays in range), write their
    KV into the dummy page, extend the row's KV length (the kernels see q_len tokens per row) in dummy-page
    columns, and leave their Mamba states in scratch positions the engine never commits. Padding
    rows are padding_row()'s, q_len tokens long, with the scratch rows the batch does not use (the
    scratch has a row per sequence, and a step's verify rows take rows 0 .. n-1)."""
    import numpy as np

    n = batch.num_requests
    q = np.asarray(batch.query_lens_cpu, dtype=np.int64)
    if size < n or int(q.max()) > q_len:
        raise ValueError(f"cannot pad a verify batch of {n} rows (q_len up to {int(q.max())}) to {size} x {q_len}")
    dev = batch.input_ids.device
    qsl = np.concatenate([[0], np.cumsum(q)])
    j = np.arange(q_len)
    src = np.zeros((size, q_len), dtype=np.int64)
    src[:n] = np.minimum(j[None, :], q[:, None] - 1) + qsl[:-1, None]
    real = np.zeros((size, q_len), dtype=bool)
    real[:n] = j[None, :] < q[:, None]
    rows = np.flatnonzero(real.ravel())
    total = size * q_len
    block = to_device(np.concatenate([src.ravel(), real.ravel().astype(np.int64), rows]), torch.long, dev)
    gather, real_t, rows_t = block[:total], block[total:2 * total].bool(), block[2 * total:]
    pad = padding_row(page_size)
    in_row = (torch.arange(total, device=dev) // q_len) < n
    input_ids = batch.input_ids[gather].masked_fill(~real_t, pad["input_ids"])
    positions = torch.where(in_row, batch.positions[gather], pad["positions"])
    kv_write_loc = torch.where(real_t, batch.kv_write_loc[gather], pad["kv_write_loc"])
    extra = q_len - q  # each real row's padding tokens: its KV length grows by as many
    seq_lens_cpu = [int(s + e) for s, e in zip(batch.seq_lens_cpu, extra)] + [q_len] * (size - n)
    width = verify_page_columns(batch.page_table.shape[1], q_len, page_size)
    page_table = torch.full((size, width), pad["page_table"], dtype=batch.page_table.dtype, device=dev)
    page_table[:n, : batch.page_table.shape[1]] = batch.page_table
    used = set(batch.scratch_index_cpu)
    spare = [r for r in range(size + n) if r not in used][: size - n]
    scratch_cpu = list(batch.scratch_index_cpu) + spare
    slots_cpu = list(batch.state_slot_cpu) + [pad["state_slot"]] * (size - n)
    small = to_device(seq_lens_cpu + scratch_cpu + slots_cpu, torch.long, dev)
    return dataclasses.replace(
        batch,
        input_ids=input_ids, positions=positions, kv_write_loc=kv_write_loc,
        query_start_loc=torch.arange(0, total + 1, q_len, dtype=batch.query_start_loc.dtype, device=dev),
        seq_lens=small[:size].to(batch.seq_lens.dtype), page_table=page_table,
        state_slot=small[2 * size:], has_initial_state=torch.ones(size, dtype=torch.bool, device=dev),
        logits_indices=torch.arange(total, dtype=batch.logits_indices.dtype, device=dev),
        num_decodes=0, num_prefills=0, num_verify=size, num_real_requests=n, uniform_q_len=q_len,
        scratch_index=small[size:2 * size], scratch_index_cpu=scratch_cpu,
        query_lens_cpu=[q_len] * size, seq_lens_cpu=seq_lens_cpu, state_slot_cpu=slots_cpu,
        has_initial_state_cpu=[True] * size,
    ), rows_t


def padding_verify_batch(n: int, q_len: int, page_size: int, device, width: int,
                         state_scratch: tuple[torch.Tensor, torch.Tensor]) -> StepBatch:
    """A verify batch of n padding rows of q_len tokens (the verify graphs' capture shape and input
    buffers): padding_row()'s values, scratch rows 0 .. n-1 (nothing is in flight at capture)."""
    pad = padding_row(page_size)
    t = n * q_len

    def full(field: str, dtype: torch.dtype, *shape: int) -> torch.Tensor:
        return torch.full(shape, pad[field], dtype=dtype, device=device)

    return StepBatch(
        input_ids=full("input_ids", torch.long, t), positions=full("positions", torch.long, t),
        query_start_loc=torch.arange(0, t + 1, q_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((n,), q_len, dtype=torch.int32, device=device),
        page_table=full("page_table", torch.int32, n, width), kv_write_loc=full("kv_write_loc", torch.long, t),
        state_slot=full("state_slot", torch.long, n), has_initial_state=full("has_initial_state", torch.bool, n),
        logits_indices=torch.arange(t, dtype=torch.long, device=device), num_decodes=0, num_prefills=0,
        query_lens_cpu=[q_len] * n, seq_lens_cpu=[q_len] * n, state_slot_cpu=[pad["state_slot"]] * n,
        has_initial_state_cpu=[True] * n, num_real_requests=0, num_verify=n,
        scratch_index=torch.arange(n, dtype=torch.long, device=device), scratch_index_cpu=list(range(n)),
        state_scratch=state_scratch, uniform_q_len=q_len,
    )


# ---------------------------------------------------------------------------------- piecewise steps
def token_bucket_batch(input_ids: torch.Tensor) -> StepBatch:
    """The batch a piecewise capture (graphs/piecewise.py) runs the model's hidden_states on: the bucket's
    input ids as one prefill row of padding (no slot, the dummy page). The pieces read only its input ids and
    its kind (not a decode-only or verify step, so every layer takes its general path); no core ever runs on
    it: the cores run on the real batch."""
    t = int(input_ids.shape[0])
    dev = input_ids.device
    pad = padding_row(1)
    return StepBatch(
        input_ids=input_ids, positions=torch.zeros(t, dtype=torch.long, device=dev),
        query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
        page_table=torch.full((1, 1), pad["page_table"], dtype=torch.int32, device=dev),
        kv_write_loc=torch.full((t,), pad["kv_write_loc"], dtype=torch.long, device=dev),
        state_slot=torch.full((1,), pad["state_slot"], dtype=torch.long, device=dev),
        has_initial_state=torch.zeros(1, dtype=torch.bool, device=dev),
        logits_indices=torch.tensor([t - 1], dtype=torch.long, device=dev), num_decodes=0, num_prefills=1,
        query_lens_cpu=[t], seq_lens_cpu=[t], state_slot_cpu=[pad["state_slot"]], has_initial_state_cpu=[False],
        num_real_requests=0,
    )
