"""One prefill chunk's chunked scan on mamba-ssm's Triton SSD kernels, issued with less host work.

Why: `mamba_chunk_scan_combined` took 0.5-0.9 ms of host time a call on the device's host for ~25 us
of device work at a short chunk (bench/bench_scan_overhead.py), and prefill runs one call per request
and Mamba layer, so a short eager prefill step is bound by its host (torch.profiler over a prefix-cache
hit: half of its host time in these calls; BENCHMARKS.md). Of that, Triton's autotuner builds its cache
key for each of the five launches by testing every one of the kernel's ~60 arguments against its
argument-name list and asking each for a dtype, and the autograd Function saves its tensors. Here:
- the forward runs without the autograd Function (`_mamba_chunk_scan_combined_fwd`);
- each of the five kernels launches through a `CachedConfigKernel`: the config its own autotuner chose
  for the same key, looked up in a dict keyed by the key arguments' values and the tensor arguments'
  dtypes (everything the autotuner's key holds, and which tensors are present); a key not seen yet goes
  through the autotuner, which tunes or finds it as before.
Measured on the H200: ~25% less host time a call (cProfile), a prefix-cache hit's 8B-shape prefill
steps from 31.3 / 29.8 to 27.3 / 27.3 ms. What is left a call is Triton's own launch path (~40-80 us a
launch for these kernels' ~60 arguments) and the library's wrappers: only fewer calls (one scan for all
of a step's prefill rows) or captured short prefill steps remove it.
Same kernels, same configs, so the same bits as `mamba_chunk_scan_combined`: `ChunkScan` checks that on
its first call against the public function run through the untouched autotuners, and falls back to the
public function for good if they differ or the library's internals are not the ones expected.
Only ever imported on CUDA (hybrid.ops.mamba_cuda).
"""
from __future__ import annotations

import importlib
import logging

import torch

log = logging.getLogger(__name__)

# (module, kernel) of the scan's forward launches in mamba-ssm's Triton ops
SCAN_KERNELS = (
    ("ssd_chunk_state", "_chunk_cumsum_fwd_kernel"),
    ("ssd_chunk_state", "_chunk_state_fwd_kernel"),
    ("ssd_state_passing", "_state_passing_fwd_kernel"),
    ("ssd_bmm", "_bmm_chunk_fwd_kernel"),
    ("ssd_chunk_scan", "_chunk_scan_fwd_kernel"),
)


class CachedConfigKernel:
    """Launches an autotuned Triton kernel with the config its autotuner chose for the launch's key,
    found in a dict; a new key goes through the autotuner (which tunes, or finds its cached choice)."""

    def __init__(self, autotuner) -> None:
        self.autotuner = autotuner
        self.fn = autotuner.fn
        names = list(autotuner.arg_names)
        self.key_args = [(names.index(k), k) for k in autotuner.keys]
        self.configs: dict[tuple, dict] = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run_recorded(args, grid, kwargs)[0]

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        n = len(args)
        values = tuple(args[i] if i < n else kwargs.get(name) for i, name in self.key_args)
        dtypes = tuple(a.dtype if isinstance(a, torch.Tensor) else None for a in args)
        return values, dtypes, tuple(sorted((k, v.dtype) for k, v in kwargs.items() if isinstance(v, torch.Tensor)))

    def run_recorded(self, args: tuple, grid, consts: dict):
        """Launch with the config the autotuner chose for this key (tuning or finding its cached choice first if the
        key is new): (what Triton's launch returned, the compiled kernel; the config's kwargs, or None for a config
        with a pre-hook, which is not kept and goes through the autotuner every time)."""
        key = self._key(args, consts)
        config = self.configs.get(key)
        if config is not None:
            return self.fn.run(*args, grid=grid, warmup=False, **consts, **config), config
        kernel = self.autotuner.run(*args, grid=grid, warmup=False, **consts)
        best = self.autotuner.best_config
        if best.pre_hook is not None:
            return kernel, None
        self.configs[key] = best.all_kwargs()
        return kernel, self.configs[key]



def _new_plans(modules: dict):
    """A ScanPlans over the installed CachedConfigKernels, or None (switch off, or the kernels not installed)."""
    from hybrid.ops.triton_guard import switch

    if not switch("scan_plans"):
        return None
    from hybrid.ops.mamba_scan_plans import KERNEL_NAMES, ScanPlans

    kernels = {name: getattr(modules[m], name, None) for m, name in SCAN_KERNELS}
    if tuple(kernels) != KERNEL_NAMES or not all(isinstance(k, CachedConfigKernel) for k in kernels.values()):
        return None
    return ScanPlans(kernels, bool(getattr(modules["ssd_chunk_scan"], "TRITON_22", True)))


def _autotuner_class():
    from triton.runtime.autotuner import Autotuner

    return Autotuner


def _install(modules: dict) -> list[tuple[object, str, object]]:
    """Put a CachedConfigKernel in place of each scan kernel's autotuner (where the scan's wrappers look
    them up, as module globals). Returns (module, name, autotuner) for each, to undo it."""
    Autotuner = _autotuner_class()
    swapped = []
    for mod_name, name in SCAN_KERNELS:
        mod = modules[mod_name]
        kernel = getattr(mod, name)
        if isinstance(kernel, CachedConfigKernel):
            kernel = kernel.autotuner
        if not isinstance(kernel, Autotuner) or not hasattr(kernel, "best_config"):
            continue
        setattr(mod, name, CachedConfigKernel(kernel))
        swapped.append((mod, name, kernel))
    return swapped


