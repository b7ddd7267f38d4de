"""The FP8 projection (Fp8Linear) and the scale checks and dequantization the loader applies: the
module that runs an FP8 checkpoint's weights, beside hybrid/quantization.py, which reads the formats
and plans the load.

CPU (and any shape cuBLASLt cannot take): the reference, in plain torch: the weight dequantized with
its scales, the input rounded to e4m3 with its scale and back. CUDA (sm_89+): the rows quantized in
one Triton launch (hybrid/ops/triton_fp8.py), then torch._scaled_mm, per-tensor or row-wise scales
(bf16, dims divisible by 16; decode-sized steps with row-wise scales on the tensor-wise GEMM with the
scales applied after it, which streams faster); weight-only projections at decode sizes on one
Triton launch that streams the e4m3 weight. No host sync: capturable in CUDA graphs.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.errors import CheckpointError
from hybrid.ops import triton_act, triton_fp8
from hybrid.ops.triton_guard import HAS_TRITON, switch
from hybrid.quantization import _SCALE_DTYPES, DYNAMIC, FP8_DTYPE, FP8_MAX, MIN_DYNAMIC_SCALE, STATIC, Fp8Param

logger = logging.getLogger("hybrid")


def check_scale(t: torch.Tensor, name: str, stored: str, rows: int | None = None,
                experts: int | None = None) -> torch.Tensor:
    """A weight or input scale as fp32: one value ([] or [1]) or, with `rows`, one per output row
    ([rows] or [rows, 1]); with `experts` (a stacked [E, rows, in] weight) one per expert or per expert
    row ([E], [E, 1], [E, 1, 1], [E, rows], [E, rows, 1]). Returned shaped to broadcast against the
    weight (0-dim, [rows, 1], [E, 1, 1] or [E, rows, 1]). CheckpointError for a non-float, mis-shaped,
    non-positive or non-finite scale."""
    if stored not in _SCALE_DTYPES:
        raise CheckpointError(f"scale tensor '{name}' is stored as {stored}: scales must be floating point")
    shape = tuple(t.shape)
    t = t.float()
    if experts is None:
        if t.numel() == 1 and t.dim() <= 1:
            out = t.reshape(())
        elif rows is not None and shape in ((rows,), (rows, 1)):
            out = t.reshape(rows, 1)
        else:
            raise CheckpointError(f"scale tensor '{name}' has shape {list(shape)}: expected one value"
                                  + (f" or one per output row ([{rows}] or [{rows}, 1])" if rows else ""))
    else:
        if t.numel() == 1 and t.dim() <= 1:
            out = t.reshape(()).expand(experts).reshape(experts, 1, 1)
        elif shape in ((experts,), (experts, 1), (experts, 1, 1)):
            out = t.reshape(experts, 1, 1)
        elif rows is not None and shape in ((experts, rows), (experts, rows, 1)):
            out = t.reshape(experts, rows, 1)
        else:
            raise CheckpointError(f"scale tensor '{name}' has shape {list(shape)}: expected one value per expert "
                                  f"([{experts}]) or per expert row ([{experts}, {rows}, 1])")
    if not bool(torch.isfinite(out).all()) or not bool((out > 0).all()):
        raise CheckpointError(f"scale tensor '{name}' holds values that are not positive and finite")
    return out


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight.float() * scale in fp32 (`scale` as check_scale returns it): the reference
    dequantization of an FP8 weight."""
    return weight.float() * scale


# the parameters that may stay in FP8 as loaded (FP8 experts, hybrid/moe.py Experts): the rest of
# the loader's dequantized set (routers, adapters, LM head) is dequantized at load
FP8_EXPERT_PARAMS = ("experts.up", "experts.down")


def keep_fp8_experts(device: torch.device) -> bool:
    """Whether an FP8 checkpoint's routed experts stay in FP8 (half the bytes resident and streamed;
    the fused MoE kernel dequantizes them in registers): on CUDA devices of compute capability 8.9
    and up, where Triton has the e4m3 type. Elsewhere (older GPUs, the CPU) they are dequantized at
    load, the reference numerics (which the FP8 experts reproduce exactly in the torch loop)."""
    return _scaled_mm_capable(torch.device(device))


