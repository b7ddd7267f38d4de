"""The FP8 activation quantization fused into the kernels that produce a projection's input (issue 17:
the norms with their residual add, the Mamba gated norm, relu2 / SwiGLU; hybrid/layers.py fp8_input),
on CPU through Triton's interpreter: each fused kernel writes its output as the unfused kernel does
and the e4m3 rows and scales quantize_rows gives of that output, bit for bit (per-row and static
scales, several row counts, widths that are not powers of two, rows quantized from one tile or in
steps); Fp8Linear takes them in place of its own quantization with the same result; which producers
fuse for which consumers; and FP8 checkpoints give the same tokens and log-probabilities with the
fusion on as off (HYBRID_FP8_FUSED_QUANT=0). The GPU's bytes: tests/gpu/test_fp8_gpu.py."""
from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU interpreter tests: run in their own process with TRITON_INTERPRET=1", allow_module_level=True)

import fp8_reference as R  # noqa: E402
from hybrid.fp8_linear import Fp8Linear  # noqa: E402
from hybrid.layers import Linear, fp8_input  # noqa: E402
from hybrid.ops import triton_act as ta  # noqa: E402
from hybrid.ops import triton_fp8 as tf  # noqa: E402
from hybrid.ops import triton_guard  # noqa: E402
from hybrid.ops import triton_moe as tm  # noqa: E402
from hybrid.ops import triton_norm as tn  # noqa: E402
from hybrid.quantization import DYNAMIC, FP8_DTYPE, STATIC  # noqa: E402

STATIC_SCALE = torch.tensor(0.011)


def _rows(t: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, width, generator=g) * 3).to(dtype)
    if t > 2:
        x[1] = 0.0  # an all-zero row: the floor scale (MIN_DYNAMIC_SCALE)
        x[2, 0] = 1e4  # saturates past 448 x the static scale
    return x


def _fused_and_plain(op: str, t: int, width: int, dtype: torch.dtype, input_scale) -> tuple:
    """(QuantizedRows of the fused launch, the unfused launch's output, [extra outputs of each: the
    updated residuals]) of one producer kernel on fresh inputs [t, width]."""
    x = _rows(t, width, dtype, seed=t * 1000 + width)
    w = (0.5 + torch.rand(width, generator=torch.Generator().manual_seed(width))).to(dtype)
    q = dict(quantize=True, input_scale=input_scale)
    if op == "rms_norm":
        return tn.rms_norm(x, w, 1e-5, True, **q), tn.rms_norm(x, w, 1e-5, True), []
    if op in ("add_rms_norm", "sum_add_rms_norm"):
        res = _rows(t, width, dtype, seed=width)
        r1, r2 = res.clone(), res.clone()
        if op == "add_rms_norm":  # (Granite's convention: the weight after the cast, a residual multiplier)
            fused = tn.add_rms_norm(x, r1, w, 1e-5, False, 0.22, **q)
            plain = tn.add_rms_norm(x, r2, w, 1e-5, False, 0.22)
        else:
            rows = tm.ExpertRows(_rows(3 * t, width, dtype, seed=7), x, 3)
            fused = tn.sum_add_rms_norm(rows, r1, w, 1e-5, True, **q)
            plain = tn.sum_add_rms_norm(rows, r2, w, 1e-5, True)
        return fused, plain, [(r1, r2)]
    if op == "gated_rms_norm":  # width = groups x group: 4 groups here, z a strided view as after the split
        y = _rows(t, width, dtype, seed=3)
        z = torch.cat([_rows(t, width, dtype, seed=4), x], dim=1)[:, width:]
        return (tn.gated_rms_norm(y, z, w, 1e-5, 4, **q), tn.gated_rms_norm(y, z, w, 1e-5, 4), [])
    if op == "relu2":
        return ta.relu2(x, **q), ta.relu2(x), []
    gate_up = torch.cat([x, _rows(t, width, dtype, seed=5)], dim=1)
    return ta.silu_and_mul(gate_up, **q), ta.silu_and_mul(gate_up), []


# widths: powers of two and not (masked lanes); for each producer one whose rows are quantized in
# 1024-wide steps rather than from one register tile (fused_quant_args: past 64 values a thread)
CASES = [(op, w) for op in ("rms_norm", "add_rms_norm", "sum_add_rms_norm", "gated_rms_norm", "relu2", "silu_and_mul")
         for w in (64, 200)]
