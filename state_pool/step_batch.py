"""The step batch: everything one forward pass needs, built by the engine (hybrid/launcher.py)
from the scheduler's output. It lives in state_pool/, the lowest package (it owns the slots and
PAD_SLOT_ID, the core of this contract), and is re-exported by hybrid.batch, because state_pool/,
attention/ and graphs/ read it without importing the runtime.

Requests are ordered decodes first, then prefill chunks (verify and replay rows, below, sit
between them), so that a decode-only step has exactly the shape the CUDA-graph wrapper captures.
All index tensors live on the model's device; the `*_cpu` lists are host copies so that no step
has to synchronise the device to read them.

Index contract shared by state_pool/, attention/ and graphs/:
- `state_slot[i]` is the Mamba slot request i reads and writes; `PAD_SLOT_ID` (-1) marks padding
  rows, which must never read or write a live slot.
- `page_table[i]` lists request i's KV pages; padding rows point at the dummy page 0 and have
  `seq_lens = 1`.
- `has_initial_state[i]` is False for a request's first chunk: its initial state is zero
  whatever its slot holds (so a recycled slot can never leak state).

Speculative verify rows (n-gram speculative decoding, hybrid/spec_decode.py) sit between the
decodes and the prefills: order is [decodes | verifies | prefills], `num_verify` counts them and
`num_prefills` counts only prefill chunks. A verify row i has q_len = 1 + its number of drafts
tokens (its last sampled token, then the drafts), has_initial_state True, seq_lens counting all
of them and a logits row for every one of them. The Mamba layers run those tokens with the decode
recurrence (no dt clamp: they are generated tokens), reading the initial state from
`state_slot[i]` but writing NOT to the slot: the conv and SSM state after the row's j-th token go
to `state_scratch[.][layer, scratch_index[i], j]`. After sampling, the engine copies the position
of the last accepted token into the slot (MambaStatePool.commit_spec); rejected positions leave
nothing in the slot, and their KV rows lie beyond the committed seq_len, to be overwritten.
Attention treats a verify row like a prefill chunk with context (causal over the new tokens).

Replay rows (a preempted sequence, readmitted, rebuilding the state of the tokens it had already
generated; see hybrid/scheduler.py) sit between the verifies and the prefills: order is
[decodes | verifies | replays | prefills], `num_replay` counts them, and neither `num_decodes`
(plain one-token decodes only, the shape the CUDA graphs capture) nor `num_prefills` includes
them. A replay row i has q_len >= 1 known tokens (q_len >= 2, or one token that is not the
sequence's last), has_initial_state True, seq_lens counting all of them, and one logits row
(for its last token) only when it reaches the sequence's last token. The Mamba layers run its
tokens with the decode recurrence, token after token (no dt clamp: they were generated tokens
and first ran as decodes, so the rebuilt state is the one the decodes built), reading and
writing `state_slot[i]` in place like a decode. Attention treats it like a prefill chunk with
context. Padding never occurs in replay rows.

State snapshots (prefix caching, hybrid/prefix_cache.py): `state_snapshots[i] = [(k, slot), ...]`
asks prefill row i to leave, besides its own slot's state after all its tokens, a copy of every
Mamba layer's conv and SSM state after its first k tokens (0 < k < q_len, ascending) in `slot`, a
slot the prefix cache owns and no row reads or writes. The Mamba layers run such a row as segments
[0, k) [k, ...) in order, the state carried between them through the row's slot exactly as between
two prefill chunks, so the prompt needs no step that ends at its caching point.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list / numpy array as a tensor on `device`, without waiting for the device: a plain
    torch.tensor(..., device=cuda) copies synchronously, stalling the host until every queued kernel
    has run (which would undo async scheduling). The pinned staging block stays reserved until the
    copy is done (the caching host allocator tracks it)."""
    t = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


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
    num_real_requests: int = -1  # rows after this are padding (graph buckets); -1 means all real
    # Speculative verify (see the module docstring): requests [num_decodes, num_decodes + num_verify)
    # each score their last sampled token plus query_lens_cpu[i] - 1 drafts.
    num_verify: int = 0
    scratch_index: torch.Tensor | None = None  # [B] int64 verify scratch row, -1 for non-verify rows
    scratch_index_cpu: list[int] | None = None
    # (spec_conv, spec_ssm) of the state pool, every layer: [layers, rows, K+1, ...]; None if no verify
    state_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
    # Replay (see the module docstring): requests [num_decodes + num_verify, ... + num_replay)
    # rebuild a readmitted sequence's state from its known generated tokens, decode recurrence in place.
    num_replay: int = 0
    # > 0: every row is a verify row of exactly this many tokens, its drafts padded (the runner's padded
    # verify batches, graphs/padding.pad_verify_batch): the kernels may then treat the step as uniform
    # (attention: one query length per request; Mamba: one T-token group from the batch's own tensors)
    uniform_q_len: int = 0
    # prefill row -> [(tokens into the row, snapshot slot)] (see the module docstring); empty: none
    state_snapshots: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # The Mamba layers' per-step index tensors (hybrid/mamba_metadata.py: verify / replay row groups,
    # prefill rows), built once per batch on first use and read by every layer. Not an __init__
    # argument, so dataclasses.replace (a padded batch) starts without it and builds its own.
    mamba_metadata: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_requests(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
