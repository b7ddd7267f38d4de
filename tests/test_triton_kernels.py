"""Triton Mamba decode kernels vs the plain-torch reference, on CPU through Triton's interpreter.

The interpreter must be switched on before triton is first imported, hence the env var at the top.
Small shapes only: the interpreter runs every program in Python.

On a machine with CUDA the interpreter is NOT switched on here (that would turn every later triton
kernel in the same pytest process, GPU tests included, into CPU-interpreted ones); there these
tests run only in their own process with the variable set explicitly:
    TRITON_INTERPRET=1 python -m pytest tests/test_triton_kernels.py
(GPU tests of the same kernels: tests/gpu/test_triton_kernels_gpu.py.)
"""
import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU interpreter tests: run in their own process with TRITON_INTERPRET=1", allow_module_level=True)

from hybrid.ops import mamba_torch  # noqa: E402
from hybrid.ops import triton_mamba as tm  # noqa: E402

PAD = -1
NUM_SLOTS = 6  # rows 0..5 (+ the pool's scratch row 6)


def _tol(state_dtype):
    return dict(atol=1e-5, rtol=1e-5) if state_dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)


def _ssm_inputs(batch, H, P, N, G, state_dtype, seed, T=None):
    g = torch.Generator().manual_seed(seed)
    lead = (batch,) if T is None else (batch, T)
    x = torch.randn(*lead, H, P, generator=g)
    dt = torch.randn(*lead, H, generator=g)
    A = -torch.exp(torch.rand(H, generator=g) * 2)
    B = torch.randn(*lead, G, N, generator=g)
    C = torch.randn(*lead, G, N, generator=g)
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g) * 0.5
    state = torch.randn(NUM_SLOTS + 1, H, P, N, generator=g).to(state_dtype)
    return x, dt, A, B, C, D, dt_bias, state


# slots next to slot 0 and next to the last slot, with padding rows in between
SLOT_CASES = [[0, PAD, 5], [PAD, 3, 0, PAD], [5, PAD]]


def _check_untouched(before, after, slots):
    live = {s for s in slots if s >= 0}
    for s in range(before.shape[0]):
        if s not in live:
            assert torch.equal(before[s], after[s]), f"slot {s} was touched"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots,H,N", [(SLOT_CASES[0], 4, 16), (SLOT_CASES[1], 8, 32)])
def test_selective_state_update(state_dtype, slots, H, N):
    P, G = 16, 2
    batch = len(slots)
    x, dt, A, B, C, D, dt_bias, state = _ssm_inputs(batch, H, P, N, G, state_dtype, seed=len(slots) + N)
    idx = torch.tensor(slots, dtype=torch.int64)
    before = state.clone()
    got = tm.selective_state_update(state, x, dt, A, B, C, D, dt_bias, idx, block_p=8)
    live = [i for i, s in enumerate(slots) if s >= 0]
    ref_state = before.float().clone()
    rows = torch.tensor(live)
    ref_y = mamba_torch.ssm_decode(x[rows], dt[rows], A, B[rows], C[rows], D, dt_bias, ref_state, idx[rows])
    assert not torch.isnan(got).any() and not torch.isnan(state.float()).any()
    torch.testing.assert_close(got[rows], ref_y, **_tol(state_dtype))
    torch.testing.assert_close(state.float()[idx[rows]], ref_state[idx[rows]].to(state_dtype).float(), **_tol(state_dtype))
    _check_untouched(before, state, slots)
    # padding rows: output from a zero state, as the reference computes it on the whole batch
    full = mamba_torch.ssm_decode(x, dt, A, B, C, D, dt_bias, before.float().clone(), idx)
    torch.testing.assert_close(got, full, **_tol(state_dtype))