def row_scales(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """check_scale's broadcastable scale of `weight` ([rows, in] or [E, rows, in]) as one fp32 value
    per output row: [rows] or [E, rows]."""
    return scale.expand(*weight.shape[:-1], 1).reshape(weight.shape[:-1]).float().contiguous()


def settle_fp8_experts(model: nn.Module, dtype: torch.dtype) -> int:
    """After a load: an Experts module whose up and down did not both stay in FP8 (a checkpoint that
    quantizes one of them) gets the FP8 one dequantized to `dtype`, since the kernel takes both or
    neither. Returns how many Experts modules hold FP8 weights."""
    from hybrid.moe import Experts

    count = 0
    for m in model.modules():
        if not isinstance(m, Experts):
            continue
        if (m.up_scale is None) != (m.down_scale is None):
            for which in ("up", "down"):
                scale = getattr(m, f"{which}_scale")
                if scale is not None:
                    w = getattr(m, which)
                    setattr(m, which, nn.Parameter(dequantize(w.data, scale[..., None]).to(dtype), requires_grad=False))
                    setattr(m, f"{which}_scale", None)
        count += m.up_scale is not None
    return count


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x quantized to e4m3 with `scale` (x / scale, clamped to +-448, rounded to the nearest e4m3) and
    dequantized back, in x.dtype: what an FP8 GEMM sees of its input."""
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.float() * scale).to(x.dtype)


def per_token_scale(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token scales [T, 1] in fp32: each row's absmax / 448, correctly rounded (floored at
    MIN_DYNAMIC_SCALE). The divisor is a tensor: torch divides a CUDA tensor by a Python scalar as a
    multiplication by its reciprocal, one ulp off the IEEE quotient for some rows (measured on the H200),
    while a tensor divisor is IEEE division on every device, as the Triton kernels' div_rn."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    return (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_DYNAMIC_SCALE)


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------


# Steps of at most this many tokens whose scales are not both per tensor run cuBLASLt's tensor-wise
# FP8 GEMM (unit scales, fp32 out) and apply the scales after it (Fp8Linear.forward_tensorwise). On
# the H200 (bench/bench_fp8_gemv.py, 2026-12-02, M = 1..64) the tensor-wise GEMM streamed the 8B
# projections at 2.3-3.4 TB/s against 1.0-2.0 TB/s for the row-wise one (e.g. the MLP down_proj in
# 26 against 79 us); larger steps keep the row-wise GEMM (an fp32 [M, N] accumulator would cost
# prefill bandwidth).
TENSORWISE_MAX_ROWS = 64
_tensorwise_probed: dict[torch.device, bool] = {}


# an activation scheme as the Triton FP8 kernels' ACT / quantize argument
_ACT_CODES = {None: triton_fp8.ACT_NONE, STATIC: triton_fp8.ACT_STATIC, DYNAMIC: triton_fp8.ACT_DYNAMIC}


def gemv_max_rows() -> int:
    """The most tokens a step may have for its FP8 projections to run on triton_fp8.fp8_gemv (one launch, the
    rows quantized inside it): 1 by default (measured on an H100, 2026-12-06, 8B shape in FP8 per-channel /
    per-token: batch 1 255 against 242 tok/s for the row quantization + tensor-wise _scaled_mm; alone at the
    8B projections fp8_gemv is 2-2.5x slower at 4 rows, so larger steps keep the GEMM), up to
    triton_fp8.GEMV_MAX_ROWS with HYBRID_FP8_DECODE_GEMM=gemv, none with any other value of it (scaled_mm,
    rowwise, triton: their A/Bs)."""
    value = os.environ.get("HYBRID_FP8_DECODE_GEMM", "")
    return triton_fp8.GEMV_MAX_ROWS if value == "gemv" else 1 if value == "" else 0


def _tensorwise_fp32_out(device: torch.device) -> bool:
    """Whether this device's torch._scaled_mm takes e4m3 x e4m3 with 0-dim scales into fp32 (probed
    once per device on a 16 x 16 product, eagerly: the first FP8 step of an LLM is a warm-up or
    memory-plan step, before any graph capture); without it the row-wise GEMM serves every step."""
    if device not in _tensorwise_probed:
        one = torch.ones((), dtype=torch.float32, device=device)
        a = torch.ones(16, 16, device=device).to(FP8_DTYPE)
        try:
            out = torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            ok = bool((out == 16.0).all())
        except (RuntimeError, ValueError) as e:  # (not an OOM: a 16 x 16 product allocates nothing to speak of)
            logger.warning("FP8 tensor-wise GEMM with fp32 output unavailable on %s (%r): row-wise _scaled_mm "
                           "for every step", device, e)
            ok = False
        _tensorwise_probed[device] = ok
    return _tensorwise_probed[device]


def _scaled_mm_capable(device: torch.device) -> bool:
    """torch._scaled_mm with e4m3 operands: CUDA devices of compute capability 8.9 (Ada) and up."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def mlp_activation(x: torch.Tensor, act: str | None) -> torch.Tensor:
    """x's rows through an MLP activation as the layers run it (the Triton launch on CUDA, torch elsewhere): None,
    x; "relu2", relu(x) ** 2; "silu_and_mul", silu(gate) * up of x = [gate | up] (half x's width)."""
    if act is None:
        return x
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if act not in ("relu2", "silu_and_mul"):
        raise ValueError(f"mlp_activation: {act!r}")
    if x.is_cuda and HAS_TRITON:
        out = triton_act.by_name(rows, act)
    elif act == "relu2":
        out = torch.square(F.relu(rows))
    else:
        gate, up = rows.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out.reshape(*x.shape[:-1], out.shape[-1])


