"""The Mamba layers' per-step metadata: which token rows, slots and verify-scratch rows each batched
recurrence step of a StepBatch's verify and replay rows touches, and where its prefill chunks are.

As vLLM's Mamba2 metadata builder does, it is built once per step and read by every Mamba layer:
`step_metadata(batch)` builds it on first use (the first Mamba layer of the step) and caches it on
the batch (`StepBatch.mamba_metadata`), so the host work and the upload are paid once per step, not
once per layer; whoever builds a StepBatch (hybrid/launcher.py, graphs/padding.py, tests) needs to
do nothing for it. Every index tensor is a view of one int64 block uploaded in a single
non-blocking copy (`to_device`); nothing here waits for the device.

The row groups are computed here only, for both Mamba paths:
- `verify_groups` / `replay_groups`: rows of one kind with the same token count T, each group one
  T-token launch of our Triton kernels (hybrid/ops/mamba_cuda.py);
- `verify_positions` / `replay_positions`: token position j of every row still active at j, one
  batched one-token recurrence step each (the torch path, Mamba2Mixer._verify / _replay, and the
  library kernels' replay);
- `prefills`: each prefill chunk's token rows, slot and has_initial_state (host values); a chunk with
  state snapshots (StepBatch.state_snapshots) as consecutive segments on the same slot, each but the
  last naming the slot its state is copied to once it has run (`snapshot_slot`).
- `varlen`: with the "varlen_prefill" switch (on unless HYBRID_VARLEN_PREFILL=0), two or more prefill rows
  or a row with snapshots, none of them padding, as device tensors for one varlen launch a layer (a row's
  segments joined again, its snapshots as (tokens, slot) pairs the kernels store from inside the row).
A plain decode step (the shape the CUDA graphs capture) has none of these: its metadata is empty
and costs no torch op. A batch derived with dataclasses.replace (e.g. padded) builds its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.batch import StepBatch, to_device
from hybrid.ops.triton_guard import switch
from hybrid.ops.triton_mamba_varlen import VarlenRows, check_snapshot, varlen_rows

_ALIGN = 2  # int64 elements: every segment of the uploaded block starts 16-byte aligned (Triton pointer hints)


@dataclass(frozen=True)
class RowGroup:
    """Request rows of one kind with the same token count, run as one T-token launch."""
    num_tokens: int  # T
    tokens: torch.Tensor  # [b, T] int64: the token rows of each request's tokens, in order
    slots: torch.Tensor  # [b] int64: each request's Mamba slot
    scratch: torch.Tensor | None  # [b] int64: verify scratch rows (scratch_index); None for replay


@dataclass(frozen=True)
class TokenPosition:
    """Token position j of every row still active there (q_len > j), as one one-token step."""
    tokens: torch.Tensor  # [n] int64 token rows
    slots: torch.Tensor  # [n] int64 Mamba slots (verify: read at j = 0 only)
    scratch: torch.Tensor | None  # [n] verify: flat scratch row scratch_index * (K+1) + j; None for replay


@dataclass(frozen=True)
class PrefillRow:
    start: int  # first token row
    length: int  # tokens
    slot: int  # PAD_SLOT_ID for a padding row (touches no state)
    has_initial_state: bool
    # >= 0: once this row has run, every Mamba layer copies its slot's state here (a prefix-cache snapshot)
    snapshot_slot: int = -1

    def keep_snapshot(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """After this row ran in a Mamba layer (either path): its slot's state into its snapshot slot, if any."""
        if self.snapshot_slot >= 0:
            conv_state[self.snapshot_slot] = conv_state[self.slot]
            ssm_state[self.snapshot_slot] = ssm_state[self.slot]


@dataclass(frozen=True)
class MambaStepMetadata:
    verify_groups: tuple[RowGroup, ...] = ()
    verify_positions: tuple[TokenPosition, ...] = ()
    replay_groups: tuple[RowGroup, ...] = ()
    replay_positions: tuple[TokenPosition, ...] = ()
    prefills: tuple[PrefillRow, ...] = ()
    # the prefill rows as one varlen launch's device tensors (hybrid/ops/triton_mamba_varlen.py): with the
    # "varlen_prefill" switch, for steps of two or more prefill rows or one with snapshots, and no padding row
    varlen: VarlenRows | None = None


def _varlen(batch: StepBatch, first: int) -> VarlenRows | None:
    """The prefill request rows (from row `first` on) as one varlen launch a layer: two or more rows, or a row
    with snapshots (the varlen kernels store the state at each snapshot from inside the row, where the row path
    runs a conv and a scan call a segment). A single plain row keeps the row path: one scan call from its
    state, where the varlen path would recur over a long prompt's tokens once more for its final state."""
    rows = range(first, batch.num_requests)
    slots = [batch.state_slot_cpu[i] for i in rows]
    snapshots = [list(batch.state_snapshots.get(i, ())) for i in rows]
    if not switch("varlen_prefill") or any(s < 0 for s in slots):  # (padding rows: the row path)
        return None
    if len(slots) < 2 and not any(snapshots):
        return None
    return varlen_rows([batch.query_lens_cpu[i] for i in rows], slots, [batch.has_initial_state_cpu[i] for i in rows],
                       batch.state_slot.device, snapshots)


