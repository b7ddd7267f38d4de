"""Tensor parallelism on CUDA (NCCL, 2 GPUs): `pytest -m multigpu tests/gpu/test_tensor_parallel_gpu.py`.
Skipped with fewer than 2 GPUs (written without a multi-GPU machine: never run yet).

fp32 (mamba-ssm's kernels use TF32 dot products, the GPU TOL of gpu_util): tp=2 must give the
greedy tokens of tp=1 and logprobs within GPU_LOGPROB_TOL; CUDA graphs must replay with the
all-reduces captured inside them; a killed worker must end the engine within seconds (the
watchdog aborts the NCCL communicator)."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from hybrid import LLM, SamplingParams
from hybrid.errors import EngineDeadError

pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

GPU_LOGPROB_TOL = 5e-3  # fp32 with TF32 dots: a bound to confirm on the first run
PROMPTS = [[5, 9, 13, 22, 7, 31, 40, 11, 12, 50, 6], [8, 19, 33], list(range(4, 30))]
FAMILIES = ["nemotron_h", "granite_moe", "bamba", "falcon_h1_norm", "zamba2", "zamba2_rope"]


def _llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    return LLM(str(path), device="cuda", max_num_seqs=8, max_model_len=256, gpu_memory_utilization=0.3, **kw)


def _close(llm: LLM) -> None:
    if llm.parallel is not None:
        llm.parallel.shutdown()


def _compare(a, b, tol: float) -> None:
    for ra, rb in zip(a, b):
        for oa, ob in zip(ra.outputs, rb.outputs):
            assert oa.token_ids == ob.token_ids
            for la, lb in zip(oa.logprobs or [], ob.logprobs or []):
                for tok in set(la) & set(lb):
                    va, vb = getattr(la[tok], "logprob", la[tok]), getattr(lb[tok], "logprob", lb[tok])
                    assert abs(va - vb) <= tol, (tok, va, vb)


@pytest.mark.parametrize("name", FAMILIES)
def test_tp2_matches_tp1_with_graphs(tiny_ckpt, name):
    path = tiny_ckpt(name)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, ignore_eos=True)
    one = _llm(path)
    out1 = one.generate(PROMPTS, params, use_tqdm=False)
    del one
    torch.cuda.empty_cache()
    two = _llm(path, tensor_parallel_size=2)
    try:
        assert two.runner.use_graphs, "CUDA graphs should be on (the NCCL all-reduces are captured)"
        out2 = two.generate(PROMPTS, params, use_tqdm=False)
        _compare(out1, out2, GPU_LOGPROB_TOL)
        assert two.runner.stats["graph_replays"] > 0
    finally:
        _close(two)


def test_tp2_bf16_runs_and_plans_memory_per_rank(tiny_ckpt):
    """bf16 with graphs, the memory plan profiled on both ranks in step, speculation and prefix caching."""
    two = _llm(tiny_ckpt("nemotron_h"), dtype="bfloat16", tensor_parallel_size=2, enable_prefix_caching=True,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        assert two.memory_plan is not None
        rep = [4, 5, 6, 7, 8] * 4
        out = two.generate([rep, rep + [9]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 16 for o in out)
        assert two.engine.stats["prefix_cache_hits"] > 0 or two.engine.stats["spec_draft_tokens"] > 0
    finally:
        _close(two)


def test_killed_worker_ends_engine_on_cuda(tiny_ckpt):
    two = _llm(tiny_ckpt("bamba"), tensor_parallel_size=2)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        two.generate([[5, 6, 7]], params, use_tqdm=False)
        os.kill(two.parallel.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            two.generate([[5, 6, 7]], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        _close(two)
