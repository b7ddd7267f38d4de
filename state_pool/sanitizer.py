"""The state sanitizer: checks a StepBatch against the live slots and pages before it runs.

Enabled with LLM(..., check_state=True) or HYBRID_CHECK_STATE=1. With it on, freed slots are also
poisoned with NaN (MambaStatePool.poison_freed), so a read that slips past these checks shows up
as NaN logits, which the engine reports too. With it off nothing here runs.

What is checked, for every row of the batch:
- a real row (request) reads and writes exactly the slot its request owns, that slot is live, and
  no two rows share a slot;
- a padding row (slot PAD_SLOT_ID, or a row at or after `num_real_requests`) points at PAD_SLOT_ID
  or at the pool's scratch row, never at a live slot, and its page table holds only the dummy page;
- every KV row a request writes lies in a page it owns, that page is live and not shared with
  another sequence (refcount 1: shared prompt pages are read-only), and its page-table entries
  are live pages.
- verify rows (speculative decoding) use distinct scratch rows inside the scratch tensor.
Replay rows (a readmitted sequence's known generated tokens) are ordinary real rows: they write
their own slot and their own pages, and get exactly the checks above.
"""
from __future__ import annotations

from dataclasses import dataclass

from state_pool.errors import StateCorruptionError
from state_pool.pool import PAD_SLOT_ID
from state_pool.util import cdiv


@dataclass
class RowOwner:
    """Who a real batch row belongs to, as the scheduler sees it."""

    name: str  # e.g. "request 'gen-3' (branch 1)"
    slot: int
    pages: list[int]


def check_batch(batch, pool, page_allocator, page_size: int, owners: list[RowOwner], dummy_page: int = 0) -> None:
    live = pool.live_slots
    num_rows = len(batch.state_slot_cpu)
    num_real = batch.num_real_requests if batch.num_real_requests >= 0 else len(owners)
    if num_real != len(owners):
        raise StateCorruptionError(f"batch has {num_real} real rows but the scheduler placed {len(owners)} requests")
    # the device copy must agree with the host copy the launchers read
    dev_slots = [int(s) for s in batch.state_slot.tolist()]
    if dev_slots != list(batch.state_slot_cpu):
        raise StateCorruptionError(f"state_slot {dev_slots} differs from its host copy {batch.state_slot_cpu}")
    seen: dict[int, str] = {}
    starts = [0]
    for q in batch.query_lens_cpu:
        starts.append(starts[-1] + q)
    kv_loc = batch.kv_write_loc.tolist()
    for row in range(num_rows):
        slot = int(batch.state_slot_cpu[row])
        if row >= num_real:
            if slot != PAD_SLOT_ID and slot != pool.scratch_slot:
                state = "live" if slot in live else "not live"
                raise StateCorruptionError(
                    f"padding row {row} points at Mamba slot {slot} ({state}); padding must use "
                    f"PAD_SLOT_ID ({PAD_SLOT_ID}) or the scratch slot {pool.scratch_slot}")
            bad_pages = [int(p) for p in batch.page_table[row].tolist() if int(p) != dummy_page]
            if bad_pages:
                raise StateCorruptionError(f"padding row {row} has real KV pages {bad_pages} in its page table")
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
        # KV writes: own pages only, never a shared page
        owned = set(owner.pages)
        ps = page_size
        for loc in kv_loc[starts[row]:starts[row + 1]]:
            page = int(loc) // ps
            if page not in owned:
                raise StateCorruptionError(
                    f"{owner.name} (row {row}, Mamba slot {slot}) would write KV page {page}, which it does not own")
            rc = page_allocator.refcount(page)
            if rc != 1:
                raise StateCorruptionError(
                    f"{owner.name} (row {row}, Mamba slot {slot}) would write KV page {page} with refcount {rc} "
                    f"({'freed' if rc == 0 else 'shared: copy-on-write missing'})")
        n_pages = cdiv(int(batch.seq_lens_cpu[row]), ps)
        table = [int(p) for p in batch.page_table[row, :n_pages].tolist()]
        for p in table:
            if p == dummy_page or page_allocator.refcount(p) < 1 or p not in owned:
                raise StateCorruptionError(
                    f"{owner.name} (row {row}, Mamba slot {slot}) would read KV page {p}, which it does not own")
    scratch = getattr(batch, "scratch_index_cpu", None)
    if scratch and batch.num_verify:
        used = [s for s in scratch if s >= 0]
        if len(set(used)) != len(used):
            raise StateCorruptionError(f"verify rows share scratch rows: {scratch}")
        if pool.spec_conv is None or (used and max(used) >= pool.spec_conv.shape[1]):
            raise StateCorruptionError(f"verify scratch rows {used} outside the scratch tensor")

