"""L2 prefetch of a preloading launch's later waves (the "wave_prefetch" switch, HYBRID_WAVE_PREFETCH=1).

Why: a one-token projection on the preloading kernels (triton_gemv, triton_fp8) asks for each program's whole
weight slab before its PDL wait, but only the programs resident on the GPU run that early. Granite-4.0-H-Tiny's
in_proj + conv is 806 programs of which 528 fit (4 an SM at its 122 registers): the other third of its 19.8 MB
is asked for only when a resident program has finished, after the wait, one HBM round trip behind. A 76-152 MB
projection of the 8B shape runs 4-9 such waves. Here each program also asks the L2 cache, before its wait,
for the slab of the program one wave after it (program p for p + R, R the launch's resident programs): one
bulk prefetch (`cp.async.bulk.prefetch.L2`, sm_90+, fire and forget, no registers held), so the next wave
finds its slab in L2. Only a hint: a wrong R costs bandwidth, never a value. At most one wave's slabs are in
flight to L2 at a time (~13-16 MB), well inside its 50-60 MB.

R comes from the compiled kernel's registers and shared memory (`resident_programs`), noted after a launch
(`note`); until then the launch's R is its grid (nothing prefetched). A captured graph keeps the R its capture
passed: the engine's warm-up launches each kernel eagerly before the captures.
"""
from __future__ import annotations

import functools
import os

import torch

from hybrid.ops.triton_guard import HAS_TRITON, switch, tl, triton
from state_pool.util import sm_count

_ALIGN = 16  # the bulk prefetch's address and size granularity
MAX_SLAB_BYTES = 1 << 20  # one prefetch asks for at most 64K 16-byte units

# (kernel name, its specialisation's key) -> programs resident at once
_resident: dict[tuple, int] = {}


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    """CUDA of compute capability 9.0+ (the bulk prefetch instruction), not Triton's interpreter (no inline PTX)."""
    return (os.environ.get("TRITON_INTERPRET", "0") != "1"
            and torch.cuda.get_device_capability(device_index)[0] >= 9)


def enabled(weight: torch.Tensor, row_bytes: int, slab_bytes: int) -> bool:
    """Whether a launch streaming `weight` (rows of `row_bytes`, contiguous) prefetches its waves: the switch on,
    a capable device (_capable), 16-byte aligned slabs of at most MAX_SLAB_BYTES."""
    return (switch("wave_prefetch") and weight.device.type == "cuda" and _capable(weight.device.index or 0)
            and weight.data_ptr() % _ALIGN == 0 and row_bytes % _ALIGN == 0 and 0 < slab_bytes <= MAX_SLAB_BYTES
            and weight.is_contiguous())


def resident_programs(n_regs: int, shared_bytes: int, num_warps: int, sms: int,
                      regs_per_sm: int = 65536, smem_per_sm: int = 228 << 10, max_warps: int = 64,
                      max_ctas: int = 32) -> int:
    """Programs of a kernel resident at once on `sms` SMs of compute capability 9.x: registers are given to a warp
    in units of 256 (8 a thread), each block reserves 1 KB of shared memory beside its own."""
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_smem = smem_per_sm // (shared_bytes + 1024)
    by_warps = max_warps // num_warps
    return max(1, min(by_regs, by_smem, by_warps, max_ctas)) * sms


def wave(key: tuple, programs: int) -> int:
    """The wave length R a launch keyed by `key` passes (prefetch_wave's `wave`): its resident programs once noted,
    else `programs` (no program has a successor one wave on: nothing prefetched)."""
    return _resident.get(key, programs)


def note(key: tuple, compiled, device: torch.device) -> None:
    """After a launch keyed by `key`: keep its compiled kernel's resident programs (once)."""
    if key in _resident or compiled is None:
        return
    n_regs = getattr(compiled, "n_regs", None)
    metadata = getattr(compiled, "metadata", None)
    if n_regs is None or metadata is None:
        return
    _resident[key] = resident_programs(n_regs, metadata.shared, metadata.num_warps, sm_count(device))


def clear() -> None:
    _resident.clear()


if HAS_TRITON:

    @triton.jit
    def prefetch_wave(w_ptr, N, row_bytes, wave, BLOCK_N: tl.constexpr, PF: tl.constexpr):
        """Ask L2 for the weight slab of program id + `wave` (rows of a row-contiguous weight, BLOCK_N rows of
        row_bytes a program), if there is one: one bulk prefetch, by the program's first thread. A no-op
        unless PF."""
        if PF:
            q = tl.program_id(0) + wave
            rows = tl.minimum(N - q * BLOCK_N, BLOCK_N)
            lanes = tl.arange(0, 128)
            size = tl.where((lanes == 0) & (rows > 0), rows * row_bytes, 0).to(tl.int32)
            addr = (w_ptr.to(tl.pointer_type(tl.int8)) + q.to(tl.int64) * BLOCK_N * row_bytes + lanes * 0).to(tl.int64)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
