"""Triton, imported guarded: hybrid must import, and run its torch path, on machines without it.
The kernel modules (triton_mamba, triton_norm, triton_act, triton_moe, triton_moe_align,
triton_moe_route) take `triton`, `tl` and `HAS_TRITON` from here and define their kernels only when
HAS_TRITON.

Programmatic dependent launch (PDL, sm_90+): a decode step is hundreds of small kernels, each of
which would otherwise start only after the one before it has finished and flushed. Launched with
`pdl_options(device)`, a kernel may be started while its predecessor still runs; it must call
`pdl_wait(PDL)` in every program before it touches memory that earlier kernels of the step write
(and before any early return); `pdl_wait` then lets the next kernel start in turn. What no earlier
kernel of the step writes (weights, a layer's own Mamba state, which only that layer's kernel
writes) may be read before the wait, so that its latency overlaps the previous kernel's tail.
HYBRID_PDL=0 turns it off.

Kernel switches (`switch(name)`), read from the environment once (`reset_switches()` reads them
again: benchmarks comparing both):
- "decode_linear" (HYBRID_DECODE_LINEAR=triton): decode-sized projections on the Triton linear
  (hybrid/ops/triton_gemv.py), the Mamba gated norm fused into out_proj;
- "decode_linear_plain" (HYBRID_DECODE_LINEAR=plain): the same Triton linear for decode-sized projections,
  the gated norm its own launch (no split-K reduce launch after out_proj): measured at batch 1 +3.2% on
  Granite-4.0-H-Tiny's shape and -5.3% on Nemotron-3-Nano's (BENCHMARKS.md), so not for every projection.
  HYBRID_DECODE_LINEAR=plain:<role>,<role> limits it to those projections (`decode_linear_plain(role)`;
  roles as hybrid/layers.Linear names them: mamba.in_proj, mamba.out_proj, attn.qkv_proj, attn.o_proj,
  mlp.up_proj, mlp.gate_up_proj, mlp.down_proj): bench_moe.py --linear-roles-ab times each alone. Each role
  alone (H100, 2026-12-05): mamba.out_proj won on both MoE shapes at batch 1 and 8 (+1.9% / +2.7% at batch 1;
  no split-K reduce launch) and is the default (DECODE_LINEAR_DEFAULT); HYBRID_DECODE_LINEAR=cublas turns it off;
- "decode_in_proj_conv" (on by default; HYBRID_DECODE_IN_PROJ_CONV=0 turns it off): a decode-only step's Mamba
  in_proj and causal conv (with its conv-state update) in one launch (triton_gemv.in_proj_conv: one launch fewer
  a Mamba layer, the projection on the Triton linear instead of cuBLAS), for in_projs of at most
  triton_gemv.IN_PROJ_CONV_MAX_BYTES (past it cuBLAS streams the weight faster). Measured (H200, 2026-12-05):
  with the Triton out_proj +4.5% at batch 1 on Granite-4.0-H-Tiny's shape;
- "decode_gated_out_proj" (HYBRID_DECODE_GATED_OUT_PROJ=1): in a decode-only step, the Mamba gated norm's sums
  of squares taken by the SSM update (triton_mamba.selective_state_update_gated) and the norm applied inside
  out_proj on the Triton linear (triton_gemv.gated_out_proj): the gated norm's launch gone. Measured (H100,
  2026-12-05): -53% / -78% at batch 1 on the two MoE shapes, like gated_norm_linear before it, so off;
- "moe_route_in_gemm" (HYBRID_MOE_ROUTE_IN_GEMM=1): a one-token step's MoE routing done inside the first expert
  GEMM (triton_moe.fused_experts' `router`: each program routes the token from the router's split-K partials),
  the routing launch gone, the second GEMM reading the routing the first wrote. Measured (H100, 2026-12-05) on
  Nemotron-3-Nano's shape: -0.4% at batch 1, and -1.3% with "norm_router" too (an MoE layer in three
  launches: triton_norm.add_rms_norm_router's logits routed in the GEMM), so off;
- "norm_router" (HYBRID_NORM_ROUTER=1): the residual add and norm before an MoE layer computed in its
  router's launch (triton_norm.add_rms_norm_router);
- "bf16_logits" (HYBRID_16BIT_LOGITS=1): the LM head's logits in the model dtype, widened after
  (hybrid/layers.logits_fp32 otherwise writes the fp32 accumulator): the A/B of the fp32 head's cost
  (bench/bench_moe.py --logits-ab).
- "fp8_triton_decode" (HYBRID_FP8_DECODE_GEMM=triton): decode-sized FP8 projections with quantized
  activations on the one-launch Triton FP8 linear instead of the Triton row quantization and
  torch._scaled_mm (hybrid/ops/triton_fp8.py; alone it lost at every 8B shape on the H200): the A/B
  of `bash bench/run_device.sh fp8-decode`;
- HYBRID_FP8_DECODE_GEMM=gemv (read by hybrid/fp8_linear.gemv_max_rows, not a switch here): FP8 projections of
  steps of up to 4 tokens on triton_fp8.fp8_gemv, the rows quantized inside its launch (one-token steps take it
  by default: +5.4% at batch 1 on an H100); any other value keeps every step on the GEMMs.
- "fp8_preload" (on by default; HYBRID_FP8_PRELOAD=0 turns it off): a one-token step's FP8 projections (K up to
  32768, the MLP down_proj included) on triton_fp8.fp8_preload_gemv: each program's whole e4m3 slab asked for
  before its PDL wait, as the 16-bit preloading linears do, the row rounded to e4m3 after it. Measured on an H100
  (BENCHMARKS.md): +6.1% at batch 1 on the 8B shape in FP8 (pcpt);
- "fp8_splitk" (HYBRID_FP8_SPLITK=1): FP8 projections of steps of 2-64 tokens whose weight is narrow (the 8B
  shape's out_proj, down_proj, o_proj, qkv_proj) on triton_fp8.fp8_splitk_gemm (K cut into slices across ~264
  programs; since 2026-12-06 the partial sums added and scaled by each column tile's last program, one launch:
  triton_fp8.fp8_splitk_linear) instead of cuBLASLt's tensor-wise GEMM, which tiled N 4096
  into 29-43 programs at batch 64 (1.0-2.3 TB/s on an H100); measured on an H100 with the partials' own pass (before fp8_splitk_linear): -2.4% at batch 64, +0.6% at
  batch 8, so off;
- "fp8_norm_rounding" (on by default, +1.0% / +0.4% at batch 8 / 64 on the FP8 8B, H100; HYBRID_FP8_NORM_ROUNDING=0
  turns it off): where a norm's output feeds FP8
  projections alone that would round it with quantize_rows (steps of 2+ tokens: prefill, batched decode), the
  norm's launch rounds its stored rows to e4m3 too (triton_fp8.round_row_into) and the projection skips its
  quantize_rows launch: the same bytes, one launch and one read of the rows fewer (the norm keeps its one program
  a row, so nothing loses parallelism, unlike the fused quantization measured and removed on 2026-12-05);
- "fp8_rowwise_decode" (HYBRID_FP8_DECODE_GEMM=rowwise): decode-sized FP8 projections with row-wise
  scales on cuBLASLt's row-wise GEMM (the default before Fp8Linear.forward_tensorwise): its A/B.
- "varlen_prefill" (on by default; HYBRID_VARLEN_PREFILL=0 turns it off): a step's prefill rows through each
  Mamba layer as one varlen conv launch, one zero-state varlen scan and one launch adding each row's initial
  state (hybrid/ops/triton_mamba_varlen.py) instead of a conv launch and a scan call per row. Measured on the
  GPU (BENCHMARKS.md): 18.5x on 64 prompts of 16 tokens, 3.6x at 128; its outputs and final states as close
  to fp32 as the row path's (tests/gpu/test_kernels.py::test_varlen_prefill_as_accurate_as_rows).
- "gemv_narrow" (on by default; HYBRID_GEMV_NARROW=0 turns it off): the Triton linear at 16 output columns a
  program where 32 would leave more than half the SMs idle (triton_gemv.default_block_n; same values).
- "triton_greedy" (on by default; HYBRID_TRITON_GREEDY=0 turns it off): a step's greedy tokens (each logits row's
  argmax and its finite flag) in two small launches (hybrid/ops/triton_greedy.py) rather than torch's argmax,
  one ~22 us kernel for a long row; the same tokens.
- "gemv_preload" (on by default; HYBRID_GEMV_PRELOAD=0 turns it off): every projection of a one-token step on
  the preloading kernels (triton_gemv.preload_applies / preload_everywhere): each program asks for its whole
  weight slab before its PDL wait, so the stream starts while the previous kernel runs, and after the wait reads
  only x (in_proj_conv also reads the conv histories before it). 16-bit projections (attention, MLP, each Mamba
  in_proj of any size with its conv, out_proj) on triton_gemv's. Measured on an H100 (BENCHMARKS.md): at batch 1
  +5.7% on Granite-4.0-H-Tiny's shape, +4.7% on Nemotron-3-Nano's, +7.5% on the 8B's. "gemv_preload_sites"
  (HYBRID_GEMV_PRELOAD=1): only where the Triton linear already ran (in_proj_conv within its size limit, the
  Mamba out_proj): +4.4% on Granite-4.0-H-Tiny's, the A/B;
- "moe_preload" (on by default; HYBRID_MOE_PRELOAD=0 turns it off): a one-token step's two expert GEMMs (16-bit
  experts, the naive layout) on triton_moe._one_token_experts_kernel: each program's whole expert slab at once,
  the second GEMM's before its PDL wait (the routing was written before the first), as the preloading linears
  do. Measured on an H100 (BENCHMARKS.md): at batch 1 +8.0% on Granite-4.0-H-Tiny's shape, +3.5% on
  Nemotron-3-Nano's;
- "moe_shared_early" (on by default; HYBRID_MOE_SHARED_EARLY=0 turns it off): in that first expert GEMM, the
  shared expert's programs go first and ask for their slabs before the PDL wait (their ids are fixed: only the
  routed pairs wait for the routing);
- "lm_head_preload" (on by default; HYBRID_LM_HEAD_PRELOAD=0 turns it off): a one-token step's 16-bit LM head on
  the preloading linear, its fp32 accumulator stored as the logits (hybrid/layers.logits_fp32; cuBLAS
  otherwise): +1.1% / +0.8% at batch 1 on the same two shapes.
The others are off: of those measured in the model on the H200 (bench/bench_moe.py --linear-ab / --norm-router-ab,
BENCHMARKS.md) "decode_linear" loses 37-45% at batch 1 and "norm_router" is neutral.
"""
from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False


