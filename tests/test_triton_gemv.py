"""The decode-sized Triton linear (hybrid/ops/triton_gemv.py) against torch, on CPU through Triton's
interpreter (see tests/test_triton_kernels.py for why the interpreter is switched on here only)."""
import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU interpreter tests: run in their own process with TRITON_INTERPRET=1", allow_module_level=True)

from hybrid.ops.triton_gemv import MAX_ROWS, small_m_linear  # noqa: E402


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k,block_n,block_k", [(40, 96, 16, 32), (64, 100, 32, 64), (17, 33, 16, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch(m, n, k, block_n, block_k, bias):
    """Ragged N and K (masked tails), every row count up to the tile height, with and without bias."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    got = small_m_linear(x, w, b, block_n=block_n, block_k=block_k, preload=False)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_narrow_programs_change_no_value(monkeypatch):
    """16 output columns a program (the default where 32 would leave over half the SMs idle: N <= 2112 on the
    132 SMs the interpreter stands for) give the values of 32 bit for bit; HYBRID_GEMV_NARROW=0 keeps 32."""
    from hybrid.ops import triton_guard
    from hybrid.ops.triton_gemv import default_block_n

    cpu = torch.device("cpu")
    monkeypatch.delenv("HYBRID_GEMV_NARROW", raising=False)
    triton_guard.reset_switches()
    assert (default_block_n(1536, cpu), default_block_n(2112, cpu), default_block_n(2113, cpu)) == (16, 16, 32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 320, generator=g).bfloat16()
    w = (torch.randn(80, 320, generator=g) / 18).bfloat16()
    narrow = small_m_linear(x, w)
    assert torch.equal(narrow, small_m_linear(x, w, block_n=16))
    assert torch.equal(narrow, small_m_linear(x, w, block_n=32, pre_k=256))
    monkeypatch.setenv("HYBRID_GEMV_NARROW", "0")
    triton_guard.reset_switches()
    assert default_block_n(1536, cpu) == 32
    triton_guard.reset_switches()


@pytest.mark.parametrize("pre_k", [16, 32, 128])
def test_any_prefetched_slab(pre_k):
    """The columns loaded before the PDL wait (pre_k) and the loop after them cover K once: a
    short, an exact and a past-the-end first slab."""
    g = torch.Generator().manual_seed(pre_k)
    x = torch.randn(5, 100, generator=g)
    w = torch.randn(48, 100, generator=g) / 10
    got = small_m_linear(x, w, block_n=16, block_k=32, pre_k=pre_k, preload=False)
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-4)


def test_layers_use_it_only_when_asked_and_eligible(monkeypatch):
    """Linear takes the kernel for fused modules, HYBRID_DECODE_LINEAR=triton and eligible inputs
    (CUDA, <= 16 rows, 16-bit): here on CPU it never applies, and the switch is read once."""
    from hybrid.ops import triton_gemv, triton_guard

    monkeypatch.setenv("HYBRID_DECODE_LINEAR", "triton")
    triton_guard.reset_switches()
    try:
        assert triton_guard.switch("decode_linear") and not triton_guard.switch("norm_router")
        x, w = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)
        assert not triton_gemv.eligible(x, w)  # not CUDA
        monkeypatch.setenv("HYBRID_DECODE_LINEAR", "cublas")
        assert triton_guard.switch("decode_linear")  # cached until reset_switches
    finally:
        triton_guard.reset_switches()
    assert not triton_guard.switch("decode_linear")


def test_plain_linear_by_role(monkeypatch, tiny_ckpt):
    """HYBRID_DECODE_LINEAR=plain takes every projection, plain:<roles> only those roles' (the model's
    Linear modules carry them), unset only the Mamba out_proj, anything else none; each read once until
    reset_switches."""
    from hybrid import LLM
    from hybrid.ops import triton_guard

    def taken(value):
        if value is None:
            monkeypatch.delenv("HYBRID_DECODE_LINEAR", raising=False)
        else:
            monkeypatch.setenv("HYBRID_DECODE_LINEAR", value)
        triton_guard.reset_switches()
        return {r for r in ROLES if triton_guard.decode_linear_plain(r)}

    ROLES = ("mamba.in_proj", "mamba.out_proj", "attn.qkv_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj")
    try:
        assert taken(None) == {"mamba.out_proj"}  # the default (triton_guard.DECODE_LINEAR_DEFAULT)
        assert taken("triton") == set() and taken("cublas") == set()
        assert taken("plain") == set(ROLES)
        assert taken("plain:mamba.in_proj, attn.o_proj") == {"mamba.in_proj", "attn.o_proj"}
        assert triton_guard.switch("decode_linear_plain") and not triton_guard.switch("decode_linear")
        monkeypatch.setenv("HYBRID_DECODE_LINEAR", "plain")
        assert not triton_guard.decode_linear_plain("mamba.out_proj")  # cached until reset_switches
    finally:
        monkeypatch.delenv("HYBRID_DECODE_LINEAR", raising=False)
        triton_guard.reset_switches()
    from hybrid.layers import Linear

    llm = LLM(tiny_ckpt("nemotron_h"), max_num_seqs=2, max_model_len=64)
    roles = {m.role for m in llm.model.modules() if isinstance(m, Linear)}
    assert {"mamba.in_proj", "mamba.out_proj", "attn.qkv_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj"} <= roles
    assert "" not in roles


def test_strided_rows_and_out_buffer():
    """x may be a row-strided view (a slice of a wider activation); `out` is written in place."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 80, generator=g)
    x = wide[:, :48]
    w = torch.randn(32, 48, generator=g)
    out = torch.full((4, 32), float("nan"))
    assert small_m_linear(x, w, out=out, block_n=16, block_k=32, preload=False) is out
    torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-4)


