"""The compile cases of tests/test_triton_compile.py, run in a process of their own: Triton must not
be in interpreter mode (the CPU test session switches it on before triton is imported). Prints one
JSON line {case: null or the error}. `python tests/triton_compile_cases.py`."""
from __future__ import annotations

import json
import os
import sys
import traceback

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from attention import triton_prefill  # noqa: E402
from hybrid.ops import (  # noqa: E402
    triton_fp8, triton_gemv, triton_greedy, triton_mamba, triton_mamba_varlen, triton_moe, triton_moe_align,
    triton_moe_route, triton_norm, triton_sampling,
)

SM90 = GPUTarget("cuda", 90, 32)
FLOATS = {"eps", "scale", "min_scale", "r_scale"}


def signature(fn, constexprs: dict, ptr_types: dict[str, str], default_ptr: str = "*bf16") -> dict[str, str]:
    """Argument types of `fn`: pointers (names ending in _ptr) bf16 unless ptr_types says, the names
    in FLOATS fp32, the other runtime arguments int32."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, default_ptr)
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


def aligned(fn, sig: dict[str, str]) -> dict:
    """The specialisation a launch on the device usually gets: pointers (torch allocations) 16-byte aligned
    and integer arguments divisible by 16, but those the kernel declines to specialise. That is the variant
    with vector loads and pipelined copies into shared memory (without it Triton loads element by element and
    pipelines nothing), so the one that needs the most shared memory and registers."""
    return {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
            if sig[p.name] not in ("constexpr", "fp32") and not p.do_not_specialize}


def _compile_sm90(fn, sig: dict[str, str], constexprs: dict, attrs: dict, num_warps: int, num_stages: int):
    """`fn` compiled for sm_90 with programmatic dependent launch."""
    return triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=SM90,
                          options=dict(num_warps=num_warps, num_stages=num_stages, launch_pdl=True))


def compiles(fn, constexprs: dict, ptr_types: dict[str, str] | None = None, num_warps: int = 4,
             num_stages: int = 3) -> None:
    """Compiles `fn` for sm_90 twice: with nothing known of its arguments, and as aligned() specialises them
    (whose pipelined copies must fit the shared memory of an SM)."""
    sig = signature(fn, constexprs, ptr_types or {})
    for attrs in ({}, aligned(fn, sig)):
        kernel = _compile_sm90(fn, sig, constexprs, attrs, num_warps, num_stages)
        assert kernel.metadata.shared <= SM90_SHARED_BYTES, f"{kernel.metadata.shared} bytes of shared memory"


def loads_before_wait(fn, constexprs: dict, ptr_types: dict[str, str] | None = None, num_warps: int = 4) -> int:
    """How many global loads the aligned sm_90 code of `fn` issues before its PDL wait (griddepcontrol.wait)."""
    sig = signature(fn, constexprs, ptr_types or {})
    ptx = _compile_sm90(fn, sig, constexprs, aligned(fn, sig), num_warps, 3).asm["ptx"]
    assert "griddepcontrol.wait" in ptx, "no PDL wait in the kernel"
    return ptx.split("griddepcontrol.wait")[0].count("ld.global")


MOE_PTRS = dict(w_ptr="*fp32", pairs_ptr="*i32", block_expert_ptr="*i32", total_ptr="*i32")
CASES = {}


def case(name):
    def register(fn):
        CASES[name] = fn
        return fn
    return register


for _config in ("decode", "prefill_gated"):
    for _act, _early, _fp8 in ((triton_moe.ACT_NONE, False, False), (triton_moe.ACT_NONE, True, False),
                               (triton_moe.ACT_RELU2, False, False), (triton_moe.ACT_SILU_MUL, False, False),
                               # FP8 experts (e4m3 weights widened in registers, per-row scales)
                               (triton_moe.ACT_NONE, True, True), (triton_moe.ACT_RELU2, False, True),
                               (triton_moe.ACT_SILU_MUL, False, True)):
        def _moe(config=_config, act=_act, early=_early, fp8=_fp8):
            up, down = triton_moe.gemm_configs(triton_moe.CONFIGS[config])
            bm, bn, bk, gm, warps, stages = down if act == triton_moe.ACT_NONE else up  # 2nd GEMM: no activation
            ptrs = dict(MOE_PTRS, ws_ptr="*fp32", **({"b_ptr": "*fp8e4nv"} if fp8 else {}))
            compiles(triton_moe._moe_gemm_kernel,
                     dict(ACT=act, MUL_W=act == triton_moe.ACT_NONE, HAS_SHARED=not fp8, W_SCALE=fp8, IEEE=False,
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, EARLY_B=early, PDL=True,
                          **triton_moe._NOT_ROUTED), ptrs, warps, stages)
        CASES[f"moe_gemm-{_config}-act{_act}-early{int(_early)}{'-fp8' * _fp8}"] = _moe


# a one-token step routed inside the first GEMM: NemotronH's router (sigmoid, bias, normalised, fp32 partials over
# 42 splits, 128 experts, shared slices) and Granite's (softmax of bf16-rounded logits, 64 experts)
for _name, _route in (("nemotron", dict(R_TOP_K=6, R_KP=8, R_EP=128, R_SIGMOID=True, R_HAS_BIAS=True,
                                        R_NORMALIZE=True, R_SPLITS=42, R_ROUND=0)),
                      ("granite", dict(R_TOP_K=6, R_KP=8, R_EP=64, R_SIGMOID=False, R_HAS_BIAS=False,
                                       R_NORMALIZE=False, R_SPLITS=24, R_ROUND=1))):
    def _routed(route=_route):
        up, _ = triton_moe.gemm_configs(triton_moe.CONFIGS["decode"])
        for act in (triton_moe.ACT_RELU2, triton_moe.ACT_SILU_MUL):  # (the first GEMM only)
            bm, bn, bk, gm, warps, stages = up
            compiles(triton_moe._moe_gemm_kernel,
                     dict(ACT=act, MUL_W=False, HAS_SHARED=True, W_SCALE=False, IEEE=False,
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, EARLY_B=False, PDL=True, ROUTED=True,
                          **route),
                     dict(MOE_PTRS, ws_ptr="*fp32", r_ptr="*fp32", rb_ptr="*fp32", r_idx_ptr="*i32", r_w_ptr="*fp32"),
                     warps, stages)
    CASES[f"moe_gemm-routed-{_name}"] = _routed


for _i, ((_e, _h, _inter, _gated), _pair) in enumerate(sorted(triton_moe.TUNED_DECODE.items())):
    def _tuned(pair=_pair, gated=_gated):
        up, down = triton_moe.gemm_configs(pair)
        for cfg, act, early in ((up, triton_moe.ACT_SILU_MUL if gated else triton_moe.ACT_RELU2, False),
                                (down, triton_moe.ACT_NONE, True)):
            bm, bn, bk, gm, warps, stages = cfg
            compiles(triton_moe._moe_gemm_kernel,
                     dict(ACT=act, MUL_W=act == triton_moe.ACT_NONE, HAS_SHARED=True, W_SCALE=False, IEEE=False,
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, EARLY_B=early, PDL=True,
                          **triton_moe._NOT_ROUTED),
                     dict(MOE_PTRS, ws_ptr="*fp32"), warps, stages)
    CASES[f"moe_gemm-tuned{_i}"] = _tuned


FP8_PTRS = dict(w_ptr="*fp8e4nv", q_ptr="*fp8e4nv", w_scale_ptr="*fp32", in_scale_ptr="*fp32", scale_ptr="*fp32",
                x_scale_ptr="*fp32")


@case("fp8_quantize_rows")
def _fp8_quantize_rows():
    for static in (False, True):  # the loop, and one register tile of a 32768-wide row (32 warps); the GPU's
        # quotient and cast (FMA_QUOTIENT, HW_CAST) and the interpreter's arithmetic
        # (and an MLP activation in the launch, relu2 and SwiGLU: a down_proj's input, the 8B's 21504-wide rows in
        # one tile)
        for fast, act in ((True, 0), (False, 0), (True, 1), (True, 2)):
            gpu = dict(FMA_QUOTIENT=fast, HW_CAST=fast, ACT=act)
            compiles(triton_fp8._quantize_rows_kernel, dict(STATIC=static, BLOCK_K=1024, ONE_TILE=False, PDL=True, **gpu),
                     FP8_PTRS)
            compiles(triton_fp8._quantize_rows_kernel, dict(STATIC=static, BLOCK_K=32768, ONE_TILE=True, PDL=True, **gpu),
                     FP8_PTRS, num_warps=32)


@case("fp8_scale_accumulator")
def _fp8_scale_accumulator():
    for per_row, bias in ((True, True), (False, False)):
        compiles(triton_fp8._scale_accumulator_kernel, dict(W_PER_ROW=per_row, HAS_BIAS=bias, BLOCK_N=1024, PDL=True),
                 dict(FP8_PTRS, acc_ptr="*fp32"))


@case("fp8_splitk")
def _fp8_splitk():
    for block_m in (16, 32, 64):  # (2-16, 17-32 and 33-64 rows: tl.dot tiles on e4m3 operands, wgmma on sm_90)
        for reduce in (False, True):  # (True: fp8_splitk_linear, the last program of a tile sums and scales)
            compiles(triton_fp8._fp8_splitk_kernel,
                     dict(BLOCK_M=block_m, BLOCK_N=triton_fp8.SPLITK_BLOCK_N, BLOCK_K=triton_fp8.SPLITK_BLOCK_K,
                          REDUCE=reduce, W_PER_ROW=reduce, HAS_BIAS=reduce, PDL=True),
                     dict(x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", p_ptr="*fp32", count_ptr="*i32", x_scale_ptr="*fp32",
                          w_scale_ptr="*fp32"), num_stages=4)


for _act in (triton_fp8.ACT_NONE, triton_fp8.ACT_STATIC, triton_fp8.ACT_DYNAMIC):
    def _fp8_small_m(act=_act):
        compiles(triton_fp8._fp8_small_m_kernel,
                 dict(ACT=act, W_PER_ROW=True, HAS_BIAS=False, BLOCK_M=triton_fp8.MAX_ROWS, BLOCK_N=32, BLOCK_K=256,
                      PDL=True), FP8_PTRS, num_stages=4)
    CASES[f"fp8_small_m-act{_act}"] = _fp8_small_m

for _mp in (1, 2, 4):
    def _fp8_gemv(m_p=_mp):
        # e4m3 rows with their scales, 16-bit rows (weight-only), 16-bit rows quantized inside (static, dynamic)
        for x_scale, quant in ((True, 0), (False, 0), (False, 1), (False, 2)):
            compiles(triton_fp8._fp8_gemv_kernel,
                     dict(HAS_X_SCALE=x_scale, QUANT=quant, FMA_QUOTIENT=True, HW_CAST=True, W_PER_ROW=True,
                          HAS_BIAS=True, M_P=m_p, BLOCK_N=16, BLOCK_K=256, PDL=True),
                     dict(FP8_PTRS, x_ptr="*fp8e4nv" if x_scale else "*bf16"), num_stages=4)
    CASES[f"fp8_gemv-m{_mp}"] = _fp8_gemv


# the one-token FP8 preloading kernel at the 8B shape's K pieces: 4096 (8 columns a program), 8192 (4), 21504 =
# 16384 + 4096 + 1024 (1), each activation scheme
for _bn, _k1, _k2, _k3 in ((8, 4096, 0, 0), (4, 8192, 0, 0), (1, 16384, 4096, 1024)):
    def _fp8_preload(bn=_bn, k1=_k1, k2=_k2, k3=_k3):
        for quant in (0, 1, 2, 3):  # (3: the row quantize_rows' e4m3 output)
            compiles(triton_fp8._fp8_preload_kernel,
                     dict(QUANT=quant, FMA_QUOTIENT=True, HW_CAST=True, W_PER_ROW=True, HAS_BIAS=False, BLOCK_N=bn,
                          K1=k1, K2=k2, K3=k3, PDL=True), dict(FP8_PTRS, x_ptr="*fp8e4nv" if quant == 3 else "*bf16"))
    CASES[f"fp8_preload-k{_k1 + _k2 + _k3}"] = _fp8_preload


@case("one_token_experts")
def _one_token_experts():
    """The one-token expert GEMMs at the released shapes' slabs: Granite-4.0-H-Tiny's first (SwiGLU, K 1536) and
    second (K 512), Nemotron-3-Nano's first (relu2, K 2688) and second (K 1856 = 1024 + 512 + 512)."""
    for act, mul_w, early, bn, k1, k2, k3 in ((triton_moe.ACT_SILU_MUL, False, False, 4, 1024, 512, 0),
                                            (triton_moe.ACT_NONE, True, True, 32, 512, 0, 0),
                                            (triton_moe.ACT_RELU2, False, False, 4, 2048, 512, 128),
                                            (triton_moe.ACT_NONE, True, True, 8, 1024, 512, 512)):
        compiles(triton_moe._one_token_experts_kernel,
                 dict(ACT=act, MUL_W=mul_w, HAS_SHARED=True, EARLY=early, SHARED_EARLY=not early, BLOCK_N=bn,
                      K1=k1, K2=k2, K3=k3, PDL=True),
                 dict(w_ptr="*fp32", block_expert_ptr="*i32"))


