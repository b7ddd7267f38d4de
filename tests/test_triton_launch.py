"""hybrid/ops/triton_launch.py on stand-ins for a @triton.jit kernel and its compiled kernel: the first call of a
layout goes through kernel[grid], a repeat launches the kept compiled kernel with every parameter's value in the
kernel's order, and anything Triton specialises on (a tensor's dtype or 16-byte alignment, an argument's value or
type, a keyword argument) makes a new layout. The real kernels: tests/gpu/test_triton_launch_gpu.py."""
from __future__ import annotations

import types

import pytest
import torch

from hybrid.ops import triton_launch


class FakeCompiled:
    def __init__(self, log: list) -> None:
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class FakeKernel:
    """A JITFunction as launch() uses it: params (name, has_default, default) and kernel[grid](*args, **kwargs),
    which returns the compiled kernel it launched."""

    def __init__(self, names: list[str], defaults: dict | None = None) -> None:
        defaults = defaults or {}
        self.params = [types.SimpleNamespace(name=n, has_default=n in defaults, default=defaults.get(n))
                       for n in names]
        self.log: list = []
        self.compiled = FakeCompiled(self.log)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return self.compiled
        return run


@pytest.fixture(autouse=True)
def fake_compiled_class(monkeypatch):
    monkeypatch.setattr(triton_launch, "_COMPILED", FakeCompiled)
    monkeypatch.setattr(triton_launch, "_ENABLED", True)
    triton_launch.forget()
    yield
    triton_launch.forget()


def _kernel():
    return FakeKernel(["x_ptr", "out_ptr", "n", "eps", "BLOCK", "FLAG"], defaults={"FLAG": False})


def test_a_repeated_layout_launches_the_kept_kernel_with_every_parameter_in_order():
    k = _kernel()
    x, out = torch.zeros(64), torch.zeros(64)
    assert triton_launch.launch(k, (4,), x, out, 64, 1e-5, BLOCK=128, num_warps=4) is k.compiled
    assert [e[0] for e in k.log] == ["triton"]
    y, out2 = torch.ones(64), torch.zeros(64)  # other tensors of the same layout
    triton_launch.launch(k, (8,), y, out2, 64, 1e-5, BLOCK=128, num_warps=4)
    assert k.log[-1][0] == "direct" and k.log[-1][1] == (8,)
    args = k.log[-1][2]
    assert args[0] is y and args[1] is out2 and args[2:] == (64, 1e-5, 128, False)  # BLOCK by name, FLAG's default


@pytest.mark.parametrize("change", ["dtype", "alignment", "int", "int_type", "float", "constexpr", "option"])
def test_anything_triton_specialises_on_makes_a_new_layout(change):
    k = _kernel()
    x, out = torch.zeros(64), torch.zeros(64)
    args, kwargs = [x, out, 1 if change == "int_type" else 64, 1e-5], {"BLOCK": 128, "num_warps": 4}
    triton_launch.launch(k, (4,), *args, **kwargs)
    if change == "dtype":
        args[0] = x.half()
    elif change == "alignment":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "int":
        args[2] = 48
    elif change == "int_type":
        args[2] = True  # (== 1 and hashes like 1, but Triton binds a bool otherwise)
    elif change == "float":
        args[3] = 1e-6
    elif change == "constexpr":
        kwargs["BLOCK"] = 256
    else:
        kwargs["num_warps"] = 8
    triton_launch.launch(k, (4,), *args, **kwargs)
    assert [e[0] for e in k.log] == ["triton", "triton"]
    triton_launch.launch(k, (4,), *args, **kwargs)
    assert k.log[-1][0] == "direct"


def test_callable_grids_unknown_compiled_kernels_and_the_switch_always_take_tritons_path(monkeypatch):
    k = _kernel()
    x = torch.zeros(64)
    for _ in range(2):
        triton_launch.launch(k, lambda meta: (1,), x, x, 64, 1e-5, BLOCK=128)
    assert [e[0] for e in k.log] == ["triton", "triton"]
    other = _kernel()
    other.compiled = object()  # e.g. the CPU interpreter's launch result
    for _ in range(2):
        triton_launch.launch(other, (1,), x, x, 64, 1e-5, BLOCK=128)
    assert [e[0] for e in other.log] == ["triton", "triton"]
    monkeypatch.setattr(triton_launch, "_ENABLED", False)
    k2 = _kernel()
    for _ in range(2):
        triton_launch.launch(k2, (1,), x, x, 64, 1e-5, BLOCK=128)
    assert [e[0] for e in k2.log] == ["triton", "triton"]


def test_a_parameter_without_value_or_default_is_never_launched_directly():
    k = FakeKernel(["x_ptr", "n", "BLOCK"])
    x = torch.zeros(4)
    for _ in range(2):
        triton_launch.launch(k, (1,), x, 4)  # BLOCK missing: Triton's path raises or binds it; not kept here
    assert [e[0] for e in k.log] == ["triton", "triton"]


def test_the_kept_layouts_are_bounded(monkeypatch):
    monkeypatch.setattr(triton_launch, "MAX_KEPT", 3)
    k = _kernel()
    x = torch.zeros(64)
    for n in range(5):
        triton_launch.launch(k, (1,), x, x, n, 1e-5, BLOCK=128)
    assert len(triton_launch._kept) <= 3
