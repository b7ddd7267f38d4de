"""The varlen prefill kernels (hybrid/ops/triton_mamba_varlen.py) on CPU through Triton's interpreter:
the conv over several rows at once equals triton_mamba.conv_prefill row by row (outputs and histories, bit
for bit), and the zero-state scan plus add_initial_states equals mamba_torch.ssm_prefill from each row's
own initial state (outputs, and final states computed by finish_rows itself). See tests/test_triton_kernels.py for the interpreter switch."""
import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU interpreter tests: run in their own process with TRITON_INTERPRET=1", allow_module_level=True)

from hybrid.ops import mamba_torch  # noqa: E402
from hybrid.ops import triton_mamba as tm  # noqa: E402
from hybrid.ops import triton_mamba_varlen as tv  # noqa: E402

# (length, slot, has_init): rows shorter than the conv history, one token, longer than a block
ROWS = [(5, 2, True), (1, 0, True), (2, 4, False), (70, 1, True), (3, 5, False), (1, 3, False)]


@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [4, 2])
def test_conv_varlen_equals_the_rows_one_by_one(conv_dtype, K):
    g = torch.Generator().manual_seed(K)
    CD, slots = 48, 7
    lengths = [n for n, _, _ in ROWS]
    # a strided view, as the in_proj split gives, in the conv state's dtype (the model's, as in the model)
    x_wide = torch.randn(sum(lengths), CD + 8, generator=g).to(conv_dtype)
    x = x_wide[:, 3:3 + CD]
    weight, bias = torch.randn(CD, K, generator=g), torch.randn(CD, generator=g)
    state = torch.randn(slots, CD, K - 1, generator=g).to(conv_dtype)
    ref_state = state.clone()
    ref, start = [], 0
    for n, slot, init in ROWS:
        ref.append(tm.conv_prefill(x[start:start + n], ref_state, slot, init, weight, bias, block_l=16, block_c=32))
        start += n
    rows = tv.varlen_rows(lengths, [s for _, s, _ in ROWS], [i for _, _, i in ROWS], torch.device("cpu"))
    got = tv.conv_prefill_varlen(x, state, rows, weight, bias, block_l=16, block_c=32)
    assert torch.equal(got, torch.cat(ref))
    assert torch.equal(state, ref_state)  # every row's history, and the untouched slot 6


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 2])
def test_zero_state_scan_plus_finish_rows_equals_each_rows_own_scan(state_dtype, groups):
    g = torch.Generator().manual_seed(groups)
    H, P, N, chunk, slots = 4, 16, 16, 8, 7
    lengths = [n for n, _, _ in ROWS]
    T = sum(lengths)
    x = torch.randn(T, H, P, generator=g)
    dt_raw = torch.randn(T, H, generator=g)
    A = -torch.rand(H, generator=g) - 0.2
    B, C = torch.randn(T, groups, N, generator=g), torch.randn(T, groups, N, generator=g)
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.1
    limit = (0.0, float("inf"))
    state = (torch.randn(slots, H, P, N, generator=g) * 0.5).to(state_dtype)
    ref_state = state.clone()
    want, start = [], 0
    for n, slot, init in ROWS:
        rows = slice(start, start + n)
        y, final = mamba_torch.ssm_prefill(x[rows], dt_raw[rows], A, B[rows], C[rows], D, dt_bias, limit, chunk,
                                           ref_state[slot] if init else None)
        ref_state[slot] = final.to(state_dtype)
        want.append(y)
        start += n
    # the zero-state scan of every row (what mamba-ssm's varlen scan gives) and its processed dt
    y0, start = [], 0
    for n, _, _ in ROWS:
        rows = slice(start, start + n)
        y0.append(mamba_torch.ssm_prefill(x[rows], dt_raw[rows], A, B[rows], C[rows], D, dt_bias, limit, chunk, None)[0])
        start += n
    dt = torch.clamp(torch.nn.functional.softplus(dt_raw + dt_bias), *limit).t().contiguous()  # [H, T]
    y = torch.cat(y0)
    rows = tv.varlen_rows(lengths, [s for _, s, _ in ROWS], [i for _, _, i in ROWS], torch.device("cpu"))
    tv.finish_rows(y, x, B, C, dt, A, state, rows, block_t=16, block_p=16)
    torch.testing.assert_close(y, torch.cat(want), rtol=1e-4, atol=1e-4)
    tol = dict(rtol=1e-4, atol=1e-4) if state_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(state.float(), ref_state.float(), **tol)
    assert torch.equal(state[6], ref_state[6])  # a slot no row owns is untouched