_ARRIVAL_COUNTS: dict = {}


def arrival_counts(owner: str, device, n: int = 1):
    """At least `n` int32 zeros on `device` for `owner`'s kernels whose last program to arrive (an acquire /
    release atomic count) finishes the launch's work: kept from launch to launch, since that last program sets
    its count back to 0 (a graph replays the launch; a stream's launches run one after another)."""
    import torch

    key = (owner, device.type, device.index)
    counts = _ARRIVAL_COUNTS.get(key)
    if counts is None or counts.numel() < n:
        counts = torch.zeros(n, dtype=torch.int32, device=device)
        _ARRIVAL_COUNTS[key] = counts
    return counts


def require(module: str) -> None:
    """Raise a clear error when a kernel of `module` is called without triton."""
    if not HAS_TRITON:
        raise RuntimeError(f"{module} needs triton, which is not importable here")


_SWITCHES = {"decode_linear": ("HYBRID_DECODE_LINEAR", "triton"), "decode_linear_plain": ("HYBRID_DECODE_LINEAR", "plain"),
             "decode_in_proj_conv": ("HYBRID_DECODE_IN_PROJ_CONV", "1"),
             "decode_gated_out_proj": ("HYBRID_DECODE_GATED_OUT_PROJ", "1"), "norm_router": ("HYBRID_NORM_ROUTER", "1"),
             "bf16_logits": ("HYBRID_16BIT_LOGITS", "1"), "fp8_triton_decode": ("HYBRID_FP8_DECODE_GEMM", "triton"),
             "fp8_rowwise_decode": ("HYBRID_FP8_DECODE_GEMM", "rowwise"),
             "varlen_prefill": ("HYBRID_VARLEN_PREFILL", "1"), "moe_route_in_gemm": ("HYBRID_MOE_ROUTE_IN_GEMM", "1"),
             "gemv_narrow": ("HYBRID_GEMV_NARROW", "1"), "triton_greedy": ("HYBRID_TRITON_GREEDY", "1"),
             "gemv_preload": ("HYBRID_GEMV_PRELOAD", "all"), "gemv_preload_sites": ("HYBRID_GEMV_PRELOAD", "1"),
             "moe_preload": ("HYBRID_MOE_PRELOAD", "1"), "moe_shared_early": ("HYBRID_MOE_SHARED_EARLY", "1"),
             "lm_head_preload": ("HYBRID_LM_HEAD_PRELOAD", "1"), "scan_plans": ("HYBRID_SCAN_PLANS", "1"),
             "fp8_preload": ("HYBRID_FP8_PRELOAD", "1"), "fp8_splitk": ("HYBRID_FP8_SPLITK", "1"),
             "fp8_norm_rounding": ("HYBRID_FP8_NORM_ROUNDING", "1")}