def test_selective_state_update_fp32_exact_slot_layout_and_int32_indices():
    """int32 indices, no D / dt_bias, fp32 output buffer, default tile config."""
    H, P, N, G = 4, 16, 16, 2
    slots = [5, PAD, 0]
    x, dt, A, B, C, D, dt_bias, state = _ssm_inputs(3, H, P, N, G, torch.float32, seed=7)
    idx = torch.tensor(slots, dtype=torch.int32)
    before = state.clone()
    out = torch.full((3, H, P), float("nan"))
    tm.selective_state_update(state, x, dt, A, B, C, None, None, idx, out=out)
    ref_state = before.clone()
    rows = torch.tensor([0, 2])
    ref_y = mamba_torch.ssm_decode(x[rows], dt[rows], A, B[rows], C[rows], torch.zeros(H), torch.zeros(H),
                                   ref_state, idx[rows].long())
    torch.testing.assert_close(out[rows], ref_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)
    full = mamba_torch.ssm_decode(x, dt, A, B, C, torch.zeros(H), torch.zeros(H), before.clone(), idx.long())
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_selective_state_update_intermediate_states(state_dtype):
    H, P, N, G, T = 4, 16, 16, 2, 3
    slots = [0, PAD, 5]
    batch = len(slots)
    x, dt, A, B, C, D, dt_bias, state = _ssm_inputs(batch, H, P, N, G, state_dtype, seed=11, T=T)
    idx = torch.tensor(slots)
    scratch_rows = torch.tensor([2, 0, 1])  # request i writes scratch row scratch_rows[i]
    inter = torch.full((3, T, H, P, N), 7.0).to(state_dtype)
    before = state.clone()
    got = tm.selective_state_update(state, x, dt, A, B, C, D, dt_bias, idx, intermediate_states=inter,
                                    intermediate_indices=scratch_rows, block_p=8)
    assert torch.equal(state, before), "verify mode must leave every slot untouched"
    assert torch.equal(inter[0], torch.full_like(inter[0], 7.0)), "the pad row's scratch row was written"
    ref_state = before.float().clone()
    for i in (0, 2):
        s = torch.tensor([slots[i]])
        for t in range(T):
            y = mamba_torch.ssm_decode(x[i:i + 1, t], dt[i:i + 1, t], A, B[i:i + 1, t], C[i:i + 1, t], D, dt_bias,
                                       ref_state, s)
            torch.testing.assert_close(got[i, t], y[0], **_tol(state_dtype))
            torch.testing.assert_close(inter[scratch_rows[i], t].float(), ref_state[slots[i]].to(state_dtype).float(),
                                       **_tol(state_dtype))
    zero = torch.zeros(1, H, P, N)
    for t in range(T):  # the padding row runs from a zero state, writing nothing
        y = mamba_torch.ssm_decode(x[1:2, t], dt[1:2, t], A, B[1:2, t], C[1:2, t], D, dt_bias, zero, torch.tensor([0]))
        torch.testing.assert_close(got[1, t], y[0], **_tol(state_dtype))
    # in-place multi-token update: the slot ends at the state after the last token
    state2 = before.clone()
    got2 = tm.selective_state_update(state2, x, dt, A, B, C, D, dt_bias, idx)
    torch.testing.assert_close(got2, got, atol=1e-6, rtol=1e-6)
    for i in (0, 2):
        assert torch.equal(state2[slots[i]], inter[scratch_rows[i], T - 1])
    _check_untouched(before, state2, slots)


def _conv_inputs(batch, CD, K, conv_dtype, seed, T=None):
    g = torch.Generator().manual_seed(seed)
    lead = (batch,) if T is None else (batch, T)
    x = torch.randn(*lead, CD, generator=g)
    conv_state = torch.randn(NUM_SLOTS + 1, CD, K - 1, generator=g).to(conv_dtype)
    weight = torch.randn(CD, K, generator=g) * 0.5
    bias = torch.randn(CD, generator=g)
    return x, conv_state, weight, bias