# a padding row (PAD_SLOT_ID) among them, flagged as if it had an initial state: it must still read none
PADDED = ROWS[:3] + [(4, -1, True)] + ROWS[3:]


def test_conv_varlen_padding_row_touches_no_slot():
    """A padding row (slot -1) is convolved from a zero history and reads and writes no slot (a -1 taken as an
    index would be the last slot); the other rows' outputs and histories are those of the step without it."""
    g = torch.Generator().manual_seed(3)
    CD, K, slots = 48, 4, 7
    x = torch.randn(sum(n for n, _, _ in PADDED), CD, generator=g)
    weight, bias = torch.randn(CD, K, generator=g), torch.randn(CD, generator=g)
    state = torch.randn(slots, CD, K - 1, generator=g)
    pad_at = sum(n for n, _, _ in PADDED[:3])
    real = torch.cat([x[:pad_at], x[pad_at + 4:]])

    def run(rows_spec, xs, st):
        rows = tv.varlen_rows([n for n, _, _ in rows_spec], [s for _, s, _ in rows_spec], [i for _, _, i in rows_spec],
                              torch.device("cpu"))
        return tv.conv_prefill_varlen(xs, st, rows, weight, bias, block_l=16, block_c=32)

    want_state = state.clone()
    want = run(ROWS, real, want_state)
    got = run(PADDED, x, state)
    assert torch.equal(torch.cat([got[:pad_at], got[pad_at + 4:]]), want)
    assert torch.equal(state, want_state)  # slot 6 (index -1) included
    scratch = torch.randn(1, CD, K - 1, generator=g)
    alone = tm.conv_prefill(x[pad_at:pad_at + 4], scratch, 0, False, weight, bias, block_l=16, block_c=32)
    assert torch.equal(got[pad_at:pad_at + 4], alone)


def test_finish_rows_padding_row_touches_no_slot():
    """finish_rows leaves a padding row's zero-state outputs as they are (no initial state added) and
    writes its final state nowhere; the other rows' outputs and states are those of the step without it."""
    g = torch.Generator().manual_seed(4)
    H, P, N, slots = 4, 16, 16, 7
    T = sum(n for n, _, _ in PADDED)
    x, y0 = torch.randn(T, H, P, generator=g), torch.randn(T, H, P, generator=g)
    B, C = torch.randn(T, 1, N, generator=g), torch.randn(T, 1, N, generator=g)
    dt = torch.rand(H, T, generator=g) * 0.5
    A = -torch.rand(H, generator=g) - 0.2
    state = torch.randn(slots, H, P, N, generator=g)
    pad_at = sum(n for n, _, _ in PADDED[:3])
    keep = torch.cat([torch.arange(pad_at), torch.arange(pad_at + 4, T)])

    def run(rows_spec, idx, st):
        rows = tv.varlen_rows([n for n, _, _ in rows_spec], [s for _, s, _ in rows_spec], [i for _, _, i in rows_spec],
                              torch.device("cpu"))
        y = y0[idx].clone()
        tv.finish_rows(y, x[idx], B[idx], C[idx], dt[:, idx].contiguous(), A, st, rows, block_t=16, block_p=16)
        return y

    want_state = state.clone()
    want = run(ROWS, keep, want_state)
    got = run(PADDED, torch.arange(T), state)
    assert torch.equal(got[keep], want)
    assert torch.equal(got[pad_at:pad_at + 4], y0[pad_at:pad_at + 4])
    assert torch.equal(state, want_state)