@case("router")
def _router():
    compiles(triton_moe_route._router_partial_kernel, dict(BLOCK_E=16, BLOCK_K=64, PDL=True),
             dict(w_ptr="*fp32", out_ptr="*fp32"))
    compiles(triton_moe_route._route_kernel,
             dict(TOP_K=6, KP=8, EP=128, SIGMOID=True, HAS_BIAS=True, NORMALIZE=True, NUM_SHARED=2, SP=2,
                  NUM_SPLITS=42, ROUND=0, PDL=True),
             dict(logits_ptr="*fp32", bias_ptr="*fp32", idx_ptr="*i32", w_ptr="*fp32"), num_warps=1)
    compiles(triton_moe_align._align_kernel, dict(BLOCK_M=16, EP=64, CHUNK=128, PDL=True),
             dict(ids_ptr="*i32", pairs_ptr="*i32", block_expert_ptr="*i32", total_ptr="*i32"), num_warps=8)


@case("counting_alignment")
def _counting():
    ints = dict(ids_ptr="*i64", counts_ptr="*i32", base_ptr="*i32", pairs_ptr="*i32", block_expert_ptr="*i32",
                total_ptr="*i32")
    compiles(triton_moe_align._align_count_kernel, dict(EP=128, CHUNK=64, PDL=True), ints)
    compiles(triton_moe_align._align_offsets_kernel, dict(BLOCK_M=128, EP=128, PP=64, CHUNK=64, PDL=True), ints,
             num_warps=8)
    compiles(triton_moe_align._align_place_kernel, dict(EP=128, CHUNK=64, PDL=True), ints)