class ChunkScan:
    """`scan(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_limit) -> (out, final_states)`:
    mamba_chunk_scan_combined(..., dt_softplus=True, return_final_states=True) with little host work."""

    def __init__(self, combined=None, modules: dict | None = None) -> None:
        """combined / modules: mamba-ssm's `ssd_combined` and the kernels' modules by name (imported
        when not given; tests pass stand-ins)."""
        prefix = "mamba_ssm.ops.triton."
        self.combined = combined if combined is not None else importlib.import_module(prefix + "ssd_combined")
        self.public = self.combined.mamba_chunk_scan_combined
        self.forward = getattr(self.combined, "_mamba_chunk_scan_combined_fwd", None)
        self.modules = modules if modules is not None else {
            m: importlib.import_module(prefix + m) for m, _ in SCAN_KERNELS}
        self.swapped: list = []
        self.lean: bool | None = None if self.forward is not None else False  # None: not checked yet
        self.plans = None  # ScanPlans once checked (see _check_plans)

    def __call__(self, x, dt, A, B, C, chunk_size: int, D, dt_bias, initial_states, dt_limit: tuple[float, float]):
        if self.lean is None:
            return self._check(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_limit)
        if self.lean:
            if self.plans is not None:
                try:
                    out, _, final = self.plans.forward(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, None,
                                                       dt_limit)
                    return out, final
                except Exception as e:  # noqa: BLE001 - keep serving on the library's forward
                    self._drop_plans(e)
            out = self.forward(x, dt, A, B, C, chunk_size, D=D, z=None, dt_bias=dt_bias, initial_states=initial_states,
                               dt_softplus=True, dt_limit=dt_limit)
            return out[0], out[5]
        return self._public(x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_limit)

    def varlen(self, x, dt, A, B, C, chunk_size: int, D, dt_bias, dt_limit: tuple[float, float], seq_idx):
        """The rows of x [1, T, H, P] (seq_idx [1, T] int32: each token's row, ascending) each scanned from a
        zero state: (y [1, T, H, P], dt [H, >= T] fp32 after softplus and clamp), or None where only the
        public function runs (it does not return dt)."""
        if not self.lean:
            return None
        if self.plans is not None:
            try:
                y, dt_out, _ = self.plans.forward(x, dt, A, B, C, chunk_size, D, dt_bias, None, seq_idx, dt_limit)
                return y, dt_out[0].reshape(dt_out.shape[1], -1)
            except Exception as e:  # noqa: BLE001 - keep serving on the library's forward
                self._drop_plans(e)
        out = self.forward(x, dt, A, B, C, chunk_size, D=D, z=None, dt_bias=dt_bias, initial_states=None,
                           seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit)
        return out[0], out[2][0].reshape(out[2].shape[1], -1)

    def _public(self, x, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_limit):
        return self.public(x, dt, A, B, C, chunk_size, D=D, z=None, dt_bias=dt_bias, initial_states=initial_states,
                           dt_softplus=True, dt_limit=dt_limit, return_final_states=True)

    def _check(self, *args):
        """First call: the public function (untouched autotuners) and the lean path on the same inputs;
        the lean path from now on if both give the same bits, the public function otherwise."""
        ref_out, ref_final = self._public(*args)
        try:
            self.swapped = _install(self.modules)
            self.lean = True
            self.plans = None
            out, final = self(*args)
            same = torch.equal(out, ref_out) and torch.equal(final, ref_final)
            if same:
                self._check_plans(args, ref_out, ref_final)
        except Exception as e:  # noqa: BLE001 - another mamba-ssm or Triton: keep the public function
            log.warning("the lean chunked-scan path failed (%s: %s); using mamba_chunk_scan_combined",
                        type(e).__name__, e)
            same = False
        if not same:
            log.warning("the lean chunked-scan path differs from mamba_chunk_scan_combined; using the latter")
            self.uninstall()
            self.lean = False
        return ref_out, ref_final

    def _check_plans(self, args: tuple, ref_out: torch.Tensor, ref_final: torch.Tensor) -> None:
        """With the lean path checked: the planned launches (hybrid/ops/mamba_scan_plans.py) from now on if a
        recording call and a direct one on the same inputs give its bits too (the "scan_plans" switch)."""
        plans = _new_plans(self.modules)
        if plans is None:
            return
        self.plans = plans
        for _ in range(2):  # the layout's first call records its launches, the second launches them directly
            out, final = self(*args)
            if self.plans is None or not (torch.equal(out, ref_out) and torch.equal(final, ref_final)):
                if self.plans is not None:
                    log.warning("the chunked scan's planned launches differ from its lean path; not using them")
                self.plans = None
                return

    def _drop_plans(self, e: Exception) -> None:
        log.warning("the chunked scan's planned launches failed (%s: %s); using the lean path", type(e).__name__, e)
        self.plans = None

    def uninstall(self) -> None:
        for mod, name, autotuner in self.swapped:
            setattr(mod, name, autotuner)
        self.swapped = []