# snapshots (tokens into the row, slot): inside the first conv window (needs the old history), on and next to a
# finish_rows block boundary (16), and two in one row
SNAPSHOTS = [[(2, 6)], [], [], [(16, 7), (17, 8), (40, 9)], [], []]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_snapshots_inside_rows_equal_the_rows_cut_there(state_dtype):
    """A row's snapshots store, in their own slots, the conv history and SSM state that the row cut at that
    point would leave in its slot (conv: bit for bit; state: up to the recurrence's rounding), and change
    nothing else: outputs and every row's own slot as without them (the conv's bit for bit; y and the states
    up to rounding, the segments' blocks summing the decays in other groups)."""
    g = torch.Generator().manual_seed(5)
    CD, K, H, P, N, slots = 40, 4, 4, 16, 16, 10
    lengths = [n for n, _, _ in ROWS]
    T = sum(lengths)
    row_slots, inits = [s for _, s, _ in ROWS], [i for _, _, i in ROWS]
    xc = torch.randn(T, CD, generator=g)
    weight, bias = torch.randn(CD, K, generator=g), torch.randn(CD, generator=g)
    conv0 = torch.randn(slots, CD, K - 1, generator=g)
    x, y0 = torch.randn(T, H, P, generator=g), torch.randn(T, H, P, generator=g)
    B, C = torch.randn(T, 1, N, generator=g), torch.randn(T, 1, N, generator=g)
    dt = torch.rand(H, T, generator=g) * 0.5
    A = -torch.rand(H, generator=g) - 0.2
    ssm0 = (torch.randn(slots, H, P, N, generator=g) * 0.5).to(state_dtype)

    def run(snapshots):
        conv, ssm, y = conv0.clone(), ssm0.clone(), y0.clone()
        rows = tv.varlen_rows(lengths, row_slots, inits, torch.device("cpu"), snapshots)
        out = tv.conv_prefill_varlen(xc, conv, rows, weight, bias, block_l=16, block_c=32)
        tv.finish_rows(y, x, B, C, dt, A, ssm, rows, block_t=16, block_p=16)
        return out, y, conv, ssm

    plain = run(None)
    snap = run(SNAPSHOTS)
    tol = dict(rtol=1e-5, atol=1e-5) if state_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert torch.equal(snap[0], plain[0])  # the conv outputs
    torch.testing.assert_close(snap[1], plain[1], rtol=1e-5, atol=1e-5)  # (the decay sums in other blocks)
    live = torch.tensor(sorted(set(row_slots)))
    assert torch.equal(snap[2][live], plain[2][live])
    torch.testing.assert_close(snap[3][live].float(), plain[3][live].float(), **tol)
    # each snapshot: the same rows with that row cut at its point (the cut row writes its slot)
    starts = [sum(lengths[:r]) for r in range(len(ROWS))]
    for r, points in enumerate(SNAPSHOTS):
        for k, snap_slot in points:
            keep = torch.cat([torch.arange(starts[r] + k), torch.arange(starts[r] + lengths[r], T)])
            cut_lengths = lengths[:r] + [k] + lengths[r + 1:]
            conv, ssm = conv0.clone(), ssm0.clone()
            rows = tv.varlen_rows(cut_lengths, row_slots, inits, torch.device("cpu"))
            tv.conv_prefill_varlen(xc[keep], conv, rows, weight, bias, block_l=16, block_c=32)
            tv.finish_rows(y0[keep].clone(), x[keep], B[keep], C[keep], dt[:, keep].contiguous(), A, ssm, rows,
                           block_t=16, block_p=16)
            assert torch.equal(snap[2][snap_slot], conv[row_slots[r]]), (r, k)
            torch.testing.assert_close(snap[3][snap_slot].float(), ssm[row_slots[r]].float(), **tol)


def test_snapshots_refused_where_they_cannot_be():
    for bad in ([[(0, 6)]], [[(5, 6)]], [[(3, 6), (2, 7)]], [[(2, 2)]], [[(2, -1)]], [[], []]):
        with pytest.raises(ValueError, match="snapshot"):
            tv.varlen_rows([5], [2], [True], torch.device("cpu"), bad)


class TorchScan:
    """hybrid.ops.mamba_scan.ChunkScan's calls on CPU: mamba_torch.ssm_prefill per row (the reference)."""

    lean = True

    def __call__(self, x, dt, A, B, C, chunk, D, dt_bias, init, dt_limit):
        y, final = mamba_torch.ssm_prefill(x[0], dt[0], A, B[0], C[0], D, dt_bias, dt_limit, chunk,
                                           None if init is None else init[0])
        return y[None].to(x.dtype), final[None]

    def varlen(self, x, dt, A, B, C, chunk, D, dt_bias, dt_limit, seq_idx):
        ids = seq_idx[0].tolist()
        ys, start = [], 0
        for r in range(max(ids) + 1):
            n = ids.count(r)
            rows = slice(start, start + n)
            ys.append(mamba_torch.ssm_prefill(x[0, rows], dt[0, rows], A, B[0, rows], C[0, rows], D, dt_bias, dt_limit,
                                              chunk, None)[0])
            start += n
        dt_p = torch.clamp(torch.nn.functional.softplus(dt[0].float() + dt_bias), *dt_limit).t().contiguous()
        return torch.cat(ys)[None].to(x.dtype), dt_p