for _router_type in ("*fp32", "*bf16"):  # NemotronH's fp32 router, Granite's bf16
    def _norm_router(router=_router_type):
        compiles(triton_norm._add_rms_norm_router_kernel,
                 dict(BLOCK=4096, BLOCK_E=16, BLOCK_K=64, W_FP32=router == "*fp32", SCALED=router != "*fp32",
                      PDL=True), dict(rw_ptr=router, partial_ptr="*fp32"), num_warps=8)
    CASES[f"norm_router-{_router_type[1:]}"] = _norm_router


@case("norms")
def _norms():
    # QUANT 0: no rounding (compiled out); 1 / 2: the output rows also rounded to e4m3 (dynamic / static scale)
    for quant in (0, 1, 2):
        rq = dict(QUANT=quant, FMA_QUOTIENT=quant != 0, HW_CAST=quant != 0)
        types = dict(q_ptr="*fp8e4nv", scale_ptr="*fp32", in_scale_ptr="*fp32") if quant else {}
        compiles(triton_norm._rms_norm_kernel, dict(BLOCK=4096, W_FP32=True, PDL=True, **rq), types, num_warps=8)
        compiles(triton_norm._add_rms_norm_kernel, dict(BLOCK=2048, W_FP32=False, SCALED=True, PDL=True, **rq), types)
        compiles(triton_norm._sum_add_rms_norm_kernel,
                 dict(TOP_K=8, HAS_ADD=False, BLOCK=4096, W_FP32=True, SCALED=False, PDL=True, **rq), types,
                 num_warps=8)
    compiles(triton_norm._gated_rms_norm_kernel, dict(BLOCK=4096, PDL=True), num_warps=8)