def test_refuses_what_it_does_not_handle():
    with pytest.raises(ValueError, match="at most 16 rows"):
        small_m_linear(torch.zeros(MAX_ROWS + 1, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="shapes/strides"):
        small_m_linear(torch.zeros(2, 8), torch.zeros(4, 6))


@pytest.mark.parametrize("m,k,n_groups,n", [(1, 96, 1, 40), (3, 128, 2, 64), (16, 256, 4, 33), (2, 512, 1, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_norm_linear_matches_the_two_launches(m, k, n_groups, n, bias):
    """gated_norm_linear == out_proj(gated_rms_norm(y, z)): group sizes that take one K step, several,
    and the prefetched slab; rows past M and columns past N masked."""
    from hybrid.ops import triton_norm
    from hybrid.ops.triton_gemv import gated_norm_block_k, gated_norm_linear

    g = torch.Generator().manual_seed(m * 100 + k + n_groups)
    y = torch.randn(m, k, generator=g)
    wide = torch.randn(m, k + 24, generator=g)
    z = wide[:, 8:8 + k]  # a strided view, as the layer's z is a slice of in_proj's output
    nw = 0.5 + torch.rand(k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    assert gated_norm_block_k(k // n_groups) is not None
    got = gated_norm_linear(y, z, nw, 1e-5, n_groups, w, b, block_n=16)
    ref = torch.nn.functional.linear(triton_norm.gated_rms_norm(y, z, nw, 1e-5, n_groups), w, b)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_gated_norm_linear_refuses_groups_it_cannot_step():
    from hybrid.ops.triton_gemv import gated_norm_block_k, gated_norm_linear

    assert gated_norm_block_k(3072) == 256 and gated_norm_block_k(512) == 256 and gated_norm_block_k(24) is None
    with pytest.raises(ValueError, match="gated_norm_linear"):
        gated_norm_linear(torch.zeros(1, 24), torch.zeros(1, 24), torch.ones(24), 1e-5, 1, torch.zeros(8, 24))


# 16-bit here is fp16: the interpreter's bf16 dot is wrong (small_m_linear alone is off by ~1e10 in bf16 on
# it, right on the GPU); the GPU test runs bf16 (tests/gpu/test_triton_fused_ops_gpu.py)
INTERPRETER_DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("width,bias,conv_bias", [(4, False, True), (2, True, False), (3, True, True)])
@pytest.mark.parametrize("preload", [False, True])
def test_in_proj_conv_equals_linear_then_conv_update(dtype, width, bias, conv_bias, preload, monkeypatch):
    """in_proj_conv = small_m_linear, then triton_mamba.conv_state_update on its conv columns: the other
    columns bit for bit, the conv's within fp32 summation order, every slot's history bit for bit (a
    padding row reads a zero history and stores nothing; the other slots are untouched). Tiled and preloading
    (slab, histories and conv weights before the wait; 4 rows, K = 64 + 16 in two pieces); the preloading one
    also equals the tiled one on the same histories up to summation order."""
    from hybrid.ops import triton_gemv
    from hybrid.ops import triton_mamba as tm
    from hybrid.ops.triton_gemv import in_proj_conv

    monkeypatch.setattr(triton_gemv, "PRELOAD_MAX_ROWS", 4)
    g = torch.Generator().manual_seed(width * 10 + bias)
    M, K, start, C, tail, S = 4, 80, 24, 40, 7, 6  # conv columns [24, 64) of 71: blocks straddle both edges
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(start + C + tail, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(start + C + tail, generator=g).to(dtype) if bias else None
    cw = torch.randn(C, width, generator=g).to(dtype)
    cb = torch.randn(C, generator=g).to(dtype) if conv_bias else None
    state = torch.randn(S, C, width - 1, generator=g).to(dtype)
    slots = torch.tensor([3, -1, 0, 5], dtype=torch.int32)
    ref_state, tiled_state = state.clone(), state.clone()
    tiles = dict(block_n=8) if preload else dict(block_n=16, block_k=32)
    ref = small_m_linear(x, w, b, preload=preload, **tiles)
    ref_conv = tm.conv_state_update(ref[:, start:start + C], ref_state, cw, cb, slots)
    got = in_proj_conv(x, w, b, state, cw, cb, slots, start, preload=preload, **tiles)
    assert torch.equal(got[:, :start], ref[:, :start]) and torch.equal(got[:, start + C:], ref[:, start + C:])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[:, start:start + C].float(), ref_conv.float(), **tol)
    assert torch.equal(state, ref_state)
    assert torch.equal(state[[1, 2, 4]], ref_state[[1, 2, 4]])  # (no row's slot: untouched in both)
    if preload:
        tiled = in_proj_conv(x, w, b, tiled_state, cw, cb, slots, start, block_n=16, block_k=32, preload=False)
        torch.testing.assert_close(got.float(), tiled.float(), **tol)
        torch.testing.assert_close(state.float(), tiled_state.float(), **tol)


def test_in_proj_conv_refuses_what_it_cannot_take():
    from hybrid.ops.triton_gemv import in_proj_conv

    x, w = torch.zeros(2, 8), torch.zeros(12, 8)
    cw, state, slots = torch.zeros(4, 3), torch.zeros(3, 4, 2), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="conv_start"):
        in_proj_conv(x, w, None, state, cw, None, slots, 9)  # columns [9, 13) of 12
    with pytest.raises(ValueError, match="conv_state"):
        in_proj_conv(x, w, None, torch.zeros(3, 4, 3), cw, None, slots, 2)
    with pytest.raises(ValueError, match="in_proj_conv"):
        in_proj_conv(torch.zeros(MAX_ROWS + 1, 8), w, None, state, cw, None, torch.zeros(MAX_ROWS + 1), 2)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("n_groups,block_p", [(1, 8), (2, None)])
def test_gated_sums_in_the_ssm_update_and_out_proj(dtype, n_groups, block_p):
    """selective_state_update_gated: y bit for bit selective_state_update's, and per head-dim block the sum
    of squares of y * silu(z) (y as stored); gated_out_proj with those sums equals gated_norm_linear (which
    takes them itself) up to the sums' order."""
    from hybrid.ops import triton_mamba as tm
    from hybrid.ops.triton_gemv import gated_norm_linear, gated_out_proj

    g = torch.Generator().manual_seed(n_groups)
    b, H, P, N, S, hidden = 3, 4, 16, 16, 5, 24
    state = torch.randn(S, H, P, N, generator=g) * 0.3
    x = torch.randn(b, H, P, generator=g).to(dtype)
    dt = torch.randn(b, H, generator=g).to(dtype)
    A, D, dt_bias = -torch.rand(H, generator=g) - 0.5, torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.1
    B = torch.randn(b, n_groups, N, generator=g).to(dtype)
    C = torch.randn(b, n_groups, N, generator=g).to(dtype)
    z = torch.randn(b, 2 * H * P, generator=g).to(dtype)[:, :H * P]  # a strided view, as the in_proj split gives
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)
    ref_state = state.clone()
    ref = tm.selective_state_update(ref_state, x, dt, A, B, C, D, dt_bias, slots, block_p=block_p)
    y, sq = tm.selective_state_update_gated(state, x, dt, A, B, C, D, dt_bias, slots, z.reshape(b, H, P),
                                            block_p=block_p)
    assert torch.equal(y, ref) and torch.equal(state, ref_state)
    h = (y.float() * torch.nn.functional.silu(z.float().reshape(b, H, P))).reshape(b, H, sq.shape[2], -1)
    torch.testing.assert_close(sq, h.pow(2).sum(-1), rtol=1e-5, atol=1e-5)
    nw = (0.5 + torch.rand(H * P, generator=g)).to(dtype)
    w = (torch.randn(hidden, H * P, generator=g) / (H * P) ** 0.5).to(dtype)
    want = gated_norm_linear(y.reshape(b, -1), z, nw, 1e-5, n_groups, w, block_n=16, block_k=16)
    got = gated_out_proj(y.reshape(b, -1), z, nw, 1e-5, n_groups, sq, w, block_n=16, block_k=16)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    with pytest.raises(ValueError, match="gated_out_proj"):
        gated_out_proj(y.reshape(b, -1), z, nw, 1e-5, n_groups, sq[:, :3], w)  # parts of 3 of the 4 heads


def _triton_mixer(dtype):
    """A random Mamba2 mixer with every fused op on, on MambaCudaKernels' Triton decode kernels (the interpreter)."""
    from random_mixer import random_mixer
    from hybrid.ops import triton_mamba as tm
    from hybrid.ops.mamba_cuda import MambaCudaKernels

    mixer = random_mixer(dtype)
    mixer.in_proj.fused = mixer.out_proj.fused = mixer.fused = True
    kernels = object.__new__(MambaCudaKernels)
    kernels.decode_kernels, kernels.triton, kernels._params, kernels.supports_verify = "triton", tm, {}, True
    mixer.kernels = kernels
    return mixer


def _decode_batch(slots: list[int]):
    """A decode-only StepBatch of one token a row on these Mamba slots (-1: a padding row)."""
    from hybrid.batch import StepBatch

    B = len(slots)
    return StepBatch(
        input_ids=torch.zeros(B, dtype=torch.long), positions=torch.zeros(B, dtype=torch.long),
        query_start_loc=torch.arange(B + 1, dtype=torch.int32), seq_lens=torch.ones(B, dtype=torch.int32),
        page_table=torch.zeros(B, 1, dtype=torch.int32), kv_write_loc=torch.zeros(B, dtype=torch.long),
        state_slot=torch.tensor(slots), has_initial_state=torch.ones(B, dtype=torch.bool),
        logits_indices=torch.arange(B), num_decodes=B, num_prefills=0, query_lens_cpu=[1] * B, seq_lens_cpu=[1] * B,
        state_slot_cpu=slots, has_initial_state_cpu=[True] * B)


FUSIONS = {"in_proj_conv": {"HYBRID_DECODE_IN_PROJ_CONV": "1"}, "gated_out_proj": {"HYBRID_DECODE_GATED_OUT_PROJ": "1"},
           "both": {"HYBRID_DECODE_IN_PROJ_CONV": "1", "HYBRID_DECODE_GATED_OUT_PROJ": "1"}}


@pytest.mark.parametrize("fusion", list(FUSIONS))
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_mixer_decode_with_fewer_launches(monkeypatch, dtype, fusion):
    """MambaCudaKernels.mamba_forward on a decode-only step (a padding row among them) with the decode
    fusions (in_proj + conv; the gated norm in the SSM update and out_proj) gives the outputs and slots of
    the unfused path (within summation order), and leaves the padding row's and the other slots untouched."""

    from hybrid.ops import triton_gemv, triton_guard

    mixer = _triton_mixer(dtype)
    cfg = mixer.cfg
    slots = [4, -1, 1]
    B = len(slots)
    batch = _decode_batch(slots)
    hidden = torch.randn(B, 32).to(dtype)
    conv = torch.randn(6, cfg.conv_dim, cfg.conv_kernel - 1).to(dtype)
    ssm = torch.randn(6, cfg.num_heads, cfg.head_dim, cfg.state_size) * 0.3  # (the SSM kernel is not what changes)
    results = {}
    monkeypatch.setattr(triton_gemv, "eligible", lambda x, w: True)  # (its CUDA check: here the interpreter)
    calls = []
    for name in ("in_proj_conv", "gated_out_proj"):
        real = getattr(triton_gemv, name)
        monkeypatch.setattr(triton_gemv, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    # the same projection kernel both ways
    monkeypatch.setenv("HYBRID_DECODE_LINEAR", "plain:mamba.in_proj,mamba.out_proj")
    for fused in ("0", "1"):
        for env in FUSIONS["both"]:  # the fusions under test as `fused` says, any other one off
            monkeypatch.setenv(env, fused if env in FUSIONS[fusion] else "0")
        triton_guard.reset_switches()
        calls.clear()
        c, s = conv.clone(), ssm.clone()
        out = mixer(hidden, batch, c, s)
        assert sorted(calls) == (sorted(n for n in ("in_proj_conv", "gated_out_proj") if fusion in (n, "both"))
                                 if fused == "1" else [])
        results[fused] = out, c, s
    for env in (*FUSIONS["both"], "HYBRID_DECODE_LINEAR"):
        monkeypatch.delenv(env)
    triton_guard.reset_switches()
    (out0, c0, s0), (out1, c1, s1) = results["0"], results["1"]
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out1.float(), out0.float(), **tol)
    # the histories: the same in_proj values shifted in (a fused kernel may sum K in another order: an ulp apart)
    torch.testing.assert_close(c1.float(), c0.float(), **tol)
    torch.testing.assert_close(s1.float(), s0.float(), **tol)
    untouched = [0, 2, 3, 5]
    assert torch.equal(c1[untouched], conv[untouched]) and torch.equal(s1[untouched], ssm[untouched])


def test_decode_fusion_defaults(monkeypatch):
    """in_proj + conv in one launch is on unless HYBRID_DECODE_IN_PROJ_CONV=0, for in_projs of at most
    triton_gemv.IN_PROJ_CONV_MAX_BYTES (cuBLAS streams larger ones faster); the gated norm folded into the
    SSM update and out_proj is off unless HYBRID_DECODE_GATED_OUT_PROJ=1 (triton_guard's measured defaults)."""
    from random_mixer import random_mixer

    from hybrid.ops import triton_gemv, triton_guard
    from hybrid.ops.mamba_cuda import MambaCudaKernels

    mixer = random_mixer(torch.float16)
    mixer.in_proj.fused = mixer.out_proj.fused = mixer.fused = True
    kernels = object.__new__(MambaCudaKernels)
    hidden = torch.zeros(2, 32, dtype=torch.float16)
    monkeypatch.setattr(triton_gemv, "eligible", lambda x, w: True)
    for env in ("HYBRID_DECODE_IN_PROJ_CONV", "HYBRID_DECODE_GATED_OUT_PROJ"):
        monkeypatch.delenv(env, raising=False)
    triton_guard.reset_switches()
    try:
        assert kernels._decode_fusions(mixer, hidden) == (True, False)
        in_proj_bytes = mixer.in_proj.weight.numel() * mixer.in_proj.weight.element_size()
        monkeypatch.setattr(triton_gemv, "IN_PROJ_CONV_MAX_BYTES", in_proj_bytes)
        assert kernels._decode_fusions(mixer, hidden) == (True, False)
        monkeypatch.setattr(triton_gemv, "IN_PROJ_CONV_MAX_BYTES", in_proj_bytes - 1)
        assert kernels._decode_fusions(mixer, hidden) == (False, False)
        monkeypatch.undo()
        monkeypatch.setattr(triton_gemv, "eligible", lambda x, w: True)
        assert kernels._decode_fusions(mixer, hidden) == (True, False)
        monkeypatch.setenv("HYBRID_DECODE_IN_PROJ_CONV", "0")
        triton_guard.reset_switches()
        assert kernels._decode_fusions(mixer, hidden) == (False, False)
    finally:
        monkeypatch.delenv("HYBRID_DECODE_IN_PROJ_CONV", raising=False)
        triton_guard.reset_switches()


def test_decode_fusions_only_for_plain_projections(monkeypatch):
    """The decode fusions call the projections' kernels themselves, so they take only a plain Linear the
    fused ops own: not tensor parallelism's RowParallelLinear out_proj (its all-reduce is in its forward),
    not an unfused one, not a mixer whose gate is not norm(y * silu(z))."""
    import dataclasses

    from random_mixer import random_mixer

    from hybrid.config import GATE_ONLY
    from hybrid.ops import triton_gemv, triton_guard
    from hybrid.ops.mamba_cuda import MambaCudaKernels
    from hybrid.parallel.layers import RowParallelLinear

    mixer = random_mixer(torch.float16)
    mixer.in_proj.fused = mixer.out_proj.fused = mixer.fused = True
    kernels = object.__new__(MambaCudaKernels)
    hidden = torch.zeros(2, 32, dtype=torch.float16)
    monkeypatch.setattr(triton_gemv, "eligible", lambda x, w: True)
    monkeypatch.setenv("HYBRID_DECODE_IN_PROJ_CONV", "1")
    monkeypatch.setenv("HYBRID_DECODE_GATED_OUT_PROJ", "1")
    triton_guard.reset_switches()
    try:
        assert kernels._decode_fusions(mixer, hidden) == (True, True)
        mixer.out_proj.__class__ = RowParallelLinear
        assert kernels._decode_fusions(mixer, hidden) == (True, False)
        mixer.out_proj.__class__ = type(mixer.in_proj)
        mixer.in_proj.fused = False
        assert kernels._decode_fusions(mixer, hidden) == (False, True)
        mixer.cfg = dataclasses.replace(mixer.cfg, gate=GATE_ONLY)
        assert kernels._decode_fusions(mixer, hidden) == (False, False)
    finally:
        monkeypatch.delenv("HYBRID_DECODE_IN_PROJ_CONV")
        monkeypatch.delenv("HYBRID_DECODE_GATED_OUT_PROJ")
        triton_guard.reset_switches()


def test_in_proj_conv_rows_setting(monkeypatch):
    """in_proj_conv takes decode steps of up to MAX_ROWS tokens, or HYBRID_IN_PROJ_CONV_MAX_ROWS (its A/B)."""
    from hybrid.ops.triton_gemv import in_proj_conv_max_rows

    monkeypatch.delenv("HYBRID_IN_PROJ_CONV_MAX_ROWS", raising=False)
    assert in_proj_conv_max_rows() == MAX_ROWS
    monkeypatch.setenv("HYBRID_IN_PROJ_CONV_MAX_ROWS", "4")
    assert in_proj_conv_max_rows() == 4


def test_k_pieces_and_preload_tiles():
    """K as the preloading kernels hold it (two powers of two, a third rounded up), and their columns a program."""
    from hybrid.ops.triton_gemv import PRELOAD_ELEMENTS, k_pieces, preload_block_n

    assert k_pieces(4096) == (4096, 0, 0)
    assert k_pieces(3072) == (2048, 1024, 0)
    assert k_pieces(2688) == (2048, 512, 128)
    assert k_pieces(1600) == (1024, 512, 64)  # 64 columns, of which 64 real
    assert k_pieces(1601) == (1024, 512, 128)  # 65 real of 128
    assert k_pieces(1) == (1, 0, 0)
    for K in (1, 7, 33, 100, 1536, 1600, 1601, 2688, 3072, 21504):
        k1, k2, k3 = k_pieces(K)
        assert k1 + k2 <= K <= k1 + k2 + k3 or (k3 == 0 and k1 + k2 == K)
        assert k3 == 0 or k3 < 2 * (K - k1 - k2)
        bn = preload_block_n(K)
        assert bn == 1 or bn * (k1 + k2 + k3) <= PRELOAD_ELEMENTS
        assert bn == 64 or 2 * bn * (k1 + k2 + k3) > PRELOAD_ELEMENTS
    assert (preload_block_n(1536), preload_block_n(3072), preload_block_n(8192)) == (8, 4, 2)
    with pytest.raises(ValueError, match="k_pieces"):
        k_pieces(0)


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k,block_n", [(40, 96, 8), (17, 100, 4), (64, 64, 16), (9, 33, None)])
@pytest.mark.parametrize("bias", [False, True])
def test_preloading_linear_matches_torch(m, n, k, block_n, bias, monkeypatch):
    """The preloading kernel: K in one, two and three pieces (the last masked past K), ragged N, up to 4 rows
    (one by default; HYBRID_GEMV_PRELOAD_ROWS up to 4); and a row's result does not depend on the others'
    values."""
    from hybrid.ops import triton_gemv

    monkeypatch.setattr(triton_gemv, "PRELOAD_MAX_ROWS", 4)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    got = small_m_linear(x, w, b, block_n=block_n, preload=True)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    if m > 1:  # other rows' values change no row's bits (ROWS > 1: the rows read together, reduced as one tile)
        other = x.clone()
        other[1:] = torch.randn(m - 1, k, generator=g)
        assert torch.equal(small_m_linear(other, w, b, block_n=block_n, preload=True)[0], got[0])


def test_preloading_linear_writes_fp32_out():
    """16-bit rows and weights, fp32 `out` (the LM head's logits, HYBRID_LM_HEAD_PRELOAD): the fp32 accumulator
    stored as it is, not rounded to 16 bits first."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 200, generator=g).half()
    w = (torch.randn(40, 200, generator=g) / 14).half()
    out = torch.empty(1, 40, dtype=torch.float32)
    got = small_m_linear(x, w, out=out, preload=True)
    want = torch.nn.functional.linear(x.double(), w.double())
    assert got is out
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, got.half().float())  # (fp16 rounding would lose bits)


def test_preloading_switch_and_its_rows(monkeypatch):
    """One-token steps take the preloading kernels by default, every projection (preload_everywhere);
    HYBRID_GEMV_PRELOAD=1 keeps them to the Triton linear's own sites, =0 turns them off; a step of more rows
    keeps the tiled kernel, and is refused when the preloading one is asked for; HYBRID_GEMV_PRELOAD_ROWS takes
    steps of up to 4 tokens."""
    from hybrid.ops import triton_guard
    from hybrid.ops.triton_gemv import PRELOAD_MAX_ROWS, preload_applies, preload_everywhere

    assert PRELOAD_MAX_ROWS == 1
    for value, applies, everywhere in ((None, True, True), ("all", True, True), ("1", True, False),
                                       ("0", False, False)):
        if value is None:
            monkeypatch.delenv("HYBRID_GEMV_PRELOAD", raising=False)
        else:
            monkeypatch.setenv("HYBRID_GEMV_PRELOAD", value)
        triton_guard.reset_switches()
        assert (preload_applies(1), preload_everywhere(1)) == (applies, everywhere)
        assert not preload_applies(2) and not preload_everywhere(2)
    monkeypatch.delenv("HYBRID_GEMV_PRELOAD")
    triton_guard.reset_switches()
    with pytest.raises(ValueError, match="preloading"):
        small_m_linear(torch.zeros(2, 8), torch.zeros(4, 8), preload=True)
    monkeypatch.setenv("HYBRID_GEMV_PRELOAD_ROWS", "4")  # the A/B of steps of up to 4 tokens
    assert preload_applies(4) and preload_everywhere(4) and not preload_applies(5)
    monkeypatch.setenv("HYBRID_GEMV_PRELOAD_ROWS", "16")  # (the kernels take 4 at most)
    assert preload_applies(4) and not preload_applies(5)
