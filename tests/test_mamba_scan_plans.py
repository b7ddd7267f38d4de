"""The chunked scan's planned launches (hybrid/ops/mamba_scan_plans.py) on stand-ins for the compiled kernels:
a layout's first call records each launch through the config lookup, later calls launch the kept kernels
directly with the same arguments; a new layout (alignment, dtype, shape, an optional input) records again; and
ChunkScan keeps the plans only when they give the lean path's bits. The real kernels:
tests/gpu/test_mamba_scan_gpu.py."""
from __future__ import annotations

import types

import pytest
import torch

from hybrid.ops import mamba_scan
from hybrid.ops.mamba_scan import SCAN_KERNELS, ChunkScan
from hybrid.ops.mamba_scan_plans import KERNEL_NAMES, PASSING, SCAN, ScanPlans


class FakeCompiled:
    """A compiled kernel as Triton's CompiledKernel[grid](*args) launches it: records (grid, args); the scan and
    state-passing kernels fill their outputs with fixed values, so a scan's results can be compared."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def launch(*args):
            self.log.append(("direct", self.name, grid, args))
            _fill(self.name, args)
        return launch


def _fill(name: str, args: tuple) -> None:
    if name == KERNEL_NAMES[SCAN]:
        args[3].fill_(1.0)  # out
    if name == KERNEL_NAMES[PASSING]:
        args[2].fill_(2.0)  # final states


class FakeCached:
    """CachedConfigKernel as ScanPlans uses it: fn.params (the launch's positional arguments, then its constexprs,
    then its config's parameters, then one parameter with a default) and run_recorded."""

    def __init__(self, name: str, log: list, pre_hook: bool = False) -> None:
        self.name, self.log, self.pre_hook = name, log, pre_hook
        self.fn = types.SimpleNamespace(params=None)
        self.config = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_H": 2, "BLOCK_SIZE": 64, "num_warps": 4}

    def run_recorded(self, args, grid, consts):
        if self.fn.params is None:
            names = [f"arg{i}" for i in range(len(args))] + list(consts) + [k for k in self.config if k != "num_warps"]
            params = [types.SimpleNamespace(name=n, has_default=False, default=None) for n in names]
            params.append(types.SimpleNamespace(name="WITH_DEFAULT", has_default=True, default=7))
            self.fn.params = params
        g = grid({**consts, **self.config})
        self.log.append(("recorded", self.name, g, args, dict(consts)))
        _fill(self.name, args)
        return FakeCompiled(self.name, self.log), (None if self.pre_hook else self.config)


def _inputs(T=37, heads=4, P=8, G=2, N=16, dtype=torch.bfloat16, first=0):
    width = heads * P + 2 * G * N + heads
    zx = torch.randn(first + T, width).to(dtype)[first:]
    x = zx[:, : heads * P].reshape(1, T, heads, P)
    B = zx[:, heads * P: heads * P + G * N].reshape(1, T, G, N)
    C = zx[:, heads * P + G * N: heads * P + 2 * G * N].reshape(1, T, G, N)
    dt = zx[:, -heads:][None]
    A, D, dt_bias = -torch.rand(heads), torch.randn(heads), torch.randn(heads)
    return x, dt, A, B, C, D, dt_bias


def _plans(pre_hook=False):
    log: list = []
    return ScanPlans({n: FakeCached(n, log, pre_hook) for n in KERNEL_NAMES}), log


def _scan(plans, inputs, init=None, seq_idx=None, chunk=16):
    x, dt, A, B, C, D, dt_bias = inputs
    return plans.forward(x, dt, A, B, C, chunk, D, dt_bias, init, seq_idx, (0.0, float("inf")))


def test_the_first_call_records_and_later_calls_launch_the_kept_kernels_with_the_same_arguments():
    plans, log = _plans()
    inputs = _inputs()
    out, dt_out, final = _scan(plans, inputs)
    assert [e[0] for e in log] == ["recorded"] * 5 and [e[1] for e in log] == list(KERNEL_NAMES)
    assert out.shape == (1, 37, 4, 8) and dt_out.shape == (1, 4, 3, 16) and final.shape == (1, 4, 8, 16)
    assert torch.all(out == 1) and torch.all(final == 2)
    recorded = log[:]
    for _ in range(2):
        log.clear()
        out, _, final = _scan(plans, inputs)
        assert [e[0] for e in log] == ["direct"] * 5 and torch.all(out == 1) and torch.all(final == 2)
        for (_, name, grid, args, consts), (_, name2, grid2, full) in zip(recorded, log):
            kernel = plans.kernels[name]
            config = {k: v for k, v in kernel.config.items() if k != "num_warps"}
            # every parameter, in the kernel's order: the positional arguments, then by name, then the default
            assert name2 == name and grid2 == grid
            assert len(full) == len(kernel.fn.params)
            assert list(full[len(args):]) == [*consts.values(), *config.values(), 7]
            for a, b in zip(full[: len(args)], args):  # the same values (fresh intermediates: same layout)
                if isinstance(a, torch.Tensor):
                    assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
                else:
                    assert a == b
    # the grids follow the config: the cumsum kernel's heads in blocks of BLOCK_SIZE_H (2), chunks of 16 tokens
    assert recorded[0][2] == (1, 3, 2)


@pytest.mark.parametrize("change", ["alignment", "dtype", "length", "initial_state", "seq_idx", "chunk"])
def test_a_new_layout_records_again(change):
    plans, log = _plans()
    _scan(plans, _inputs())
    log.clear()
    init = seq_idx = None
    chunk = 16
    if change == "alignment":  # rows of an in_proj-shaped output from row 3: the views start off 16 bytes
        inputs = _inputs(first=3)
    elif change == "dtype":
        inputs = _inputs(dtype=torch.float16)
    elif change == "length":
        inputs = _inputs(T=36)
    else:
        inputs = _inputs()
        if change == "initial_state":
            init = torch.randn(1, 4, 8, 16)
        elif change == "seq_idx":
            seq_idx = torch.zeros(1, 37, dtype=torch.int32)
        else:
            chunk = 32
    _scan(plans, inputs, init, seq_idx, chunk)
    assert [e[0] for e in log] == ["recorded"] * 5
    log.clear()
    _scan(plans, inputs, init, seq_idx, chunk)
    assert [e[0] for e in log] == ["direct"] * 5
    # the optional inputs reach the kernels that take them
    if change == "initial_state":
        assert plans.kernels[KERNEL_NAMES[PASSING]].log[-3][3][4] is not None
    if change == "seq_idx":
        assert all(e[3][5] is seq_idx for e in log if e[1] == KERNEL_NAMES[PASSING])


def test_the_kept_layouts_are_bounded(monkeypatch):
    from hybrid.ops import mamba_scan_plans

    monkeypatch.setattr(mamba_scan_plans, "MAX_PLANS", 3)
    plans, log = _plans()
    for T in range(30, 36):
        _scan(plans, _inputs(T=T))
    assert 1 <= len(plans.plans) <= 3


def test_a_config_with_a_pre_hook_is_never_launched_directly():
    plans, log = _plans(pre_hook=True)
    for _ in range(3):
        _scan(plans, _inputs())
    assert [e[0] for e in log] == ["recorded"] * 15


def _fake_library(value_out, value_final):
    calls = {"public": 0, "forward": 0}
    out, final = torch.full((1, 37, 4, 8), value_out), torch.full((1, 4, 8, 16), value_final)

    def public(*a, **k):
        calls["public"] += 1
        return out.clone(), final.clone()

    def forward(*a, **k):
        calls["forward"] += 1
        return (out.clone(), None, None, None, None, final.clone())

    combined = types.SimpleNamespace(mamba_chunk_scan_combined=public, _mamba_chunk_scan_combined_fwd=forward)
    modules = {m: types.SimpleNamespace() for m, _ in SCAN_KERNELS}
    return combined, modules, calls


def _checked_scan(monkeypatch, lean_out: float):
    """A ChunkScan over the fake library (lean outputs lean_out, final states 2) and fake plans, after its
    first call (the check: public, lean, then the plans twice): (scan, plans, log, calls, the call's args)."""
    combined, modules, calls = _fake_library(lean_out, 2.0)
    plans, log = _plans()
    monkeypatch.setattr(mamba_scan, "_install", lambda modules: [])
    monkeypatch.setattr(mamba_scan, "_new_plans", lambda modules: plans)
    scan = ChunkScan(combined, modules)
    x, dt, A, B, C, D, dt_bias = _inputs()
    args = (x, dt, A, B, C, 16, D, dt_bias, None, (0.0, float("inf")))
    scan(*args)
    return scan, plans, log, calls, args


@pytest.mark.parametrize("same", [True, False])
def test_chunk_scan_keeps_the_plans_only_where_they_give_the_lean_bits(monkeypatch, same):
    scan, plans, log, calls, args = _checked_scan(monkeypatch, 1.0 if same else 5.0)
    assert scan.lean is True and (scan.plans is plans) == same
    before = dict(calls)
    log.clear()
    out, final = scan(*args)
    if same:  # the planned launches, directly: the library's forward not called
        assert [e[0] for e in log] == ["direct"] * 5 and calls == before
    else:
        assert not log and calls["forward"] == before["forward"] + 1
    assert torch.all(out == (1.0 if same else 5.0)) and torch.all(final == 2.0)


def test_chunk_scan_drops_plans_that_fail_and_keeps_serving(monkeypatch):
    scan, plans, log, calls, args = _checked_scan(monkeypatch, 1.0)
    assert scan.plans is plans
    plans.forward = lambda *a: (_ for _ in ()).throw(RuntimeError("launch failed"))
    out, final = scan(*args)
    assert scan.plans is None and torch.all(out == 1.0) and torch.all(final == 2.0)