@case("constants_before_wait")
def _constants_before_wait():
    """The decode chain's small kernels ask for what no kernel writes (norm weights, an FP8 static input scale, the
    SSM update's D and dt_bias, the routing bias) before their PDL wait, where its latency overlaps the kernel
    before: after the wait the norm weight was a dependent read from HBM past the row's reduction."""
    fp8 = dict(q_ptr="*fp8e4nv", scale_ptr="*fp32", in_scale_ptr="*fp32")
    for fn, consts, warps in ((triton_norm._rms_norm_kernel, dict(BLOCK=4096, W_FP32=True), 8),
                              (triton_norm._add_rms_norm_kernel, dict(BLOCK=2048, W_FP32=False, SCALED=True), 4),
                              (triton_norm._sum_add_rms_norm_kernel,
                               dict(TOP_K=8, HAS_ADD=False, BLOCK=4096, W_FP32=True, SCALED=False), 8)):
        plain = loads_before_wait(fn, dict(consts, QUANT=0, FMA_QUOTIENT=False, HW_CAST=False, PDL=True),
                                  num_warps=warps)
        static = loads_before_wait(fn, dict(consts, QUANT=2, FMA_QUOTIENT=True, HW_CAST=True, PDL=True), fp8,
                                   num_warps=warps)
        assert plain >= 1 and static > plain, (fn.fn.__name__, plain, static)  # the weight; then the scale too
    assert loads_before_wait(triton_norm._gated_rms_norm_kernel, dict(BLOCK=4096, PDL=True), num_warps=8) >= 1
    ssm_ptrs = dict(state_ptr="*fp32", A_ptr="*fp32", D_ptr="*fp32", dt_bias_ptr="*fp32", idx_ptr="*i64")
    ssm = [loads_before_wait(triton_mamba._ssm_update_kernel,
                             dict(BLOCK_P=16, BLOCK_N=128, HAS_D=params, HAS_DT_BIAS=params, HAS_INTER=False,
                                  HAS_INTER_IDX=False, HAS_GATE_SQ=False, PDL=True), ssm_ptrs)
           for params in (False, True)]
    assert ssm[1] >= ssm[0] + 2, ssm
    route = [loads_before_wait(triton_moe_route._route_kernel,
                               dict(TOP_K=6, KP=8, EP=128, SIGMOID=True, HAS_BIAS=bias, NORMALIZE=True, NUM_SHARED=2,
                                    SP=2, NUM_SPLITS=1, ROUND=0, PDL=True),
                               dict(logits_ptr="*fp32", bias_ptr="*fp32", idx_ptr="*i32", w_ptr="*fp32"), num_warps=1)
             for bias in (False, True)]
    assert route[1] > route[0], route
    # the tiled in_proj + conv (decode steps of 2-16 tokens): the slots' conv histories, conv weights and biases
    conv = [loads_before_wait(triton_gemv._in_proj_conv_kernel,
                              dict(HAS_BIAS=False, HAS_CONV_BIAS=conv_bias, KW=4, BLOCK_M=16, BLOCK_N=32,
                                   BLOCK_K=256, PRE_K=512, PDL=True), dict(idx_ptr="*i32", cs_ptr="*fp32"))
            for conv_bias in (False, True)]
    assert conv[1] > conv[0] > 16, conv  # (16: the slab's first tile alone)


