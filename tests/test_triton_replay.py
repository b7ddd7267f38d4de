"""The CUDA path's replay rows on our Triton decode kernels (hybrid.ops.mamba_cuda.triton_replay),
checked on CPU through Triton's interpreter against the torch reference (Mamba2Mixer._replay):
same outputs, the replay rows' slots updated identically (in place), every other slot untouched."""
from __future__ import annotations

import pytest
import torch

from hybrid.batch import StepBatch

tm = pytest.importorskip("hybrid.ops.triton_mamba")
if not tm.is_available():
    pytest.skip("triton is not installed", allow_module_level=True)


def _replay_batch(slots, q_lens, num_decodes):
    """num_decodes one-token decode rows, then replay rows, then one prefill row (the last entry)."""
    n_tok = sum(q_lens)
    n = len(q_lens)
    z = torch.zeros(n_tok, dtype=torch.long)
    return StepBatch(
        input_ids=z, positions=z, query_start_loc=torch.zeros(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(q_lens, dtype=torch.int32), page_table=torch.zeros(n, 1, dtype=torch.int32),
        kv_write_loc=z, state_slot=torch.tensor(slots), has_initial_state=torch.ones(n, dtype=torch.bool),
        logits_indices=torch.arange(n_tok), num_decodes=num_decodes, num_prefills=1, query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(q_lens), state_slot_cpu=list(slots), has_initial_state_cpu=[True] * n,
        num_replay=n - num_decodes - 1,
    )


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_triton_replay_matches_torch_reference(tiny_ckpt, make_llm, ssm_dtype):
    """One T-token launch per token count, with fp32 and bf16 state."""
    from hybrid.ops.mamba_cuda import triton_replay

    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=6)
    mixer = llm.model.mamba_mixers()[0]
    cfg = mixer.cfg
    pool = llm.state_pool
    g = torch.Generator().manual_seed(0)
    conv0, ssm0 = pool.layer(mixer.layer_index)
    conv0 = torch.randn(conv0.shape, generator=g)
    ssm0 = (torch.randn(ssm0.shape, generator=g) * 0.3).to(ssm_dtype)
    # decode row (slot 1), replay rows (slots 3, 0, 2, 5: token counts 3, 2, 3, 1 -> three launches
    # grouped by count), prefill row (slot 4): only slots 3, 0, 2, 5 may change
    slots, q_lens, nd = [1, 3, 0, 2, 5, 4], [1, 3, 2, 3, 1, 4], 1
    replay_slots = slots[nd:-1]
    replay_toks = list(range(1, 1 + sum(q_lens[nd:-1])))
    n_tok = sum(q_lens)
    xBC = torch.randn(n_tok, cfg.conv_dim, generator=g)
    dt = torch.randn(n_tok, cfg.num_heads, generator=g) * 0.5
    A = -torch.exp(mixer.A_log.float())
    batch = _replay_batch(slots, q_lens, nd)
    assert batch.num_replay == 4

    def run(fn):
        conv, ssm = conv0.clone(), ssm0.clone()
        y = torch.zeros(n_tok, cfg.num_heads, cfg.head_dim)
        fn(y, conv, ssm)
        others = [s for s in range(conv.shape[0]) if s not in replay_slots]
        assert torch.equal(conv[others], conv0[others]) and torch.equal(ssm[others], ssm0[others]), \
            "a slot that is not a replay row's was written"
        assert not y[[t for t in range(n_tok) if t not in replay_toks]].any(), "a non-replay row's output"
        return y, conv, ssm

    ref = run(lambda y, conv, ssm: mixer._replay(xBC, dt, A, y, batch, conv, ssm))
    params = {"A": A, "D": mixer.D.float(), "dt_bias": mixer.dt_bias.float()}
    got = run(lambda y, conv, ssm: triton_replay(tm, mixer, xBC, dt, params, y, batch, conv, ssm))
    tol = 1e-5 if ssm_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[0], ref[0], atol=tol, rtol=tol)
    torch.testing.assert_close(got[1][replay_slots], ref[1][replay_slots], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[2][replay_slots].float(), ref[2][replay_slots].float(), atol=tol, rtol=tol)
    # the slots did move: the replay wrote them
    assert not torch.equal(got[2][replay_slots], ssm0[replay_slots])
    assert not torch.equal(got[1][replay_slots], conv0[replay_slots])
