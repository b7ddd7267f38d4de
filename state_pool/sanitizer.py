"""The state sanitizer: checks a StepBatch against the live slots and pages, in two halves.

Enabled with LLM(..., check_state=True) or HYBRID_CHECK_STATE=1. With it on, freed slots are also
poisoned with NaN (MambaStatePool.poison_freed), so a read that slips past these checks shows up
as NaN logits, which the engine reports too. With it off nothing here runs.

- Before the step runs, on the host (`check_batch`): the batch's host copies against what the
  scheduler placed (no device read, so no sync: a sync would serialize the steps that async
  scheduling overlaps, hiding the races this should catch). A failure refuses the step.
- After the step is queued, on the device (`ExpectedInputs.faults`): the index tensors that actually
  ran (the CUDA-graph input buffers after they were filled, the padded eager batch, or the batch
  itself) against what the host check derived from the owners, including the padding rows the
  runner added. The per-row fault bits come back with the sampled tokens, where the host waits
  anyway; a fault fails the step's requests (and the owners of any slot a faulty row named).

What is checked, for every row of the batch:
- a real row (request) reads and writes exactly the slot its request owns, that slot is live, and
  no two rows share a slot;
- a padding row (slot PAD_SLOT_ID, or a row at or after `num_real_requests`) points at PAD_SLOT_ID
  or at the pool's scratch row, never at a live slot, and its page table holds only the dummy page;
- every KV row a request writes lies in a page it owns, that page is live and not shared with
  another sequence (refcount 1: shared prompt pages are read-only), and its page-table entries
  are live pages.
- verify rows (speculative decoding) use distinct scratch rows inside the scratch tensor: their
  host copies in the host half, their device copies as they ran (the padding rows of a padded
  verify step included) in the device half;
- a real row's KV length (seq_lens) and token count are its request's (where the owner states them:
  the context before the step plus the tokens it runs; a padded verify row's padding tokens on top,
  as it ran), so attention reads exactly the positions the request has; a padding row's length
  covers its own tokens and stays inside its page-table row (all dummy pages);
- a real row's context (KV length less its tokens) is the number of tokens the state in its slot
  has absorbed, as the resources count them from the slot's own history (`RowOwner.state_len`:
  zero when allocated, plus each launched chunk, plus a verify's accepted inputs, copied with the
  state by forks and prefix-cache copies): a scheduler count that is off by any amount within the
  sequence (a token applied twice, or skipped) is refused.
Replay rows (a readmitted sequence's known generated tokens) are ordinary real rows: they write
their own slot and their own pages, and get exactly the checks above.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from state_pool.errors import StateCorruptionError
from state_pool.pool import PAD_SLOT_ID
from state_pool.step_batch import StepBatch, to_device
from state_pool.util import cdiv

# fault bits of one row, as ExpectedInputs.faults reports them
SLOT_FAULT, KV_WRITE_FAULT, PAGE_TABLE_FAULT, SCRATCH_FAULT, SEQ_LEN_FAULT = 1, 2, 4, 8, 16


@dataclass
class RowOwner:
    """Who a real batch row belongs to, as the scheduler sees it."""

    name: str  # e.g. "request 'gen-3' (branch 1)"
    slot: int
    pages: list[int]
    seq_len: int = -1  # KV length after the step (context + the tokens it runs); -1: not stated
    q_len: int = -1  # tokens the row runs; -1: not stated
    max_len: int = -1  # tokens the sequence has to run (known, in flight, drafts): -1: not stated
    state_len: int = -1  # tokens the state in its slot has absorbed, by the slot's own ledger: -1: not kept


@dataclass
class ExpectedInputs:
    """What the kernels of a checked step must read, derived on the host from the owners (not from
    the batch's device tensors): the real rows' Mamba slots, the KV row of every token they write
    and the leading page-table entries they read. Rows the runner appends are padding rows."""

    num_real: int
    slots: list[int]  # [num_real]
    kv_write_loc: np.ndarray  # [tokens of the real rows] int64
    token_rows: np.ndarray  # [tokens of the real rows] the row of each
    page_rows: np.ndarray  # flat (row, column) -> page of every page-table entry a real row reads
    page_cols: np.ndarray
    page_values: np.ndarray
    scratch_slot: int
    dummy_page: int
    page_size: int
    seq_lens: np.ndarray | None = None  # [num_real] KV length of each real row after the step (host copy)

    def faults(self, ran: StepBatch) -> torch.Tensor:
        """Fault bits per row of `ran` (the batch as it ran, padding rows included), int32, on the
        device and without a host sync. Real rows: the slot, the KV write rows and the page-table
        entries equal the expected ones. Padding rows: slot PAD_SLOT_ID or the scratch slot, KV
        writes into the dummy page (or none), a page table of dummy pages only."""
        dev = ran.state_slot.device
        rows = int(ran.state_slot.shape[0])
        n, t = self.num_real, len(self.kv_write_loc)
        consistent = True
        slot = ran.state_slot
        real = torch.arange(rows, device=dev) < n
        want_slot = torch.full((rows,), PAD_SLOT_ID, dtype=slot.dtype, device=dev)
        want_slot[:n] = to_device(self.slots, slot.dtype, dev)
        pad_ok = (slot == PAD_SLOT_ID) | (slot == self.scratch_slot)
        bad_slot = torch.where(real, slot != want_slot, ~pad_ok)
        # KV writes: each real row's real tokens come first in its rows of `ran` (in the order they were
        # scheduled); every other token (a padding row's, or a padded verify row's padding tokens) may
        # write only into the dummy page. Where the tokens lie comes from ran's host query lengths.
        loc = ran.kv_write_loc
        ran_q = np.asarray(ran.query_lens_cpu, dtype=np.int64)
        counts = np.bincount(np.asarray(self.token_rows, dtype=np.int64), minlength=n)[:n]
        if len(ran_q) != rows or loc.shape[0] != int(ran_q.sum()) or (ran_q[:n] < counts).any() \
                or int(counts.sum()) != t:  # shapes are host metadata: no sync to see this
            kv_faults = torch.ones(rows, dtype=torch.int32, device=dev)
            consistent = False
        else:
            row_of = np.repeat(np.arange(rows), ran_q)
            in_row = np.arange(len(row_of)) - np.repeat(np.cumsum(ran_q) - ran_q, ran_q)
            real_tok = (row_of < n) & (in_row < np.append(counts, 0)[np.minimum(row_of, n)])
            real_pos, pad_pos = np.flatnonzero(real_tok), np.flatnonzero(~real_tok)
            want_loc = to_device(self.kv_write_loc, loc.dtype, dev)
            real_i, pad_i = to_device(real_pos, torch.long, dev), to_device(pad_pos, torch.long, dev)
            pads = loc[pad_i]
            dummy = torch.div(pads, self.page_size, rounding_mode="floor") == self.dummy_page
            bad_loc = torch.zeros(len(row_of), dtype=torch.int32, device=dev)
            bad_loc[real_i] = (loc[real_i] != want_loc).int()
            bad_loc[pad_i] = (~(dummy | (pads < 0))).int()
            kv_faults = torch.zeros(rows, dtype=torch.int32, device=dev).index_add_(
                0, to_device(row_of, torch.long, dev), bad_loc)
        # page tables: the entries a real row reads; every entry of a padding row
        table = ran.page_table
        read = table[to_device(self.page_rows, torch.long, dev), to_device(self.page_cols, torch.long, dev)]
        bad_read = (read != to_device(self.page_values, table.dtype, dev)).int()
        pt_faults = torch.zeros(rows, dtype=torch.int32, device=dev).index_add_(
            0, to_device(self.page_rows, torch.long, dev), bad_read)
        pt_faults[n:] += (table[n:] != self.dummy_page).sum(dim=1).int()
        seq_faults = self._seq_len_faults(ran, rows, ran_q, counts) if consistent else \
            torch.ones(rows, dtype=torch.int32, device=dev)
        return (bad_slot.int() * SLOT_FAULT + (kv_faults > 0).int() * KV_WRITE_FAULT
                + (pt_faults > 0).int() * PAGE_TABLE_FAULT + _scratch_faults(ran, rows) * SCRATCH_FAULT
                + seq_faults * SEQ_LEN_FAULT)

    def _seq_len_faults(self, ran: StepBatch, rows: int, ran_q: np.ndarray, counts: np.ndarray) -> torch.Tensor:
        """[rows] int32: 1 for a real row whose device KV length is not its request's (plus the padding
        tokens a padded verify row ran with), and for any row whose length is shorter than the tokens
        it runs or reaches past its page-table row (the kernels would read the next row's pages)."""
        n = self.num_real
        lo = ran_q.astype(np.int64)
        hi = np.full(rows, int(ran.page_table.shape[1]) * self.page_size, dtype=np.int64)
        if self.seq_lens is not None:  # the real rows' lengths are known exactly
            lo[:n] = hi[:n] = self.seq_lens + (ran_q[:n] - counts)
        bounds = to_device(np.concatenate([lo, hi]), ran.seq_lens.dtype, ran.seq_lens.device)
        seq = ran.seq_lens[:rows]
        return ((seq < bounds[:rows]) | (seq > bounds[rows:])).int()


def _scratch_faults(ran: StepBatch, rows: int) -> torch.Tensor:
    """[rows] int32: 1 for a verify row (real or padding) whose scratch row, as it ran, lies outside
    the verify scratch or is another verify row's too (the kernels would write past the scratch, or
    two rows' per-token states into the same place)."""
    dev = ran.state_slot.device
    bad = torch.zeros(rows, dtype=torch.int32, device=dev)
    nv, idx = ran.num_verify, ran.scratch_index
    if not nv or idx is None or ran.state_scratch is None:
        return bad
    nd = ran.num_decodes
    idx = idx[nd:nd + nv]  # (one entry a row: -1 outside the verify rows)
    outside = (idx < 0) | (idx >= ran.state_scratch[0].shape[1])
    shared = (idx[:, None] == idx[None, :]).sum(dim=1) > 1
    bad[nd:nd + nv] = (outside | shared).int()
    return bad


def device_checks(expected: ExpectedInputs | None, ran: StepBatch | None,
                  regions: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The device half, queued behind the forward (no sync): fault bits of the index tensors that ran
    and the slots they named, and whether each must-stay-zero workspace region is still zero. For the
    engine to read back with the step's tokens (then `read_faults`)."""
    checks: dict[str, torch.Tensor] = {}
    if expected is not None and ran is not None:
        checks["input_faults"], checks["ran_slots"] = expected.faults(ran), ran.state_slot.clone()
    if regions:
        checks["dirty_regions"] = torch.stack([r.ne(0).any() for _, r in regions])
    return checks


@dataclass
class StepFault:
    """What the device half found in one step."""

    reason: str
    named_slots: set[int]  # slots a faulty row ran on: their owners' state may have been written
    dirty_regions: bool  # a must-stay-zero region was not zero (clear it before the next step)


def read_faults(checks: dict[str, list], owners: list[RowOwner], region_names: list[str]) -> StepFault | None:
    """The device half's results, read back on the host (lists), as a StepFault; None when clean."""
    faults = checks.get("input_faults")
    if faults is not None and any(faults):
        ran_slots = checks["ran_slots"]
        parts = []
        for row, bits in enumerate(faults):
            if not bits:
                continue
            who = owners[row].name if row < len(owners) else f"padding row {row}"
            what = [name for bit, name in ((SLOT_FAULT, f"Mamba slot {ran_slots[row]}"),
                                           (KV_WRITE_FAULT, "KV write rows"), (PAGE_TABLE_FAULT, "page table"),
                                           (SCRATCH_FAULT, "verify scratch row"),
                                           (SEQ_LEN_FAULT, "KV length"))
                    if bits & bit]
            owns = f" (owns slot {owners[row].slot})" if row < len(owners) and bits & SLOT_FAULT else ""
            parts.append(f"{who} ran with a wrong {', '.join(what)}{owns}")
        named = {ran_slots[r] for r, bits in enumerate(faults) if bits & SLOT_FAULT}
        return StepFault("the step's index tensors as they ran differ from what the sanitizer checked: "
                         + "; ".join(parts), named, False)
    dirty = checks.get("dirty_regions")
    if dirty is not None and any(dirty):
        names = [n for n, d in zip(region_names, dirty) if d]
        return StepFault(f"attention workspace regions that must stay zero were not zero after the step: {names}",
                         set(), True)
    return None


def check_batch(batch: StepBatch, pool, page_allocator, page_size: int, owners: list[RowOwner],
                dummy_page: int = 0) -> ExpectedInputs:
    """The host half: raise StateCorruptionError if the batch's host copies would touch a slot or page
    its rows do not own; return what its device tensors must hold (for ExpectedInputs.faults).
    Reads no device tensor."""
    live = pool.live_slots
    num_rows = len(batch.state_slot_cpu)
    num_real = batch.num_real_requests if batch.num_real_requests >= 0 else len(owners)
    if num_real != len(owners):
        raise StateCorruptionError(f"batch has {num_real} real rows but the scheduler placed {len(owners)} requests")
    seen: dict[int, str] = {}
    ps = page_size
    kv_loc: list[np.ndarray] = []
    token_rows: list[np.ndarray] = []
    page_rows, page_cols, page_values = [], [], []
    seq_lens: list[int] = []
    for row in range(num_rows):
        slot = int(batch.state_slot_cpu[row])
        if row >= num_real:
            if slot != PAD_SLOT_ID and slot != pool.scratch_slot:
                state = "live" if slot in live else "not live"
                raise StateCorruptionError(
                    f"padding row {row} points at Mamba slot {slot} ({state}); padding must use "
                    f"PAD_SLOT_ID ({PAD_SLOT_ID}) or the scratch slot {pool.scratch_slot}")
            continue
        owner = owners[row]
        if slot == PAD_SLOT_ID or slot != owner.slot:
            raise StateCorruptionError(
                f"{owner.name} (row {row}) would use Mamba slot {slot} but owns slot {owner.slot}")
        if slot not in live:
            raise StateCorruptionError(f"{owner.name} (row {row}) would use Mamba slot {slot}, which is freed")
        if slot in seen:
            raise StateCorruptionError(
                f"{owner.name} (row {row}) and {seen[slot]} would both write Mamba slot {slot}")
        seen[slot] = owner.name
        # the tokens of this row sit at positions [seq_len - q_len, seq_len): their KV rows follow from
        # the owner's pages; each page written must be the row's own and not shared
        seq_len, q_len = int(batch.seq_lens_cpu[row]), int(batch.query_lens_cpu[row])
        if (owner.seq_len >= 0 and seq_len != owner.seq_len) or (owner.q_len >= 0 and q_len != owner.q_len):
            raise StateCorruptionError(
                f"{owner.name} (row {row}, Mamba slot {slot}) would run {q_len} tokens to KV length {seq_len}, "
                f"but it has {owner.seq_len - owner.q_len} tokens in the cache and {owner.q_len} to run")
        if owner.max_len >= 0 and seq_len > owner.max_len:  # the scheduler's count ran past the sequence
            raise StateCorruptionError(
                f"{owner.name} (row {row}, Mamba slot {slot}) would run to KV length {seq_len}, past the "
                f"{owner.max_len} tokens it has")
        if owner.state_len >= 0 and seq_len - q_len != owner.state_len:  # a miscount within the sequence
            raise StateCorruptionError(
                f"{owner.name} (row {row}, Mamba slot {slot}) would run on a context of {seq_len - q_len} tokens, "
                f"but the state in its slot has absorbed {owner.state_len}")
        seq_lens.append(seq_len)
        n_pages = cdiv(seq_len, ps)
        if n_pages > len(owner.pages):
            raise StateCorruptionError(
                f"{owner.name} (row {row}, Mamba slot {slot}) would read {n_pages} KV pages but owns {len(owner.pages)}")
        pos = np.arange(seq_len - q_len, seq_len, dtype=np.int64)
        pages = np.asarray(owner.pages[:n_pages], dtype=np.int64)
        for page in sorted({int(p) for p in pages[pos // ps]}):
            rc = page_allocator.refcount(page)
            if rc != 1:
                raise StateCorruptionError(
                    f"{owner.name} (row {row}, Mamba slot {slot}) would write KV page {page} with refcount {rc} "
                    f"({'freed' if rc == 0 else 'shared: copy-on-write missing'})")
        for p in owner.pages[:n_pages]:
            if p == dummy_page or page_allocator.refcount(p) < 1:
                raise StateCorruptionError(
                    f"{owner.name} (row {row}, Mamba slot {slot}) would read KV page {p}, which is not live")
        kv_loc.append(pages[pos // ps] * ps + pos % ps)
        token_rows.append(np.full(q_len, row, dtype=np.int64))
        page_rows.append(np.full(n_pages, row, dtype=np.int64))
        page_cols.append(np.arange(n_pages, dtype=np.int64))
        page_values.append(pages)
    scratch = getattr(batch, "scratch_index_cpu", None)
    if scratch and batch.num_verify:
        used = [s for s in scratch if s >= 0]
        if len(set(used)) != len(used):
            raise StateCorruptionError(f"verify rows share scratch rows: {scratch}")
        if pool.spec_conv is None or (used and max(used) >= pool.spec_conv.shape[1]):
            raise StateCorruptionError(f"verify scratch rows {used} outside the scratch tensor")

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    stated = all(o.seq_len >= 0 for o in owners)
    return ExpectedInputs(num_real, [o.slot for o in owners], cat(kv_loc), cat(token_rows), cat(page_rows),
                          cat(page_cols), cat(page_values), pool.scratch_slot, dummy_page, ps,
                          np.asarray(seq_lens, dtype=np.int64) if stated else None)
