"""Which integer arguments of our Triton kernels are left unspecialised, and why.

Triton compiles a kernel per value class of each integer argument (== 1, a multiple of 16, other).
An argument that follows the step's batch (token / row / pair / block / sequence counts, a chunk
length, a stride of a per-step buffer) can take any class at run time, so each new class compiles
a new kernel after the startup warm-up (hybrid/warmup.py, hybrid/ops/compile_watch.py): those are in
the kernel's `do_not_specialize`. Model dimensions (hidden size, heads, vocabulary, weight strides)
are fixed per model and stay specialised. KERNELS lists every kernel launched from these modules,
with an empty tuple where nothing is batch-dependent, so that a new kernel needs a decision here."""
from __future__ import annotations

import importlib
import inspect

import pytest

pytest.importorskip("triton")

# (module, kernel) -> the arguments not specialised at all (do_not_specialize)
KERNELS = {
    # pair count n, block count (cdiv(n, BLOCK_M) + min(E, n)), the counting sort's program count.
    # Left specialised: num_rows and per_program, multiples of BLOCK_M / CHUNK whatever the batch.
    ("hybrid.ops.triton_moe_align", "_align_kernel"): ("n", "num_blocks"),
    ("hybrid.ops.triton_moe_align", "_align_count_kernel"): ("n",),
    ("hybrid.ops.triton_moe_align", "_align_offsets_kernel"): ("num_programs", "num_blocks"),
    ("hybrid.ops.triton_moe_align", "_align_place_kernel"): ("n",),
    # pair rows and row blocks of the step; N, K, a_div (top-k or 1), num_experts, strides: the model's
    ("hybrid.ops.triton_moe", "_moe_gemm_kernel"): ("num_pairs", "num_m_blocks"),
    ("hybrid.ops.triton_moe", "_sum_k_kernel"): (),  # H only (tokens are the grid)
    ("hybrid.ops.triton_moe", "_one_token_experts_kernel"): (),  # one token: the pairs are the grid
    # tokens T, and T * E between the split-K partials' rows
    ("hybrid.ops.triton_moe_route", "_router_partial_kernel"): ("T",),
    ("hybrid.ops.triton_moe_route", "_route_kernel"): ("s_split",),
    ("hybrid.ops.triton_norm", "_rms_norm_kernel"): (),  # rows are the grid; H, row strides: the model's
    ("hybrid.ops.triton_norm", "_add_rms_norm_kernel"): (),
    ("hybrid.ops.triton_norm", "_sum_add_rms_norm_kernel"): (),
    ("hybrid.ops.triton_norm", "_add_rms_norm_router_kernel"): ("T",),
    ("hybrid.ops.triton_norm", "_gated_rms_norm_kernel"): (),
    ("hybrid.ops.triton_gemv", "_small_m_linear_kernel"): ("M",),  # the step's rows (<= 16)
    ("hybrid.ops.triton_gemv", "_gated_norm_linear_kernel"): ("M",),
    ("hybrid.ops.triton_gemv", "_in_proj_conv_kernel"): ("M",),  # C0, CD, the conv state's strides: the model's
    # HB (heads x head-dim blocks) and HB_G (a group's part of it): the SSM update's block count follows the batch
    ("hybrid.ops.triton_gemv", "_gated_out_proj_kernel"): ("M", "HB_G", "HB", "s_sq"),
    ("hybrid.ops.triton_gemv", "_preload_linear_kernel"): ("M",),
    ("hybrid.ops.triton_gemv", "_preload_in_proj_conv_kernel"): ("M",),
    ("hybrid.ops.triton_act", "_relu2_kernel"): (),
    ("hybrid.ops.triton_act", "_silu_and_mul_kernel"): (),
    # T (tokens per row): == 1 is decode's own specialisation (~40% of a bf16 decode on the H200), so
    # it stays specialised; only its multiple-of-16 class is dropped (MAMBA_UNALIGNED)
    ("hybrid.ops.triton_mamba", "_ssm_update_kernel"): (),
    ("hybrid.ops.triton_mamba", "_conv_update_kernel"): (),
    ("hybrid.ops.triton_mamba", "_conv_prefill_kernel"): ("L",),  # the prefill chunk's length
    # the step's prefill tokens; the rows (cu_seqlens, slots) are tensors, the rows' count the grid
    ("hybrid.ops.triton_mamba_varlen", "_conv_varlen_kernel"): ("T",),
    ("hybrid.ops.triton_mamba_varlen", "_conv_history_kernel"): (),
    ("hybrid.ops.triton_mamba_varlen", "_row_states_kernel"): ("s_dt_h",),  # (the scan's dt: chunks x chunk)
    # V: the vocabulary (the sampled rows are the grid)
    ("hybrid.ops.triton_sampling", "fallback_kernel"): (),
    # V, the chunk width and count: the vocabulary's (the rows are the grid)
    ("hybrid.ops.triton_greedy", "_chunk_best_kernel"): (),
    ("hybrid.ops.triton_greedy", "_combine_kernel"): (),
    # requests in the step, and the KV split (from the step's grid)
    ("attention.triton_prefill", "_paged_prefill_kernel"): ("num_seqs", "num_splits"),
    ("attention.triton_prefill", "_combine_splits_kernel"): ("num_splits",),
    ("attention.trtllm", "_write_kv_kernel"): (),  # page size, strides of the cache and of K / V rows
    # the FP8 projection: M, the step's rows; the quantization and the scales after the GEMM take
    # their rows from the grid (K, N, strides: the model's)
    ("hybrid.ops.triton_fp8", "_fp8_small_m_kernel"): ("M",),
    ("hybrid.ops.triton_fp8", "_fp8_gemv_kernel"): ("M",),
    ("hybrid.ops.triton_fp8", "_quantize_rows_kernel"): (),
    ("hybrid.ops.triton_fp8", "_scale_accumulator_kernel"): ("s_as",),  # (M x N between split-K partials)
    ("hybrid.ops.triton_fp8", "_fp8_splitk_kernel"): ("M", "s_ps"),
    ("hybrid.ops.triton_fp8", "_fp8_preload_kernel"): (),  # (one row; N, K, strides: the model's)
}