# (decode slots, prefill rows (slot, length, has_init), prefix-cache snapshots {request row: [(tokens, slot)]})
MIXER_STEPS = {
    "rows": ([5, 0], [(2, 21, True), (3, 2, False), (4, 1, True), (1, 9, False)], {}),
    "rows_with_snapshots": ([5, 0], [(2, 21, True), (3, 2, False), (4, 1, True), (1, 9, False)],
                            {2: [(2, 7), (16, 8)], 3: [(1, 9)]}),
    # a prefix-cache hit's step: one row resuming from its slot, its next caching point inside it
    "one_row_with_a_snapshot": ([], [(2, 21, True)], {0: [(16, 8)]}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", list(MIXER_STEPS))
def test_mixer_varlen_prefill_equals_the_rows_one_by_one(monkeypatch, dtype, step):
    """MambaCudaKernels.mamba_forward with the varlen_prefill switch: a step of decode rows and several prefill
    rows (with and without a history, shorter than the conv window, one token, several chunks), with and
    without prefix-cache snapshots inside them, and a single row with a snapshot, gives the outputs and
    leaves the slots (snapshot slots included) as the row-by-row path does (the scan is the torch reference
    on CPU)."""
    import dataclasses

    from hybrid.batch import StepBatch
    from random_mixer import random_mixer
    from hybrid.ops import triton_guard
    from hybrid.ops.mamba_cuda import MambaCudaKernels

    mixer = random_mixer(dtype)
    cfg = mixer.cfg
    kernels = object.__new__(MambaCudaKernels)
    kernels.chunk_scan, kernels.decode_kernels, kernels.triton, kernels._params = TorchScan(), "triton", tm, {}
    kernels.supports_verify = True
    mixer.kernels = kernels
    decode, prefill, snapshots = MIXER_STEPS[step]
    q = [1] * len(decode) + [n for _, n, _ in prefill]
    slots = decode + [s for s, _, _ in prefill]
    init = [True] * len(decode) + [i for _, _, i in prefill]
    T = sum(q)
    batch = StepBatch(
        input_ids=torch.zeros(T, dtype=torch.long), positions=torch.zeros(T, dtype=torch.long),
        query_start_loc=torch.tensor([0] + list(torch.tensor(q).cumsum(0).tolist()), dtype=torch.int32),
        seq_lens=torch.tensor(q, dtype=torch.int32), page_table=torch.zeros(len(q), 1, dtype=torch.int32),
        kv_write_loc=torch.zeros(T, dtype=torch.long), state_slot=torch.tensor(slots), has_initial_state=torch.tensor(init),
        logits_indices=torch.tensor([T - 1]), num_decodes=len(decode), num_prefills=len(prefill), query_lens_cpu=q,
        seq_lens_cpu=q, state_slot_cpu=slots, has_initial_state_cpu=init, state_snapshots=snapshots)
    hidden = torch.randn(T, 32).to(dtype)
    conv = torch.randn(10, cfg.conv_dim, cfg.conv_kernel - 1).to(dtype)
    ssm = torch.randn(10, cfg.num_heads, cfg.head_dim, cfg.state_size) * 0.3
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    monkeypatch.setenv("HYBRID_VARLEN_PREFILL", "0")  # the rows one by one
    triton_guard.reset_switches()
    ref_run = dataclasses.replace(batch)
    ref = mixer(hidden, ref_run, conv_ref, ssm_ref)
    assert ref_run.mamba_metadata.varlen is None
    monkeypatch.setenv("HYBRID_VARLEN_PREFILL", "1")
    triton_guard.reset_switches()
    try:
        run = dataclasses.replace(batch)
        out = mixer(hidden, run, conv, ssm)
        assert run.mamba_metadata.varlen is not None and run.mamba_metadata.varlen.num_rows == len(prefill)
    finally:
        monkeypatch.delenv("HYBRID_VARLEN_PREFILL")
        triton_guard.reset_switches()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    assert torch.equal(conv, conv_ref)  # the conv histories: bit for bit
    torch.testing.assert_close(ssm, ssm_ref, **tol)
    assert torch.equal(ssm[6], ssm_ref[6]) and torch.equal(conv[6], conv_ref[6])
