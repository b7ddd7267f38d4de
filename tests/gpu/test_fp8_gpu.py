"""FP8 GEMMs on CUDA (issue 17 item 2): Fp8Linear's torch._scaled_mm path against the dequantized
reference on random tensors at the Nemotron-H-8B projection shapes (per-tensor and row-wise scales,
static and dynamic per-token activations), its capture in a CUDA graph, and tiny FP8 checkpoints
(tests/fp8_reference.py, hybrid.tools.quantize_fp8) served on the GPU under CUDA graphs against the
CPU reference of the same checkpoint."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_util import GREEDY, rel_err  # noqa: E402

import fp8_reference as R  # noqa: E402
import tiny_checkpoints  # noqa: E402
from hybrid.fp8_linear import Fp8Linear  # noqa: E402
from hybrid.quantization import DYNAMIC, FP8_DTYPE, STATIC  # noqa: E402

# Nemotron-H-8B (bench/bench_decode.py CONFIG): hidden 4096, Mamba 128 heads x 64 (inner 8192, 8 groups
# x 128 state), attention 32 x 128 q / 8 kv heads, relu2 MLP 21504. (out, in) of each projection.
SHAPES_8B = {
    "mamba.in_proj": (2 * 8192 + 2 * 8 * 128 + 128, 4096),
    "mamba.out_proj": (4096, 8192),
    "attn.qkv_proj": (32 * 128 + 2 * 8 * 128, 4096),
    "attn.o_proj": (4096, 32 * 128),
    "mlp.up_proj": (21504, 4096),
    "mlp.down_proj": (4096, 21504),
}
ROWS = (1, 8, 64, 256, 1000)  # decode batches and a prefill chunk (not a multiple of 16)


def _layer(n: int, k: int, per_channel: bool, act: str, seed: int, bias: bool = False) -> Fp8Linear:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, generator=g, device="cuda") / k ** 0.5
    w = w * (1 + torch.rand(n, 1, generator=g, device="cuda"))  # rows of different scales
    amax = w.abs().amax(-1) if per_channel else w.abs().amax()
    scale = (amax / 448).float()
    q = (w / (scale[:, None] if per_channel else scale)).clamp(-448, 448).to(FP8_DTYPE)
    input_scale = torch.tensor(4.5 / 448, device="cuda") if act == STATIC else None
    b = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16) if bias else None
    return Fp8Linear(q, scale, input_scale, act, b)


def _exact(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """The product of the layer's e4m3 operands, in fp64: what the FP8 GEMM computes before its
    output is rounded to bf16."""
    s = layer.input_scales(x.float())
    xq = (x.float() / s).clamp(-448, 448).to(FP8_DTYPE)
    ws = layer.weight_scale if layer.weight_scale.dim() == 0 else layer.weight_scale[:, None]
    out = F.linear(xq.double() * s.double(), layer.weight.double() * ws.double())
    return out + layer.bias.double() if layer.bias is not None else out


@pytest.mark.parametrize("act", [STATIC, DYNAMIC])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("name", list(SHAPES_8B))
def test_scaled_mm_matches_dequantized_reference_8b_shapes(name, per_channel, act):
    n, k = SHAPES_8B[name]
    layer = _layer(n, k, per_channel, act, seed=list(SHAPES_8B).index(name), bias=name == "attn.o_proj")
    assert layer.use_scaled_mm, "the 8B shapes satisfy _scaled_mm's alignment (multiples of 16)"
    g = torch.Generator(device="cuda").manual_seed(1)
    for m in ROWS:
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # the GEMM: the exact product of the fp8 operands, rounded once to bf16 (2^-9 relative)
        assert rel_err(got, _exact(layer, x)) < 5e-3, (name, m)
        # the reference path (dequantized weight and fake-quantized input, both cast to bf16, bf16 GEMM)
        assert rel_err(got, layer.forward_reference(x)) < 1e-2, (name, m)


def test_misaligned_dims_fall_back_to_the_reference_path():
    """Dims _scaled_mm cannot take run the reference; the one-launch Triton kernel (weight-only
    projections' decode path, HYBRID_FP8_DECODE_GEMM=triton for the others) has no alignment rule."""
    layer = _layer(328, 64, False, DYNAMIC, seed=3)  # a tiny Mamba in_proj: 328 rows, not a multiple of 16
    assert not layer.use_scaled_mm
    x = torch.randn(40, 64, device="cuda").to(torch.bfloat16)
    assert torch.equal(layer(x), layer.forward_reference(x))
    assert torch.equal(layer(x[:5]), layer.forward_reference(x[:5]))
    assert rel_err(layer.forward_small_m(x[:5]), _exact(layer, x[:5])) < 5e-3


@pytest.mark.parametrize("act", [None, STATIC, DYNAMIC])
@pytest.mark.parametrize("name", ["mamba.in_proj", "mamba.out_proj", "mlp.down_proj"])
def test_decode_sized_kernel_matches_the_exact_product(name, act):
    """The one-launch FP8 kernel (hybrid/ops/triton_fp8.py; the default for weight-only projections at
    decode sizes, HYBRID_FP8_DECODE_GEMM=triton for the others), every activation scheme at the 8B
    shapes: the exact product of the e4m3 operands rounded once, as the default path (_scaled_mm
    after the Triton row quantization) and fp8_gemv (HYBRID_FP8_DECODE_GEMM=gemv, up to 4 rows) are."""
    from hybrid.ops import triton_fp8

    n, k = SHAPES_8B[name]
    layer = _layer(n, k, per_channel=True, act=act if act is not None else DYNAMIC, seed=11)
    if act is None:
        layer = Fp8Linear(layer.weight.data, layer.weight_scale.data, None, None, None)
    g = torch.Generator(device="cuda").manual_seed(2)
    for m in (1, 3, 16):
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        x[0, 0] = 30.0  # row scales that differ
        assert triton_fp8.eligible(x, layer.weight)
        got = layer.forward_small_m(x)
        exact = _exact(layer, x) if act is not None else F.linear(
            x.double(), layer.weight.double() * layer.weight_scale.double()[:, None])
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert rel_err(got, exact) < 5e-3, (name, act, m)
        assert rel_err(layer(x), exact) < 5e-3, (name, act, m)
        if m <= triton_fp8.GEMV_MAX_ROWS:
            assert rel_err(layer.forward_gemv(x), exact) < 5e-3, (name, act, m)


@pytest.mark.parametrize("act", [STATIC, DYNAMIC])
@pytest.mark.parametrize("name", ["mamba.in_proj", "mamba.out_proj", "attn.o_proj"])
def test_gemv_quantizing_inside_equals_quantize_rows_then_gemv(name, act):
    """fp8_gemv(quantize=...) (Fp8Linear.forward_gemv, one launch) writes the bytes of quantize_rows followed
    by fp8_gemv on its e4m3 rows (two launches) on the GPU too: the hardware cast and the fma quotient in
    both, 1-4 rows with very different scales, at the 8B shapes."""
    from hybrid.ops import triton_fp8

    n, k = SHAPES_8B[name]
    layer = _layer(n, k, per_channel=True, act=act, seed=13, bias=name == "attn.o_proj")
    a = triton_fp8.ACT_STATIC if act == STATIC else triton_fp8.ACT_DYNAMIC
    g = torch.Generator(device="cuda").manual_seed(4)
    for m in (1, 2, 3, 4):
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        x[0, 0] = 30.0
        x[-1] *= 1e-3
        xq, xs = triton_fp8.quantize_rows(x, layer.input_scale)
        two = triton_fp8.fp8_gemv(xq, xs, layer.weight, layer.weight_scale, layer.bias)
        one = triton_fp8.fp8_gemv(x, None, layer.weight, layer.weight_scale, layer.bias, quantize=a,
                                  input_scale=layer.input_scale)
        assert torch.equal(one, two), (name, act, m)
        assert torch.equal(layer.forward_gemv(x), one)


@pytest.mark.parametrize("act", [None, STATIC, DYNAMIC])
@pytest.mark.parametrize("name", list(SHAPES_8B))
def test_preload_gemv_matches_the_exact_product_and_captures(name, act, monkeypatch):
    """fp8_preload_gemv (HYBRID_FP8_PRELOAD=1: one token, each program's e4m3 slab before its PDL wait) at every
    8B projection and activation scheme: the exact product of the e4m3 operands rounded once (the down_proj's
    K 21504 through quantize_rows first), routed to by the switch, and a graph replay after a kernel that writes
    the row equal to eager."""
    from hybrid.ops import triton_fp8, triton_guard

    n, k = SHAPES_8B[name]
    layer = _layer(n, k, per_channel=name != "attn.o_proj", act=act if act is not None else DYNAMIC, seed=17,
                   bias=name == "attn.qkv_proj")
    if act is None:
        layer = Fp8Linear(layer.weight.data, layer.weight_scale.data, None, None, layer.bias)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    x[0, -1] = 30.0
    got = layer.forward_preload(x)
    ws = layer.weight_scale.double() if layer.weight_scale.dim() == 0 else layer.weight_scale.double()[:, None]
    exact = _exact(layer, x) if act is not None else F.linear(x.double(), layer.weight.double() * ws) + (
        layer.bias.double() if layer.bias is not None else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (1, n)
    assert rel_err(got, exact) < 5e-3, (name, act)
    monkeypatch.setenv("HYBRID_FP8_PRELOAD", "1")
    triton_guard.reset_switches()
    try:
        assert torch.equal(layer(x), got)
        src = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        layer(src.mul(2))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(src.mul(2))  # the row written by the kernel before (the PDL wait must hold)
        src.copy_(torch.randn(1, k, device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, layer.forward_preload(src.mul(2)))
    finally:
        monkeypatch.delenv("HYBRID_FP8_PRELOAD")
        triton_guard.reset_switches()
    assert triton_fp8.preload_eligible(x, layer.weight)


@pytest.mark.parametrize("act", [STATIC, DYNAMIC])
@pytest.mark.parametrize("name", ["mamba.out_proj", "attn.qkv_proj", "attn.o_proj", "mlp.down_proj"])
def test_splitk_gemm_matches_the_exact_product_and_captures(name, act, monkeypatch):
    """HYBRID_FP8_SPLITK=1: 2-64 rows of the 8B's narrow projections on fp8_splitk_gemm (the e4m3 tensor-core dot
    with each K step's product added in fp32), per-channel and per-tensor scales: the exact product of the e4m3
    operands rounded once; and a graph replay after a kernel that writes the rows equal to eager."""
    from hybrid.ops import triton_fp8, triton_guard

    n, k = SHAPES_8B[name]
    monkeypatch.setenv("HYBRID_FP8_SPLITK", "1")
    triton_guard.reset_switches()
    calls = []
    real = triton_fp8.fp8_splitk_linear
    monkeypatch.setattr(triton_fp8, "fp8_splitk_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    try:
        for per_channel in (True, False):
            layer = _layer(n, k, per_channel=per_channel, act=act, seed=23, bias=name == "attn.qkv_proj")
            g = torch.Generator(device="cuda").manual_seed(5)
            for m in (2, 16, 33, 64):
                x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
                x[0, 0] = 30.0
                got = layer(x)
                assert got.dtype == torch.bfloat16 and got.shape == (m, n)
                assert rel_err(got, _exact(layer, x)) < 5e-3, (name, act, per_channel, m)
                assert calls[-1] == m
            src = torch.randn(64, k, device="cuda").to(torch.bfloat16)
            layer(src.mul(2))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = layer(src.mul(2))
            src.copy_(torch.randn(64, k, device="cuda").to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, layer(src.mul(2)))
    finally:
        monkeypatch.delenv("HYBRID_FP8_SPLITK")
        triton_guard.reset_switches()


@pytest.mark.parametrize("name", ["mamba.out_proj", "mlp.down_proj", "mamba.in_proj"])
def test_splitk_linear_sums_in_its_last_programs_bit_for_bit(name):
    """fp8_splitk_linear on the GPU (each column tile's last program to arrive sums the partials and scales them,
    ordered by an acquire / release count): the values of fp8_splitk_gemm then scale_accumulator, bit for bit, at
    2-64 rows and several splits, launch after launch (the counts go back to 0), and under a graph replay."""
    from hybrid.ops import triton_fp8

    n, k = SHAPES_8B[name]
    layer = _layer(n, k, per_channel=True, act=DYNAMIC, seed=31, bias=True)
    g = torch.Generator(device="cuda").manual_seed(7)
    for m in (2, 17, 64):
        xq, xs = triton_fp8.quantize_rows(torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16))
        for splits in (2, 4, 8):
            if (k // triton_fp8.SPLITK_BLOCK_K) % splits:
                continue
            want = triton_fp8.scale_accumulator(triton_fp8.fp8_splitk_gemm(xq, layer.weight, splits), xs,
                                                layer.weight_scale, layer.bias, out_dtype=torch.bfloat16)
            for _ in range(3):
                got = triton_fp8.fp8_splitk_linear(xq, xs, layer.weight, layer.weight_scale, layer.bias,
                                                   splits=splits)
                assert torch.equal(got, want), (name, m, splits)
    assert not triton_fp8._tile_counts(xq.device, 1).any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_fp8.fp8_splitk_linear(xq, xs, layer.weight, layer.weight_scale, layer.bias, splits=4)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, triton_fp8.fp8_splitk_linear(xq, xs, layer.weight, layer.weight_scale, layer.bias,
                                                             splits=4))


@pytest.mark.parametrize("per_channel,act", [(True, DYNAMIC), (False, STATIC), (True, STATIC)])
@pytest.mark.parametrize("name", ["mamba.in_proj", "attn.qkv_proj", "mlp.up_proj"])
def test_norm_rounding_feeds_the_projection_bit_for_bit(name, per_channel, act, monkeypatch):
    """A norm's launch that rounds its rows for the FP8 projection after it (triton_norm.RoundFor: the default for
    steps of 2+ tokens) gives that projection the bytes its own quantize_rows would: the same output, bit for bit,
    at decode batches (tensor-wise GEMM, split-K for the per-tensor scales), prefill chunks (row-wise / per-tensor
    GEMM) and under a graph, with no quantize_rows launch; a one-token step is not rounded by the norm."""
    from hybrid.ops import triton_fp8, triton_norm

    n, k = SHAPES_8B[name]
    layer = _layer(n, k, per_channel=per_channel, act=act, seed=29)
    weight = (0.5 + torch.rand(k, device="cuda")).to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(3)
    real = triton_fp8.quantize_rows
    launches = []
    monkeypatch.setattr(triton_fp8, "quantize_rows", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    for rows in (2, 8, 64, 65, 300, 4096):
        assert layer.rounds_rows_first(rows, torch.bfloat16, torch.device("cuda"))
        x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16) * 2
        residual = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
        normed = triton_norm.add_rms_norm(x, residual.clone(), weight, 1e-5, True, 1.0,
                                          triton_norm.RoundFor(layer.input_scale))
        assert triton_fp8.rounding_of(normed, layer.input_scale) is not None
        launches.clear()
        got = layer(normed)
        assert not launches, rows  # the projection took the norm's rounding
        want = layer(normed.clone())  # (a copy carries no rounding: quantize_rows runs)
        assert launches and torch.equal(got, want), (name, rows)
    assert not layer.rounds_rows_first(1, torch.bfloat16, torch.device("cuda"))
    src = torch.randn(64, k, device="cuda").to(torch.bfloat16)
    res = torch.zeros(64, k, device="cuda", dtype=torch.bfloat16)

    def step():
        return layer(triton_norm.add_rms_norm(src.mul(2), res.clone(), weight, 1e-5, True, 1.0,
                                              triton_norm.RoundFor(layer.input_scale)))

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    src.copy_(torch.randn(64, k, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())


@pytest.mark.parametrize("mlp_act", ["relu2", "silu_and_mul"])
@pytest.mark.parametrize("act", [STATIC, DYNAMIC])
@pytest.mark.parametrize("rows", [1, 8, 100, 1000, 2048])  # (2048: the looped tiles of many wide rows)
def test_mlp_activation_in_the_row_quantization_changes_no_value(rows, act, mlp_act):
    """The 8B MLP down_proj with its MLP activation (relu2, or SwiGLU of [gate | up] rows) taken by its row
    quantization (layer(h, act=...): the fused MLPs' path) equals the activation's own launch and then the
    projection, bit for bit, on every path: one-token kernels (1 row), the tensor-wise GEMM (8), the row-wise one
    (100, a 1000-row prefill chunk)."""
    from hybrid.fp8_linear import mlp_activation

    n, k = SHAPES_8B["mlp.down_proj"]
    layer = _layer(n, k, per_channel=True, act=act, seed=19)
    h = torch.randn(rows, k * (2 if mlp_act == "silu_and_mul" else 1), device="cuda").to(torch.bfloat16) * 3
    assert torch.equal(layer(h, act=mlp_act), layer(mlp_activation(h, mlp_act)))


@pytest.mark.parametrize("gemm", ["gemv", "triton"])
def test_decode_switches_route_and_capture(gemm, monkeypatch):
    """HYBRID_FP8_DECODE_GEMM=gemv / triton send a decode-sized step to fp8_gemv / the one-launch
    linear (the same bytes as calling them directly), and the layer captures in a CUDA graph."""
    from hybrid.ops import triton_guard

    n, k = SHAPES_8B["attn.o_proj"]
    layer = _layer(n, k, True, DYNAMIC, seed=5)
    x = torch.randn(2, k, device="cuda").to(torch.bfloat16)
    monkeypatch.setenv("HYBRID_FP8_DECODE_GEMM", gemm)
    triton_guard.reset_switches()
    try:
        direct = layer.forward_gemv(x) if gemm == "gemv" else layer.forward_small_m(x)
        assert torch.equal(layer(x), direct)
        graph = torch.cuda.CUDAGraph()
        layer(x)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = layer(x)
        new = torch.randn(2, k, device="cuda").to(torch.bfloat16)
        x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, layer(new))
    finally:
        monkeypatch.delenv("HYBRID_FP8_DECODE_GEMM")
        triton_guard.reset_switches()


@pytest.mark.parametrize("per_channel,act,bias", [(True, DYNAMIC, False), (False, DYNAMIC, True), (True, STATIC, True)])
def test_tensorwise_decode_path_routes_and_matches_rowwise(per_channel, act, bias, monkeypatch):
    """Steps of at most TENSORWISE_MAX_ROWS tokens with row-wise scales take the tensor-wise GEMM and
    the scales after it (forward_tensorwise); longer steps, and HYBRID_FP8_DECODE_GEMM=rowwise, the
    row-wise GEMM. Both are the exact product rounded once (and agree to bf16 rounding), and the
    tensor-wise path captures in a CUDA graph."""
    from hybrid import fp8_linear
    from hybrid.ops import triton_guard

    n, k = SHAPES_8B["mlp.down_proj"]
    layer = _layer(n, k, per_channel, act, seed=9, bias=bias)
    g = torch.Generator(device="cuda").manual_seed(4)
    for m in (1, 5, fp8_linear.TENSORWISE_MAX_ROWS, fp8_linear.TENSORWISE_MAX_ROWS + 1):
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        x[0, :7] = 25.0  # row scales that differ
        one_launch = layer._one_launch_path(x)  # (a one-token step: the preloading GEMV, tested on its own)
        if one_launch is not None:
            want = one_launch(x)
        else:
            want = layer.forward_tensorwise(x) if m <= fp8_linear.TENSORWISE_MAX_ROWS else layer.forward_scaled_mm(x)
        assert torch.equal(layer(x), want), m
        assert rel_err(layer.forward_tensorwise(x), _exact(layer, x)) < 5e-3, m
        assert rel_err(layer.forward_tensorwise(x), layer.forward_scaled_mm(x)) < 8e-3, m
    x = torch.randn(3, k, generator=g, device="cuda").to(torch.bfloat16)
    monkeypatch.setenv("HYBRID_FP8_DECODE_GEMM", "rowwise")
    triton_guard.reset_switches()
    try:
        assert torch.equal(layer(x), layer.forward_scaled_mm(x))
    finally:
        monkeypatch.delenv("HYBRID_FP8_DECODE_GEMM")
        triton_guard.reset_switches()
    layer(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.forward_tensorwise(x)
    new = torch.randn(3, k, generator=g, device="cuda").to(torch.bfloat16)
    x.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, layer.forward_tensorwise(new))


def test_quantize_rows_gives_torchs_bytes_on_the_gpu():
    """The Triton row quantization before _scaled_mm gives the reference's e4m3 bytes and scales
    (torch's cast), dynamic and static, on real widths."""
    from hybrid.fp8_linear import per_token_scale
    from hybrid.ops import triton_fp8

    for width in (8192, 21504, 40000):  # one register tile (up to ONE_TILE_MAX_K), and the loop past it
        x = (torch.randn(300, width, device="cuda") * 4).to(torch.bfloat16)
        x[5] = 0
        for static in (None, torch.tensor(0.013, device="cuda")):
            q, s = triton_fp8.quantize_rows(x, static)
            want_s = per_token_scale(x) if static is None else static.expand(300, 1)
            assert torch.equal(s, want_s.float().contiguous()), width
            want = (x.float() / want_s).clamp(-448, 448).to(FP8_DTYPE)
            assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)), width


def test_quantize_rows_near_every_rounding_boundary_on_the_gpu():
    """The GPU's quantization (the quotient from the row's reciprocal with a fused-multiply-add
    correction, the hardware e4m3 cast) against torch's IEEE division and cast, on bf16 values a few
    ulps either side of (e4m3 midpoint x scale), zeros of both signs, and a static scale with
    values past the clamp and infinities; and the same bytes as the division path."""
    from hybrid.fp8_linear import per_token_scale
    from hybrid.ops import triton_fp8

    g = torch.Generator(device="cuda").manual_seed(3)
    e4m3 = torch.arange(0, 127, dtype=torch.uint8, device="cuda").view(FP8_DTYPE).float()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    s = (torch.rand(512, 1, generator=g, device="cuda") * 0.05 + 1e-3) * 2.0 ** torch.randint(
        -12, 12, (512, 1), generator=g, device="cuda")
    m = mids[torch.randint(0, mids.numel(), (512, 4096), generator=g, device="cuda")]
    x = (m * s * torch.where(torch.rand(512, 4096, generator=g, device="cuda") < 0.5, -1.0, 1.0)).to(torch.bfloat16)
    bits = x.view(torch.int16) + torch.randint(-2, 3, x.shape, generator=g, device="cuda", dtype=torch.int16)
    x = bits.view(torch.bfloat16)  # a few bf16 ulps either side
    x[:, 0], x[:, 1] = 0.0, -0.0
    x[:, 2] = (448 * s[:, 0]).to(torch.bfloat16)
    for static in (None, torch.tensor(0.013, device="cuda")):
        xs = x.clone()
        if static is not None:
            xs[:, 3], xs[:, 4], xs[:, 5] = 1e9, float("inf"), float("-inf")
        q, sc = triton_fp8.quantize_rows(xs, static)
        want_s = per_token_scale(xs) if static is None else static.expand(512, 1)
        assert torch.equal(sc, want_s.float().contiguous())
        want = (xs.float() / want_s).clamp(-448, 448).to(FP8_DTYPE)
        assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
        q_div, _ = triton_fp8.quantize_rows(xs, static, fma_quotient=False, hw_cast=False)
        assert torch.equal(q_div.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("per_channel,act", [(False, STATIC), (True, DYNAMIC), (False, DYNAMIC)])
def test_scaled_mm_captured_in_a_cuda_graph(per_channel, act):
    """No host syncs: the layer (dynamic per-token scales included) captures, and a replay on new
    input equals the eager call."""
    n, k = SHAPES_8B["mamba.out_proj"]
    layer = _layer(n, k, per_channel, act, seed=7)
    static_x = torch.randn(8, k, device="cuda").to(torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            layer(static_x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static_x)
    new = torch.randn(8, k, device="cuda").to(torch.bfloat16) * 3
    static_x.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, layer(new))


# ---------------------------------------------------------------------------------------------
# tiny FP8 checkpoints served on the GPU
# ---------------------------------------------------------------------------------------------

# (family, scheme): no dt clamp in these (prefill and decode compute the same function), so the CPU
# reference can be asked for its greedy choice after the GPU's own prefixes
MOE_FAMILIES = ("granite_moe", "nemotron_h_sharded", "nemotron_h_latent")
CASES = [("granite_dense", "modelopt_fp8"), ("granite_moe", "ct_fp8_dynamic"),
         ("nemotron_h_sharded", "modelopt_pcpt"), ("falcon_h1", "ct_fp8"), ("nemotron_h_latent", "modelopt_pcpt")]


@pytest.fixture(scope="module")
def fp8_path(tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_gpu")
    built = {}

    def get(family, scheme):
        if (family, scheme) not in built:
            # MoE families route every token to every expert (as tests/gpu/test_state_under_graphs.py
            # does): measured on the H200, one routing choice flipped by FP8 noise in a tiny random MoE
            # moved later logits by 1.2-1.5 nats, which no bound can tell from a real fault
            src = (tiny_checkpoints.build_every_expert(family, root / f"{family}-every-expert")
                   if family in MOE_FAMILIES else tiny_ckpt(family))
            built[family, scheme] = R.quantize(src, root / f"{family}-{scheme}", scheme)
        return built[family, scheme]

    return get


def _prompts(path):
    from tiny_checkpoints import vocab_size_of

    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, vocab_size_of(path), (n,), generator=g).tolist() for n in (1, 5, 8, 17, 27, 40)]


def _run(llm, prompts, n=12):
    from hybrid import SamplingParams

    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=n, **GREEDY),
                                                         use_tqdm=False)]


