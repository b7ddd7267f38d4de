"""`launch(kernel, grid, *args, **kwargs)`: `kernel[grid](*args, **kwargs)` for a @triton.jit kernel, with less host
work when a call repeats an earlier one's argument layout.

Why: an eager prefill step launches each small kernel of every layer once (norms, the varlen conv and its
history, the row states, the gated norm, activations, the KV write: ~180 launches in the 8B shape's step), and
Triton's own launch path binds and specialises every argument, builds the cache key and checks the kernel's
globals each time: ~25 us of host a launch on the device's host, for kernels that run a few us. A prefix-cache
hit's step is bound by its host (BENCHMARKS.md), as is any short prompt's.

How: the first call with a given layout goes through `kernel[grid]`, which returns the compiled kernel it
launched; that kernel and the values of the parameters after the positional arguments (keyword arguments, else
defaults) are kept under the layout. A later call with the same layout launches the kept kernel directly
(`CompiledKernel[grid](*args)`). The layout is everything Triton specialises a launch on, taken conservatively:
each tensor argument's dtype and whether its address is a multiple of 16 bytes, every other argument's type and
value, and the keyword arguments (constexprs and launch options). Calls with a callable grid, and Tritons whose
launch returns no compiled kernel (the CPU interpreter), always take `kernel[grid]`. `HYBRID_DIRECT_LAUNCH=0`
turns it off.
"""
from __future__ import annotations

import os

import torch

_ENABLED = os.environ.get("HYBRID_DIRECT_LAUNCH", "1") != "0"
MAX_KEPT = 4096  # layouts kept in all (token counts vary by step: each new count is a new layout)
_kept: dict[tuple, tuple] = {}


def _arg_key(a) -> tuple:
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    return type(a), a


def _compiled_kernel_class():
    try:
        from triton.compiler import CompiledKernel
    except Exception:  # noqa: BLE001 - no Triton, or one that moved it
        return None
    return CompiledKernel


_COMPILED = None


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs); see the module docstring."""
    if not _ENABLED or callable(grid):
        return kernel[grid](*args, **kwargs)
    key = (id(kernel), tuple(map(_arg_key, args)), tuple((k, _arg_key(v)) for k, v in kwargs.items()))
    kept = _kept.get(key)
    if kept is not None:
        compiled, tail, _ = kept
        compiled[grid](*args, *tail)
        return compiled
    compiled = kernel[grid](*args, **kwargs)
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = _compiled_kernel_class() or type(None)
    if isinstance(compiled, _COMPILED) and compiled is not None:
        tail = _tail(kernel, len(args), kwargs)
        if tail is not None:
            if len(_kept) >= MAX_KEPT:
                _kept.clear()
            _kept[key] = (compiled, tail, kernel)  # (the kernel: kept alive while its id is a key)
    return compiled


def _tail(kernel, n_args: int, kwargs: dict) -> tuple | None:
    """The values of kernel's parameters after the first n_args, as Triton binds them: the keyword argument of
    that name, else the parameter's default (None where one has neither)."""
    params = getattr(kernel, "params", None)
    if params is None:
        return None
    tail = []
    for p in params[n_args:]:
        if p.name in kwargs:
            tail.append(kwargs[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:
            return None
    return tuple(tail)


def forget() -> None:
    """Drop every kept launch (tests)."""
    _kept.clear()
