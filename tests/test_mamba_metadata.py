"""The Mamba layers' per-step metadata (hybrid/mamba_metadata.py): built once per step and uploaded
in one copy, whatever the number of Mamba layers, and read by every layer; its row groups are the
ones the torch path and the CUDA dispatch both use."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from hybrid import SamplingParams
from hybrid import mamba_metadata as mm
from hybrid.batch import StepBatch

torch.set_num_threads(1)  # 2 cores shared by several people

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _count(monkeypatch) -> dict[str, int]:
    """Count metadata builds, uploads and reads (step_metadata calls)."""
    counts = {"build": 0, "upload": 0, "read": 0}
    build, upload, read = mm.build, mm.to_device, mm.step_metadata

    def counting_build(batch):
        counts["build"] += 1
        return build(batch)

    def counting_upload(*args, **kwargs):
        counts["upload"] += 1
        return upload(*args, **kwargs)

    def counting_read(batch):
        counts["read"] += 1
        return read(batch)

    monkeypatch.setattr(mm, "build", counting_build)
    monkeypatch.setattr(mm, "to_device", counting_upload)
    import hybrid.layers

    monkeypatch.setattr(hybrid.layers, "step_metadata", counting_read)
    return counts


def test_metadata_built_once_per_step(tiny_ckpt, make_llm, monkeypatch):
    """An engine run with verify rows (n-gram drafts), a replay row (a preempted request) and prefill
    chunks: every step builds the metadata once and uploads it at most once, though each of the
    model's Mamba layers reads it."""
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=4, page_size=4, max_model_len=96, speculative_config=SPEC)
    num_mamba = len(llm.model.mamba_mixers())
    assert num_mamba >= 2
    counts = _count(monkeypatch)
    runner = llm.engine.runner
    execute = runner.execute
    steps = []

    def wrapped(batch):
        before = dict(counts)
        out = execute(batch)
        steps.append({"verify": batch.num_verify, "replay": batch.num_replay, "prefills": batch.num_prefills,
                      **{k: counts[k] - before[k] for k in counts}})
        return out

    runner.execute = wrapped
    eng = llm.engine
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 30, 41, 12, 77, 3, 50]]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    victim = eng.requests["r1"].seqs[0]
    preempted = False
    while eng.has_unfinished_requests():
        eng.step()
        if not preempted and len(victim.output_token_ids) >= 8 and victim in eng.running:
            eng.scheduler.preempt(victim)
            preempted = True
    assert preempted
    assert any(s["verify"] for s in steps) and any(s["replay"] for s in steps) and any(s["prefills"] for s in steps)
    for s in steps:
        assert s["build"] == 1, s
        assert s["upload"] == (1 if s["verify"] or s["replay"] else 0), s
        assert s["read"] >= num_mamba, s  # every Mamba layer read the one built for its step


