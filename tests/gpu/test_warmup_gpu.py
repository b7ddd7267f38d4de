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


def test_no_moe_kernel_compiles_after_startup_at_any_step_size(tiny_ckpt):
    """The fused MoE kernels change tiles, alignment method and the shared expert's place with the
    step's size (triton_moe.launch_plan): after the warm-up (HybridModel.warm_up_moe), an MoE layer
    called at any step size up to the step budget compiles nothing."""
    llm = LLM(tiny_ckpt("granite_moe"), device="cuda", max_num_seqs=16, max_model_len=4096,
              max_num_batched_tokens=2048, warmup=True)
    assert compile_watch.install()
    layers = llm.model.moe_layers()
    assert layers and all(moe.experts.fused for moe, _ in layers)
    before = len(compile_watch.events())
    moe, shared = layers[0]
    hidden = moe.experts.up.shape[2]
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for T in list(range(1, 80)) + list(range(80, 2049, 13)):
            x = torch.randn(T, hidden, dtype=llm.model.embed.dtype, device="cuda", generator=g)
            out = moe(x) if shared is None else moe(x, shared=shared)
            if not isinstance(out, torch.Tensor):
                out.sum()
    torch.cuda.synchronize()
    late = [f"{e.kernel}: {e.signature}" for e in compile_watch.events()[before:] if e.after_startup]
    assert not late, late


@pytest.mark.parametrize("max_model_len", [4096, 300])
@pytest.mark.parametrize("family", ["nemotron_h", "bamba"])
def test_no_mamba_prefill_compiles_after_startup_at_any_step(tiny_ckpt, family, max_model_len):
    """A step's prefill rows run as one varlen launch a layer, and the scan's kernels take the step's total
    tokens and chunk count (and products of them) as integers: after the warm-up (varlen_warmup_lengths,
    prefill_warmup_lengths) a Mamba layer's prefill of two or three rows at any total up to the budget,
    and of one row at any length it may have, compiles nothing; with a max_model_len under the step budget
    too (rows of many requests total more than one request may hold)."""
    from hybrid.ops import triton_mamba_varlen as tv

    llm = LLM(tiny_ckpt(family), device="cuda", max_num_seqs=16, max_model_len=max_model_len,
              max_num_batched_tokens=2048, warmup=True)
    assert compile_watch.install()
    mixer = llm.model.mamba_mixers()[0]
    kernels = mixer.kernels
    conv_state, ssm_state = llm.runner.ctx.mamba_state(mixer.layer_index)
    scratch = conv_state.shape[0] - 1
    cfg = mixer.cfg
    width = cfg.intermediate_size + cfg.conv_dim + cfg.num_heads
    p = kernels.params(mixer)
    before = len(compile_watch.events())
    with torch.inference_mode():
        for total in list(range(2, 300)) + list(range(300, 2049, 7)):
            zxbcdt = torch.zeros(total, width, dtype=llm.model.embed.dtype, device="cuda")
            _, xBC, dt = torch.split(zxbcdt, [cfg.intermediate_size, cfg.conv_dim, cfg.num_heads], dim=-1)
            for lengths in ([total - 1, 1], [1, total - 2, 1] if total > 2 else None):
                if lengths is None:
                    continue
                rows = tv.varlen_rows(lengths, [scratch] * len(lengths), [True] * len(lengths), conv_state.device)
                assert kernels._prefill_varlen(mixer, p, xBC, dt, conv_state, ssm_state, rows) is not None
            for has_init in (False, True) if total <= max_model_len else ():
                kernels._prefill_row(mixer, p, xBC, dt, conv_state, ssm_state, scratch, has_init)
    torch.cuda.synchronize()
    conv_state[scratch].zero_()
    ssm_state[scratch].zero_()
    late = [f"{e.kernel}: {e.signature}" for e in compile_watch.events()[before:] if e.after_startup]
    assert not late, late