_ON_BY_DEFAULT = {"varlen_prefill", "decode_in_proj_conv", "gemv_narrow", "triton_greedy", "gemv_preload",
                  "moe_preload", "moe_shared_early", "lm_head_preload", "scan_plans", "fp8_preload",
                  "fp8_norm_rounding"}  # these read as on unless their variable says "0"
# HYBRID_DECODE_LINEAR unset: only each Mamba out_proj on the Triton linear at decode sizes (measured, module
# docstring); "cublas" (or any value but triton / plain...) keeps every projection on cuBLAS
DECODE_LINEAR_DEFAULT = "plain:mamba.out_proj"
_switch_values: dict[str, bool] = {}


def switch(name: str) -> bool:
    """Whether kernel switch `name` is on (see the module docstring)."""
    if name not in _switch_values:
        env, on = _SWITCHES[name]
        if name == "decode_linear_plain":  # "plain" or "plain:<roles>"
            _switch_values[name] = _decode_linear_value().split(":", 1)[0] == on
        elif name in _ON_BY_DEFAULT:
            _switch_values[name] = os.environ.get(env, on) != "0"
        else:
            _switch_values[name] = os.environ.get(env, "") == on
    return _switch_values[name]


_plain_roles: list = []  # [the roles of HYBRID_DECODE_LINEAR=plain:<roles>, or None for every role], once read


