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


def test_a_compile_is_described_by_its_arguments_specialisations():
    """The description names each argument as Triton specialised it (type, divisible by 16, a constant) from the
    hook's `compile` keyword; Triton's own repr where that keyword has another shape."""
    compile = {"signature": {"x_ptr": "*bf16", "n": "i32", "m": "i32", "one": "constexpr", "BLOCK": "constexpr"},
               "constants": {(3,): 1, (4,): 128}, "configs": [{(0,): [["tt.divisibility", 16]],
                                                               (2,): [["tt.divisibility", 16]]}]}
    fallback = "demo_kernel[num_warps=4, num_stages=3](x_ptr: ()"
    assert compile_watch.describe(compile, fallback) == (
        "demo_kernel[num_warps=4, num_stages=3](x_ptr: *bf16 %16, n: i32, m: i32 %16, one=1, BLOCK=128)")
    assert compile_watch.describe(None, fallback) == fallback
    assert compile_watch.describe({"signature": 3}, fallback) == fallback


def test_the_warning_carries_the_description(fresh, caplog):
    caplog.set_level(logging.WARNING, logger="hybrid")
    compile_watch.startup_begins()
    compile_watch.startup_ends()
    compile = {"signature": {"x_ptr": "*fp32", "n": "i32"}, "constants": {}, "configs": [{}]}
    compile_watch._on_cache_miss(key="k", repr="demo_kernel[num_warps=4](x_ptr: ()", fn=_Fn(), compile=compile)
    compile_watch._on_compiled(key="k", repr="demo_kernel[num_warps=4](x_ptr: ()", fn=_Fn(), compile=compile)
    assert "demo_kernel[num_warps=4](x_ptr: *fp32, n: i32)" in caplog.text
    assert compile_watch.events()[-1].signature == "demo_kernel[num_warps=4](x_ptr: *fp32, n: i32)"