class Fp8Linear(nn.Module):
    """A linear projection with an FP8 (e4m3) weight [out, in] and fp32 scales, as the checkpoint
    stores them (parts of a fused projection concatenated; per-tensor scales that differ between
    the parts become one scale per output row).

    `weight_scale`: 0-dim (per tensor) or [out] (per output row). `activation`: None (weights only),
    STATIC (`input_scale`, 0-dim) or DYNAMIC (per token at run time).

    CPU, and dims cuBLASLt cannot take: the reference path, in plain torch: the weight dequantized
    (weight.float() * scale, cast to the activation dtype) and, when the checkpoint quantizes
    activations, the input quantized to e4m3 with its scale and dequantized back, then F.linear in
    the activation dtype: what the FP8 GEMM computes, up to accumulation order.
    CUDA (sm_89+, bf16, in and out features multiples of 16, activations quantized): the rows
    quantized in one Triton launch (triton_fp8.quantize_rows), then torch._scaled_mm, e4m3 x e4m3 ->
    bf16 with fp32 scales: per-tensor scales when weight and input are both per tensor, else
    row-wise (input [T, 1], weight [1, out]); steps of at most TENSORWISE_MAX_ROWS tokens take the
    tensor-wise GEMM with unit scales into fp32 and the row-wise scales after it instead
    (forward_tensorwise; HYBRID_FP8_DECODE_GEMM=rowwise keeps the row-wise GEMM). Weight-only projections (16-bit activations), steps of
    at most triton_fp8.MAX_ROWS tokens: one Triton launch streaming the e4m3 weight
    (triton_fp8.fp8_small_m_linear), which HYBRID_FP8_DECODE_GEMM=triton also gives the quantized
    ones (it lost to _scaled_mm alone on the H200: the benchmarks' A/B). One-token steps (gemv_max_rows;
    up to triton_fp8.GEMV_MAX_ROWS with HYBRID_FP8_DECODE_GEMM=gemv) on triton_fp8.fp8_gemv, the rows
    quantized inside its launch, for projections of K up to triton_fp8.GEMV_MAX_K (+5.4% at batch 1 on
    an H100 against the tensor-wise path, BENCHMARKS.md). No host syncs (the dynamic scales are computed on the device),
    so all are captured in CUDA graphs."""

    # forward(x, act=...) takes an MLP activation of its input (hybrid/layers.DenseMLP, GatedMLP ask for it)
    takes_mlp_activation = True

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                 activation: str | None, bias: torch.Tensor | None) -> None:
        super().__init__()
        assert weight.dtype == FP8_DTYPE and weight.dim() == 2
        n, k = weight.shape
        assert weight_scale.dtype == torch.float32 and weight_scale.shape in ((), (n,))
        assert (activation == STATIC) == (input_scale is not None)
        self.in_features, self.out_features = k, n
        self.activation = activation
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale.contiguous(), requires_grad=False)
        self.input_scale = (nn.Parameter(input_scale.reshape(()).float(), requires_grad=False)
                            if input_scale is not None else None)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.use_scaled_mm = (activation is not None and k % 16 == 0 and n % 16 == 0
                              and _scaled_mm_capable(weight.device))
        # both scales one value: the GEMM takes them as they are (no row-wise scaling)
        self.per_tensor_scales = activation == STATIC and self.weight_scale.dim() == 0
        self.register_buffer("_unit_scale", torch.ones((), dtype=torch.float32, device=weight.device), persistent=False)
        # row-wise GEMMs take the weight scale as [1, out] (a per-tensor one expanded once here)
        self.register_buffer("_scale_b_row", self.weight_scale.detach().expand(n).reshape(1, n).contiguous(),
                             persistent=False)

    def extra_repr(self) -> str:
        per = "tensor" if self.weight_scale.dim() == 0 else "channel"
        return (f"in_features={self.in_features}, out_features={self.out_features}, weight_scale=per-{per}, "
                f"activation={self.activation}, bias={self.bias is not None}, scaled_mm={self.use_scaled_mm}")

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        scale = self.weight_scale if self.weight_scale.dim() == 0 else self.weight_scale[:, None]
        return dequantize(self.weight, scale).to(dtype)

    def input_scales(self, x: torch.Tensor) -> torch.Tensor | None:
        """The activation scale(s) of input x [T, in]: 0-dim (static), [T, 1] (dynamic) or None."""
        if self.activation == STATIC:
            return self.input_scale
        if self.activation == DYNAMIC:
            return per_token_scale(x)
        return None

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The dequantized path (plain torch; CPU, and any device)."""
        s = self.input_scales(x)
        if s is not None:
            x = fake_quantize(x, s)
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def forward_scaled_mm(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """torch._scaled_mm on x [..., in] (bf16 on CUDA; see the class docs); `act` (see forward): on the MLP
        activation of x, taken in the row quantization's launch."""
        shape = x.shape
        # sa [M, 1]: the row's or the static scale
        xq, sa = triton_fp8.quantize_rows(x.reshape(-1, x.shape[-1]).contiguous(), self.input_scale, act=act)
        return self._scaled_mm_gemm(xq, sa, x.dtype).reshape(*shape[:-1], self.out_features)

    def _scaled_mm_gemm(self, xq: torch.Tensor, sa: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """forward_scaled_mm after the rows' rounding (as _tensorwise_gemm's)."""
        if self.per_tensor_scales:
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=self.input_scale, scale_b=self.weight_scale,
                                   out_dtype=dtype)
        else:  # row-wise: input [M, 1], weight [1, N]; bf16 output
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=sa, scale_b=self._scale_b_row,
                                   out_dtype=torch.bfloat16).to(dtype)
        if self.bias is not None:
            out = out + self.bias
        return out

    def forward_tensorwise(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """A decode-sized step [..., in] (at most TENSORWISE_MAX_ROWS tokens) of a row-wise scaled
        projection: the rows quantized, cuBLASLt's tensor-wise FP8 GEMM with unit scales into an fp32
        accumulator, then the row and column scales (and bias) in one Triton launch
        (triton_fp8.scale_accumulator): the row-wise GEMM's product with one rounding to x.dtype (the
        row-wise path adds a bias after its rounding: up to one bf16 ulp apart there). `act`: as
        forward_scaled_mm's."""
        shape = x.shape
        xq, sa = triton_fp8.quantize_rows(x.reshape(-1, x.shape[-1]).contiguous(), self.input_scale, act=act)
        return self._tensorwise_gemm(xq, sa, x.dtype).reshape(*shape[:-1], self.out_features)

    def _tensorwise_gemm(self, xq: torch.Tensor, sa: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """forward_tensorwise after the rows' rounding: e4m3 rows xq [M, in] with their scales sa [M, 1]."""
        if self._narrow_for_splitk() and triton_fp8.splitk_eligible(xq, self.weight):
            # (the partials summed and scaled by each column tile's last program: one launch)
            return triton_fp8.fp8_splitk_linear(xq, sa, self.weight, self.weight_scale, self.bias, out_dtype=dtype)
        acc = torch._scaled_mm(xq, self.weight.t(), scale_a=self._unit_scale, scale_b=self._unit_scale,
                               out_dtype=torch.float32)
        return triton_fp8.scale_accumulator(acc, sa, self.weight_scale, self.bias, out_dtype=dtype)

    def _narrow_for_splitk(self) -> bool:
        """Whether decode-sized steps take triton_fp8.fp8_splitk_gemm instead of cuBLASLt: the "fp8_splitk" switch,
        and a weight narrow enough that the kernel cuts K in two or more (where cuBLASLt's grid is small)."""
        return switch("fp8_splitk") and triton_fp8.splitk_splits(self.out_features, self.in_features) > 1

    def forward_small_m(self, x: torch.Tensor) -> torch.Tensor:
        """A decode-sized step [..., in] on the one-launch Triton kernel (see the class docs)."""
        shape = x.shape
        out = triton_fp8.fp8_small_m_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale,
                                            _ACT_CODES[self.activation], self.input_scale, self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    def forward_gemv(self, x: torch.Tensor) -> torch.Tensor:
        """At most triton_fp8.GEMV_MAX_ROWS tokens [..., in] on triton_fp8.fp8_gemv, one launch: the rows
        rounded to e4m3 inside it as quantize_rows would (unless weight-only) (HYBRID_FP8_DECODE_GEMM=gemv)."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()
        out = triton_fp8.fp8_gemv(x2, None, self.weight, self.weight_scale, self.bias,
                                  quantize=_ACT_CODES[self.activation], input_scale=self.input_scale, out_dtype=x.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def forward_preload(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """One token [..., in] on triton_fp8.fp8_preload_gemv: one launch, each program's weight slab asked for
        before its PDL wait, the row rounded to e4m3 inside it (unless weight-only) (the default; HYBRID_FP8_PRELOAD=0
        turns it off). `act`: as forward's (in the row rounding's launch where the row is rounded before)."""
        shape = x.shape
        out = triton_fp8.fp8_preload_gemv(x.reshape(1, shape[-1]), self.weight, self.weight_scale, self.bias,
                                          quantize=_ACT_CODES[self.activation], input_scale=self.input_scale,
                                          out_dtype=x.dtype, act=act)
        return out.reshape(*shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """The projection of x [..., in], or with `act` of an MLP activation of x (a down_proj's input): "relu2",
        relu(x) ** 2; "silu_and_mul", silu(gate) * up of x [..., 2 * in] = [gate | up]. The paths that round
        the rows with quantize_rows take the activation in its launch; the others run it first."""
        if x.is_cuda and HAS_TRITON:
            rows = x.reshape(-1, x.shape[-1])
            rounded = triton_fp8.rounding_of(x, self.input_scale) if act is None and x.dim() == 2 else None
            if rounded is not None and self.rounds_rows_first(rows.shape[0], x.dtype, x.device):
                # the rows' rounding came with them from the kernel that wrote them (a norm): no quantize_rows
                gemm = self._tensorwise_gemm if self._tensorwise_rows(rows.shape[0], x.device) else self._scaled_mm_gemm
                return gemm(rounded.q, rounded.scales, x.dtype)
            one_launch = self._one_launch_path(rows[:, :self.in_features])  # (the activation's shape)
            if one_launch == self.forward_preload:
                return self.forward_preload(x, act)
            if one_launch is not None:
                return one_launch(mlp_activation(x, act))
            if self.use_scaled_mm and x.dtype == torch.bfloat16:
                if self._tensorwise_rows(rows.shape[0], x.device):
                    return self.forward_tensorwise(x, act)
                return self.forward_scaled_mm(x, act)
        return self.forward_reference(mlp_activation(x, act))

    def _tensorwise_rows(self, rows: int, device: torch.device) -> bool:
        """Whether a step of this many rows takes forward_tensorwise (else forward_scaled_mm) on the scaled-mm path:
        row-wise scales at decode sizes, or per-tensor ones that the split-K GEMM takes."""
        if not self.per_tensor_scales:
            return rows <= TENSORWISE_MAX_ROWS and not switch("fp8_rowwise_decode") and _tensorwise_fp32_out(device)
        return rows <= triton_fp8.SPLITK_MAX_ROWS and self._narrow_for_splitk()

    def rounds_rows_first(self, rows: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether forward rounds a step of `rows` rows of this dtype to e4m3 with quantize_rows (no MLP activation)
        before its GEMM. Then the kernel that writes those rows may round them in its own launch (a norm:
        hybrid/ops/triton_norm RoundFor) and forward takes that rounding: one launch fewer, the same bytes. Steps a
        one-launch kernel may take (it rounds inside itself) are left alone; so is everything off the
        scaled-mm path."""
        if not (device.type == "cuda" and HAS_TRITON and self.activation is not None and self.use_scaled_mm
                and dtype == torch.bfloat16 and switch("fp8_norm_rounding")):
            return False
        one_launch_max = max(1 if switch("fp8_preload") else 0, gemv_max_rows(),
                             triton_fp8.MAX_ROWS if switch("fp8_triton_decode") else 0)
        return rows > one_launch_max

    def _one_launch_path(self, rows: torch.Tensor):
        """The one-launch Triton path rows [M, in] take (forward_preload, forward_gemv, forward_small_m), or None:
        the row quantization and a cuBLASLt GEMM, or the reference."""
        if rows.shape[0] == 1 and switch("fp8_preload") and triton_fp8.preload_eligible(rows, self.weight):
            return self.forward_preload
        if rows.shape[0] <= gemv_max_rows() and triton_fp8.gemv_eligible(rows, self.weight):
            return self.forward_gemv
        if (self.activation is None or switch("fp8_triton_decode")) and triton_fp8.eligible(rows, self.weight):
            return self.forward_small_m
        return None


def build_fp8_linear(param: Fp8Param, weights: list[torch.Tensor], scales: list[torch.Tensor],
                     input_scales: list[torch.Tensor | None], bias: torch.Tensor | None,
                     row_scale: torch.Tensor | None, input_multiplier: float) -> Fp8Linear:
    """The Fp8Linear of one model projection from its on-disk parts (weights fp8 [rows_i, in];
    scales from check_scale: 0-dim or [rows_i, 1]). `row_scale` [out] (fp32): per-row multipliers the
    loader folds into weights (Falcon-H1's muP), folded into the weight scale here; `input_multiplier`:
    a multiplier the model applies to this projection's input before it (Falcon-H1's ssm_in /
    attention_in, folded into the weight rows), so the checkpoint's input scale, calibrated on the
    multiplied input, is divided by it. The parts of a fused projection take the largest of their
    static input scales (they share one input; as vLLM)."""
    weight = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
    rows = [w.shape[0] for w in weights]
    per_tensor = all(s.dim() == 0 for s in scales)
    if per_tensor and row_scale is None and all(bool((s == scales[0]).all()) for s in scales[1:]):
        weight_scale = scales[0].reshape(())
    else:
        weight_scale = torch.cat([s.reshape(-1).expand(r) if s.dim() == 0 else s.reshape(r)
                                  for s, r in zip(scales, rows)])
        if row_scale is not None:
            weight_scale = weight_scale * row_scale.to(weight_scale.device, torch.float32)
    input_scale = None
    if param.scheme.activation == STATIC:
        input_scale = torch.stack([s.reshape(()) for s in input_scales]).max()
        if input_multiplier != 1.0:
            input_scale = input_scale / input_multiplier
    return Fp8Linear(weight, weight_scale.float(), input_scale, param.scheme.activation, bias)