for _pre_k in (256, 512, 2048):
    def _linears(pre_k=_pre_k):
        compiles(triton_gemv._small_m_linear_kernel,
                 dict(HAS_BIAS=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, PRE_K=pre_k, PDL=True), num_stages=4)
        compiles(triton_gemv._gated_norm_linear_kernel,
                 dict(HAS_BIAS=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, PRE_K=min(pre_k, 512), GP=8, PDL=True))
        compiles(triton_gemv._in_proj_conv_kernel,
                 dict(HAS_BIAS=True, HAS_CONV_BIAS=True, KW=4, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, PRE_K=pre_k,
                      PDL=True), dict(idx_ptr="*i32", cs_ptr="*fp32"), num_stages=4)
    CASES[f"decode_linears-pre{_pre_k}"] = _linears


# the preloading kernels at the released shapes' K pieces: Granite-4.0-H-Tiny's in_proj (1024 + 512) and out_proj
# (2048 + 1024), Nemotron-3-Nano's in_proj (2048 + 512 + 128), the 8B's out_proj (8192)
for _bn, _k1, _k2, _k3 in ((8, 1024, 512, 0), (4, 2048, 1024, 0), (4, 2048, 512, 128), (2, 8192, 0, 0)):
    def _preload(bn=_bn, k1=_k1, k2=_k2, k3=_k3):
        for rows in (1, 2, 4):  # one row (the default), and a step's rows read together
            compiles(triton_gemv._preload_linear_kernel,
                     dict(HAS_BIAS=False, ROWS=rows, BLOCK_N=bn, K1=k1, K2=k2, K3=k3, PDL=True))
            compiles(triton_gemv._preload_in_proj_conv_kernel,
                     dict(HAS_BIAS=True, HAS_CONV_BIAS=True, KW=4, KWP=4, ROWS=rows, BLOCK_N=bn, K1=k1, K2=k2,
                          K3=k3, PDL=True), dict(idx_ptr="*i32", cs_ptr="*fp32"))
    CASES[f"preload_linears-k{_k1 + _k2 + _k3}"] = _preload