# the arguments specialised on == 1 only, not on divisibility by 16 (do_not_specialize_on_alignment),
# where the installed Triton has the option
MAMBA_UNALIGNED = {
    ("hybrid.ops.triton_mamba", "_ssm_update_kernel"): ("T",),
    ("hybrid.ops.triton_mamba", "_conv_update_kernel"): ("T",),
}

# @triton.jit helpers only called from kernels: their arguments take the calling kernel's specialisation
HELPERS = {
    "hybrid.ops.triton_moe_align": {"_count_experts", "_store_block_experts", "_place_pairs"},
    "hybrid.ops.triton_moe": {"expert_sum", "_block_tile", "_block_operands", "_mma", "_k_steps", "_store_block",
                              "_routed_pair", "_expert_rows"},
    "hybrid.ops.triton_moe_route": {"router_split", "route_token", "route_bias"},
    "hybrid.ops.triton_norm": {"_normalised_cols", "_normalised_row", "_plus_residual", "_added_row", "_norm_weight"},
    "hybrid.ops.triton_gemv": {"_program_slab", "_weight_tile", "_store_rows", "_gated_rows", "_gated_normed",
                               "_rows_times_slab", "_gated_normed_dot", "_slab_piece", "_preload_slab", "_piece_dot", "slab_pieces", "slab_dot", "_rows_piece",
                               "_preloaded_rows"},
    "hybrid.ops.triton_act": {"relu2_values", "silu_mul_values"},
    "hybrid.ops.triton_mamba": {"_softplus", "_ext_tile", "_conv_window_out"},
    "hybrid.ops.triton_mamba_varlen": {"_history_columns"},
    "hybrid.ops.triton_sampling": {"_fixed", "_kept_masses", "_top_k_probs", "_signed_masses"},
    "hybrid.ops.triton_greedy": {"_better", "_tile_best"},
    "attention.triton_prefill": {"_attend_tile"},
    "attention.trtllm": set(),
    "hybrid.ops.triton_fp8": {"_round_e4m3", "round_row_into", "static_scale", "_e4m3_values", "_quantized", "_gemv_step", "_ieee_quotient", "_e4m3_row", "_dynamic_scale",
                             "_gemv_step_quantizing", "_gemv_row_scales", "_preload_x_piece", "_preload_piece_dot",
                             "_activated"},
}


def _has_alignment_option() -> bool:
    import triton

    return "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


def _jit_functions(module) -> dict:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, (JITFunction, InterpretedFunction)) and obj.fn.__module__ == module.__name__}


def _params(kernel) -> dict[str, tuple[bool, bool, bool]]:
    """name -> (constexpr, do_not_specialize, do_not_specialize_on_alignment) of each argument, from a
    JITFunction's KernelParams or, under the interpreter (the CPU session), the decorator's arguments."""
    if hasattr(kernel, "params"):  # JITFunction
        return {p.name: (p.is_constexpr, p.do_not_specialize, getattr(p, "do_not_specialize_on_alignment", False))
                for p in kernel.params}
    names = list(inspect.signature(kernel.fn).parameters.values())

    def listed(option: str) -> set[str]:
        return {names[a].name if isinstance(a, int) else a for a in kernel.kwargs.get(option) or ()}

    dns, dns_oa = listed("do_not_specialize"), listed("do_not_specialize_on_alignment")
    return {p.name: ("constexpr" in str(p.annotation), p.name in dns, p.name in dns_oa) for p in names}


def _kernel(module: str, name: str):
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("module", sorted(HELPERS))
def test_every_kernel_of_the_module_is_listed(module):
    kernels = {name for mod, name in KERNELS if mod == module}
    assert set(_jit_functions(importlib.import_module(module))) == kernels | HELPERS[module]


@pytest.mark.parametrize("key", sorted(KERNELS), ids=lambda k: f"{k[0].rsplit('.', 1)[-1]}.{k[1]}")
def test_batch_dependent_arguments_are_not_specialised(key):
    params = _params(_kernel(*key))
    expected = set(KERNELS[key])
    unknown = expected - {name for name, (const, _, _) in params.items() if not const}
    assert not unknown, f"not runtime arguments of the kernel (Triton ignores such names): {unknown}"
    assert {name for name, (_, dns, _) in params.items() if dns} == expected

    unaligned = set(MAMBA_UNALIGNED.get(key, ())) if _has_alignment_option() else set()
    assert {name for name, (_, _, dns_oa) in params.items() if dns_oa} == unaligned


def test_the_options_mean_one_class_on_this_triton():
    """On the installed Triton, an argument in do_not_specialize has one specialisation whatever its
    value, and one in do_not_specialize_on_alignment keeps == 1 apart from the rest."""
    jit = pytest.importorskip("triton.runtime.jit")
    spec = getattr(jit, "native_specialize_impl", None)
    if spec is None:
        pytest.skip("no native_specialize_impl in this Triton")
    # (backend, value, is_const, specialize, align) -> (type, specialisation)
    assert len({spec(None, v, False, False, True) for v in (1, 16, 37)}) == 1
    assert len({spec(None, v, False, True, False) for v in (1, 16, 37)}) == 2
    assert len({spec(None, v, False, True, True) for v in (1, 16, 37)}) == 3
