"""Our weight-streaming Triton matmul on the GPU: bf16 at Nemotron-H-8B projection shapes against
F.linear, and an engine whose decode projections run on it (LLM(decode_gemm="triton"), CUDA graphs
on) checked teacher-forced against the default engine."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from hybrid.ops import triton_gemm as tg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_util import GREEDY, assert_greedy_under_reference, rel_err  # noqa: E402

DEV = "cuda"


@pytest.mark.parametrize("N,K", [(18560, 4096), (4096, 8192), (4096, 21504), (6144, 4096), (1000, 136)])
@pytest.mark.parametrize("M", [1, 7, 64])
def test_skinny_matmul_bf16(N, K, M):
    g = torch.Generator(device=DEV).manual_seed(N + M)
    x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
    w = (torch.randn(N, K, device=DEV, generator=g) / K ** 0.5).bfloat16()
    b = torch.randn(N, device=DEV, generator=g).bfloat16()
    got = tg.skinny_matmul(x, w, b)
    assert rel_err(got, F.linear(x.float(), w.float(), b.float())) < 1e-2


def test_engine_with_triton_gemm(tiny_ckpt):
    from hybrid import LLM, SamplingParams

    path = tiny_ckpt("granite_dense")
    prompts = [[5, 6, 7, 8, 9], [11], list(range(20, 50))]
    kw = dict(device="cuda", max_num_seqs=4, max_model_len=128, gpu_memory_utilization=0.3)
    llm = LLM(path, decode_gemm="triton", **kw)
    assert llm.model.layers[0].mlp.down_proj.skinny_max_rows == tg.MAX_M
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, **GREEDY),
                                                         use_tqdm=False)]
    assert llm.runner.stats["graph_replays"] > 0
    assert_greedy_under_reference(LLM(path, **kw), prompts, got)