def _mixed_batch(state_scratch) -> StepBatch:
    """[2 decodes | 3 verify rows | 2 replay rows | 2 prefill chunks (one of them padding)]."""
    q = [1, 1, 3, 2, 3, 4, 1, 5, 2]
    slots = [0, 1, 2, 3, 4, 5, 6, 7, -1]
    scratch = [-1, -1, 1, 0, 2, -1, -1, -1, -1]
    init = [True] * 7 + [False, True]
    T = sum(q)
    z = torch.zeros(T, dtype=torch.long)
    return StepBatch(
        input_ids=z, positions=z, query_start_loc=torch.zeros(len(q) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(q, dtype=torch.int32), page_table=torch.zeros(len(q), 1, dtype=torch.int32),
        kv_write_loc=z, state_slot=torch.tensor(slots), has_initial_state=torch.tensor(init),
        logits_indices=torch.arange(T), num_decodes=2, num_prefills=2, query_lens_cpu=q, seq_lens_cpu=q,
        state_slot_cpu=slots, has_initial_state_cpu=init, num_verify=3, scratch_index=torch.tensor(scratch),
        scratch_index_cpu=scratch, state_scratch=state_scratch, num_replay=2,
    )


def test_row_groups_and_positions(monkeypatch):
    K1 = 4  # verify scratch positions per row (num_speculative_tokens + 1)
    scr = (torch.zeros(2, 3, K1, 1, 1), torch.zeros(2, 3, K1, 1, 1, 1))  # [layers, rows, K+1, ...]
    batch = _mixed_batch(scr)
    counts = _count(monkeypatch)
    meta = mm.step_metadata(batch)
    assert mm.step_metadata(batch) is meta and batch.mamba_metadata is meta
    assert counts["build"] == 1 and counts["upload"] == 1
    # token rows: decodes 0, 1; verify rows 2-4, 5-6, 7-9; replay rows 10-13, 14; prefills 15-19, 20-21
    as_list = lambda t: None if t is None else t.tolist()  # noqa: E731
    groups = [(g.num_tokens, as_list(g.tokens), as_list(g.slots), as_list(g.scratch)) for g in meta.verify_groups]
    assert groups == [(3, [[2, 3, 4], [7, 8, 9]], [2, 4], [1, 2]), (2, [[5, 6]], [3], [0])]
    groups = [(g.num_tokens, as_list(g.tokens), as_list(g.slots), as_list(g.scratch)) for g in meta.replay_groups]
    assert groups == [(4, [[10, 11, 12, 13]], [5], None), (1, [[14]], [6], None)]
    pos = [(as_list(p.tokens), as_list(p.slots), as_list(p.scratch)) for p in meta.verify_positions]
    assert pos == [([2, 5, 7], [2, 3, 4], [1 * K1, 0, 2 * K1]), ([3, 6, 8], [2, 3, 4], [K1 + 1, 1, 2 * K1 + 1]),
                   ([4, 9], [2, 4], [K1 + 2, 2 * K1 + 2])]
    pos = [(as_list(p.tokens), as_list(p.slots), p.scratch) for p in meta.replay_positions]
    assert pos == [([10, 14], [5, 6], None), ([11], [5], None), ([12], [5], None), ([13], [5], None)]
    assert meta.prefills == (mm.PrefillRow(15, 5, 7, False), mm.PrefillRow(20, 2, -1, True))
    # every index tensor is a view of the one uploaded block
    base = meta.verify_groups[0].tokens.untyped_storage().data_ptr()
    for g in meta.verify_groups + meta.replay_groups:
        assert g.tokens.untyped_storage().data_ptr() == base and g.slots.untyped_storage().data_ptr() == base
    # a batch derived with dataclasses.replace (e.g. padded) starts without it and builds its own
    assert dataclasses.replace(batch).mamba_metadata is None


def test_plain_decode_metadata_is_empty(monkeypatch):
    """A decode-only step (what the CUDA graphs capture) gets an empty metadata: no torch op, no upload."""
    from graphs.padding import padding_batch

    counts = _count(monkeypatch)
    meta = mm.step_metadata(padding_batch(4, 4, torch.device("cpu")))
    assert meta == mm.MambaStepMetadata() and counts["upload"] == 0


def test_no_index_uploads_in_layer_code():
    """The per-layer code reads the step's metadata; it builds no index tensors of its own."""
    from hybrid.layers import Mamba2Mixer
    from hybrid.ops import mamba_cuda

    sources = [inspect.getsource(Mamba2Mixer), inspect.getsource(mamba_cuda.MambaCudaKernels),
               inspect.getsource(mamba_cuda.triton_verify), inspect.getsource(mamba_cuda.triton_replay)]
    for src in sources:
        assert "torch.tensor(" not in src and "to_device(" not in src and "_cpu" not in src


@pytest.mark.parametrize("impl", ["torch", "cuda_dispatch"])
def test_verify_and_replay_paths_read_one_metadata(impl, tiny_ckpt, make_llm, monkeypatch):
    """Every Mamba layer's verify and replay on one batch, on the torch path or through the CUDA
    dispatch (mamba_cuda.triton_verify / triton_replay, with the Triton recurrence stubbed: the
    kernels themselves are checked in test_triton_verify.py / test_triton_replay.py): one build,
    one upload, and the dispatch launches exactly the metadata's row groups."""
    from hybrid.ops import mamba_cuda

    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=8)
    pool = llm.state_pool
    pool.enable_spec_scratch(3, 4)
    batch = _mixed_batch(pool.spec_scratch)
    mixers = llm.model.mamba_mixers()
    counts = _count(monkeypatch)
    launches = []

    def fake_recurrence(tm, mixer, params, xBC, dt, conv, ssm, slots, scratch=None, scratch_index=None, out=None):
        launches.append((tuple(xBC.shape[:-1]), slots.tolist(), None if scratch_index is None else
                         scratch_index.tolist()))
        return torch.ones(*xBC.shape[:-1], mixer.cfg.num_heads, mixer.cfg.head_dim)

    monkeypatch.setattr(mamba_cuda, "triton_recurrence", fake_recurrence)
    g = torch.Generator().manual_seed(0)
    for mixer in mixers:
        cfg = mixer.cfg
        T = batch.num_tokens
        xBC = torch.randn(T, cfg.conv_dim, generator=g)
        dt = torch.randn(T, cfg.num_heads, generator=g) * 0.5
        A = -torch.exp(mixer.A_log.float())
        y = torch.zeros(T, cfg.num_heads, cfg.head_dim)
        conv, ssm = pool.layer(mixer.layer_index)
        if impl == "torch":
            mixer._verify(xBC, dt, A, y, batch, conv, ssm)
            mixer._replay(xBC, dt, A, y, batch, conv, ssm)
        else:
            params = {"A": A, "D": mixer.D.float(), "dt_bias": mixer.dt_bias.float()}
            mamba_cuda.triton_verify(None, mixer, xBC, dt, params, y, batch, conv, ssm)
            mamba_cuda.triton_replay(None, mixer, xBC, dt, params, y, batch, conv, ssm)
        assert y[2:15].abs().sum(dim=(1, 2)).all() and not y[:2].any() and not y[15:].any()
    assert len(mixers) >= 2 and counts["build"] == 1 and counts["upload"] == 1
    if impl == "cuda_dispatch":  # per layer: two verify groups (T = 3, 2), two replay groups (T = 4, 1)
        assert launches == [((2, 3), [2, 4], [1, 2]), ((1, 2), [3], [0]), ((1, 4), [5], None),
                            ((1, 1), [6], None)] * len(mixers)


