"""L2 prefetch of the next weight stream of a one-token decode step (the "l2_prefetch" switch,
HYBRID_L2_PREFETCH=1).

Why: at batch 1 a MoE hybrid's step is its weight bytes plus a chain of small dependent kernels (norms,
the SSM update, the gated norm, routing, the experts' sum), ~10 a layer (BENCHMARKS.md, MoE section).
The preloading kernels (triton_gemv, triton_moe's one-token experts) start their own weight stream
before their PDL wait, so it overlaps the one kernel before them, but while the small kernels between
two projections run, HBM is idle. Here each weight-streaming kernel also asks the L2 cache for the
*next* projection's weights (`cp.async.bulk.prefetch.L2`, sm_90+: fire and forget, no registers held),
so the bytes keep streaming through the small kernels and the next projection reads them from L2.

The order of the streams is recorded once, from an eager one-token step (`recording()`, called by the
graph runner before its captures): each preloading launch notes its weight (`note`), and each then
prefetches what the launch after it streams (the last, the LM head, the first layer's: the next step's).
Only a hint: a wrong or missing target costs bandwidth, never a value. A target is capped at MAX_BYTES
(the L2 holds 50 MB on an H100 / H200; the LM head is far larger).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

from hybrid.ops.triton_guard import HAS_TRITON, switch, tl, triton
from state_pool.util import cdiv

LANES = 128  # prefetches a program issues (one a thread at 4 warps)
MAX_BYTES = 24 << 20  # of one target
MAX_PIECE = 1 << 16  # bytes one prefetch asks for, at most
MIN_PIECE = 32 << 10  # and at least (but a target's last piece)
_ALIGN = 16  # the bulk prefetch's address and size granularity

# weight data_ptr -> (the next stream's bytes as a uint8 view, its size): built by recording()
_next: dict[int, tuple[torch.Tensor, int]] = {}
_recorded: list[tuple[int, torch.Tensor | None]] | None = None


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` prefetch: the switch on, CUDA of compute capability 9.0+ (the bulk
    prefetch instruction), not Triton's CPU interpreter (no inline PTX there)."""
    return (switch("l2_prefetch") and device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def note(weight: torch.Tensor, streamed: torch.Tensor | None) -> None:
    """While recording: a preloading launch keyed by `weight` (the tensor its caller passes) streams
    `streamed` (the part of it known before the launch: the weight, or a MoE GEMM's shared-expert slab;
    None: nothing a launch before could prefetch, e.g. routed experts)."""
    if _recorded is not None:
        _recorded.append((weight.data_ptr(), streamed))


@contextmanager
def recording() -> Iterator[None]:
    """Record the launches of the forward run inside, then make each launch prefetch the next one's
    stream (the last one's: the first's). Replaces what an earlier recording made."""
    global _recorded
    _next.clear()
    _recorded = []
    try:
        yield
        calls = _recorded
    finally:
        _recorded = None
    for i, (key, _) in enumerate(calls):
        streamed = calls[(i + 1) % len(calls)][1]
        if streamed is None or key in _next:  # (a weight used twice, as Zamba2's shared block: its first use)
            continue
        flat = streamed.detach().reshape(-1).view(torch.uint8)
        size = min(flat.numel(), MAX_BYTES) // _ALIGN * _ALIGN
        if size and streamed.data_ptr() % _ALIGN == 0:
            _next[key] = (flat, size)


def clear() -> None:
    """Forget the recorded targets (no launch prefetches)."""
    _next.clear()


def launch_args(weight: torch.Tensor, programs: int) -> dict:
    """Keyword arguments of a kernel taking prefetch_l2's parameters (pf_ptr, pf_bytes, pf_piece, PF), for
    a launch of `programs` programs keyed by `weight`: its target split in pieces, LANES a program."""
    target = _next.get(weight.data_ptr()) if _next else None
    if target is None or not enabled(weight.device):
        return {"pf_ptr": weight, "pf_bytes": 0, "pf_piece": 0, "PF": False}
    flat, size = target
    # (the instruction takes at most 64K 16-byte units: a target past programs * LANES * 1 MB is cut there)
    # pieces of at least MIN_PIECE: few bulk prefetches (each lane's is a turn of a loop over the warp's lanes)
    piece = min(max(cdiv(cdiv(size, programs * LANES), _ALIGN) * _ALIGN, MIN_PIECE), MAX_PIECE)
    return {"pf_ptr": flat, "pf_bytes": size, "pf_piece": piece, "PF": True}


if HAS_TRITON:

    @triton.jit
    def prefetch_l2(pf_ptr, pf_bytes, pf_piece, PF: tl.constexpr):
        """This program's share of [pf_ptr, pf_ptr + pf_bytes) (bytes) asked into L2: LANES pieces of pf_piece
        bytes (a multiple of 16), piece i of program p at (p + i * programs) * pf_piece, each one bulk prefetch
        (no registers held, nothing waits on it). A no-op unless PF."""
        if PF:
            lanes = tl.arange(0, 128)  # LANES
            start = (tl.program_id(0) + lanes * tl.num_programs(0)).to(tl.int64) * pf_piece
            size = tl.minimum(pf_bytes - start, pf_piece)
            size = tl.where(size > 0, size, 0).to(tl.int32)
            addr = (pf_ptr + start).to(tl.int64)  # pf_ptr: bytes (a uint8 view)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
