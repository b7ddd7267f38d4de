"""Padding a decode batch up to a CUDA-graph bucket (runs on CPU too).

Padding rows: token 0 at position 0, seq_len 1, every page-table entry the dummy page (their KV
write lands in the dummy page), Mamba slot PAD_SLOT_ID (the torch path reads zeros and writes
nothing; the CUDA kernels skip them or point them at the pool's scratch row). The padded batch
keeps `num_real_requests`, and only the real rows' logits are returned by the runner.
"""
from __future__ import annotations

import dataclasses

import torch

from attention.kv_cache import DUMMY_PAGE
from state_pool.pool import PAD_SLOT_ID
from state_pool.step_batch import StepBatch


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to and including max_num_seqs (vLLM's buckets)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


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
