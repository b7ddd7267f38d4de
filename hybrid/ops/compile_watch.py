"""The Triton compiles of this process: which kernel, which specialisation, how long, and whether
startup was over when it happened.

Why: Triton compiles a kernel per specialisation the first time a launch meets it (its integer
arguments are specialised by value class: 1, a multiple of 16, other), and a compile stalls the
step it happens in for up to seconds (from the on-disk cache: milliseconds). The startup warm-up
(hybrid/warmup.py) is meant to leave none for the requests; when one happens anyway, a warning names
the kernel and its argument classes, so that the gap can be closed, and benchmarks count them per
run (bench/bench_throughput.py). Installed by `LLM` on CUDA; a no-op where Triton has no compile
hooks (`triton.knobs.runtime`, Triton 3.4+).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger("hybrid")


@dataclass(frozen=True)
class CompileEvent:
    kernel: str  # the kernel function's qualified name
    signature: str  # launch options and each argument's type and value class (describe)
    seconds: float  # from the cache miss to the compiled kernel (a disk-cache hit is milliseconds)
    after_startup: bool


_lock = threading.Lock()
_events: list[CompileEvent] = []
_started: dict[tuple[int, str], float] = {}
_startups_running = 0  # LLM startups in progress in this process
_served = False  # some startup has finished: compiles now stall requests
_installed = False


def install() -> bool:
    """Install the hooks once (chained to any already set); False where Triton has none."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from triton import knobs
            runtime = knobs.runtime
        except Exception:  # no Triton, or one without knobs
            return False
        if not (hasattr(runtime, "jit_cache_hook") and hasattr(runtime, "jit_post_compile_hook")):
            return False
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        runtime.jit_cache_hook = _chain(_on_cache_miss, before)
        runtime.jit_post_compile_hook = _chain(_on_compiled, after)
        _installed = True
        return True


def _chain(ours, theirs):
    def hook(*args, **kwargs):
        ours(**kwargs)
        # Triton skips the compile when jit_cache_hook returns true: only the earlier hook may say so
        return theirs(*args, **kwargs) if theirs is not None else None
    return hook


def _name(fn) -> str:
    return getattr(fn, "name", None) or getattr(fn, "__qualname__", None) or repr(fn)


def _on_cache_miss(*, key, fn, **_) -> None:
    with _lock:
        _started[(threading.get_ident(), _name(fn) + str(key))] = time.perf_counter()


def describe(compile: dict | None, fallback: str) -> str:
    """Each argument of a compile as Triton specialised it, from the hook's `compile` keyword: `name: type`,
    ` %16` where the value is known divisible by 16, `name=value` for a constant (a constexpr, or an integer
    specialised to 1). Why: Triton's own description (`repr`) pairs the arguments with a key whose layout changed
    in Triton 3.5+ and came out as `(states_ptr: ()`, which names no specialisation. `fallback` where the keyword
    does not have that shape."""
    try:
        signature = compile["signature"]
        constants = compile.get("constants") or {}
        attrs = (compile.get("configs") or [{}])[0] or {}
        parts = []
        for i, (arg, ty) in enumerate(signature.items()):
            if ty == "constexpr" or (i,) in constants:
                parts.append(f"{arg}={constants.get((i,), '?')}")
            else:
                divisible = any(a[0] == "tt.divisibility" and a[1] % 16 == 0 for a in attrs.get((i,), []))
                parts.append(f"{arg}: {ty}{' %16' if divisible else ''}")
        return f"{fallback.split('(', 1)[0]}({', '.join(parts)})"
    except Exception:  # another Triton's shape
        return fallback


def _on_compiled(*, key, repr: str, fn, compile=None, **_) -> None:  # noqa: A002 - Triton's keywords
    now = time.perf_counter()
    name = _name(fn)
    signature = describe(compile, repr)
    with _lock:
        start = _started.pop((threading.get_ident(), name + str(key)), now)
        event = CompileEvent(name, signature, now - start, _served and _startups_running == 0)
        _events.append(event)
    if event.after_startup:
        logger.warning("Triton compiled %s after startup (%.2f s; a specialisation the warm-up did not meet): %s",
                       name, event.seconds, signature)


def startup_begins() -> None:
    """An LLM startup begins: its compiles are expected."""
    global _startups_running
    with _lock:
        _startups_running += 1


def startup_ends() -> None:
    """An LLM startup has ended (or failed): from now on, while no other one runs, a compile is
    logged as a warning (requests are being served)."""
    global _startups_running, _served
    with _lock:
        _startups_running = max(0, _startups_running - 1)
        _served = True


def events() -> list[CompileEvent]:
    """Every compile recorded so far, in order."""
    with _lock:
        return list(_events)
