"""mamba-ssm's chunked-scan forward as its five kernel launches, each issued straight to the compiled kernel
once its inputs' layout has been seen: the same launches with the same arguments, a fraction of the host work.

Why: a prefix-cache hit's prefill step is bound by its host (an H100 issued the 8B shape's 272-token step in
26.0 of its 26.3 ms), and under cProfile the chunked scan was ~40% of that: per call, the five library wrappers
(asserts, `torch.cuda.device` blocks, einops), then for each launch our config lookup (CachedConfigKernel's key
over ~60 arguments) and Triton's own launch path (binding and specialising every argument, the cache key, launch
metadata): ~0.4 ms of host for ~25 us of device work, 24 times a step.

Here `ScanPlans.forward` runs `_mamba_chunk_scan_combined_fwd(..., z=None, dt_softplus=True)`'s steps itself
(the same allocations, views and kernel arguments as the wrappers, written out once below). The first call with a
given layout (shapes, strides, dtypes, 16-byte alignment of every input, the optional inputs present, chunk size,
dt limits) launches each kernel through its CachedConfigKernel (Triton's path: the autotuner's choice, a compile
where needed) and keeps what that launch used: the compiled kernel, the config, and the values of the parameters
after the positional arguments (constexprs, config, defaults). Every later call with that layout launches those
compiled kernels directly (`CompiledKernel[grid](*args)`) with the arguments computed the same way. Everything
Triton specialises a launch on (argument dtypes, pointer alignment, integer values: shapes and strides) is a
function of that layout, so the kernel Triton's path would pick is the kept one.
`ChunkScan` checks this path bit for bit against `mamba_chunk_scan_combined` on its first call (both the first,
recording launch and a direct one) and falls back for good on any difference or error.
Only ever imported on CUDA (through hybrid.ops.mamba_scan).
"""
from __future__ import annotations

import math

import torch

from hybrid.ops.triton_guard import tl, triton
from state_pool.util import cdiv

# the launch order, and each kernel's name in SCAN_KERNELS (hybrid.ops.mamba_scan)
CUMSUM, STATE, PASSING, BMM, SCAN = range(5)
KERNEL_NAMES = ("_chunk_cumsum_fwd_kernel", "_chunk_state_fwd_kernel", "_state_passing_fwd_kernel",
                "_bmm_chunk_fwd_kernel", "_chunk_scan_fwd_kernel")


MAX_PLANS = 4096  # layouts kept at most (each new prefill length is a new layout)


def _layout(t: torch.Tensor | None) -> tuple | None:
    """What of a tensor argument a launch's specialisation and arguments depend on (None: absent)."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0


class _Recorder:
    """A layout's first call: each launch through Triton's path, keeping (compiled kernel, config, the values of
    the parameters after the positional arguments) for the direct launches of later calls."""

    def __init__(self, kernels: dict) -> None:
        self.kernels = kernels
        self.kept: list | None = []

    def launch(self, i: int, grid, args: tuple, consts: dict) -> None:
        cached = self.kernels[KERNEL_NAMES[i]]
        kernel, config = cached.run_recorded(args, grid, consts)
        if self.kept is None:
            return
        if config is None or not hasattr(kernel, "__getitem__"):
            self.kept = None  # (a config with a pre-hook, or a Triton whose launch returns no kernel)
            return
        tail = []
        for p in cached.fn.params[len(args):]:
            if p.name in consts:
                tail.append(consts[p.name])
            elif p.name in config:
                tail.append(config[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                self.kept = None
                return
        self.kept.append((kernel, config, tuple(tail)))


class _Direct:
    """A seen layout's call: each launch straight to the kept compiled kernel."""

    def __init__(self, kept: list) -> None:
        self.kept = kept

    def launch(self, i: int, grid, args: tuple, consts: dict) -> None:
        kernel, config, tail = self.kept[i]
        kernel[grid(config)](*args, *tail)