for _inter in (False, True):
    def _mamba(inter=_inter):
        compiles(triton_mamba._ssm_update_kernel,
                 dict(BLOCK_P=16, BLOCK_N=128, HAS_D=True, HAS_DT_BIAS=True, HAS_INTER=inter, HAS_INTER_IDX=False,
                      PDL=True), dict(state_ptr="*fp32", A_ptr="*fp32", idx_ptr="*i64", inter_ptr="*fp32",
                                      inter_idx_ptr="*i64"))
        compiles(triton_mamba._conv_update_kernel,
                 dict(K=4, KP=4, BLOCK_C=256, HAS_BIAS=True, SILU=True, HAS_INTER=inter, HAS_INTER_IDX=False,
                      PDL=True), dict(idx_ptr="*i64", inter_idx_ptr="*i64"))
        compiles(triton_mamba._conv_prefill_kernel,
                 dict(K=4, BLOCK_L=64, BLOCK_C=128, HAS_HIST=True, HAS_BIAS=True, PDL=True))
    CASES[f"mamba_decode-inter{int(_inter)}"] = _mamba


VARLEN_PTRS = dict(cu_ptr="*i32", seq_ptr="*i32", slot_ptr="*i32", init_ptr="*i32", snap_cu_ptr="*i32",
                   snap_pos_ptr="*i32", snap_slot_ptr="*i32")


@case("mamba_varlen_prefill")
def _mamba_varlen():
    """The varlen prefill kernels at the launches' tiles (the Nemotron-H shape's state: 128 wide, fp32 and bf16):
    the conv, the histories (with the snapshots' loop) and the rows' states (segments ending at snapshots)."""
    tv = triton_mamba_varlen
    compiles(tv._conv_varlen_kernel, dict(K=4, BLOCK_L=64, BLOCK_C=128, HAS_BIAS=True, PDL=True), VARLEN_PTRS)
    compiles(tv._conv_history_kernel, dict(W=3, WP=4, BLOCK_C=128, PDL=True), VARLEN_PTRS)
    for state in ("*fp32", "*bf16"):
        compiles(tv._row_states_kernel, dict(BLOCK_T=32, BLOCK_P=32, BLOCK_N=128, IEEE=False, PDL=True),
                 dict(VARLEN_PTRS, dt_ptr="*fp32", a_ptr="*fp32", state_ptr=state))


@case("greedy")
def _greedy():
    """The greedy tokens' two launches at their tiles: fp32 and bf16 logits, 128 chunks at most."""
    for logits in ("*fp32", "*bf16"):
        compiles(triton_greedy._chunk_best_kernel, dict(BLOCK=1024, PDL=True),
                 dict(x_ptr=logits, val_ptr="*fp32", idx_ptr="*i32"))
    compiles(triton_greedy._combine_kernel, dict(C_P=triton_greedy.MAX_CHUNKS, PDL=True),
             dict(val_ptr="*fp32", idx_ptr="*i32", token_ptr="*i64", finite_ptr="*i8"), num_warps=1)