CASES += [("add_rms_norm", 20000), ("gated_rms_norm", 4 * 1500), ("relu2", 33000)]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op,width", CASES)
def test_fused_kernels_write_quantize_rows_bytes(op, width, dtype, static):
    """The fused launch's output equals the unfused launch's (and so does anything else it updates,
    the residual), and its e4m3 rows and scales are quantize_rows' of that output, bit for bit."""
    s_in = STATIC_SCALE if static else None
    for t in (1, 3, 17) if width < 10000 else (3,):
        fused, plain, extra = _fused_and_plain(op, t, width, dtype, s_in)
        assert isinstance(fused, tf.QuantizedRows) and fused.input_scale is s_in
        assert fused.x.dtype == plain.dtype and torch.equal(fused.x, plain), (op, t)
        assert all(torch.equal(a, b) for a, b in extra)
        q, s = tf.quantize_rows(plain, s_in)
        assert fused.q.dtype == FP8_DTYPE and fused.q.shape == plain.shape and fused.scale.shape == (t, 1)
        assert torch.equal(fused.scale, s), (op, t)
        assert torch.equal(fused.q.view(torch.uint8), q.view(torch.uint8)), (op, t)
    if width == 20000:  # the case meant to step through the row does
        assert not tf.fused_quant_args(plain, True, None, tn._warps(32768))[0]["Q_ONE_TILE"]


def test_fused_kernels_with_no_rows():
    x = torch.zeros(0, 64)
    out = tn.rms_norm(x, torch.ones(64), 1e-5, True, quantize=True)
    assert out.x.shape == out.q.shape == (0, 64) and out.scale.shape == (0, 1)
    assert ta.relu2(x, quantize=True).q.shape == (0, 64)


