"""The varlen prefill kernels (hybrid/ops/triton_mamba_varlen.py) on CPU through Triton's interpreter:
the conv over several rows at once equals triton_mamba.conv_prefill row by row (outputs and histories, bit
for bit), and the zero-state scan plus add_initial_states equals mamba_torch.ssm_prefill from each row's
own initial state (outputs and final states). See tests/test_triton_kernels.py for the interpreter switch."""
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
from hybrid.ops import triton_mamba_varlen as tv  # noqa: E402

# (length, slot, has_init): rows shorter than the conv history, one token, longer than a block
ROWS = [(5, 2, True), (1, 0, True), (2, 4, False), (70, 1, True), (3, 5, False), (1, 3, False)]


@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [4, 2])
def test_conv_varlen_equals_the_rows_one_by_one(conv_dtype, K):
    g = torch.Generator().manual_seed(K)
    CD, slots = 48, 7
    lengths = [n for n, _, _ in ROWS]
    # a strided view, as the in_proj split gives, in the conv state's dtype (the model's, as in the model)
    x_wide = torch.randn(sum(lengths), CD + 8, generator=g).to(conv_dtype)
    x = x_wide[:, 3:3 + CD]
    weight, bias = torch.randn(CD, K, generator=g), torch.randn(CD, generator=g)
    state = torch.randn(slots, CD, K - 1, generator=g).to(conv_dtype)
    ref_state = state.clone()
    ref, start = [], 0
    for n, slot, init in ROWS:
        ref.append(tm.conv_prefill(x[start:start + n], ref_state, slot, init, weight, bias, block_l=16, block_c=32))
        start += n
    rows = tv.varlen_rows(lengths, [s for _, s, _ in ROWS], [i for _, _, i in ROWS], torch.device("cpu"))
    got = tv.conv_prefill_varlen(x, state, rows, weight, bias, block_l=16, block_c=32)
    assert torch.equal(got, torch.cat(ref))
    assert torch.equal(state, ref_state)  # every row's history, and the untouched slot 6


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 2])
def test_zero_state_scan_plus_initial_states_equals_each_rows_own_scan(state_dtype, groups):
    g = torch.Generator().manual_seed(groups)
    H, P, N, chunk, slots = 4, 16, 16, 8, 7
    lengths = [n for n, _, _ in ROWS]
    T = sum(lengths)
    x = torch.randn(T, H, P, generator=g)
    dt_raw = torch.randn(T, H, generator=g)
    A = -torch.rand(H, generator=g) - 0.2
    B, C = torch.randn(T, groups, N, generator=g), torch.randn(T, groups, N, generator=g)
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.1
    limit = (0.0, float("inf"))
    state = (torch.randn(slots, H, P, N, generator=g) * 0.5).to(state_dtype)
    ref_state = state.clone()
    want, finals, start = [], [], 0
    for n, slot, init in ROWS:
        rows = slice(start, start + n)
        y, final = mamba_torch.ssm_prefill(x[rows], dt_raw[rows], A, B[rows], C[rows], D, dt_bias, limit, chunk,
                                           ref_state[slot] if init else None)
        ref_state[slot] = final.to(state_dtype)
        want.append(y)
        start += n
    # the zero-state scan of every row (what mamba-ssm's varlen scan gives), and its processed dt
    y0, f0, start = [], [], 0
    for n, _, _ in ROWS:
        rows = slice(start, start + n)
        y, final = mamba_torch.ssm_prefill(x[rows], dt_raw[rows], A, B[rows], C[rows], D, dt_bias, limit, chunk, None)
        y0.append(y)
        f0.append(final)
        start += n
    dt = torch.clamp(torch.nn.functional.softplus(dt_raw + dt_bias), *limit).t().contiguous()  # [H, T]
    y = torch.cat(y0)
    rows = tv.varlen_rows(lengths, [s for _, s, _ in ROWS], [i for _, _, i in ROWS], torch.device("cpu"))
    tv.add_initial_states(y, C, dt, A, state, torch.stack(f0), rows, block_t=16, block_p=16)
    torch.testing.assert_close(y, torch.cat(want), rtol=1e-4, atol=1e-4)
    tol = dict(rtol=1e-4, atol=1e-4) if state_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(state.float(), ref_state.float(), **tol)
    assert torch.equal(state[6], ref_state[6])  # a slot no row owns is untouched