class ScanPlans:
    """forward(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, seq_idx, dt_limit) -> (out, dt_out,
    final_states): `_mamba_chunk_scan_combined_fwd`'s out, dt and final_states with z=None and dt_softplus=True;
    see the module docstring."""

    def __init__(self, kernels: dict, triton_22: bool = True) -> None:
        """kernels: each scan kernel's CachedConfigKernel by name; triton_22: the chunk-scan module's TRITON_22
        (a constexpr its kernel takes)."""
        self.kernels = kernels
        self.triton_22 = triton_22
        self.plans: dict[tuple, list | None] = {}

    def forward(self, x, dt, A, B, C, chunk_size: int, D, dt_bias, initial_states, seq_idx,
                dt_limit: tuple[float, float]):
        if x.is_cuda and x.device.index != torch.cuda.current_device():  # (Triton launches on the current device)
            with torch.cuda.device(x.device):
                return self.forward(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, seq_idx, dt_limit)
        key = (tuple(map(_layout, (x, dt, A, B, C, D, dt_bias, initial_states, seq_idx))), chunk_size,
               tuple(dt_limit), x.device.index)
        kept = self.plans.get(key, False)
        launcher = _Direct(kept) if kept else _Recorder(self.kernels)
        result = self._run(launcher, x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, seq_idx, dt_limit)
        if isinstance(launcher, _Recorder):
            if len(self.plans) >= MAX_PLANS:  # (a serving process meets many chunk lengths: keep it bounded)
                self.plans.clear()
            self.plans[key] = launcher.kept if launcher.kept and len(launcher.kept) == 5 else None
        return result

    def _run(self, launcher, x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, seq_idx, dt_limit):
        # _mamba_chunk_scan_combined_fwd's steps (mamba-ssm 2.x), its wrappers' allocations and arguments as they are
        batch, seqlen, nheads, headdim = x.shape
        ngroups, dstate = B.shape[2], B.shape[3]
        if B.stride(-1) != 1:
            B = B.contiguous()
        if C.stride(-1) != 1:
            C = C.contiguous()
        if x.stride(-1) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        if D is not None and D.stride(-1) != 1:
            D = D.contiguous()
        dev = x.device
        nchunks = math.ceil(seqlen / chunk_size)
        seq_strides = (seq_idx.stride(0), seq_idx.stride(1)) if seq_idx is not None else (0, 0)
        has_seq = seq_idx is not None

        # dt after softplus and clamp, and its cumulative sum times A, per chunk (_chunk_cumsum_fwd)
        dt_out = torch.empty(batch, nheads, nchunks, chunk_size, device=dev, dtype=torch.float32)
        dA = torch.empty(batch, nheads, nchunks, chunk_size, device=dev, dtype=torch.float32)
        dt_s = (dt_out.stride(0), dt_out.stride(2), dt_out.stride(1), dt_out.stride(3))
        dA_s = (dA.stride(0), dA.stride(2), dA.stride(1), dA.stride(3))
        launcher.launch(CUMSUM, lambda m: (batch, nchunks, cdiv(nheads, m["BLOCK_SIZE_H"])),
                        (dt, A, dt_bias, dt_out, dA, batch, seqlen, nheads, chunk_size, dt_limit[0], dt_limit[1],
                         dt.stride(0), dt.stride(1), dt.stride(2), A.stride(0),
                         dt_bias.stride(0) if dt_bias is not None else 0, *dt_s, *dA_s, True),
                        {"HAS_DT_BIAS": dt_bias is not None, "BLOCK_SIZE_CHUNK": triton.next_power_of_2(chunk_size)})

        # each chunk's state from zero (_chunk_state_fwd, states in fp32)
        states = torch.empty(batch, nchunks, nheads, headdim, dstate, device=dev, dtype=torch.float32)
        launcher.launch(STATE, lambda m: (cdiv(headdim, m["BLOCK_SIZE_M"]) * cdiv(dstate, m["BLOCK_SIZE_N"]),
                                          batch * nchunks, nheads),
                        (x, B, states, dt_out, dA, seq_idx, headdim, dstate, chunk_size, batch, seqlen,
                         nheads // ngroups, *x.stride(), B.stride(0), B.stride(1), B.stride(2), B.stride(-1),
                         *states.stride(), *dt_s, *dA_s, *seq_strides),
                        {"HAS_SEQ_IDX": has_seq})

        # the states passed across chunks (_state_passing_fwd on the (p n)-flattened states, out in C's dtype)
        dim = headdim * dstate
        flat = states.view(batch, nchunks, nheads, dim)
        dA_last = dA[:, :, :, -1]
        init = initial_states.reshape(batch, nheads, dim) if initial_states is not None else None
        passed = torch.empty(batch, nchunks, nheads, dim, device=dev, dtype=C.dtype)
        final = torch.empty(batch, nheads, dim, device=dev, dtype=torch.float32)
        launcher.launch(PASSING, lambda m: (cdiv(dim, m["BLOCK_SIZE"]), batch, nheads),
                        (flat, passed, final, dA_last, init, seq_idx, dim, nchunks, seqlen if has_seq else 0,
                         chunk_size if has_seq else 0, *flat.stride(), *passed.stride(), *final.stride(),
                         dA_last.stride(0), dA_last.stride(2), dA_last.stride(1),
                         *(init.stride() if init is not None else (0, 0, 0)), *seq_strides),
                        {"HAS_INITSTATES": init is not None, "HAS_SEQ_IDX": has_seq})
        states = passed.view(batch, nchunks, nheads, headdim, dstate)

        # C^T B within each chunk (_bmm_chunk_fwd, fp32 out, not causal)
        cb = torch.empty(batch, nchunks, ngroups, chunk_size, chunk_size, device=dev, dtype=torch.float32)
        launcher.launch(BMM, lambda m: (cdiv(chunk_size, m["BLOCK_SIZE_M"]) * cdiv(chunk_size, m["BLOCK_SIZE_N"]),
                                        batch, nchunks * ngroups),
                        (C, B, cb, seq_idx, seqlen, chunk_size, dstate, ngroups,
                         C.stride(0), C.stride(1), C.stride(2), C.stride(-1),
                         B.stride(0), B.stride(1), B.stride(2), B.stride(-1),
                         cb.stride(0), cb.stride(1), cb.stride(2), cb.stride(-2), cb.stride(-1), *seq_strides,
                         False, _dot_dtype(C.dtype, B.dtype)),
                        {"HAS_SEQ_IDX": has_seq})

        # the outputs (_chunk_scan_fwd, no z)
        out = torch.empty(batch, seqlen, nheads, headdim, device=dev, dtype=x.dtype)
        launcher.launch(SCAN, lambda m: (cdiv(chunk_size, m["BLOCK_SIZE_M"]) * cdiv(headdim, m["BLOCK_SIZE_N"]),
                                         batch * nchunks, nheads),
                        (cb, x, None, out, None, dt_out, dA, seq_idx, C, states, D, chunk_size, headdim, dstate,
                         batch, seqlen, nheads // ngroups, *cb.stride(), *x.stride(), 0, 0, 0, 0, *out.stride(),
                         *dt_s, *dA_s, *seq_strides, *C.stride(), *states.stride(),
                         D.stride(0) if D is not None else 0, True, D is not None,
                         D.dim() == 2 if D is not None else True),
                        {"BLOCK_SIZE_DSTATE": max(triton.next_power_of_2(dstate), 16), "HAS_Z": False,
                         "HAS_SEQ_IDX": has_seq, "IS_TRITON_22": self.triton_22})
        return out, dt_out, final.view(batch, nheads, headdim, dstate)


def _dot_dtype(a: torch.dtype, b: torch.dtype):
    """_bmm_chunk_fwd's dot_dtype constexpr for operands of these dtypes."""
    if torch.bfloat16 in (a, b):
        return tl.bfloat16
    return tl.float16 if torch.float16 in (a, b) else tl.float32
