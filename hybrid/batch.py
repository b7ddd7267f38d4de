"""The step batch: everything one forward pass needs, built by the engine.

Requests are ordered decodes first, then prefill chunks, so that a decode-only step has exactly
the shape the CUDA-graph wrapper captures. All index tensors live on the model's device; the
`*_cpu` lists are host copies so that no step has to synchronise the device to read them.

Index contract shared by state_pool/, attention/ and graphs/:
- `state_slot[i]` is the Mamba slot request i reads and writes; `PAD_SLOT_ID` (-1) marks padding
  rows, which must never read or write a live slot.
- `page_table[i]` lists request i's KV pages; padding rows point at the dummy page 0 and have
  `seq_lens = 1`.
- `has_initial_state[i]` is False for a request's first chunk: its initial state is zero
  whatever its slot holds (so a recycled slot can never leak state).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T] int64, new tokens of all requests, flattened
    positions: torch.Tensor  # [T] int64, absolute position of each token
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32, KV length of each request after this step
    page_table: torch.Tensor  # [B, max_pages] int32
    kv_write_loc: torch.Tensor  # [T] int64, flat KV row (page * page_size + offset) of each new token
    state_slot: torch.Tensor  # [B] int64, Mamba slot per request, PAD_SLOT_ID for padding rows
    has_initial_state: torch.Tensor  # [B] bool
    logits_indices: torch.Tensor  # [R] int64, token rows whose logits are wanted
    num_decodes: int  # the first num_decodes requests are one-token decodes
    num_prefills: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    state_slot_cpu: list[int]
    has_initial_state_cpu: list[bool]
    # Speculative verify: per-request number of draft tokens scored in this step (0 if none).
    # When any is > 0 the Mamba layers keep the state after every token in `state_scratch`.
    num_real_requests: int = -1  # rows after this are padding (graph buckets); -1 means all real

    @property
    def num_requests(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes
