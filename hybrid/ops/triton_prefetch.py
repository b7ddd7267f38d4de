"""L2 prefetch of weights (Triton, sm_90+). A decode step at small batch is hundreds of short,
latency-bound kernels (norms, the conv and SSM update, the router), none of which keeps the memory
system busy; a prefetch issued a few kernels ahead of a projection streams its weight into L2 while
they run, so that the projection then reads from L2. A pure performance hint: it writes nothing, and
every kernel reads the same values whether or not its weight was prefetched.

One launch prefetches the regions of a table (`region_table`), each row [address, row_bytes,
nbytes, rows]:
- rows == 0: the bytes [address, address + nbytes);
- rows > 0: a stacked weight of `rows` rows (an expert stack): for each id of the launch's `ids`
  (a routing's expert ids, read on the device, so the launch is graph capturable) that is < rows,
  the first nbytes of row id, at address + id * row_bytes. Ids >= rows (the shared expert's
  pseudo-expert columns) are skipped.

Under programmatic dependent launch the kernel lets the next kernel start at once and issues the
fixed regions' prefetches before its wait for its predecessor (weights are written by no kernel of
the step); the rows regions read `ids`, written by the predecessor, after that wait. Every program
waits before it ends: the kernel after this one waits on this one's completion alone.
"""
from __future__ import annotations

import torch

from hybrid.ops.triton_guard import HAS_TRITON, pdl_options, require, tl, triton
from state_pool.util import cdiv

PIECE = 4096  # bytes one lane asks for (one bulk prefetch)
LANES = 128  # lanes (threads) of a program: one program covers LANES * PIECE bytes of a region
ALIGN = 16  # cp.async.bulk wants 16-byte aligned addresses and sizes


def is_available(device: torch.device) -> bool:
    """Bulk prefetch is an sm_90 instruction (and inline PTX, which the interpreter cannot run);
    elsewhere callers skip the hint."""
    import os

    return (HAS_TRITON and device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


if HAS_TRITON:

    @triton.jit
    def _prefetch_pieces(base, nbytes, piece0, PIECE: tl.constexpr, LANES: tl.constexpr):
        """Bulk L2 prefetch of pieces piece0 .. piece0 + LANES - 1 of [base, base + nbytes) (`base` an
        int64 address; both multiples of 16)."""
        offs = (piece0 + tl.arange(0, LANES)).to(tl.int64) * PIECE
        size = tl.minimum(nbytes - offs, PIECE).to(tl.int32)
        ok = (size > 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [base + offs, size, ok], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit(do_not_specialize=["num_ids"])  # the step's routed pairs: any count
    def _prefetch_kernel(table_ptr, ids_ptr, num_ids, PIECE: tl.constexpr, LANES: tl.constexpr,
                         HAS_IDS: tl.constexpr, PDL: tl.constexpr):
        # program (block b, region r, id j): pieces b * LANES.. of region r (of its row ids[j])
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        r = tl.program_id(1)
        j = tl.program_id(2)
        address = tl.load(table_ptr + 4 * r)
        row_bytes = tl.load(table_ptr + 4 * r + 1)
        nbytes = tl.load(table_ptr + 4 * r + 2)
        rows = tl.load(table_ptr + 4 * r + 3)
        piece0 = tl.program_id(0) * LANES
        if rows == 0:
            if j == 0:
                _prefetch_pieces(address, nbytes, piece0, PIECE, LANES)
            if PDL:
                tl.extra.cuda.gdc_wait()
        else:
            if PDL:
                tl.extra.cuda.gdc_wait()  # the ids are the predecessor's output
            if HAS_IDS:
                row = tl.load(ids_ptr + j).to(tl.int64)
                if row < rows:
                    _prefetch_pieces(address + row * row_bytes, nbytes, piece0, PIECE, LANES)


def region_table(fixed: list[torch.Tensor], stacked: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The [regions, 4] int64 table of `fixed` (contiguous tensors, whole) and `stacked` (contiguous
    [rows, ...] stacks, one row per id) for prefetch(): see the module docstring."""
    rows = []
    for t in fixed:
        assert t.is_contiguous(), "prefetch regions are contiguous tensors"
        rows.append([t.data_ptr(), 0, t.numel() * t.element_size() // ALIGN * ALIGN, 0])
    for t in stacked:
        assert t.is_contiguous(), "prefetch regions are contiguous tensors"
        row_bytes = t[0].numel() * t.element_size()
        assert row_bytes % ALIGN == 0 and t.data_ptr() % ALIGN == 0, "stacked rows must be 16-byte aligned"
        rows.append([t.data_ptr(), row_bytes, row_bytes, t.shape[0]])
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 4)


def prefetch(table: torch.Tensor, max_region_bytes: int, ids: torch.Tensor | None = None) -> None:
    """Ask L2 for the regions of `table` (region_table; `max_region_bytes`: its largest nbytes),
    rows regions for each of `ids` (int32 or int64, contiguous; None: fixed regions only)."""
    require(__name__)
    if table.shape[0] == 0 or max_region_bytes <= 0:
        return
    num_ids = ids.numel() if ids is not None else 0
    grid = (cdiv(max_region_bytes, PIECE * LANES), table.shape[0], max(num_ids, 1))
    _prefetch_kernel[grid](table, ids if ids is not None else table, num_ids, PIECE=PIECE, LANES=LANES,
                           HAS_IDS=ids is not None, num_warps=LANES // 32, **pdl_options(table.device))