def test_uniform_verify_metadata_equals_the_built_one():
    """A padded verify batch (uniform_q_len set, graphs/padding.pad_verify_batch) gets its one group
    from the batch's own device tensors, with no upload (what a captured graph needs), holding the
    same token rows, slots and scratch rows as the host-built metadata of the same batch."""
    T, n = 3, 4
    scratch = (torch.zeros(1, 5, T, 2), torch.zeros(1, 5, T, 2))
    slots, scr = [2, -1, 0, -1], [0, 1, 2, 3]
    b = StepBatch(
        input_ids=torch.zeros(n * T, dtype=torch.long), positions=torch.zeros(n * T, dtype=torch.long),
        query_start_loc=torch.arange(0, n * T + 1, T, dtype=torch.int32), seq_lens=torch.full((n,), 9, dtype=torch.int32),
        page_table=torch.zeros(n, 2, dtype=torch.int32), kv_write_loc=torch.zeros(n * T, dtype=torch.long),
        state_slot=torch.tensor(slots), has_initial_state=torch.ones(n, dtype=torch.bool),
        logits_indices=torch.arange(n * T), num_decodes=0, num_prefills=0, query_lens_cpu=[T] * n,
        seq_lens_cpu=[9] * n, state_slot_cpu=slots, has_initial_state_cpu=[True] * n, num_verify=n,
        scratch_index=torch.tensor(scr), scratch_index_cpu=scr, state_scratch=scratch)
    built = mm.build(b)
    uniform = mm.build(dataclasses.replace(b, uniform_q_len=T))
    (g,), (u,) = built.verify_groups, uniform.verify_groups
    assert u.num_tokens == g.num_tokens == T
    for a, c in ((u.tokens, g.tokens), (u.slots, g.slots), (u.scratch, g.scratch)):
        assert torch.equal(a, c)
    assert len(uniform.verify_positions) == len(built.verify_positions) == T
    for pu, pb in zip(uniform.verify_positions, built.verify_positions):
        assert torch.equal(pu.tokens, pb.tokens) and torch.equal(pu.slots, pb.slots)
        assert torch.equal(pu.scratch, pb.scratch)


def test_varlen_rows_of_a_steps_prefill_rows(monkeypatch):
    """The varlen launch's rows: two or more prefill rows, or one with snapshots (each a (tokens, slot) pair the
    kernels store from inside the row); a single plain row, a padding row or the switch off keep the row path."""
    from types import SimpleNamespace

    from hybrid.ops import triton_guard

    monkeypatch.delenv("HYBRID_VARLEN_PREFILL", raising=False)
    triton_guard.reset_switches()

    def step(rows, snapshots):  # rows: (length, slot, has_init) of each prefill request row, after one decode
        return SimpleNamespace(state_slot=torch.zeros(1), num_requests=1 + len(rows),
                               query_lens_cpu=[1] + [n for n, _, _ in rows], state_slot_cpu=[0] + [s for _, s, _ in rows],
                               has_initial_state_cpu=[True] + [i for _, _, i in rows], state_snapshots=snapshots)

    # a request row of 40 tokens on slot 2, cut at 16 (into slot 8) and 30 (into slot 9)
    hit = [(40, 2, True)]
    rows = mm._varlen(step(hit, {1: [(16, 8), (30, 9)]}), 1)
    assert rows.num_rows == 1 and rows.cu_seqlens.tolist() == [0, 40] and rows.slots.tolist() == [2]
    assert rows.has_init.tolist() == [1] and rows.snap_cu.tolist() == [0, 2]
    assert rows.snap_pos.tolist() == [16, 30] and rows.snap_slots.tolist() == [8, 9]
    rows = mm._varlen(step([(3, 5, False)] + hit, {2: [(16, 8), (30, 9)]}), 1)
    assert rows.cu_seqlens.tolist() == [0, 3, 43] and rows.snap_cu.tolist() == [0, 0, 2]
    assert rows.has_init.tolist() == [0, 1] and rows.snap_pos.tolist() == [16, 30]
    assert mm._varlen(step(hit, {}), 1) is None  # one plain row: one scan call from its state
    assert mm._varlen(step(hit + [(4, -1, False)], {1: [(16, 8)]}), 1) is None  # a padding row
    monkeypatch.setenv("HYBRID_VARLEN_PREFILL", "0")
    triton_guard.reset_switches()
    try:
        assert mm._varlen(step(hit, {1: [(16, 8), (30, 9)]}), 1) is None
    finally:
        monkeypatch.delenv("HYBRID_VARLEN_PREFILL")
        triton_guard.reset_switches()
