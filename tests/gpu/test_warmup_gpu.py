"""The startup warm-up on the GPU (hybrid/warmup.py): after it, requests of any prompt length, alone
and batched, sampled or greedy, meet no Triton kernel specialisation that was not compiled during
startup (hybrid/ops/compile_watch.py records every compile); the Mamba prefill specialisations
(ModelRunner.warm_up_prefill_kernels) are among them."""
from __future__ import annotations

import pytest
import torch

from hybrid import LLM
from hybrid.ops import compile_watch
from hybrid.sampling import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["nemotron_h", "granite_moe"])
def test_no_triton_compile_after_startup(tiny_ckpt, family):
    from tiny_checkpoints import vocab_size_of

    path = tiny_ckpt(family)
    llm = LLM(path, device="cuda", max_num_seqs=16, max_model_len=4096, max_num_batched_tokens=2048, warmup=True)
    assert compile_watch.install()
    chunk = llm.model.mamba_mixers()[0].cfg.chunk_size
    g = torch.Generator().manual_seed(0)
    v = vocab_size_of(path)
    # lengths of every class: 1, multiples of 16 (of the chunk too), others, 16 chunks, over the budget
    lengths = [1, 16, 48, 37, chunk, chunk + 16, 16 * chunk, 16 * chunk - 3, 3000, 128, 100, 2]
    prompts = [torch.randint(4, v, (n,), generator=g).tolist() for n in lengths]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=1, ignore_eos=True)
    before = len(compile_watch.events())
    for p in prompts[:4]:  # alone
        llm.generate([p], greedy, use_tqdm=False)
    llm.generate(prompts, [greedy if i % 2 else sampled for i in range(len(prompts))], use_tqdm=False)
    late = [f"{e.kernel}: {e.signature}" for e in compile_watch.events()[before:] if e.after_startup]
    assert not late, late
