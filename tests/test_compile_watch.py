"""hybrid/ops/compile_watch.py: Triton compiles are recorded with their kernel, argument classes and
seconds; one after an LLM startup (with none in progress) is logged as a warning naming the kernel;
the hooks chain to ones already installed and never make Triton skip a compile."""
import logging

import pytest

from hybrid.ops import compile_watch


class _Fn:
    name = "demo_kernel"


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(compile_watch, "_events", [])
    monkeypatch.setattr(compile_watch, "_started", {})
    monkeypatch.setattr(compile_watch, "_startups_running", 0)
    monkeypatch.setattr(compile_watch, "_served", False)


def _compile(key="k1", sig="demo_kernel[num_warps=4](x: *bf16, n: i32)"):
    compile_watch._on_cache_miss(key=key, repr=sig, fn=_Fn(), compile={}, is_manual_warmup=False,
                                 already_compiled=False)
    compile_watch._on_compiled(key=key, repr=sig, fn=_Fn(), compile={}, is_manual_warmup=False,
                               already_compiled=False)


def test_compiles_during_startup_are_recorded_quietly_and_later_ones_warn(fresh, caplog):
    caplog.set_level(logging.WARNING, logger="hybrid")
    _compile("before")  # no startup yet (a kernel used outside LLM): not "after startup"
    compile_watch.startup_begins()
    _compile("during")
    compile_watch.startup_ends()
    assert not caplog.records
    _compile("after", sig="demo_kernel[num_warps=4](x: *bf16, n: i32D)")
    events = compile_watch.events()
    assert [e.after_startup for e in events] == [False, False, True]
    assert all(e.kernel == "demo_kernel" and e.seconds >= 0 for e in events)
    assert len(caplog.records) == 1 and "demo_kernel" in caplog.text and "n: i32D" in caplog.text
    compile_watch.startup_begins()  # a second LLM starting in the same process: expected again
    _compile("second startup")
    assert not compile_watch.events()[-1].after_startup


def test_install_chains_to_an_earlier_hook_and_lets_triton_compile(fresh, monkeypatch):
    knobs = pytest.importorskip("triton.knobs")
    runtime = knobs.runtime
    if not hasattr(runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no compile hooks")
    seen = []

    def earlier(**kwargs):
        seen.append(kwargs["key"])
        return None

    monkeypatch.setattr(runtime, "jit_cache_hook", earlier)
    monkeypatch.setattr(runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(compile_watch, "_installed", False)
    assert compile_watch.install() and compile_watch.install()  # once
    kwargs = dict(key="k", repr="r", fn=_Fn(), compile={}, is_manual_warmup=False, already_compiled=False)
    assert not runtime.jit_cache_hook(**kwargs)  # falsy: Triton goes on to compile
    runtime.jit_post_compile_hook(**kwargs)
    assert seen == ["k"] and len(compile_watch.events()) == 1