@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_state_update(conv_dtype, with_bias):
    CD, K = 80, 4
    slots = [PAD, 5, 0, PAD]
    x, conv_state, weight, bias = _conv_inputs(len(slots), CD, K, conv_dtype, seed=3)
    bias = bias if with_bias else None
    idx = torch.tensor(slots)
    before = conv_state.clone()
    got = tm.conv_state_update(x, conv_state, weight, bias, idx, "silu", block_c=32)
    rows = torch.tensor([1, 2])
    ref_state = before.float().clone()
    ref = mamba_torch.conv_decode(x[rows], ref_state, idx[rows], weight, bias)
    tol = _tol(conv_dtype)
    torch.testing.assert_close(got[rows], ref, **tol)
    # the history shift is a pure copy: exact in fp32. (Triton's CPU interpreter rounds fp32 -> bf16
    # differently from torch, so bf16 is within one ulp here; the GPU test checks it exactly.)
    if conv_dtype == torch.float32:
        assert torch.equal(conv_state[idx[rows]], ref_state[idx[rows]])
    else:
        torch.testing.assert_close(conv_state[idx[rows]].float(), ref_state[idx[rows]].to(conv_dtype).float(),
                                   atol=1e-2, rtol=1e-2)
    _check_untouched(before, conv_state, slots)
    full = mamba_torch.conv_decode(x, before.float().clone(), idx, weight, bias)
    torch.testing.assert_close(got, full, **tol)


def test_conv_state_update_multi_token_and_intermediate():
    CD, K, T = 48, 4, 5  # T > K-1: the window leaves the history
    slots = [5, PAD, 0]
    x, conv_state, weight, bias = _conv_inputs(3, CD, K, torch.float32, seed=5, T=T)
    idx = torch.tensor(slots)
    inter = torch.full((3, T, CD, K - 1), 7.0)
    before = conv_state.clone()
    got = tm.conv_state_update(x, conv_state, weight, bias, idx, "silu", intermediate_states=inter, block_c=32)
    assert torch.equal(conv_state, before)
    assert torch.equal(inter[1], torch.full_like(inter[1], 7.0))
    ref_state = before.clone()
    for i in (0, 2):
        s = torch.tensor([slots[i]])
        for t in range(T):
            y = mamba_torch.conv_decode(x[i:i + 1, t], ref_state, s, weight, bias)
            torch.testing.assert_close(got[i, t], y[0], atol=1e-5, rtol=1e-5)
            assert torch.equal(inter[i, t], ref_state[slots[i]])
    got2 = tm.conv_state_update(x, conv_state, weight, bias, idx, "silu", block_c=32)
    torch.testing.assert_close(got2, got, atol=0, rtol=0)
    for i in (0, 2):
        assert torch.equal(conv_state[slots[i]], inter[i, T - 1])
    _check_untouched(before, conv_state, slots)



def test_import_without_triton_is_guarded():
    assert tm.is_available()
    assert hasattr(tm, "HAS_TRITON")


def test_module_imports_without_triton():
    """Importing the module must work where triton is absent; calling a kernel then raises."""
    import subprocess
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "from hybrid.ops import triton_mamba as tm\n"
        "assert not tm.is_available()\n"
        "try:\n"
        "    tm.conv_state_update(None, None, None, None, None)\n"
        "except RuntimeError:\n"
        "    print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_init", [True, False])
@pytest.mark.parametrize("L", [1, 2, 70])  # shorter than the history (1, 2), and several token blocks (70)
def test_conv_prefill(conv_dtype, has_init, L):
    CD, K = 80, 4
    g = torch.Generator().manual_seed(L)
    x_full = torch.randn(L, CD + 16, generator=g).to(conv_dtype)
    x = x_full[:, 8:8 + CD]  # a column slice, as xBC is of the projection output
    conv_state = torch.randn(NUM_SLOTS + 1, CD, K - 1, generator=g).to(conv_dtype)
    weight = (torch.randn(CD, K, generator=g) * 0.5).to(conv_dtype)
    bias = torch.randn(CD, generator=g).to(conv_dtype)
    ref_state = conv_state.clone()
    ref = mamba_torch.conv_prefill(x, ref_state, 3, has_init, weight, bias)
    before = conv_state.clone()
    got = tm.conv_prefill(x, conv_state, 3, has_init, weight, bias, block_l=32, block_c=32)
    assert got.shape == (L, CD) and got.dtype == conv_dtype and got.is_contiguous()
    torch.testing.assert_close(got.float(), ref.float(), **_tol(conv_dtype))
    assert torch.equal(conv_state[3], ref_state[3])  # the history is a copy of inputs: exact
    others = [s for s in range(NUM_SLOTS + 1) if s != 3]
    assert torch.equal(conv_state[others], before[others])