def _regrets(cpu, prompts, got) -> list[float]:
    """For every GPU token: how many nats below its own greedy choice the CPU reference ranks it,
    given the GPU's own prefix (0 where the two agree)."""
    from hybrid import SamplingParams

    prefixes = [p + g[:j] for p, g in zip(prompts, got) for j in range(len(g))]
    res = cpu.generate(prefixes, SamplingParams(max_tokens=1, logprobs=cpu.config.vocab_size, **GREEDY),
                       use_tqdm=False)
    return [max(r.outputs[0].logprobs[0].values()) - r.outputs[0].logprobs[0][t]
            for r, t in zip(res, [t for g in got for t in g])]


# Bounds measured on the H200 (2026-12-01), with about 40% headroom. bf16 activations round
# differently from the CPU's fp32 before the e4m3 quantization, so some activations land on the
# neighbouring e4m3 value (a 1/16 step), and these tiny random models have sharp near-ties: bf16 + graphs
# against the CPU, greedy under the reference 0.81-0.96 of the tokens, max regret 0.41-1.42 nats (the
# largest in the MoE families, though every token goes to every expert); fp32 activations on CUDA
# against the CPU, 0.88-0.93 and 0.20-0.29 nats. A broken FP8 path (wrong scale, layout or dtype)
# ranks its tokens at random: several nats, and a greedy share near 1/vocab. The GEMM itself is held
# to the exact product at the 8B shapes above.
FP8_NEAR_TIE = 2.0  # nats below the CPU reference's greedy choice
FP8_MIN_EXACT = 0.6
# LatentMoE's tiny checkpoint moves 6x more than nemotron_h under bf16 rounding alone (tests/test_fp8.py's
# CLOSE_BOUND). On the H100 (2026-12-07, two runs, same figures) its bf16 + graphs run was greedy under the
# reference for 0.75 of the tokens with one token 2.07 nats below, while its fp32-activation run through the
# same fused FP8 kernels held the tight fp32 bounds below: so rounding, not the FP8 latent path. The greedy
# share still separates a broken path (near 1/vocab) from this one.
FP8_NEAR_TIE_OF = {"nemotron_h_latent": 3.0}
FP32_FP8_NEAR_TIE = 0.5
FP32_FP8_MIN_EXACT = 0.75