def _layer(activation, seed: int, dtype: torch.dtype = torch.float32, n: int = 48, k: int = 64) -> Fp8Linear:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(FP8_DTYPE)
    s_in = torch.tensor(0.02) if activation == STATIC else None
    bias = torch.randn(n, generator=g).to(dtype)
    return Fp8Linear(w, (torch.rand(n, generator=g) + 0.5) / 200, s_in, activation, bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("activation", [STATIC, DYNAMIC])
def test_fp8_linear_takes_quantized_rows(activation, dtype, monkeypatch):
    """Fp8Linear on QuantizedRows (the CPU's reference path: the rows dequantized from their bytes,
    not quantized again) computes exactly what it computes from the rows alone; rows quantized with
    another static scale than the layer's are refused."""
    from hybrid import fp8_linear

    layer = _layer(activation, seed=2, dtype=dtype)
    x = _rows(5, 64, dtype, seed=9)
    rows = tn.rms_norm(x, torch.ones(64, dtype=dtype), 1e-5, True, quantize=True, input_scale=layer.input_scale)
    assert layer.quantizes(5, dtype, x.device) and layer.route(5, dtype, x.device) == "reference"
    want = layer(rows.x)
    monkeypatch.setattr(fp8_linear, "fake_quantize", lambda *a: pytest.fail("quantized again"))
    assert torch.equal(layer(rows), want)
    if activation == STATIC:
        other = tf.QuantizedRows(rows.x, rows.q, rows.scale, torch.tensor(0.02))
        with pytest.raises(ValueError, match="another input scale"):
            layer(other)


def test_which_consumers_take_quantized_rows(monkeypatch):
    """fp8_input: FP8 projections with activation scales take the rows quantized, one or several
    sharing a scheme (all per row, or one static scale); not bf16 or weight-only projections, not two
    FP8 projections with their own static scales (Falcon-H1's parallel Mamba and attention in
    ModelOpt's FP8), nor with HYBRID_FP8_FUSED_QUANT=0."""
    cpu = torch.device("cpu")
    dyn, dyn2, static = _layer(DYNAMIC, 1), _layer(DYNAMIC, 2), _layer(STATIC, 3)
    static2 = _layer(STATIC, 4)  # the same value, its own parameter
    weight_only = Fp8Linear(dyn.weight.data, dyn.weight_scale.data, None, None, None)
    assert fp8_input((dyn,), 4, torch.float32, cpu) == {"quantize": True, "input_scale": None}
    assert fp8_input((dyn, dyn2), 4, torch.float32, cpu) == {"quantize": True, "input_scale": None}
    assert fp8_input((static,), 4, torch.float32, cpu) == {"quantize": True, "input_scale": static.input_scale}
    for projs in [(), (weight_only,), (Linear(64, 48, False),), (static, static2), (dyn, static), (dyn, weight_only)]:
        assert fp8_input(projs, 4, torch.float32, cpu) == {}, projs
    monkeypatch.setenv("HYBRID_FP8_FUSED_QUANT", "0")
    triton_guard.reset_switches()
    try:
        assert fp8_input((dyn,), 4, torch.float32, cpu) == {}
    finally:
        monkeypatch.delenv("HYBRID_FP8_FUSED_QUANT")
        triton_guard.reset_switches()


# ---------------------------------------------------------------------------------------------
# FP8 checkpoints through the fused path, on and off
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_ckpt(tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_fused_quant")
    built = {}

    def get(family: str, scheme: str) -> str:
        if (family, scheme) not in built:
            built[family, scheme] = R.quantize(tiny_ckpt(family), root / f"{family}-{scheme}", scheme)
        return built[family, scheme]

    return get


def _generate(path, make_llm, monkeypatch, fused: bool):
    """Greedy tokens and log-probabilities of an LLM with the fused ops (the Triton kernels under the
    interpreter), the quantization fused or not, and the names of the Fp8Linear projections that
    were handed QuantizedRows."""
    from hybrid import SamplingParams

    if not fused:
        monkeypatch.setenv("HYBRID_FP8_FUSED_QUANT", "0")
    triton_guard.reset_switches()
    took = set()
    real = Fp8Linear.forward

    def forward(self, x):
        if isinstance(x, tf.QuantizedRows):
            took.add(self._name)
        return real(self, x)

    monkeypatch.setattr(Fp8Linear, "forward", forward)
    try:
        llm = make_llm(path, fused_ops=True)
        for name, m in llm.model.named_modules():
            if isinstance(m, Fp8Linear):
                m._name = name
        sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
        outs = llm.generate([[5, 6, 7, 8, 9, 10, 11], [12], list(range(20, 37))], sp, use_tqdm=False)
    finally:
        monkeypatch.undo()
        triton_guard.reset_switches()
    fp8 = {n for n, m in llm.model.named_modules() if isinstance(m, Fp8Linear)}
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], took, fp8


# Which projections read a fused kernel's output alone (hybrid/model.py norm_consumers; the MLPs'
# down_proj, the Mamba out_proj): every FP8 one but the attention o_proj (its input is the attention
# backend's), an MoE layer's shared expert's up_proj (the router reads the norm's output too),
# Zamba2's shared block and per-layer linear (their adapters read the same rows / the input is a
# sum; its gelu MLP runs in torch), and Falcon-H1's out_proj (its gate order is not the fused gated norm's).
def _expected(fp8: set[str], family: str, scheme: str) -> set[str]:
    def excluded(name: str) -> bool:
        if name.endswith("o_proj") or name.startswith("shared_blocks") or name.endswith(".linear"):
            return True
        if ".shared." in name and name.endswith("up_proj"):
            return True
        if family.startswith("falcon_h1") and name.endswith("out_proj"):
            return True
        # Falcon-H1 in ModelOpt's FP8: Mamba in_proj and attention qkv have their own static scales
        return family.startswith("falcon_h1") and scheme == "modelopt_fp8" and name.endswith(("in_proj", "qkv_proj"))
    return {n for n in fp8 if not excluded(n)}


# the producers each family's run must cover (suffixes of the projections they feed)
COVERED = {"nemotron_h": ("in_proj", "qkv_proj", "up_proj", "out_proj", "down_proj"),  # norms, gated norm, relu2
           "granite_dense": ("in_proj", "gate_up_proj", "out_proj", "down_proj"),  # + SwiGLU
           "falcon_h1": ("gate_up_proj", "down_proj"),  # + the two readers of input_norm when per row
           "zamba2": ("in_proj", "out_proj")}


@pytest.mark.parametrize("family", ["nemotron_h", "granite_dense", "falcon_h1", "zamba2"])
@pytest.mark.parametrize("scheme", ["ct_fp8_dynamic", "modelopt_fp8"])
def test_fp8_checkpoint_same_with_the_quantization_fused(family, scheme, fp8_ckpt, make_llm, monkeypatch):
    """An FP8 checkpoint through the fused ops gives the same tokens and log-probabilities, exactly,
    with the activation quantization fused into the norm / activation kernels as with each
    projection quantizing its own input; the fused run hands every projection that alone reads a
    fused kernel's output its rows quantized, the other run none."""
    path = fp8_ckpt(family, scheme)
    want, took_off, fp8 = _generate(path, make_llm, monkeypatch, fused=False)
    got, took_on, _ = _generate(path, make_llm, monkeypatch, fused=True)
    assert got == want
    assert not took_off
    expected = _expected(fp8, family, scheme)
    assert expected and took_on == expected, (sorted(took_on ^ expected))
    covered = COVERED[family] + (("in_proj", "qkv_proj") if family == "falcon_h1" and scheme == "ct_fp8_dynamic" else ())
    for suffix in covered:
        assert any(n.endswith(f".{suffix}") for n in took_on), suffix
