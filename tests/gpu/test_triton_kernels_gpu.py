"""GPU tests of hybrid.ops.triton_mamba (compiled Triton, Nemotron-H-8B layer dims) vs the torch reference.

Run in a process where TRITON_INTERPRET is not set (tests/test_triton_kernels.py sets it only on
machines without CUDA):  python -m pytest -m gpu tests/gpu/test_triton_kernels_gpu.py
"""
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

# Without CUDA, tests/gpu/conftest.py marks every test here skipped (and `-m "not gpu"` deselects them).
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process: run the GPU tests in their own process", allow_module_level=True)
pytest.importorskip("triton")

from hybrid.ops import mamba_torch  # noqa: E402
from hybrid.ops import triton_mamba as tm  # noqa: E402

H, P, G, N, K = 128, 64, 8, 128, 4
CD = H * P + 2 * G * N
SLOTS = 10  # the last row (9) plays the pool's scratch row
DEV = "cuda"


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


IDX = [0, -1, 8, 3, -1]  # next to slot 0 and to the last live slot, with pad rows


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_p", [None, 4, 16, 64])
def test_ssm_update_vs_reference(state_dtype, block_p):
    g = _gen(0)
    b = len(IDX)
    x = torch.randn(b, H, P, device=DEV, generator=g)
    dt = torch.randn(b, H, device=DEV, generator=g) - 1
    A = -torch.exp(torch.rand(H, device=DEV, generator=g) * 2)
    B = torch.randn(b, G, N, device=DEV, generator=g)
    C = torch.randn(b, G, N, device=DEV, generator=g)
    D = torch.randn(H, device=DEV, generator=g)
    dtb = torch.randn(H, device=DEV, generator=g) * 0.5
    state = (torch.randn(SLOTS, H, P, N, device=DEV, generator=g) * 0.3).to(state_dtype)
    idx = torch.tensor(IDX, device=DEV)
    live = (idx >= 0).nonzero().flatten()
    before = state.clone()
    ref_state = before.float().clone()
    ref_y = mamba_torch.ssm_decode(x[live], dt[live], A, B[live], C[live], D, dtb, ref_state, idx[live])
    y = tm.selective_state_update(state, x, dt, A, B, C, D, dtb, idx, block_p=block_p)
    torch.cuda.synchronize()
    bound = 1e-5 if state_dtype == torch.float32 else 1e-2
    assert not torch.isnan(y).any()
    assert _rel(y[live], ref_y) < bound
    assert _rel(state[idx[live]], ref_state[idx[live]]) < bound
    if state_dtype == torch.bfloat16:  # one rounding of the fp32 result: within one bf16 ulp of torch's
        torch.testing.assert_close(state[idx[live]].float(), ref_state[idx[live]].to(state_dtype).float(),
                                   atol=1e-6, rtol=8e-3)
    for s in range(SLOTS):
        if s not in IDX:
            assert torch.equal(state[s], before[s]), s
    full = mamba_torch.ssm_decode(x, dt, A, B, C, D, dtb, before.float().clone(), idx)  # pad rows: zero state
    assert _rel(y, full) < bound


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_ssm_update_bf16_activations_strided_like_the_layer(state_dtype):
    """x / B / C as views of one bf16 xBC row, dt a view of zxbcdt: the layer's call pattern."""
    g = _gen(1)
    b = 4
    zxbcdt = torch.randn(b, H * P + CD + H, device=DEV, generator=g).to(torch.bfloat16)
    xbc = zxbcdt[:, H * P:H * P + CD]
    dt = zxbcdt[:, H * P + CD:]
    x, B, C = torch.split(xbc, [H * P, G * N, G * N], dim=-1)
    x, B, C = x.reshape(b, H, P), B.reshape(b, G, N), C.reshape(b, G, N)
    A = -torch.exp(torch.rand(H, device=DEV, generator=g) * 2)
    D = torch.randn(H, device=DEV, generator=g)
    dtb = torch.randn(H, device=DEV, generator=g) * 0.5
    state = (torch.randn(SLOTS, H, P, N, device=DEV, generator=g) * 0.3).to(state_dtype)
    idx = torch.tensor([2, 0, 8, 5], device=DEV)
    ref_state = state.float().clone()
    ref_y = mamba_torch.ssm_decode(x.float(), dt.float(), A, B.float(), C.float(), D, dtb, ref_state, idx)
    y = tm.selective_state_update(state, x, dt, A, B, C, D, dtb, idx, out=torch.empty(b, H, P, device=DEV))
    bound = 1e-5 if state_dtype == torch.float32 else 1e-2
    assert _rel(y, ref_y) < bound
    assert _rel(state[idx], ref_state[idx]) < bound


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_ssm_verify_intermediate_states(state_dtype):
    g = _gen(2)
    b, T = 3, 4
    x = torch.randn(b, T, H, P, device=DEV, generator=g)
    dt = torch.randn(b, T, H, device=DEV, generator=g) - 1
    A = -torch.exp(torch.rand(H, device=DEV, generator=g) * 2)
    B = torch.randn(b, T, G, N, device=DEV, generator=g)
    C = torch.randn(b, T, G, N, device=DEV, generator=g)
    D = torch.randn(H, device=DEV, generator=g)
    dtb = torch.randn(H, device=DEV, generator=g) * 0.5
    state = (torch.randn(SLOTS, H, P, N, device=DEV, generator=g) * 0.3).to(state_dtype)
    idx = torch.tensor([8, -1, 0], device=DEV)
    inter = torch.full((b, T, H, P, N), 7.0, device=DEV).to(state_dtype)
    before = state.clone()
    y = tm.selective_state_update(state, x, dt, A, B, C, D, dtb, idx, intermediate_states=inter)
    assert torch.equal(state, before)
    assert bool((inter[1] == 7).all())
    bound = 1e-5 if state_dtype == torch.float32 else 1e-2
    ref_state = before.float().clone()
    for i in (0, 2):
        for t in range(T):
            s = idx[i:i + 1]
            ry = mamba_torch.ssm_decode(x[i:i + 1, t], dt[i:i + 1, t], A, B[i:i + 1, t], C[i:i + 1, t], D, dtb,
                                        ref_state, s)
            assert _rel(y[i, t], ry[0]) < bound
            assert _rel(inter[i, t], ref_state[s[0]]) < bound


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_multi_token_launch_equals_decodes(state_dtype):
    """The state contract on the compiled kernels: one T-token launch (verify into the scratch, and
    replay in place) equals T one-token decode launches bit for bit, states and outputs, with the
    conv history and the SSM state stored in state_dtype (x fp32). CPU twin: tests/test_state_contract.py."""
    g = _gen(6)
    b, T = 3, 4
    xBC = torch.randn(b, T, CD, device=DEV, generator=g)
    w = torch.randn(CD, K, device=DEV, generator=g) * 0.5
    cb = torch.randn(CD, device=DEV, generator=g)
    dt = torch.randn(b, T, H, device=DEV, generator=g) - 1
    A = -torch.exp(torch.rand(H, device=DEV, generator=g) * 2)
    D = torch.randn(H, device=DEV, generator=g)
    dtb = torch.randn(H, device=DEV, generator=g) * 0.5
    conv0 = torch.randn(SLOTS, CD, K - 1, device=DEV, generator=g).to(state_dtype)
    ssm0 = (torch.randn(SLOTS, H, P, N, device=DEV, generator=g) * 0.3).to(state_dtype)
    idx = torch.tensor([8, 0, 3], device=DEV)

    def run(xbc_in, dt_in, conv, ssm, scratch=None):
        lead = xbc_in.shape[:-1]
        cs, ss = scratch if scratch is not None else (None, None)
        xbc = tm.conv_state_update(xbc_in, conv, w, cb, idx, "silu", intermediate_states=cs)
        xs, Bs, Cs = torch.split(xbc, [H * P, G * N, G * N], dim=-1)
        y = tm.selective_state_update(ssm, xs.reshape(*lead, H, P), dt_in, A, Bs.reshape(*lead, G, N),
                                      Cs.reshape(*lead, G, N), D, dtb, idx, intermediate_states=ss)
        return xbc, y

    conv, ssm = conv0.clone(), ssm0.clone()
    dec = []
    for t in range(T):
        xbc, y = run(xBC[:, t], dt[:, t], conv, ssm)
        dec.append((xbc, y, conv[idx].clone(), ssm[idx].clone()))
    c_scr = torch.zeros(b, T, CD, K - 1, device=DEV, dtype=state_dtype)
    s_scr = torch.zeros(b, T, H, P, N, device=DEV, dtype=state_dtype)
    cv, sv = conv0.clone(), ssm0.clone()
    xbc_v, y_v = run(xBC, dt, cv, sv, (c_scr, s_scr))
    cr, sr = conv0.clone(), ssm0.clone()
    xbc_r, y_r = run(xBC, dt, cr, sr)
    assert torch.equal(cv, conv0) and torch.equal(sv, ssm0)
    for t, (xbc, y, c, s) in enumerate(dec):
        assert torch.equal(xbc_v[:, t], xbc) and torch.equal(xbc_r[:, t], xbc), t
        assert torch.equal(y_v[:, t], y) and torch.equal(y_r[:, t], y), t
        assert torch.equal(c_scr[:, t], c) and torch.equal(s_scr[:, t], s), t
    assert torch.equal(cr, conv) and torch.equal(sr, ssm)


