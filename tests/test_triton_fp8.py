"""The FP8 projection's Triton kernels (hybrid/ops/triton_fp8.py) against the reference numerics of
hybrid/fp8_linear.py, on CPU through Triton's interpreter (see tests/test_triton_kernels.py for why
the interpreter is switched on here only)."""
import math
import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU interpreter tests: run in their own process with TRITON_INTERPRET=1", allow_module_level=True)

from hybrid.fp8_linear import Fp8Linear, fake_quantize, per_token_scale  # noqa: E402
from hybrid.ops import triton_act, triton_fp8  # noqa: E402
from hybrid.quantization import DYNAMIC, FP8_DTYPE, STATIC  # noqa: E402

ACTS = {None: triton_fp8.ACT_NONE, STATIC: triton_fp8.ACT_STATIC, DYNAMIC: triton_fp8.ACT_DYNAMIC}


def _layer(n: int, k: int, activation, per_row: bool, bias: bool, seed: int) -> Fp8Linear:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(FP8_DTYPE)
    ws = (torch.rand(n, generator=g) + 0.5) / 200 if per_row else torch.tensor(0.004)
    b = torch.randn(n, generator=g) if bias else None
    s_in = torch.tensor(0.02) if activation == STATIC else None
    return Fp8Linear(w, ws.float(), s_in, activation, b)


@pytest.mark.parametrize("activation", [None, STATIC, DYNAMIC])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("m,n,k,block_k", [(1, 40, 96, 32), (3, 17, 100, 32), (16, 64, 300, 128)])
def test_small_m_linear_matches_the_reference(activation, per_row, m, n, k, block_k):
    """Every activation scheme (weight-only, static, dynamic per row) and weight scale (per tensor,
    per row), ragged N and K (masked tails), row counts up to the tile height, with a bias: the
    kernel computes the reference's dequantized GEMM up to summation order. fp32 rows here: the
    interpreter's tl.dot on bf16 tiles is wrong (bf16 rows: tests/gpu/test_fp8_gpu.py)."""
    layer = _layer(n, k, activation, per_row, bias=m != 1, seed=m * 7 + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3
    x[0, 0] = 40.0  # one large value: a dynamic row scale that differs from the rest
    got = triton_fp8.fp8_small_m_linear(x, layer.weight, layer.weight_scale, ACTS[activation], layer.input_scale,
                                        layer.bias, block_n=16, block_k=block_k)
    want = layer.forward_reference(x)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_rows_do_not_depend_on_each_other():
    """A row's output is the same alone and among others (dynamic scales are per row)."""
    layer = _layer(32, 64, DYNAMIC, True, False, seed=3)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    x[2] *= 100
    many = triton_fp8.fp8_small_m_linear(x, layer.weight, layer.weight_scale, triton_fp8.ACT_DYNAMIC,
                                         block_n=16, block_k=32)
    one = triton_fp8.fp8_small_m_linear(x[1:2], layer.weight, layer.weight_scale, triton_fp8.ACT_DYNAMIC,
                                        block_n=16, block_k=32)
    torch.testing.assert_close(many[1:2], one, atol=0, rtol=0)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("k,block_k", [(100, 32), (256, 1024), (300, None)])
def test_quantize_rows_gives_the_reference_bytes(static, k, block_k):
    """quantize_rows writes exactly the e4m3 values and fp32 scales of the reference
    (per_token_scale, then x / scale clamped and rounded), saturating values past 448 x scale."""
    g = torch.Generator().manual_seed(k + static)
    x = (torch.randn(6, k, generator=g) * 5).to(torch.bfloat16)
    x[3] = 0.0  # an all-zero row: the floor scale
    s_in = torch.tensor(0.01) if static else None
    q, s = triton_fp8.quantize_rows(x, s_in, block_k=block_k)
    want_s = s_in.expand(6, 1) if static else per_token_scale(x)
    assert q.dtype == FP8_DTYPE and s.shape == (6, 1) and s.dtype == torch.float32
    torch.testing.assert_close(s, want_s.float(), atol=0, rtol=0)
    want_q = (x.float() / want_s).clamp(-448, 448).to(FP8_DTYPE)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close((q.float() * s).to(x.dtype), fake_quantize(x, want_s), atol=0, rtol=0)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("k,block_k", [(100, 32), (300, None)])
def test_quantize_rows_with_relu2_is_quantize_rows_of_relu2(static, k, block_k):
    """quantize_rows(x, act="relu2") (a relu2 MLP's down_proj input, the activation in the rounding's launch) writes
    the bytes and scales quantize_rows writes for relu(x) ** 2 rounded to bf16 (triton_act.relu2's values), on
    the one-tile and the looped kernel; rows of negative values only (all zero after relu2) included."""
    g = torch.Generator().manual_seed(k + 7 * static)
    x = (torch.randn(5, k, generator=g) * 4).to(torch.bfloat16)
    x[2] = -x[2].abs()
    s_in = torch.tensor(0.05) if static else None
    q, s = triton_fp8.quantize_rows(x, s_in, block_k=block_k, act="relu2")
    # (against triton_act.relu2's output: Triton's interpreter rounds fp32 to bf16 its own way, the GPU to nearest)
    want_q, want_s = triton_fp8.quantize_rows(triton_act.relu2(x), s_in, block_k=block_k)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(s, want_s, atol=0, rtol=0)
    assert not torch.equal(q.view(torch.uint8), triton_fp8.quantize_rows(x, s_in, block_k=block_k)[0].view(torch.uint8))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("k,block_k", [(100, 32), (300, None)])
def test_quantize_rows_with_silu_and_mul_is_quantize_rows_of_silu_and_mul(static, k, block_k):
    """quantize_rows(x, act="silu_and_mul") on [gate | up] rows 2K wide (a SwiGLU MLP's down_proj input) writes the
    bytes and scales of quantize_rows on triton_act.silu_and_mul's output, one tile and looped."""
    g = torch.Generator().manual_seed(k + 3 * static)
    x = (torch.randn(4, 2 * k, generator=g) * 3).to(torch.bfloat16)
    s_in = torch.tensor(0.03) if static else None
    q, s = triton_fp8.quantize_rows(x, s_in, block_k=block_k, act="silu_and_mul")
    want_q, want_s = triton_fp8.quantize_rows(triton_act.silu_and_mul(x), s_in, block_k=block_k)
    assert q.shape == (4, k)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(s, want_s, atol=0, rtol=0)


@pytest.mark.parametrize("act", [None, "relu2"])
def test_quantize_rows_loops_over_many_wide_rows_with_the_same_bytes(act, monkeypatch):
    """Many rows wider than LOOPED_MIN_K take the looped tiles by default (bounds lowered here): the bytes and
    scales of one register tile a row."""
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(8)) * 5
    want = triton_fp8.quantize_rows(x, act=act)
    monkeypatch.setattr(triton_fp8, "LOOPED_MIN_ROWS", 4)
    monkeypatch.setattr(triton_fp8, "LOOPED_MIN_K", 256)
    monkeypatch.setattr(triton_fp8, "LOOPED_BLOCK_K", 64)
    seen = []
    real = triton_fp8._quantize_rows_kernel
    monkeypatch.setattr(triton_fp8, "_quantize_rows_kernel",
                        type("K", (), {"__getitem__": lambda _, grid: lambda *a, **k: seen.append(k["BLOCK_K"])
                                       or real[grid](*a, **k)})())
    got = triton_fp8.quantize_rows(x, act=act)
    few = triton_fp8.quantize_rows(x[:3], act=act)  # (under LOOPED_MIN_ROWS: one tile)
    assert seen == [64, 512]
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    assert torch.equal(few[0].view(torch.uint8), want[0][:3].view(torch.uint8))


