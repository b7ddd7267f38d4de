"""Every decode-path Triton kernel, and attention/triton_prefill.py's paged prefill attention, compiles
for sm_90 (the H200) with programmatic dependent launch, on a machine without a GPU: Triton's wheel
carries ptxas, so the compiled path (which the CPU tests otherwise never reach: they run the
interpreter) is checked for what only the compiler refuses, e.g. a loop-carried variable whose shape
changes across the loop, which the interpreter runs fine.
The cases (tests/triton_compile_cases.py, the constexprs the launch sites pass at the real model
shapes) run in one process of their own, outside the interpreter this session uses."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "triton_compile_cases.py")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(*args: str) -> dict | list:
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=_env(), timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"{SCRIPT} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results() -> dict:
    return _run()


NAMES = ["moe_gemm-decode-act0-early0", "moe_gemm-decode-act0-early1", "moe_gemm-decode-act1-early0",
         "moe_gemm-decode-act2-early0", "moe_gemm-prefill_gated-act0-early0", "moe_gemm-prefill_gated-act0-early1",
         "moe_gemm-prefill_gated-act1-early0", "moe_gemm-prefill_gated-act2-early0",
         "moe_gemm-decode-act0-early1-fp8", "moe_gemm-decode-act1-early0-fp8", "moe_gemm-decode-act2-early0-fp8",
         "moe_gemm-prefill_gated-act0-early1-fp8", "moe_gemm-prefill_gated-act1-early0-fp8",
         "moe_gemm-prefill_gated-act2-early0-fp8", "moe_gemm-routed-nemotron", "moe_gemm-routed-granite",
         "moe_gemm-tuned0", "router", "counting_alignment", "greedy",
         "norm_router-fp32",
         "norm_router-bf16", "norms", "decode_linears-pre256", "decode_linears-pre512", "decode_linears-pre2048",
         "preload_linears-k1536", "preload_linears-k3072", "preload_linears-k2688", "preload_linears-k8192",
         "mamba_decode-inter0", "mamba_decode-inter1", "mamba_varlen_prefill", "prefill_attention-hd160-bf16", "prefill_attention-hd160-fp8",
         "prefill_attention-hd224-bf16", "prefill_attention-hd224-fp8", "fp8_quantize_rows", "fp8_scale_accumulator", "fp8_splitk", "fp8_small_m-act0",
         "fp8_small_m-act1", "fp8_small_m-act2", "fp8_gemv-m1", "fp8_gemv-m2", "fp8_gemv-m4", "fp8_preload-k4096",
         "fp8_preload-k8192", "fp8_preload-k21504", "one_token_experts",
         "sampler_fallback", "constants_before_wait"]


def test_the_cases_are_these():
    assert _run("--names") == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_compiles_for_sm90(results, name):
    error = results[name]
    if error is not None and error.startswith("SKIP"):
        pytest.skip(error)
    assert error is None, error