@pytest.mark.parametrize("family,scheme", CASES)
def test_fp8_checkpoint_under_cuda_graphs_vs_cpu(family, scheme, fp8_path):
    from hybrid import LLM, SamplingParams

    path = fp8_path(family, scheme)
    gpu = LLM(path, device="cuda", max_num_seqs=8, page_size=16, max_model_len=128, max_num_batched_tokens=32,
              cuda_graph_sizes=[1, 2, 4, 8], gpu_memory_utilization=0.5)
    assert gpu.dtype == torch.bfloat16 and gpu.runner.use_graphs
    layers = [m for m in gpu.model.modules() if isinstance(m, Fp8Linear)]
    assert layers and any(m.use_scaled_mm for m in layers)
    from hybrid.moe import Experts

    # the routed experts of the MoE families stay FP8 on sm_89+, in the fused kernel (hybrid/moe.py)
    assert all(m.fp8 and m.fused for m in gpu.model.modules() if isinstance(m, Experts))
    prompts = _prompts(path)
    got = _run(gpu, prompts)
    assert gpu.runner.stats["graph_replays"] > 0
    cpu = LLM(path, device="cpu", dtype="float32", max_num_seqs=8, max_model_len=128)
    want = _run(cpu, prompts)
    first = sum(g[0] == w[0] for g, w in zip(got, want)) / len(want)
    agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(len(w) for w in want)
    regret = _regrets(cpu, prompts, got)  # every GPU token against the CPU's choice after its prefix
    exact = sum(r == 0 for r in regret) / len(regret)
    print(f"{family} {scheme}: FP8 bf16+graphs vs CPU fp32 of the same checkpoint: first {first:.2f}, "
          f"agree {agree:.2f}, greedy under the reference {exact:.2f}, max regret {max(regret):.3f} nats")
    assert first >= 0.5 and exact >= FP8_MIN_EXACT and max(regret) <= FP8_NEAR_TIE_OF.get(family, FP8_NEAR_TIE)


