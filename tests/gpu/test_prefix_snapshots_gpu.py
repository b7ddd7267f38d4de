"""Prefix-cache snapshots inside a prefill chunk on the CUDA kernels (StepBatch.state_snapshots,
MambaCudaKernels._prefill_row): the chunked scan split at each snapshot point (mamba-ssm's
mamba_chunk_scan_combined once more per point) and the conv inputs before it, against the same
kernels run as chunks ending at those points (the split path), and against the torch reference; and
in the engine, a second turn after a prefix hit is one prefill step whose tokens pass the
teacher-forced check. (The CPU side of this: tests/test_prefix_snapshots.py.)"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_util import GREEDY, TOL, assert_greedy_under_reference, rel_err  # noqa: E402
from test_kernels import DEV, NEMO, TINY, make_mixer  # noqa: E402

from hybrid import LLM, SamplingParams  # noqa: E402
from hybrid.batch import StepBatch  # noqa: E402


def prefill_batch(rows) -> StepBatch:
    """Prefill rows (slot, length, has_initial_state, snapshots [(t, slot)]), on the GPU."""
    q = [r[1] for r in rows]
    n, t = len(rows), sum(q)
    z = torch.zeros(t, dtype=torch.long, device=DEV)
    qsl = [0]
    for k in q:
        qsl.append(qsl[-1] + k)
    return StepBatch(
        input_ids=z, positions=z, query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(q, dtype=torch.int32, device=DEV), page_table=torch.zeros(n, 1, dtype=torch.int32, device=DEV),
        kv_write_loc=z, state_slot=torch.tensor([r[0] for r in rows], device=DEV),
        has_initial_state=torch.tensor([r[2] for r in rows], device=DEV), logits_indices=torch.arange(t, device=DEV),
        num_decodes=0, num_prefills=n, query_lens_cpu=q, seq_lens_cpu=q, state_slot_cpu=[r[0] for r in rows],
        has_initial_state_cpu=[r[2] for r in rows],
        state_snapshots=tuple((i, tt, s) for i, r in enumerate(rows) for tt, s in r[3]),
    )


@pytest.mark.parametrize("decode_kernels", ["triton", "library"])
@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg,hidden", [(TINY, 64), (NEMO, 512)])
def test_cuda_snapshots_equal_split_chunks_and_torch(cfg, hidden, ssm_dtype, decode_kernels):
    """in_proj and out_proj made the identity (so that only the Mamba ops see the row counts): the
    snapshot slots hold what the same kernels leave in the row's slot when the row runs as chunks
    ending at those points (conv bit for bit; the SSM state from the same scan calls on the same
    values, so within float noise of the kernels' own); outputs and final states likewise; the torch
    reference agrees within the kernel tolerance; a padding row and every other slot are untouched."""
    from hybrid.ops.mamba_cuda import MambaCudaKernels

    dtype = torch.bfloat16
    mixer = make_mixer(cfg, hidden, dtype)
    mixer.in_proj, mixer.out_proj = torch.nn.Identity(), torch.nn.Identity()
    width = cfg.intermediate_size + cfg.conv_dim + cfg.num_heads
    slots = 8  # 0..7, scratch row 8
    g = torch.Generator().manual_seed(1)
    conv0 = torch.randn(slots + 1, cfg.conv_dim, cfg.conv_kernel - 1, generator=g).to(DEV, dtype)
    ssm0 = (torch.randn(slots + 1, cfg.num_heads, cfg.head_dim, cfg.state_size, generator=g) * 0.3).to(DEV, ssm_dtype)
    L = 3 * cfg.chunk_size + 40
    a, b = cfg.chunk_size * 3 // 2, 2 * cfg.chunk_size  # one point inside a scan chunk, one on its boundary
    rows = [(1, L, True, [(2, 5), (a, 6), (b, 7)]), (-1, 3, False, []), (2, 37, False, [(16, 4)]), (3, 5, True, [])]
    hidden_in = (torch.randn(sum(r[1] for r in rows), width, generator=g) * 0.5).to(DEV, dtype)

    mixer.kernels = MambaCudaKernels(decode_kernels)
    conv, ssm = conv0.clone(), ssm0.clone()
    out = mixer(hidden_in, prefill_batch(rows), conv, ssm)

    split_conv, split_ssm = conv0.clone(), ssm0.clone()
    want = torch.zeros_like(out)
    kept, start = {}, 0
    for slot, length, has_init, snaps in rows:
        if slot >= 0:
            lo = 0
            for hi, dst in snaps + [(length, None)]:
                piece = prefill_batch([(slot, hi - lo, has_init or lo > 0, [])])
                want[start + lo:start + hi] = mixer(hidden_in[start + lo:start + hi], piece, split_conv, split_ssm)
                if dst is not None:
                    kept[dst] = (split_conv[slot].clone(), split_ssm[slot].clone())
                lo = hi
        start += length

    mixer.kernels = None  # the torch reference, fused
    ref_conv, ref_ssm = conv0.clone(), ssm0.clone()
    ref = mixer(hidden_in, prefill_batch(rows), ref_conv, ref_ssm)
    torch.cuda.synchronize()

    noise = 1e-5 if ssm_dtype == torch.float32 else 4e-3  # (bf16 state: a rounding flip here and there)
    for dst, (c, s) in kept.items():
        assert torch.equal(conv[dst], c), f"conv snapshot in slot {dst}"
        assert rel_err(ssm[dst].float(), s.float()) < noise, f"SSM snapshot in slot {dst}"
        assert rel_err(ssm[dst].float(), ref_ssm[dst].float()) < TOL[dtype], f"SSM snapshot {dst} vs torch"
    real_rows = list(range(L)) + list(range(L + 3, out.shape[0]))  # L..L+3: the padding row
    assert rel_err(out[real_rows].float(), want[real_rows].float()) < noise
    assert rel_err(out[real_rows].float(), ref[real_rows].float()) < TOL[dtype]
    for slot in (1, 2, 3):
        assert torch.equal(conv[slot], split_conv[slot]) and rel_err(ssm[slot].float(), split_ssm[slot].float()) < noise
    for s in (0, 8):  # no row's, no snapshot's (8: the scratch row)
        assert torch.equal(conv[s], conv0[s]) and torch.equal(ssm[s], ssm0[s]), f"slot {s} written"


@pytest.fixture(scope="module")
def bamba_unclamped(tmp_path_factory):
    import tiny_checkpoints

    return str(tiny_checkpoints.build_bamba(tmp_path_factory.mktemp("bamba_unclamped_snap"), seed=3))


def test_second_turn_after_a_hit_is_one_step_on_cuda(bamba_unclamped):
    """On the CUDA kernels (graphs, async scheduling, sanitizer on): the second turn after a hit runs
    one prefill step where the split path ran two, caches its prefix from inside that step, and its
    tokens are the reference engine's greedy choices (teacher-forced, near-ties allowed)."""
    g = torch.Generator().manual_seed(5)
    first = torch.randint(4, 100, (600,), generator=g).tolist()
    llm = LLM(bamba_unclamped, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=4, max_model_len=2048,
              page_size=16, enable_prefix_caching=True, check_state=True)
    assert llm.engine.resources.fused_snapshots, "the CUDA kernels take snapshots inside a chunk"
    sp = SamplingParams(max_tokens=8, **GREEDY)
    answer = llm.generate([first], sp, use_tqdm=False)[0].outputs[0].token_ids
    second = first + list(answer) + torch.randint(4, 100, (100,), generator=g).tolist()  # 708: cached at 704
    calls = []
    real = llm.runner.execute

    def execute(batch):
        calls.append(batch.num_prefills)
        return real(batch)

    llm.runner.execute = execute
    hits = llm.engine.stats["prefix_cache_hit_tokens"]
    got = llm.generate([second], sp, use_tqdm=False)[0].outputs[0].token_ids
    llm.runner.execute = real
    assert llm.engine.stats["prefix_cache_hit_tokens"] - hits == 592  # the first turn's caching point
    assert sum(calls) == 1, calls  # its 116 tokens, across the new caching point 704: one prefill step
    assert 704 in {len(e.tokens) for e in llm.engine.prefix_cache.entries.values()}
    ref = LLM(bamba_unclamped, device="cuda", gpu_memory_utilization=0.2, max_num_seqs=8, max_model_len=2048)
    assert_greedy_under_reference(ref, [second], [list(got)])