@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.bfloat16])
def test_conv_update_vs_reference(conv_dtype):
    g = _gen(3)
    xBC = torch.randn(len(IDX), CD, device=DEV, generator=g)
    w = torch.randn(CD, K, device=DEV, generator=g) * 0.5
    cb = torch.randn(CD, device=DEV, generator=g)
    conv = torch.randn(SLOTS, CD, K - 1, device=DEV, generator=g).to(conv_dtype)
    idx = torch.tensor(IDX, device=DEV)
    live = (idx >= 0).nonzero().flatten()
    ref_conv = conv.float().clone()
    xbc = mamba_torch.conv_decode(xBC[live], ref_conv, idx[live], w, cb)
    c1 = conv.clone()
    out = tm.conv_state_update(xBC, c1, w, cb, idx, "silu")
    assert _rel(out[live], xbc) < 1e-5
    assert torch.equal(c1, ref_conv.to(conv_dtype)), "conv history must be bit-identical (and others untouched)"
    full = mamba_torch.conv_decode(xBC, conv.float().clone(), idx, w, cb)  # pad rows: zero history
    assert _rel(out, full) < 1e-5


def test_matches_library_when_installed():
    """Same update as mamba_ssm's selective_state_update (if importable), bf16 state."""
    import importlib.util
    import sys
    import types
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None:
        pytest.skip("mamba_ssm not installed")
    if "mamba_ssm" not in sys.modules:
        pkg = types.ModuleType("mamba_ssm")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["mamba_ssm"] = pkg
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as ssu
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"mamba_ssm Triton kernels not importable: {e}")
    g = _gen(5)
    b = 4
    x = torch.randn(b, H, P, device=DEV, generator=g)
    dt = torch.randn(b, H, device=DEV, generator=g) - 1
    A = -torch.exp(torch.rand(H, device=DEV, generator=g) * 2)
    B = torch.randn(b, G, N, device=DEV, generator=g)
    C = torch.randn(b, G, N, device=DEV, generator=g)
    D = torch.randn(H, device=DEV, generator=g)
    dtb = torch.randn(H, device=DEV, generator=g) * 0.5
    state = (torch.randn(SLOTS, H, P, N, device=DEV, generator=g) * 0.3)
    idx = torch.tensor([3, 0, 8, 5], device=DEV)
    s1, s2 = state.clone(), state.clone()
    y1 = tm.selective_state_update(s1, x, dt, A, B, C, D, dtb, idx)
    y2 = ssu(s2, x, dt[:, :, None].expand(b, H, P), A[:, None, None].expand(H, P, N), B, C,
             D=D[:, None].expand(H, P), z=None, dt_bias=dtb[:, None].expand(H, P), dt_softplus=True,
             state_batch_indices=idx.to(torch.int32))
    assert _rel(y1, y2) < 1e-5
    assert _rel(s1, s2) < 1e-5


@pytest.mark.parametrize("has_init", [True, False])
@pytest.mark.parametrize("L", [2, 1000])
def test_conv_prefill_8b_dims(has_init, L):
    g = _gen(L)
    zx = torch.randn(L, CD + 8192, device=DEV, generator=g).bfloat16()
    x = zx[:, 8192:]  # the xBC columns of the projection output, as in the mixer
    conv = torch.randn(SLOTS, CD, K - 1, device=DEV, generator=g).bfloat16()
    w = (torch.randn(CD, K, device=DEV, generator=g) * 0.5).bfloat16()
    b = torch.randn(CD, device=DEV, generator=g).bfloat16()
    ref_conv, before = conv.clone(), conv.clone()
    ref = mamba_torch.conv_prefill(x, ref_conv, 4, has_init, w, b)
    got = tm.conv_prefill(x, conv, 4, has_init, w, b)
    assert torch.isfinite(got).all() and _rel(got, ref) < 2e-2
    assert torch.equal(conv, ref_conv)  # the new history of slot 4, every other slot untouched
    assert torch.equal(conv[5:], before[5:]) and torch.equal(conv[:4], before[:4])