SAMPLER_PTRS = dict(v_ptr="*fp32", p_ptr="*fp32", covered_ptr="*i32", top_k_ptr="*i64", kth_ptr="*fp32",
                    top_p_ptr="*fp64", cut_ptr="*fp32", floor_ptr="*fp32", u_ptr="*fp64", out_ptr="*i64")


@case("sampler_fallback")
def _sampler_fallback():
    """The sampler's fallback kernel as hybrid/sampling.py launches it, with and without top-k."""
    from hybrid.sampling import FALLBACK_PIVOTS, FALLBACK_TILE

    for top_k in (False, True):
        for int_masses in (False, True):  # (float64 masses on GPUs with fast float64, int64 elsewhere)
            compiles(triton_sampling.fallback_kernel,
                     dict(TOP_K=top_k, TOP_P=True, MIN_P=True, ROWS=FALLBACK_TILE[0], EPT=FALLBACK_TILE[1],
                          PIVOTS=FALLBACK_PIVOTS, INT_MASSES=int_masses),
                     SAMPLER_PTRS, num_warps=8)


SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one block may have on sm_90


for _hd in (160, 224):  # Zamba2-2.7B's and -7B's attention heads: no FlashInfer prefill kernel at these
    for _kv in ("bf16", "fp8"):
        def _prefill(head_dim=_hd, kv=_kv):
            """attention/triton_prefill.py's kernel at the launch's own tiles (32 / 32 heads: one query head
            a KV head; and a GQA-4 tile), bf16 queries over a bf16 or an FP8 e4m3 cache, unsplit and
            split over the KV (with the kernel that combines the parts)."""
            fn = triton_prefill._paged_prefill_kernel
            block_m, block_n, warps, stages = triton_prefill.tiles(head_dim, 32, 32, torch.bfloat16)
            for gp, split in ((1, False), (4, False), (1, True), (4, True)):
                constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=256, GP=gp, BLOCK_M=block_m, BLOCK_N=block_n,
                                  PAGE_SIZE=16, IEEE=False, SPLIT=split)
                sig = signature(fn, constexprs, dict(kv_ptr="*fp8e4nv" if kv == "fp8" else "*bf16", qsl_ptr="*i32",
                                                     seq_lens_ptr="*i32", pt_ptr="*i32", part_ptr="*fp32",
                                                     part_ml_ptr="*fp32"))
                sig.update(k_mul="fp32", v_mul="fp32")
                # pointers and strides 16-divisible, as the launch specializes them at these head dims: the
                # K/V loads vectorize and pipeline (without the hint ptxas spills, and the shared size is
                # not the launch's)
                attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                         if name.endswith("_ptr") or name.startswith("stride")}
                src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
                kernel = triton.compile(src, target=SM90,
                                        options=dict(num_warps=warps, num_stages=stages, launch_pdl=True))
                shared = kernel.metadata.shared
                assert shared <= SM90_SHARED_BYTES, f"{shared} bytes of shared memory (GP {gp}, split {split})"
            combine = triton_prefill._combine_splits_kernel
            constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=256, BLOCK_S=16)
            sig = signature(combine, constexprs, dict(part_ptr="*fp32", part_ml_ptr="*fp32"))
            sig.update(v_mul="fp32")
            triton.compile(ASTSource(combine, sig, constexprs=constexprs), target=SM90,
                           options=dict(num_warps=4, num_stages=1, launch_pdl=True))
        CASES[f"prefill_attention-hd{_hd}-{_kv}"] = _prefill


if __name__ == "__main__":
    if sys.argv[1:] == ["--names"]:
        print(json.dumps(sorted(CASES)))
        sys.exit(0)
    results = {}
    for name, run in CASES.items():
        try:
            run()
            results[name] = None
        except FileNotFoundError as e:  # a triton wheel without ptxas: nothing to check here
            results[name] = f"SKIP {e}"
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = traceback.format_exc()[-3000:]
    print(json.dumps(results))