def test_quantize_rows_act_checks():
    with pytest.raises(ValueError, match="act 'gelu'"):
        triton_fp8.quantize_rows(torch.zeros(1, 32, dtype=torch.bfloat16), act="gelu")
    with pytest.raises(ValueError, match="even width"):
        triton_fp8.quantize_rows(torch.zeros(1, 33, dtype=torch.bfloat16), act="silu_and_mul")


def test_layer_activation_on_the_reference_path():
    """Fp8Linear(x, act=...) off CUDA: the reference projection of the MLP activation (the torch chain's values)."""
    layer = _layer(24, 64, DYNAMIC, True, bias=True, seed=4)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(layer(x, act="relu2"), layer.forward_reference(torch.square(torch.relu(x))),
                               atol=0, rtol=0)
    gate_up = torch.randn(2, 1, 128, generator=torch.Generator().manual_seed(7))
    got = layer(gate_up, act="silu_and_mul")
    assert got.shape == (2, 1, 24)
    want = layer.forward_reference(torch.nn.functional.silu(gate_up[..., :64]) * gate_up[..., 64:])
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("per_row,bias", [(True, True), (False, False)])
def test_scale_accumulator_applies_row_and_column_scales_once(per_row, bias):
    """scale_accumulator: the fp32 product of e4m3 operands times each row's and each column's
    scale, plus bias, rounded once to the output dtype (torch's fp32 ops in the same order)."""
    g = torch.Generator().manual_seed(7)
    m, n = 3, 1500  # N past one 1024-wide program
    acc = torch.randn(m, n, generator=g) * 1e3
    xs = torch.rand(m, 1, generator=g) / 100
    ws = (torch.rand(n, generator=g) / 100) if per_row else torch.tensor(0.004)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    want = acc * xs * (ws[None, :] if per_row else ws)
    if bias:
        want = want + b.float()
    # fp32 out: bit for bit (the interpreter's own fp32 -> bf16 cast truncates, so the bf16 output is
    # checked to its spacing only; the GPU test compares the rounded bf16 against the exact product)
    assert torch.equal(triton_fp8.scale_accumulator(acc, xs, ws, b, out_dtype=torch.float32), want)
    got = triton_fp8.scale_accumulator(acc, xs, ws, b, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=0)
    with pytest.raises(ValueError, match="fp32 accumulator"):
        triton_fp8.scale_accumulator(acc.to(torch.bfloat16), xs, ws)


