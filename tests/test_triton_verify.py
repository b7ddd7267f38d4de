"""The CUDA path's speculative verify on our Triton kernels (hybrid.ops.mamba_cuda.triton_verify),
checked on CPU through Triton's interpreter against the torch reference (Mamba2Mixer._verify):
same outputs, same per-token states in the verify scratch, slots untouched."""
from __future__ import annotations

import pytest
import torch

from hybrid.batch import StepBatch

tm = pytest.importorskip("hybrid.ops.triton_mamba")
if not tm.is_available():
    pytest.skip("triton is not installed", allow_module_level=True)


def _verify_batch(slots, q_lens, scratch, scratch_tensors):
    n_tok = sum(q_lens)
    z = torch.zeros(n_tok, dtype=torch.long)
    return StepBatch(
        input_ids=z, positions=z, query_start_loc=torch.zeros(len(q_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(q_lens, dtype=torch.int32), page_table=torch.zeros(len(q_lens), 1, dtype=torch.int32),
        kv_write_loc=z, state_slot=torch.tensor(slots), has_initial_state=torch.ones(len(q_lens), dtype=torch.bool),
        logits_indices=torch.arange(n_tok), num_decodes=0, num_prefills=0, query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(q_lens), state_slot_cpu=list(slots), has_initial_state_cpu=[True] * len(q_lens),
        num_verify=len(q_lens),
        scratch_index=torch.tensor(scratch), scratch_index_cpu=list(scratch), state_scratch=scratch_tensors,
    )


def test_triton_verify_matches_torch_reference(tiny_ckpt, make_llm):
    from hybrid.ops.mamba_cuda import triton_verify

    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=4)
    mixer = llm.model.mamba_mixers()[0]
    cfg = mixer.cfg
    pool = llm.state_pool
    pool.enable_spec_scratch(3, 4)
    g = torch.Generator().manual_seed(0)
    pool.conv_state.copy_(torch.randn(pool.conv_state.shape, generator=g))
    pool.ssm_state.copy_(torch.randn(pool.ssm_state.shape, generator=g) * 0.3)
    slots, q_lens, scratch = [3, 0, 2], [3, 2, 4], [1, 0, 2]  # two token counts: two launches
    n_tok = sum(q_lens)
    xBC = torch.randn(n_tok, cfg.conv_dim, generator=g)
    dt = torch.randn(n_tok, cfg.num_heads, generator=g) * 0.5
    A = -torch.exp(mixer.A_log.float())
    conv, ssm = pool.layer(mixer.layer_index)
    before = (conv.clone(), ssm.clone())

    def run(fn):
        conv.copy_(before[0])
        ssm.copy_(before[1])
        pool.spec_conv.zero_()
        pool.spec_ssm.zero_()
        y = torch.zeros(n_tok, cfg.num_heads, cfg.head_dim)
        fn(y, _verify_batch(slots, q_lens, scratch, pool.spec_scratch))
        assert torch.equal(conv, before[0]) and torch.equal(ssm, before[1]), "a slot was written"
        return y, pool.spec_conv[mixer.layer_index].clone(), pool.spec_ssm[mixer.layer_index].clone()

    ref = run(lambda y, b: mixer._verify(xBC, dt, A, y, b, conv, ssm))
    params = {"A": A, "D": mixer.D.float(), "dt_bias": mixer.dt_bias.float()}
    got = run(lambda y, b: triton_verify(tm, mixer, xBC, dt, params, y, b, conv, ssm))
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    for r, q in zip(scratch, q_lens):  # every written position; positions past q_len stay zero
        torch.testing.assert_close(got[1][r, :q], ref[1][r, :q], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[2][r, :q], ref[2][r, :q], atol=1e-5, rtol=1e-5)
        assert not got[2][r, q:].any()
    assert got[2].abs().sum() > 0
