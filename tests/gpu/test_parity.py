"""GPU vs CPU-reference parity on the tiny checkpoints (head dims 16, pages 16..128)."""
from __future__ import annotations

import pytest
import torch

from hybrid import LLM
from hybrid.sampling import SamplingParams

FAMILIES = ["nemotron_h", "nemotron_h_sharded", "bamba", "granite_dense", "granite_moe", "falcon_h1", "falcon_h1_norm",
            "zamba2", "zamba2_rope", "nemotron_h_latent"]
# MoE: nemotron_h, nemotron_h_sharded, granite_moe, nemotron_h_latent (LatentMoE); Zamba2: shared blocks
def prompts_of(path):
    # (tests/conftest's prompts_for runs transformers, which on a machine with mamba-ssm and
    # causal-conv1d installed tries their CUDA kernels on CPU tensors: fixed random prompts instead)
    from tiny_checkpoints import vocab_size_of

    g = torch.Generator().manual_seed(0)
    v = vocab_size_of(path)
    return [torch.randint(4, v, (n,), generator=g).tolist() for n in (1, 5, 8, 17, 27, 40)]


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def run(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def common(path, **kw):
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 16)  # several chunks per prompt, mixed steps
    kw.setdefault("max_model_len", 128)
    return LLM(path, **kw)


@pytest.fixture(scope="module")
def cpu_tokens(tiny_ckpt):
    cache = {}

    def get(name):
        if name not in cache:
            prompts = prompts_of(tiny_ckpt(name))
            cache[name] = (prompts, run(common(tiny_ckpt(name), device="cpu", dtype="float32"), prompts))
        return cache[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("page_size", [16, 128])
def test_fp32_gpu_matches_cpu_token_for_token(name, page_size, tiny_ckpt, cpu_tokens):
    prompts, ref = cpu_tokens(name)
    llm = common(tiny_ckpt(name), device="cuda", dtype="float32", page_size=page_size, gpu_memory_utilization=0.5)
    assert all(m.kernels is not None for m in llm.model.mamba_mixers())
    got = run(llm, prompts)
    agree = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r)) / sum(len(r) for r in ref)
    print(f"{name} page {page_size}: fp32 GPU vs CPU token agreement {agree:.3f}")
    assert [g[0] for g in got] == [r[0] for r in ref] and agree >= 0.9


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_gpu_graphs_close_to_cpu(name, tiny_ckpt, cpu_tokens):
    prompts, ref = cpu_tokens(name)
    llm = common(tiny_ckpt(name), device="cuda", page_size=32, gpu_memory_utilization=0.5)
    assert llm.dtype == torch.bfloat16 and llm.runner.use_graphs  # MoE models too (fused experts)
    got = run(llm, prompts)
    assert llm.runner.stats["graph_replays"] > 0
    first = sum(g[0] == r[0] for g, r in zip(got, ref)) / len(ref)
    agree = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r)) / sum(len(r) for r in ref)
    print(f"{name}: bf16+graphs vs cpu fp32: first-token agreement {first:.2f}, token agreement {agree:.2f}")
    assert first >= 0.75


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_graphs_equal_eager_engine(name, tiny_ckpt):
    prompts = prompts_of(tiny_ckpt(name))
    eager = run(common(tiny_ckpt(name), device="cuda", enforce_eager=True, gpu_memory_utilization=0.5), prompts)
    graphs = common(tiny_ckpt(name), device="cuda", gpu_memory_utilization=0.5)
    got = run(graphs, prompts)
    agree = sum(a == b for g, r in zip(got, eager) for a, b in zip(g, r)) / sum(len(r) for r in eager)
    print(f"{name}: graphs vs eager token agreement {agree:.3f}")
    assert agree >= 0.9
