"""The chunked scan's lean launch path (hybrid/ops/mamba_scan.py) on stand-ins for Triton's autotuner and
mamba-ssm's modules: which launches go through the autotuner, which reuse its choice, and the check that
falls back to the public function. The real kernels: tests/gpu/test_mamba_scan_gpu.py."""
from __future__ import annotations

import types

import pytest
import torch

from hybrid.ops import mamba_scan
from hybrid.ops.mamba_scan import SCAN_KERNELS, CachedConfigKernel, ChunkScan


class FakeConfig:
    def __init__(self, block: int, pre_hook=None) -> None:
        self.block, self.pre_hook = block, pre_hook

    def all_kwargs(self) -> dict:
        return {"BLOCK": self.block, "num_warps": 4}


class FakeAutotuner:
    """Triton's Autotuner as CachedConfigKernel uses it: arg_names, keys, fn.run, run, best_config. Its
    choice depends on the key argument `n` and on the first tensor's dtype."""

    def __init__(self, pre_hook=None) -> None:
        self.arg_names = ["x_ptr", "y_ptr", "n", "stride"]
        self.keys = ["n"]
        self.tuned: list[tuple] = []
        self.launched: list[dict] = []
        self.pre_hook = pre_hook
        self.fn = types.SimpleNamespace(run=self._launch)
        self.best_config = None

    def _launch(self, *args, **kwargs):
        self.launched.append(kwargs)
        return "launched"

    def run(self, *args, **kwargs):
        n = args[2] if len(args) > 2 else kwargs["n"]
        self.best_config = FakeConfig(16 if n < 64 else 64 if args[0].dtype == torch.float32 else 32, self.pre_hook)
        self.tuned.append((n, args[0].dtype))
        return self.fn.run(*args, **kwargs, **self.best_config.all_kwargs())


def test_a_key_goes_through_the_autotuner_once_then_reuses_its_choice():
    tuner = FakeAutotuner()
    k = CachedConfigKernel(tuner)
    x, y = torch.zeros(4), torch.zeros(4)
    for _ in range(3):
        assert k[(1,)](x, y, 8, 1) == "launched"
    assert tuner.tuned == [(8, torch.float32)]
    assert [kw["BLOCK"] for kw in tuner.launched] == [16, 16, 16]
    assert all(kw["grid"] == (1,) and kw["warmup"] is False for kw in tuner.launched)
    # a new key value, a new dtype, a key argument given by name: each its own autotuner visit, right config
    k[(1,)](x, y, 128, 1)
    k[(1,)](x.half(), y, 128, 1)
    k[(2,)](x.half(), y, n=128, stride=1)
    k[(2,)](x.half(), y, n=128, stride=1)
    assert tuner.tuned == [(8, torch.float32), (128, torch.float32), (128, torch.float16), (128, torch.float16)]
    assert [kw["BLOCK"] for kw in tuner.launched[3:]] == [64, 32, 32, 32]
    # a non-key argument's value is not part of the choice
    k[(1,)](x, y, 8, 99)
    assert len(tuner.tuned) == 4 and tuner.launched[-1]["BLOCK"] == 16


def test_a_config_with_a_pre_hook_always_goes_through_the_autotuner():
    tuner = FakeAutotuner(pre_hook=lambda nargs: None)
    k = CachedConfigKernel(tuner)
    x = torch.zeros(4)
    for _ in range(3):
        k[(1,)](x, x, 8, 1)
    assert len(tuner.tuned) == 3


def _fake_library(lean_result, public_result):
    """ssd_combined and the kernels' modules as ChunkScan sees them: each kernel a FakeAutotuner."""
    calls = {"public": 0, "forward": 0}

    def public(*a, **k):
        calls["public"] += 1
        assert k["return_final_states"] and k["dt_softplus"]
        return public_result

    def forward(*a, **k):
        calls["forward"] += 1
        assert k["dt_softplus"] and k["z"] is None
        return (lean_result[0], None, None, None, None, lean_result[1])

    combined = types.SimpleNamespace(mamba_chunk_scan_combined=public, _mamba_chunk_scan_combined_fwd=forward)
    modules = {m: types.SimpleNamespace() for m, _ in SCAN_KERNELS}
    for m, name in SCAN_KERNELS:
        setattr(modules[m], name, FakeAutotuner())
    return combined, modules, calls


SCAN_ARGS = (None, None, None, None, None, 128, None, None, None, (0.0, float("inf")))


def test_chunk_scan_takes_the_lean_path_after_its_check(monkeypatch):
    monkeypatch.setattr(mamba_scan, "_autotuner_class", lambda: FakeAutotuner)
    monkeypatch.setattr(mamba_scan, "_new_plans", lambda modules: None)  # (the planned launches: tests below)
    out, final = torch.arange(6.0), torch.ones(2)
    combined, modules, calls = _fake_library((out.clone(), final.clone()), (out, final))
    scan = ChunkScan(combined, modules)
    for _ in range(3):
        o, f = scan(*SCAN_ARGS)
        assert torch.equal(o, out) and torch.equal(f, final)
    assert scan.lean is True and calls == {"public": 1, "forward": 3}
    assert all(isinstance(getattr(modules[m], n), CachedConfigKernel) for m, n in SCAN_KERNELS)
    scan.uninstall()
    assert all(isinstance(getattr(modules[m], n), FakeAutotuner) for m, n in SCAN_KERNELS)


@pytest.mark.parametrize("broken", ["differs", "raises", "no_forward"])
def test_chunk_scan_falls_back_to_the_public_function(monkeypatch, broken):
    monkeypatch.setattr(mamba_scan, "_autotuner_class", lambda: FakeAutotuner)
    monkeypatch.setattr(mamba_scan, "_new_plans", lambda modules: None)
    out, final = torch.arange(6.0), torch.ones(2)
    lean = (out + 1, final) if broken == "differs" else (out.clone(), final.clone())
    combined, modules, calls = _fake_library(lean, (out, final))
    if broken == "raises":
        combined._mamba_chunk_scan_combined_fwd = lambda *a, **k: (_ for _ in ()).throw(TypeError("new signature"))
    if broken == "no_forward":
        del combined._mamba_chunk_scan_combined_fwd
    scan = ChunkScan(combined, modules)
    for _ in range(3):
        o, f = scan(*SCAN_ARGS)
        assert torch.equal(o, out) and torch.equal(f, final)
    assert scan.lean is False and calls["public"] == 3
    # the library's kernels are left as they were
    assert all(isinstance(getattr(modules[m], n), FakeAutotuner) for m, n in SCAN_KERNELS)