@pytest.fixture(scope="module", params=CASES[:3])
def fp8_llm(request, fp8_path):
    from hybrid import LLM

    return LLM(fp8_path(*request.param), device="cuda", max_num_seqs=8, page_size=16, max_model_len=64,
               cuda_graph_sizes=[1, 2, 4, 8], gpu_memory_utilization=0.5)


@pytest.mark.parametrize("slots", [[7], [7, 2, 0], list(range(8))])
def test_fp8_replay_equals_eager(fp8_llm, slots):
    """A captured FP8 decode graph replays bit for bit what the eager forward of the same padded batch
    computes, and leaves the slots outside the batch untouched (as tests/gpu/test_graphs.py checks
    for the bf16 checkpoints)."""
    from test_graphs import replay_and_padded_eager

    _, s0, eager, s_eager, out, s_graph = replay_and_padded_eager(fp8_llm, slots, 16)
    assert torch.equal(out, eager)
    assert all(torch.equal(a, b) for a, b in zip(s_graph[:2], s_eager[:2]))
    other = [s for s in range(8) if s not in slots]
    assert torch.equal(s_graph[0][:, other], s0[0][:, other]) and torch.equal(s_graph[1][:, other], s0[1][:, other])


# (and LatentMoE: this run holding its bounds is what says its bf16 run's 2.07-nat token is rounding)
@pytest.mark.parametrize("family,scheme", CASES[:2] + CASES[4:5])
def test_fp8_checkpoint_fp32_gpu_matches_cpu(family, scheme, fp8_path):
    """fp32 activations on CUDA take the reference path (_scaled_mm only for bf16). Not token for token
    with the CPU as the unquantized fp32 parity tests are: quantizing an activation to e4m3 is a step
    function, so an fp32 rounding difference between the two devices (1e-7) now and then lands a value
    on the neighbouring e4m3 step (1/16 apart), and in a tiny random model a later near-tie flips (on
    the H200, 60-80% of the tokens agreed, every first token did). So: every first token equal, and
    every GPU token the CPU's greedy choice after the GPU's own prefix, or within FP32_FP8_NEAR_TIE of it."""
    from hybrid import LLM

    path = fp8_path(family, scheme)
    prompts = _prompts(path)
    got = _run(LLM(path, device="cuda", dtype="float32", max_num_seqs=4, max_model_len=128,
                   gpu_memory_utilization=0.5), prompts)
    cpu = LLM(path, device="cpu", dtype="float32", max_num_seqs=8, max_model_len=128)
    want = _run(cpu, prompts)
    regret = _regrets(cpu, prompts, got)
    print(f"{family} {scheme}: FP8 fp32 CUDA vs CPU: greedy under the reference "
          f"{sum(r == 0 for r in regret) / len(regret):.2f}, max regret {max(regret):.4f} nats")
    assert [g[0] for g in got] == [w[0] for w in want]
    assert sum(r == 0 for r in regret) / len(regret) >= FP32_FP8_MIN_EXACT and max(regret) <= FP32_FP8_NEAR_TIE


def test_memory_plan_counts_fp8_weights(fp8_path, tiny_ckpt):
    from hybrid import LLM

    kw = dict(device="cuda", max_num_seqs=4, max_model_len=128, gpu_memory_utilization=0.5)
    fp8 = LLM(fp8_path("granite_dense", "modelopt_fp8"), **kw)
    bf16 = LLM(tiny_ckpt("granite_dense"), **kw)
    assert fp8.memory_plan.weight_bytes == sum(p.numel() * p.element_size() for p in fp8.model.parameters())
    proj = sum(m.weight.numel() for m in fp8.model.modules() if isinstance(m, Fp8Linear))
    assert bf16.memory_plan.weight_bytes - fp8.memory_plan.weight_bytes >= proj * 0.9  # 2 -> 1 byte a value