@pytest.mark.parametrize("m,n,k,splits", [(1, 64, 128, 1), (5, 100, 512, 2), (40, 130, 768, 3), (64, 64, 256, 2)])
def test_splitk_gemm_partials_sum_to_the_exact_product(m, n, k, splits):
    """fp8_splitk_gemm: S partial products over whole K steps (rows and columns past the tiles masked), each the
    exact product of its slice of K (e4m3 integers up to 16: every sum exact in fp32, whatever the order);
    scale_accumulator adds them in order, then the scales."""
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randint(-16, 17, (m, k), generator=g).float().to(FP8_DTYPE)
    w = torch.randint(-16, 17, (n, k), generator=g).float().to(FP8_DTYPE)
    parts = triton_fp8.fp8_splitk_gemm(x, w, splits)
    assert parts.shape == (splits, m, n) and parts.dtype == torch.float32
    step = k // splits
    for i in range(splits):
        sl = slice(i * step, (i + 1) * step)
        assert torch.equal(parts[i], x[:, sl].double().mm(w[:, sl].double().t()).float()), i
    xs = torch.rand(m, 1, generator=g) / 100
    ws = torch.rand(n, generator=g) / 100
    summed = parts[0].clone()
    for i in range(1, splits):
        summed += parts[i]
    assert torch.equal(triton_fp8.scale_accumulator(parts, xs, ws, out_dtype=torch.float32), summed * xs * ws)