def _prefill_segments(batch: StepBatch, i: int, start: int) -> list[PrefillRow]:
    """Request row i (a prefill chunk from token row `start`) as PrefillRows: one, or one segment per
    state snapshot and the rest (StepBatch.state_snapshots), all on the row's slot."""
    length, slot, has_init = batch.query_lens_cpu[i], batch.state_slot_cpu[i], batch.has_initial_state_cpu[i]
    rows, done = [], 0
    for k, snapshot_slot in batch.state_snapshots.get(i, ()):
        check_snapshot(k, snapshot_slot, done, length, slot, f"prefill row {i}")
        rows.append(PrefillRow(start + done, k - done, slot, has_init or done > 0, snapshot_slot))
        done = k
    rows.append(PrefillRow(start + done, length - done, slot, has_init or done > 0))
    return rows


def step_metadata(batch: StepBatch) -> MambaStepMetadata:
    """The batch's Mamba metadata, built (and uploaded) on the first call, cached on the batch."""
    meta = batch.mamba_metadata
    if meta is None:
        meta = batch.mamba_metadata = build(batch)
    return meta


def _rows(batch: StepBatch, first: int, count: int) -> list[tuple[int, int, int, int]]:
    """(first token row, token count, slot, scratch index) of request rows [first, first + count)."""
    q_lens = batch.query_lens_cpu
    scratch = batch.scratch_index_cpu
    tok = sum(q_lens[:first])
    rows = []
    for i in range(first, first + count):
        rows.append((tok, q_lens[i], batch.state_slot_cpu[i], scratch[i] if scratch is not None else -1))
        tok += q_lens[i]
    return rows


class _Block:
    """Host int64 segments that become views of one uploaded tensor: add() returns a handle,
    upload() copies the whole block to the device at once, view(handle) is then that segment."""

    def __init__(self) -> None:
        self.values: list[int] = []
        self.flat: torch.Tensor | None = None

    def add(self, values: list[int], shape: tuple[int, ...] | None = None) -> tuple[int, int, tuple[int, ...]]:
        start = len(self.values)
        self.values.extend(values)
        self.values.extend([0] * (-len(self.values) % _ALIGN))
        return start, len(values), shape or (len(values),)

    def upload(self, device: torch.device) -> None:
        self.flat = to_device(self.values, torch.long, device)  # the step's one upload

    def view(self, handle) -> torch.Tensor | None:
        if handle is None:
            return None
        start, n, shape = handle
        return self.flat[start:start + n].view(shape)


def _uniform_verify(batch: StepBatch, T: int, width: int) -> MambaStepMetadata:
    """Verify rows only, all of T tokens (a padded verify batch, graphs/padding.pad_verify_batch, or
    one whose rows all have as many drafts): one group, its index tensors derived on the device from
    the batch's own slot and scratch tensors (no host values, no upload), so that a CUDA graph
    captured on one batch reads the next one's from the same buffers."""
    b = batch.num_requests
    tokens = torch.arange(b * T, device=batch.state_slot.device).view(b, T)
    slots, scratch = batch.state_slot, batch.scratch_index
    positions = tuple(TokenPosition(tokens[:, j], slots, scratch * width + j) for j in range(T))
    return MambaStepMetadata((RowGroup(T, tokens, slots, scratch),), positions)


def build(batch: StepBatch) -> MambaStepMetadata:
    """Compute the row groups, positions and prefill rows of `batch` and upload their index tensors
    in one copy (see the module docstring); use step_metadata(batch) to get the cached one."""
    nd, nv, nr = batch.num_decodes, batch.num_verify, batch.num_replay
    q_lens = batch.query_lens_cpu
    start = nd + sum(q_lens[nd:nd + nv + nr])
    prefills = []
    first_prefill = nd + nv + nr
    for i in range(first_prefill, batch.num_requests):
        prefills.extend(_prefill_segments(batch, i, start))
        start += q_lens[i]
    if not nv and not nr:  # decodes and prefills only (a captured decode step among them): no upload
        return MambaStepMetadata(prefills=tuple(prefills), varlen=_varlen(batch, first_prefill))

    # verify rows: position j of scratch row r is r * width + j in the flat view of a layer's scratch
    width = batch.state_scratch[0].shape[2] if nv else 0  # [layers, rows, K+1, ...]
    if batch.uniform_q_len:
        return _uniform_verify(batch, batch.uniform_q_len, width)
    block = _Block()
    planned = {}
    for kind, first, count in (("verify", nd, nv), ("replay", nd + nv, nr)):
        verify = kind == "verify"
        rows = _rows(batch, first, count)
        by_len: dict[int, list[tuple[int, int, int, int]]] = {}
        for r in rows:
            by_len.setdefault(r[1], []).append(r)
        groups = [(T, block.add([tok + j for tok, _, _, _ in g for j in range(T)], (len(g), T)),
                   block.add([slot for _, _, slot, _ in g]),
                   block.add([scr for _, _, _, scr in g]) if verify else None)
                  for T, g in by_len.items()]
        positions = []
        for j in range(max((T for _, T, _, _ in rows), default=0)):
            act = [r for r in rows if r[1] > j]
            positions.append((block.add([tok + j for tok, _, _, _ in act]),
                              block.add([slot for _, _, slot, _ in act]),
                              block.add([scr * width + j for _, _, _, scr in act]) if verify else None))
        planned[kind] = (groups, positions)
    block.upload(batch.state_slot.device)
    v = block.view

    def finish(kind):
        groups, positions = planned[kind]
        return (tuple(RowGroup(T, v(t), v(s), v(c)) for T, t, s, c in groups),
                tuple(TokenPosition(v(t), v(s), v(c)) for t, s, c in positions))

    verify_groups, verify_positions = finish("verify")
    replay_groups, replay_positions = finish("replay")
    return MambaStepMetadata(verify_groups, verify_positions, replay_groups, replay_positions, tuple(prefills),
                             _varlen(batch, first_prefill))