def decode_linear_plain(role: str) -> bool:
    """Whether the "decode_linear_plain" switch takes the projection of this role (hybrid/layers.Linear.role)."""
    if not switch("decode_linear_plain"):
        return False
    if not _plain_roles:
        value = _decode_linear_value()
        _plain_roles.append(frozenset(r.strip() for r in value.split(":", 1)[1].split(",") if r.strip())
                            if ":" in value else None)
    roles = _plain_roles[0]
    return roles is None or role in roles


def _decode_linear_value() -> str:
    return os.environ.get(_SWITCHES["decode_linear"][0], DECODE_LINEAR_DEFAULT)


def reset_switches() -> None:
    """Read the switches and HYBRID_PDL from the environment again at their next use."""
    _switch_values.clear()
    _plain_roles.clear()
    _pdl_by_device.clear()


_pdl_by_device: dict = {}


def pdl_options(device) -> dict:
    """Launch keyword arguments for a kernel with a `PDL: tl.constexpr` parameter that begins with
    pdl_wait(PDL): PDL on CUDA devices of compute capability 9.0 or newer, off elsewhere (the CPU
    interpreter, older GPUs, HYBRID_PDL=0)."""
    key = (device.type, device.index)
    if key not in _pdl_by_device:
        import torch

        on = (device.type == "cuda" and os.environ.get("HYBRID_PDL", "1") != "0"
              and os.environ.get("TRITON_INTERPRET", "0") != "1"
              and torch.cuda.get_device_capability(device)[0] >= 9)
        _pdl_by_device[key] = {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
    return _pdl_by_device[key]


if HAS_TRITON:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait for the previous kernel to complete (and its writes to be visible), then let the
        next kernel start: see the module docstring. A no-op when PDL is off. (Letting it start before
        the wait, kernels launching two or more deep, was measured neutral: BENCHMARKS.md.)"""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