def test_splitk_splits_and_eligibility():
    """Splits cut K into whole 128-wide steps, about 264 programs in all, and only where the weight is narrow
    enough to need it (the 8B shape: out_proj, down_proj, o_proj and qkv_proj split; in_proj and up_proj not)."""
    shapes = {"in_proj": (18560, 4096), "out_proj": (4096, 8192), "qkv_proj": (6144, 4096), "o_proj": (4096, 4096),
              "up_proj": (21504, 4096), "down_proj": (4096, 21504)}
    splits = {name: triton_fp8.splitk_splits(n, k) for name, (n, k) in shapes.items()}
    assert splits == {"in_proj": 1, "out_proj": 4, "qkv_proj": 2, "o_proj": 4, "up_proj": 1, "down_proj": 4}
    for (n, k), s in zip(shapes.values(), splits.values()):
        assert (k // triton_fp8.SPLITK_BLOCK_K) % s == 0
    assert triton_fp8.splitk_splits(64, 128 * 7) == 7  # (a prime number of steps: all of them)
    x, w = torch.zeros(64, 256, dtype=FP8_DTYPE), torch.zeros(32, 256, dtype=FP8_DTYPE)
    assert triton_fp8.splitk_eligible(x, w)
    assert not triton_fp8.splitk_eligible(torch.zeros(65, 256, dtype=FP8_DTYPE), w)  # taller than one tile
    assert not triton_fp8.splitk_eligible(x[:, :200], w[:, :200])  # K not whole steps
    assert not triton_fp8.splitk_eligible(x.to(torch.bfloat16), w)  # rows not rounded yet
    with pytest.raises(ValueError, match="whole steps"):
        triton_fp8.fp8_splitk_gemm(x, w, 3)


@pytest.mark.parametrize("activation", [STATIC, DYNAMIC])
@pytest.mark.parametrize("per_row", [False, True])
def test_layer_splitk_path(activation, per_row, monkeypatch):
    """Fp8Linear with HYBRID_FP8_SPLITK=1 on 2-64 rows of a narrow weight: forward_tensorwise on the split-K GEMM
    (per-tensor scales too), the reference's dequantized product up to summation order."""
    from hybrid.ops import triton_guard

    layer = _layer(64, 1024, activation, per_row, bias=True, seed=5)
    x = torch.randn(2, 9, 1024, generator=torch.Generator().manual_seed(4))
    monkeypatch.setenv("HYBRID_FP8_SPLITK", "1")
    triton_guard.reset_switches()
    calls = []
    real = triton_fp8.fp8_splitk_linear
    monkeypatch.setattr(triton_fp8, "fp8_splitk_linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    try:
        got = layer.forward_tensorwise(x)
    finally:
        monkeypatch.delenv("HYBRID_FP8_SPLITK")
        triton_guard.reset_switches()
    assert calls == [(18, 1024)]
    torch.testing.assert_close(got, layer.forward_reference(x), atol=2e-3, rtol=2e-3)


def test_eligible_only_on_cuda():
    w = torch.zeros(4, 8, dtype=FP8_DTYPE)
    assert not triton_fp8.eligible(torch.zeros(2, 8, dtype=torch.bfloat16), w)


def test_rounding_at_ties_binade_carries_subnormals_and_saturation():
    """The kernels' e4m3 rounding is torch's cast: ties to even (17 -> 16, 19 -> 20), a mantissa that
    carries into the next binade (31.9 -> 32, which Triton's interpreter's own cast gets wrong),
    subnormals (spacing 2^-9), signs, and values past 448 saturated by the clamp."""
    v = torch.tensor([17.0, 19.0, 31.9, -127.6, 0.003, -0.0009765625, 0.0, -0.0, 447.0, 1000.0, -1e6, 1.0625,
                      2.0 ** -10])
    q, _ = triton_fp8.quantize_rows(v[None], torch.tensor(1.0))
    want = v.clamp(-448, 448).to(FP8_DTYPE)
    assert torch.equal(q[0].view(torch.uint8), want.view(torch.uint8)), (q[0].float(), want.float())


@pytest.mark.parametrize("activation", [None, STATIC, DYNAMIC])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("m,n,k,block_n,block_k", [(1, 40, 96, 16, 32), (3, 17, 100, 16, 64), (4, 64, 300, 32, 128)])
def test_gemv_matches_the_reference(activation, per_row, m, n, k, block_n, block_k):
    """fp8_gemv after quantize_rows (or on the rows as they are, weight-only), ragged N and K, 1-4
    rows, with a bias: the reference's dequantized GEMM up to summation order; rows independent."""
    layer = _layer(n, k, activation, per_row, bias=m > 1, seed=m * 5 + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)) * 3
    x[0, 1] = -35.0
    if activation is None:
        got = triton_fp8.fp8_gemv(x, None, layer.weight, layer.weight_scale, layer.bias, out_dtype=x.dtype,
                                  block_n=block_n, block_k=block_k)
    else:
        xq, xs = triton_fp8.quantize_rows(x, layer.input_scale)
        got = triton_fp8.fp8_gemv(xq, xs, layer.weight, layer.weight_scale, layer.bias, out_dtype=x.dtype,
                                  block_n=block_n, block_k=block_k)
        alone = triton_fp8.fp8_gemv(xq[-1:], xs[-1:], layer.weight, layer.weight_scale, layer.bias,
                                    out_dtype=x.dtype, block_n=block_n, block_k=block_k)
        torch.testing.assert_close(got[-1:], alone, atol=0, rtol=0)
    torch.testing.assert_close(got, layer.forward_reference(x), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("activation", [STATIC, DYNAMIC])
@pytest.mark.parametrize("m,n,k,block_k", [(1, 40, 96, 32), (3, 17, 100, 64), (4, 24, 300, 128)])
@pytest.mark.parametrize("fma_quotient", [False, True])
def test_gemv_quantizing_its_rows_equals_quantize_rows_then_gemv(activation, m, n, k, block_k, fma_quotient):
    """fp8_gemv(quantize=...) rounds 16-bit rows to e4m3 inside its launch: the same bytes as quantize_rows
    and then fp8_gemv on its output (the same scales, e4m3 values, products and sums), bit for bit;
    rows with very different scales, ragged N and K, both quotients."""
    layer = _layer(n, k, activation, True, bias=m > 1, seed=m * 3 + n + k)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)) * 3).to(torch.bfloat16)
    x[0, 1] = -35.0
    if m > 2:
        x[2] *= 1e-3
    act = triton_fp8.ACT_STATIC if activation == STATIC else triton_fp8.ACT_DYNAMIC
    xq, xs = triton_fp8.quantize_rows(x, layer.input_scale, fma_quotient=fma_quotient, hw_cast=False)
    two = triton_fp8.fp8_gemv(xq, xs, layer.weight, layer.weight_scale, layer.bias, out_dtype=torch.float32,
                              block_n=16, block_k=block_k)
    one = triton_fp8.fp8_gemv(x, None, layer.weight, layer.weight_scale, layer.bias, quantize=act,
                              input_scale=layer.input_scale, out_dtype=torch.float32, block_n=16, block_k=block_k,
                              fma_quotient=fma_quotient, hw_cast=False)
    torch.testing.assert_close(one, two, atol=0, rtol=0)
    # the reference in fp32 on the same (bf16-exact) values: the dequantized GEMM up to summation order
    torch.testing.assert_close(one, layer.forward_reference(x.float()), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("activation", [None, STATIC, DYNAMIC])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("n,k,block_n", [(40, 96, None), (17, 100, 4), (24, 1600, None), (9, 3000, 2)])
def test_preload_gemv_matches_gemv_and_the_reference(activation, per_row, n, k, block_n):
    """fp8_preload_gemv (one token, the slab before the wait, K as up to three pieces: 96 = 64 + 32, 100 = 64 +
    32 + 4, 1600 = 1024 + 512 + 64, 3000 = 2048 + 512 + 512 of which 440) rounds the row as fp8_gemv does (the
    same e4m3 values and products: equal up to the order of the fp32 sums) and matches the reference's
    dequantized GEMM; ragged N, a bias, both weight scales, every activation scheme."""
    layer = _layer(n, k, activation, per_row, bias=True, seed=n + k)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(k)) * 3).to(torch.bfloat16)
    x[0, k - 1] = -35.0  # the absmax in the last piece
    act = ACTS[activation]
    got = triton_fp8.fp8_preload_gemv(x, layer.weight, layer.weight_scale, layer.bias, quantize=act,
                                      input_scale=layer.input_scale, out_dtype=torch.float32, block_n=block_n,
                                      fma_quotient=False, hw_cast=False)
    gemv = triton_fp8.fp8_gemv(x, None, layer.weight, layer.weight_scale, layer.bias, quantize=act,
                               input_scale=layer.input_scale, out_dtype=torch.float32, block_n=16, block_k=64,
                               fma_quotient=False, hw_cast=False)
    assert got.shape == (1, n)
    torch.testing.assert_close(got, gemv, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got, layer.forward_reference(x.float()), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("activation", [STATIC, DYNAMIC])
def test_preload_gemv_rounds_wide_rows_once_before(activation, monkeypatch):
    """Rows wider than HYBRID_FP8_PRELOAD_ROUND_MAX_K are rounded by quantize_rows before the launch (the kernel
    then reads e4m3 values and the row's scale): the same result as rounding inside, bit for bit (the same
    values, products and order of sums)."""
    layer = _layer(24, 1600, activation, True, bias=True, seed=5)
    x = (torch.randn(1, 1600, generator=torch.Generator().manual_seed(8)) * 3).to(torch.bfloat16)
    kw = dict(quantize=ACTS[activation], input_scale=layer.input_scale, out_dtype=torch.float32,
              fma_quotient=False, hw_cast=False)
    inside = triton_fp8.fp8_preload_gemv(x, layer.weight, layer.weight_scale, layer.bias, **kw)
    monkeypatch.setenv("HYBRID_FP8_PRELOAD_ROUND_MAX_K", "1024")
    before = triton_fp8.fp8_preload_gemv(x, layer.weight, layer.weight_scale, layer.bias, **kw)
    torch.testing.assert_close(before, inside, atol=0, rtol=0)
    torch.testing.assert_close(before, layer.forward_reference(x.float()), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("mlp_act", ["relu2", "silu_and_mul"])
@pytest.mark.parametrize("round_before", [False, True])
def test_preload_gemv_takes_the_mlp_activation(mlp_act, round_before, monkeypatch):
    """fp8_preload_gemv(act=...) on the pre-activation row (a down_proj's input): bit for bit the activation's own
    launch then the kernel; where the row is rounded before (K past HYBRID_FP8_PRELOAD_ROUND_MAX_K) the activation
    runs inside that quantize_rows launch, with no launch of its own."""
    layer = _layer(24, 1600, DYNAMIC, True, bias=True, seed=6)
    width = 3200 if mlp_act == "silu_and_mul" else 1600
    h = (torch.randn(1, width, generator=torch.Generator().manual_seed(9)) * 3).to(torch.bfloat16)
    kw = dict(quantize=triton_fp8.ACT_DYNAMIC, out_dtype=torch.float32, fma_quotient=False, hw_cast=False)
    if round_before:
        monkeypatch.setenv("HYBRID_FP8_PRELOAD_ROUND_MAX_K", "1024")
    activated = triton_act.relu2(h) if mlp_act == "relu2" else triton_act.silu_and_mul(h)
    want = triton_fp8.fp8_preload_gemv(activated, layer.weight, layer.weight_scale, layer.bias, **kw)
    launches = []
    for name in ("relu2", "silu_and_mul"):
        real = getattr(triton_act, name)
        monkeypatch.setattr(triton_act, name, lambda x, real=real, name=name: launches.append(name) or real(x))
    got = triton_fp8.fp8_preload_gemv(h, layer.weight, layer.weight_scale, layer.bias, act=mlp_act, **kw)
    assert torch.equal(got, want)
    assert launches == ([] if round_before else [mlp_act])
    with pytest.raises(ValueError, match="act"):  # (the pre-activation row's width must match the weight's K)
        triton_fp8.fp8_preload_gemv(h, layer.weight, layer.weight_scale, act="silu_and_mul" if width == 1600
                                    else "relu2", **kw)


def test_preload_gemv_argument_checks():
    w = torch.zeros(16, 32, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="one row"):
        triton_fp8.fp8_preload_gemv(torch.zeros(2, 32, dtype=torch.bfloat16), w, torch.tensor(1.0))
    with pytest.raises(ValueError, match="input_scale exactly when static"):
        triton_fp8.fp8_preload_gemv(torch.zeros(1, 32, dtype=torch.bfloat16), w, torch.tensor(1.0),
                                    quantize=triton_fp8.ACT_STATIC)
    big = torch.zeros(1, triton_fp8.PRELOAD_MAX_K + 1, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="K <="):
        triton_fp8.fp8_preload_gemv(torch.zeros(1, big.shape[1], dtype=torch.bfloat16), big, torch.tensor(1.0))


def test_gemv_quantize_argument_checks():
    w = torch.zeros(16, 32, dtype=FP8_DTYPE)
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="input_scale exactly when static"):
        triton_fp8.fp8_gemv(x, None, w, torch.tensor(1.0), quantize=triton_fp8.ACT_STATIC)
    with pytest.raises(ValueError, match="input_scale exactly when static"):
        triton_fp8.fp8_gemv(x, torch.ones(1, 1), w, torch.tensor(1.0), quantize=triton_fp8.ACT_DYNAMIC)


def test_gemv_refuses_more_rows_than_it_reduces():
    w = torch.zeros(16, 32, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        triton_fp8.fp8_gemv(torch.zeros(5, 32), None, w, torch.tensor(1.0))


def test_gemv_takes_few_rows_of_bounded_width(monkeypatch):
    """HYBRID_FP8_DECODE_GEMM=gemv sends fp8_gemv at most GEMV_MAX_ROWS rows of at most GEMV_MAX_K columns
    (past that the tensor-wise GEMM was faster on the GPU); the device checks are eligible()'s."""
    monkeypatch.setattr(triton_fp8, "eligible", lambda x, w: True)
    w = torch.zeros(16, 1, dtype=FP8_DTYPE)
    assert triton_fp8.gemv_eligible(torch.zeros(triton_fp8.GEMV_MAX_ROWS, triton_fp8.GEMV_MAX_K), w)
    assert not triton_fp8.gemv_eligible(torch.zeros(1, triton_fp8.GEMV_MAX_K + 1), w)
    assert not triton_fp8.gemv_eligible(torch.zeros(triton_fp8.GEMV_MAX_ROWS + 1, 64), w)


@pytest.mark.parametrize("activation", [None, DYNAMIC])
@pytest.mark.parametrize("path,tokens", [("forward_gemv", 3), ("forward_preload", 1)])
def test_layer_gemv_paths(activation, path, tokens):
    """Fp8Linear.forward_gemv (HYBRID_FP8_DECODE_GEMM=gemv on CUDA) and forward_preload (one token on CUDA, the
    default) on [batch, tokens, in] rows."""
    layer = _layer(48, 64, activation, True, bias=True, seed=9)
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(2))
    got = getattr(layer, path)(x)
    assert got.shape == (1, tokens, 48)
    torch.testing.assert_close(got, layer.forward_reference(x), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("static", [False, True])
def test_fma_quotient_gives_the_ieee_quotient_near_every_rounding_boundary(static, monkeypatch):
    """quantize_rows' GPU quotient (fma_quotient: RN(1/s) once, then Markstein's correction with
    fused multiply-adds, no division per value) rounds every value as IEEE division does, on values
    placed within a few ulps of e4m3 rounding boundaries (midpoints, where x * RN(1/s) alone picks
    the wrong side), zeros of both signs, values past the clamp and infinities. Triton's interpreter
    does not fuse tl.fma, so it is fused here (float64 products of fp32 operands are exact)."""
    import numpy as np
    from triton.runtime import interpreter

    def fused(self, x, y, z):
        with np.errstate(invalid="ignore", over="ignore"):  # (inf - inf where the kernel then keeps q0)
            out = (x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64))
        return interpreter.TensorHandle(out.astype(z.data.dtype), z.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fma", fused)
    g = torch.Generator().manual_seed(11)
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()  # the non-negative e4m3 values
    mids = (e4m3[1:] + e4m3[:-1]) / 2

    def near_boundaries(s: float, n: int = 700) -> torch.Tensor:
        """n values a few ulps either side of (midpoint x s), both signs."""
        m = mids[torch.randint(0, mids.numel(), (n,), generator=g)]
        x = (m * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0) * s).float()
        step = torch.randint(-3, 4, (n,), generator=g)
        for _ in range(3):
            x = torch.where(step > 0, torch.nextafter(x, torch.full_like(x, math.inf)), x)
            x = torch.where(step < 0, torch.nextafter(x, torch.full_like(x, -math.inf)), x)
            step = step - step.sign()
        x[:2] = torch.tensor([0.0, -0.0])
        return x

    s_in = torch.tensor(0.013) if static else None
    rows = []
    for r in range(24):
        if static:  # one scale for every row; values past the clamp and infinities too
            x = near_boundaries(0.013)
            x[2:5] = torch.tensor([1e9 * 0.013, -math.inf, math.inf])
        else:  # each row its own scale: its absmax is 448 s
            s = float(torch.rand((), generator=g) * 0.05 + 1e-3) * 2.0 ** int(torch.randint(-12, 12, (), generator=g))
            x = near_boundaries(s)
            x[2] = 448.0 * s
        rows.append(x)
    x = torch.stack(rows)
    q, sc = triton_fp8.quantize_rows(x, s_in, fma_quotient=True, hw_cast=False)
    want_s = s_in.expand(x.shape[0], 1) if static else per_token_scale(x)
    assert torch.equal(sc, want_s.float())
    want = (x / want_s).clamp(-448, 448).to(FP8_DTYPE)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    # without the correction (x * RN(1/s) alone) some of these values round to the other e4m3 neighbour
    naive = (x * (1.0 / want_s)).clamp(-448, 448).to(FP8_DTYPE)
    assert not torch.equal(naive.view(torch.uint8), want.view(torch.uint8))


def test_gemv_rows_by_setting(monkeypatch):
    """One-token steps take fp8_gemv by default; HYBRID_FP8_DECODE_GEMM=gemv up to GEMV_MAX_ROWS; any other
    value (the GEMMs' A/Bs) none."""
    from hybrid.fp8_linear import gemv_max_rows

    monkeypatch.delenv("HYBRID_FP8_DECODE_GEMM", raising=False)
    assert gemv_max_rows() == 1
    monkeypatch.setenv("HYBRID_FP8_DECODE_GEMM", "gemv")
    assert gemv_max_rows() == triton_fp8.GEMV_MAX_ROWS
    for other in ("scaled_mm", "rowwise", "triton"):
        monkeypatch.setenv("HYBRID_FP8_DECODE_GEMM", other)
        assert gemv_max_rows() == 0


@pytest.mark.parametrize("kind", ["rms", "add", "sum_add"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("hidden", [64, 96])  # 96: masked lanes past the row
def test_norm_rounds_its_rows_as_quantize_rows_does(kind, static, hidden):
    """A norm launch asked to round its output for an FP8 projection (triton_norm.RoundFor): the normed rows and the
    residual are those of the launch without it, bit for bit, and the attached rounding is quantize_rows' output for
    those rows (the same e4m3 bytes and scales), with the dynamic scales or the given static one."""
    from hybrid.ops import triton_moe, triton_norm
    g = torch.Generator().manual_seed(hidden + 3 * static)
    T, K = 5, 3
    weight = (0.5 + torch.rand(hidden, generator=g)).to(torch.bfloat16)
    x = (torch.randn(T, hidden, generator=g) * 3).to(torch.bfloat16)
    x[1, 7] = 900.0  # one row far from the others: its own dynamic scale; static: values past 448 saturate
    residual = (torch.randn(T, hidden, generator=g) * 2).to(torch.bfloat16)
    input_scale = torch.tensor(0.03) if static else None

    def run(round_for):
        res = residual.clone()
        if kind == "rms":
            return triton_norm.rms_norm(x, weight, 1e-5, True, round_for), res
        if kind == "add":
            return triton_norm.add_rms_norm(x, res, weight, 1e-5, False, 0.5, round_for), res
        rows = triton_moe.ExpertRows(x.repeat_interleave(K, 0) / K, None, K)
        return triton_norm.sum_add_rms_norm(rows, res, weight, 1e-5, True, 1.0, round_for), res

    plain, plain_res = run(None)
    rounded_rows, res = run(triton_norm.RoundFor(input_scale))
    assert torch.equal(rounded_rows, plain) and torch.equal(res, plain_res)
    assert triton_fp8.rounding_of(plain, input_scale) is None
    r = triton_fp8.rounding_of(rounded_rows, input_scale)
    assert r is not None and r.input_scale is input_scale
    want_q, want_s = triton_fp8.quantize_rows(plain, input_scale)
    assert r.q.dtype == FP8_DTYPE and torch.equal(r.q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(r.scales, want_s)
    if static:
        assert torch.equal(r.scales, input_scale.expand(T, 1))
    else:
        assert len(set(r.scales.flatten().tolist())) == T  # each row its own absmax


def test_a_rounding_is_taken_only_with_its_rows_and_its_scheme():
    """The rounding rides on the rows tensor: a reshape, a copy or a slice of the rows has none; a consumer of another
    scheme (a static scale where the rows were rounded with dynamic ones, or another static scale tensor) gets
    None, and rounds the rows itself."""
    rows = torch.randn(4, 32).to(torch.bfloat16)
    static = torch.tensor(0.02)
    q, s = triton_fp8.quantize_rows(rows, None)
    triton_fp8.attach_rounding(rows, triton_fp8.RowRounding(q, s, None))
    assert triton_fp8.rounding_of(rows, None).q is q
    assert triton_fp8.rounding_of(rows, static) is None
    for other in (rows.view(2, 64), rows.clone(), rows[:2], rows.contiguous().reshape(4, 32) + 0):
        assert triton_fp8.rounding_of(other, None) is None
    q2, s2 = triton_fp8.quantize_rows(rows, static)
    triton_fp8.attach_rounding(rows, triton_fp8.RowRounding(q2, s2, static))
    assert triton_fp8.rounding_of(rows, static).q is q2
    assert triton_fp8.rounding_of(rows, torch.tensor(0.02)) is None and triton_fp8.rounding_of(rows, None) is None


class _Consumer(torch.nn.Module):
    """A stand-in FP8 projection: its scheme and whether it rounds a step's rows with quantize_rows first."""

    def __init__(self, input_scale, rounds_from: int):
        super().__init__()
        self.input_scale, self.rounds_from = input_scale, rounds_from

    def rounds_rows_first(self, rows, dtype, device):
        return rows >= self.rounds_from


def test_norm_rounds_for_its_consumers_only_when_all_round_alike():
    """RMSNorm asks its launch for the rounding only when every FP8 projection reading its output would round
    those rows with quantize_rows first and all share one scheme; never without consumers."""
    from hybrid.layers import RMSNorm
    norm = RMSNorm(32, 1e-5, weight_in_fp32=False)
    rows = torch.zeros(8, 32, dtype=torch.bfloat16)
    assert norm._round_for(rows) is None
    static = torch.tensor(0.5)
    norm.fp8_consumers = (_Consumer(None, 2), _Consumer(None, 2))
    assert norm._round_for(rows).input_scale is None
    assert norm._round_for(rows[:1]) is None  # a one-token step: the projections round inside their own launch
    norm.fp8_consumers = (_Consumer(None, 2), _Consumer(None, 16))
    assert norm._round_for(rows) is None  # one of them would not round these rows first
    norm.fp8_consumers = (_Consumer(static, 2), _Consumer(static, 2))
    assert norm._round_for(rows).input_scale is static
    norm.fp8_consumers = (_Consumer(static, 2), _Consumer(torch.tensor(0.5), 2))
    assert norm._round_for(rows) is None  # two static scales: two roundings
    norm.fp8_consumers = (_Consumer(static, 2), _Consumer(None, 2))
    assert norm._round_for(rows) is None


def test_rounds_rows_first_only_on_the_scaled_mm_path(monkeypatch):
    """Fp8Linear.rounds_rows_first: never on the CPU (the reference path fake-quantizes) nor for weight-only
    projections; on CUDA only past the rows a one-launch kernel may take, and never with the switch off."""
    from hybrid.ops import triton_guard
    layer = _layer(32, 64, DYNAMIC, True, False, seed=5)
    assert not layer.rounds_rows_first(8, torch.bfloat16, torch.device("cpu"))
    cuda = torch.device("cuda", 0)
    layer.use_scaled_mm = True  # (what a CUDA device of sm_89+ sets at construction)
    assert layer.rounds_rows_first(2, torch.bfloat16, cuda) and layer.rounds_rows_first(8192, torch.bfloat16, cuda)
    assert not layer.rounds_rows_first(1, torch.bfloat16, cuda)  # the preloading kernel rounds one row itself
    assert not layer.rounds_rows_first(8, torch.float16, cuda)
    monkeypatch.setenv("HYBRID_FP8_DECODE_GEMM", "gemv")  # fp8_gemv takes up to GEMV_MAX_ROWS rows
    triton_guard.reset_switches()
    try:
        assert not layer.rounds_rows_first(triton_fp8.GEMV_MAX_ROWS, torch.bfloat16, cuda)
        assert layer.rounds_rows_first(triton_fp8.GEMV_MAX_ROWS + 1, torch.bfloat16, cuda)
        monkeypatch.setenv("HYBRID_FP8_NORM_ROUNDING", "0")
        triton_guard.reset_switches()
        assert not layer.rounds_rows_first(64, torch.bfloat16, cuda)
    finally:
        monkeypatch.delenv("HYBRID_FP8_DECODE_GEMM")
        monkeypatch.delenv("HYBRID_FP8_NORM_ROUNDING", raising=False)
        triton_guard.reset_switches()
    weight_only = _layer(32, 64, None, True, False, seed=6)
    weight_only.use_scaled_mm = True
    assert not weight_only.rounds_rows_first(8, torch.bfloat16, cuda)


@pytest.mark.parametrize("per_row,bias", [(True, False), (False, True)])
@pytest.mark.parametrize("m,n,k,splits,block_n", [(3, 96, 512, 2, 32), (16, 200, 1024, 4, 64), (1, 64, 256, 1, 64)])
def test_splitk_linear_equals_partials_then_scale_accumulator(per_row, bias, m, n, k, splits, block_n):
    """fp8_splitk_linear (each column tile's last program sums the partials and scales them): the values of
    fp8_splitk_gemm then scale_accumulator, bit for bit, in fp32 and bf16 out; ragged N (masked columns) and rows;
    the tile counts back at 0 after the launch, so a second launch (a graph replay) gives the same."""
    g = torch.Generator().manual_seed(m + n + k)
    x = (torch.randn(m, k, generator=g) * 40).clamp(-448, 448).to(FP8_DTYPE)
    w = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(FP8_DTYPE)
    xs = (torch.rand(m, 1, generator=g) + 0.5) / 100
    ws = (torch.rand(n, generator=g) + 0.5) / 300 if per_row else torch.tensor(0.003)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    for out_dtype in (torch.float32, torch.bfloat16):
        parts = triton_fp8.fp8_splitk_gemm(x, w, splits, block_n=block_n)
        want = triton_fp8.scale_accumulator(parts, xs, ws, b, out_dtype=out_dtype)
        got = triton_fp8.fp8_splitk_linear(x, xs, w, ws, b, out_dtype=out_dtype, splits=splits, block_n=block_n)
        assert got.dtype == out_dtype and torch.equal(got, want)
        assert not triton_fp8._tile_counts(x.device, 1).any()
        again = triton_fp8.fp8_splitk_linear(x, xs, w, ws, b, out_dtype=out_dtype, splits=splits, block_n=block_n)
        assert torch.equal(again, want)
    with pytest.raises(ValueError, match="x_scale"):
        triton_fp8.fp8_splitk_linear(x, xs[:-1] if m > 1 else xs.repeat(2, 1), w, ws)
