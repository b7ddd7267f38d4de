"""Kernel-vs-reference checks on random inputs: Mamba CUDA kernels and the trtllm attention backend."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from gpu_util import TOL, rel_err

from attention.backend import TorchAttentionBackend, write_kv
from hybrid.batch import StepBatch
from hybrid.config import MambaConfig
from hybrid.layers import Mamba2Mixer
from state_pool.pool import PAD_SLOT_ID

DEV = "cuda"
SLOTS = 6  # live rows 0..5, scratch row 6


def make_mixer(cfg: MambaConfig, hidden: int, dtype, seed=0) -> Mamba2Mixer:
    g = torch.Generator().manual_seed(seed)
    m = Mamba2Mixer(hidden, cfg, 0)
    nh = cfg.num_heads

    def put(mod, name, t):
        setattr(mod, name, torch.nn.Parameter(t.to(DEV, dtype), requires_grad=False))

    put(m.in_proj, "weight", torch.randn(m.in_proj.weight.shape, generator=g) / math.sqrt(hidden))
    put(m.out_proj, "weight", torch.randn(m.out_proj.weight.shape, generator=g) / math.sqrt(cfg.intermediate_size))
    put(m, "conv_weight", torch.randn(cfg.conv_dim, cfg.conv_kernel, generator=g) * 0.5)
    put(m, "conv_bias", torch.randn(cfg.conv_dim, generator=g) * 0.1)
    put(m, "A_log", torch.log(torch.rand(nh, generator=g) * 15 + 1))
    put(m, "D", torch.randn(nh, generator=g))
    put(m, "dt_bias", torch.log(torch.expm1(torch.rand(nh, generator=g) * 0.09 + 0.01)))
    put(m, "norm_weight", 1 + 0.1 * torch.randn(cfg.intermediate_size, generator=g))
    return m


def mixed_batch(decode_slots, prefill, device=DEV) -> StepBatch:
    """decode rows (one token each) then prefill chunks [(slot, length, has_initial_state)]."""
    q = [1] * len(decode_slots) + [p[1] for p in prefill]
    slots = list(decode_slots) + [p[0] for p in prefill]
    init = [True] * len(decode_slots) + [p[2] for p in prefill]
    T = sum(q)
    qsl = [0]
    for n in q:
        qsl.append(qsl[-1] + n)
    return StepBatch(
        input_ids=torch.zeros(T, dtype=torch.long, device=device), positions=torch.zeros(T, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(q, dtype=torch.int32, device=device), page_table=torch.zeros(len(q), 1, dtype=torch.int32, device=device),
        kv_write_loc=torch.zeros(T, dtype=torch.long, device=device), state_slot=torch.tensor(slots, device=device),
        has_initial_state=torch.tensor(init, device=device), logits_indices=torch.tensor([T - 1], device=device),
        num_decodes=len(decode_slots), num_prefills=len(prefill), query_lens_cpu=q, seq_lens_cpu=q,
        state_slot_cpu=slots, has_initial_state_cpu=init,
    )


TINY = MambaConfig(num_heads=8, head_dim=16, n_groups=2, state_size=16, conv_kernel=4, chunk_size=8, conv_bias=True,
                   proj_bias=False, norm_eps=1e-5, dt_limit=(0.0, math.inf))
NEMO = MambaConfig(num_heads=32, head_dim=64, n_groups=8, state_size=128, conv_kernel=4, chunk_size=128, conv_bias=True,
                   proj_bias=False, norm_eps=1e-5, dt_limit=(0.0, math.inf))


@pytest.mark.parametrize("decode_kernels", ["triton", "library"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg,hidden", [(TINY, 64), (dataclasses.replace(TINY, dt_limit=(0.0, 0.15)), 64), (NEMO, 512)])
def test_mamba_kernels_vs_torch(cfg, hidden, dtype, decode_kernels):
    from hybrid.ops.mamba_cuda import MambaCudaKernels

    torch.manual_seed(0)
    mixer = make_mixer(cfg, hidden, dtype)
    conv = torch.randn(SLOTS + 1, cfg.conv_dim, cfg.conv_kernel - 1, device=DEV).to(dtype)
    ssm = torch.randn(SLOTS + 1, cfg.num_heads, cfg.head_dim, cfg.state_size, device=DEV) * 0.3
    # decodes on slots 5, 0 and a padding row; prefills: with initial state (slot 2, 37 tokens,
    # several chunks), without (slot 3, 5 tokens, shorter than the conv window), with (slot 4, 1 token)
    batch = mixed_batch([5, PAD_SLOT_ID, 0], [(2, 37, True), (3, 5, False), (4, 1, True)])
    hidden_in = torch.randn(batch.num_tokens, hidden, device=DEV).to(dtype)

    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    ref = mixer(hidden_in, batch, conv_ref, ssm_ref)  # torch path
    mixer.kernels = MambaCudaKernels(decode_kernels)
    out = mixer(hidden_in, batch, conv, ssm)
    torch.cuda.synchronize()
    real = [0, 2] + list(range(3, batch.num_tokens))  # row 1 is padding
    tol = TOL[dtype]
    assert rel_err(out[real], ref[real]) < tol
    live = [0, 2, 3, 4, 5]
    assert rel_err(conv[live], conv_ref[live]) < tol
    assert rel_err(ssm[live], ssm_ref[live]) < tol
    assert torch.equal(conv[1], conv_ref[1]) and torch.equal(ssm[1], ssm_ref[1])  # slot 1 not in the batch


def test_selective_state_update_pad_goes_to_scratch():
    from hybrid.ops.mamba_cuda import MambaCudaKernels

    cfg, dtype = TINY, torch.bfloat16
    mixer = make_mixer(cfg, 64, dtype, seed=1)
    mixer.kernels = MambaCudaKernels("library")  # mamba-ssm's kernel cannot skip PAD_SLOT_ID rows
    conv = torch.randn(SLOTS + 1, cfg.conv_dim, 3, device=DEV).to(dtype)
    ssm = torch.randn(SLOTS + 1, cfg.num_heads, cfg.head_dim, cfg.state_size, device=DEV)
    before = (conv.clone(), ssm.clone())
    batch = mixed_batch([PAD_SLOT_ID, 3, PAD_SLOT_ID], [])
    mixer(torch.randn(3, 64, device=DEV).to(dtype), batch, conv, ssm)
    untouched = [0, 1, 2, 4, 5]
    assert torch.equal(conv[untouched], before[0][untouched]) and torch.equal(ssm[untouched], before[1][untouched])
    # the pad rows went to the scratch row SLOTS (graphs.padding), never to a live slot
    assert not torch.equal(ssm[3], before[1][3]) and not torch.equal(conv[3], before[0][3])


# ---------------------------------------------------------------------------------- attention
def attn_batch(q_lens, ctx_lens, page_size, max_pages, device=DEV, seed=0):
    """Requests with ctx_lens tokens already cached and q_lens new ones; distinct random pages."""
    g = torch.Generator().manual_seed(seed)
    n = len(q_lens)
    seq = [c + q for c, q in zip(ctx_lens, q_lens)]
    need = [-(-s // page_size) for s in seq]
    perm = (torch.randperm(sum(need), generator=g) + 1).tolist()
    table = torch.zeros(n, max_pages, dtype=torch.int32)
    loc, k = [], 0
    for i in range(n):
        pages = perm[k:k + need[i]]
        k += need[i]
        table[i, : need[i]] = torch.tensor(pages, dtype=torch.int32)
        loc += [pages[p // page_size] * page_size + p % page_size for p in range(ctx_lens[i], seq[i])]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    nd = sum(1 for q in q_lens if q == 1) if all(q == 1 for q in q_lens) else 0
    return StepBatch(
        input_ids=torch.zeros(qsl[-1], dtype=torch.long, device=device), positions=torch.zeros(qsl[-1], dtype=torch.long, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device), seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
        page_table=table.to(device), kv_write_loc=torch.tensor(loc, device=device),
        state_slot=torch.zeros(n, dtype=torch.long, device=device), has_initial_state=torch.ones(n, dtype=torch.bool, device=device),
        logits_indices=torch.zeros(1, dtype=torch.long, device=device), num_decodes=nd, num_prefills=n - nd,
        query_lens_cpu=list(q_lens), seq_lens_cpu=seq, state_slot_cpu=[0] * n, has_initial_state_cpu=[True] * n,
    ), sum(need) + 1


def attn_inputs(num_pages: int, q_lens, page_size: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    """Random bf16 pages [num_pages, 2, kv_heads, page_size, head_dim] and q / k / v for the tokens."""
    dtype = torch.bfloat16
    torch.manual_seed(seed)
    kv = torch.randn(num_pages, 2, kv_heads, page_size, head_dim, device=DEV).to(dtype)
    T = sum(q_lens)
    q = torch.randn(T, heads, head_dim, device=DEV).to(dtype)
    k = torch.randn(T, kv_heads, head_dim, device=DEV).to(dtype)
    v = torch.randn(T, kv_heads, head_dim, device=DEV).to(dtype)
    return kv, q, k, v


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (32, 8, 128), (32, 32, 128)])  # MHA: Zamba2-1.2B
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_trtllm_attention_vs_torch(page_size, heads, kv_heads, head_dim, mode):
    from attention.trtllm import TrtllmAttentionBackend

    if mode == "decode":
        q_lens, ctx = [1, 1, 1, 1], [0, 15, 200, 517]
    else:
        q_lens, ctx = [1, 40, 7, 130], [33, 0, 100, 16]  # a decode row, a first chunk, later chunks
    batch, num_pages = attn_batch(q_lens, ctx, page_size, max_pages=-(-700 // page_size))
    dtype = torch.bfloat16
    kv, q, k, v = attn_inputs(num_pages, q_lens, page_size, heads, kv_heads, head_dim, seed=1)
    scale = head_dim ** -0.5
    kv_ref = kv.clone()
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), kv_ref.float(), batch, scale)
    backend = TrtllmAttentionBackend()
    out = backend.forward(q, k, v, kv, batch, scale)
    torch.cuda.synchronize()
    assert rel_err(out.float(), ref) < TOL[dtype], rel_err(out.float(), ref)
    kv_ref2 = kv_ref.clone()
    write_kv(kv_ref2, k, v, batch.kv_write_loc)
    assert torch.equal(kv, kv_ref2)  # fused KV write == reference scatter, exactly


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (32, 8, 128), (32, 2, 128), (40, 8, 128),
                                                    (32, 32, 128)])
@pytest.mark.parametrize("q_len", [2, 4])
def test_trtllm_verify_vs_torch_at_long_contexts(page_size, heads, kv_heads, head_dim, q_len):
    """A padded verify step (every row q_len tokens: the verify graphs' shape, XQA's speculative mode
    with its causal mask) over histories up to 16K tokens (multi-block XQA), against the reference."""
    import dataclasses

    from attention.trtllm import TrtllmAttentionBackend

    ctx = [3, 900, 4097, 16380 - q_len]
    q_lens = [q_len] * len(ctx)
    batch, num_pages = attn_batch(q_lens, ctx, page_size, max_pages=-(-16384 // page_size) + 1)
    batch = dataclasses.replace(batch, num_decodes=0, num_prefills=0, num_verify=len(ctx), uniform_q_len=q_len)
    dtype = torch.bfloat16
    kv, q, k, v = attn_inputs(num_pages, q_lens, page_size, heads, kv_heads, head_dim, seed=2)
    scale = head_dim ** -0.5
    plain = dataclasses.replace(batch, num_verify=0, num_prefills=len(ctx), uniform_q_len=0)
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), kv.clone().float(), plain, scale)
    out = TrtllmAttentionBackend().forward(q, k, v, kv, batch, scale)
    torch.cuda.synchronize()
    assert rel_err(out.float(), ref) < TOL[dtype], rel_err(out.float(), ref)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 32, 128), (32, 8, 128), (32, 2, 128), (8, 2, 64),
                                                    (4, 4, 32)])
def test_trtllm_decode_vs_torch_at_long_contexts(heads, kv_heads, head_dim):
    """Decode rows over histories up to 16K tokens (XQA's multi-block mode) at the released head
    ratios, MHA (Zamba2-1.2B: 32 query heads on 32 KV heads, the only XQA user without GQA) included,
    against the reference."""
    from attention.trtllm import TrtllmAttentionBackend

    ctx = [0, 3, 900, 4097, 16383]
    q_lens = [1] * len(ctx)
    batch, num_pages = attn_batch(q_lens, ctx, 16, max_pages=-(-16384 // 16) + 1)
    kv, q, k, v = attn_inputs(num_pages, q_lens, 16, heads, kv_heads, head_dim, seed=4)
    scale = head_dim ** -0.5
    ref = TorchAttentionBackend().forward(q.float(), k.float(), v.float(), kv.clone().float(), batch, scale)
    out = TrtllmAttentionBackend().forward(q, k, v, kv, batch, scale)
    torch.cuda.synchronize()
    err = [rel_err(out[i].float(), ref[i]) for i in range(len(ctx))]
    assert max(err) < TOL[torch.bfloat16], err


def test_fused_kv_write_skips_negative_rows():
    from attention.trtllm import write_kv_fused

    kv = torch.zeros(4, 2, 2, 16, 64, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(3, 2, 64, device=DEV).bfloat16()
    v = torch.randn(3, 2, 64, device=DEV).bfloat16()
    write_kv_fused(kv, k, v, torch.tensor([17, -1, 63], device=DEV))
    assert torch.equal(kv[1, 0, :, 1], k[0]) and torch.equal(kv[1, 1, :, 1], v[0])
    assert torch.equal(kv[3, 0, :, 15], k[2]) and torch.equal(kv[3, 1, :, 15], v[2])
    assert int((kv != 0).sum()) == 4 * 64 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg,hidden", [(TINY, 64), (dataclasses.replace(TINY, dt_limit=(0.0, 0.15)), 64), (NEMO, 512)])
def test_varlen_prefill_vs_torch(cfg, hidden, dtype, monkeypatch):
    """The varlen prefill path (the default; one conv launch, one zero-state varlen scan and one
    launch for the rows' initial and final states a layer, hybrid/ops/triton_mamba_varlen.py) against the
    torch path, in a step of decodes and four prefill rows."""
    from hybrid.ops import triton_guard
    from hybrid.ops.mamba_cuda import MambaCudaKernels

    torch.manual_seed(1)
    mixer = make_mixer(cfg, hidden, dtype)
    conv = torch.randn(SLOTS + 1, cfg.conv_dim, cfg.conv_kernel - 1, device=DEV).to(dtype)
    ssm = torch.randn(SLOTS + 1, cfg.num_heads, cfg.head_dim, cfg.state_size, device=DEV) * 0.3
    mixer.kernels = MambaCudaKernels("triton")
    warm = mixed_batch([], [(1, 9, True)])  # (the scan's first call checks its lean path)
    mixer(torch.randn(9, hidden, device=DEV).to(dtype), warm, conv.clone(), ssm.clone())
    assert mixer.kernels.chunk_scan.lean is True
    batch = mixed_batch([5, 0], [(2, 300, True), (3, 5, False), (4, 1, True), (1, 130, False)])
    hidden_in = torch.randn(batch.num_tokens, hidden, device=DEV).to(dtype)
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    kernels, mixer.kernels = mixer.kernels, None
    ref = mixer(hidden_in, batch, conv_ref, ssm_ref)  # torch path
    mixer.kernels = kernels
    monkeypatch.setenv("HYBRID_VARLEN_PREFILL", "1")
    triton_guard.reset_switches()
    try:
        run = dataclasses.replace(batch)
        out = mixer(hidden_in, run, conv, ssm)
        torch.cuda.synchronize()
        assert run.mamba_metadata.varlen is not None
    finally:
        monkeypatch.delenv("HYBRID_VARLEN_PREFILL")
        triton_guard.reset_switches()
    tol = TOL[dtype]
    assert rel_err(out, ref) < tol
    assert rel_err(conv, conv_ref) < tol and rel_err(ssm, ssm_ref) < tol
    assert torch.equal(ssm[6], ssm_ref[6]) and torch.equal(conv[6], conv_ref[6])  # the scratch row


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg,hidden", [(TINY, 64), (NEMO, 512)])
def test_varlen_prefill_as_accurate_as_rows(cfg, hidden, state_dtype, monkeypatch):
    """A bf16 model's step through the varlen prefill path lands as close to an fp32 computation (the torch
    path on the same bf16-rounded weights, inputs and states) as the row-by-row path does: outputs and
    every slot's SSM state, in both state dtypes. (The loose bf16 tolerance of test_varlen_prefill_vs_torch
    would let a small systematic error through; rounding noise is what both paths may differ by.)"""
    import copy

    from hybrid.ops import triton_guard
    from hybrid.ops.mamba_cuda import MambaCudaKernels

    torch.manual_seed(2)
    mixer = make_mixer(cfg, hidden, torch.bfloat16)
    ref_mixer = copy.deepcopy(mixer).float()
    mixer.kernels = MambaCudaKernels("triton")
    warm = mixed_batch([], [(1, 9, True)])
    scratch_conv = torch.zeros(SLOTS + 1, cfg.conv_dim, cfg.conv_kernel - 1, device=DEV, dtype=torch.bfloat16)
    scratch_ssm = torch.zeros(SLOTS + 1, cfg.num_heads, cfg.head_dim, cfg.state_size, device=DEV, dtype=state_dtype)
    mixer(torch.randn(9, hidden, device=DEV).bfloat16(), warm, scratch_conv, scratch_ssm)
    assert mixer.kernels.chunk_scan.lean is True
    conv = torch.randn(SLOTS + 1, cfg.conv_dim, cfg.conv_kernel - 1, device=DEV).bfloat16()
    ssm = (torch.randn(SLOTS + 1, cfg.num_heads, cfg.head_dim, cfg.state_size, device=DEV) * 0.3).to(state_dtype)
    batch = mixed_batch([5, 0], [(2, 300, True), (3, 5, False), (4, 1, True), (1, 130, False)])
    hidden_in = torch.randn(batch.num_tokens, hidden, device=DEV).bfloat16()
    conv_ref, ssm_ref = conv.float(), ssm.float()
    ref = ref_mixer(hidden_in.float(), dataclasses.replace(batch), conv_ref, ssm_ref)  # torch path, fp32
    results = {}
    for path, env in (("rows", "0"), ("varlen", "1")):
        monkeypatch.setenv("HYBRID_VARLEN_PREFILL", env)
        triton_guard.reset_switches()
        c, s, run = conv.clone(), ssm.clone(), dataclasses.replace(batch)
        out = mixer(hidden_in, run, c, s)
        torch.cuda.synchronize()
        assert (run.mamba_metadata.varlen is not None) == (path == "varlen")
        results[path] = out, c, s
    monkeypatch.delenv("HYBRID_VARLEN_PREFILL", raising=False)
    triton_guard.reset_switches()
    (out_rows, conv_rows, ssm_rows), (out_var, conv_var, ssm_var) = results["rows"], results["varlen"]
    assert torch.equal(conv_var, conv_rows)
    errs = {"y": (rel_err(out_rows, ref), rel_err(out_var, ref))}
    for slot in range(SLOTS):
        errs[slot] = (rel_err(ssm_rows[slot], ssm_ref[slot]), rel_err(ssm_var[slot], ssm_ref[slot]))
    print(errs)
    for name, (rows_err, var_err) in errs.items():
        assert var_err <= 1.25 * rows_err + 1e-5, (name, errs)


# (decode slots, prefill rows, snapshots, the slots a step writes): two rows with three snapshots, and a
# prefix-cache hit's step (one row resuming from its slot, its next caching point inside it)
SNAPSHOT_STEPS = {"rows": ([5], [(2, 300, True), (3, 37, False)], {1: [(16, 0), (256, 1)], 2: [(32, 4)]},
                           (5, 2, 3, 0, 1, 4)),
                  "hit": ([], [(2, 272, True)], {0: [(16, 1)]}, (2, 1))}


@pytest.mark.parametrize("step", list(SNAPSHOT_STEPS))
@pytest.mark.parametrize("decode_kernels", ["triton", "library"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg,hidden", [(TINY, 64), (NEMO, 512)])
def test_prefill_snapshots_vs_torch(cfg, hidden, dtype, decode_kernels, step):
    """Prefix-cache snapshots inside prefill rows (StepBatch.state_snapshots: the state after a row's first k
    tokens into the snapshot's slot) on the CUDA kernels against the torch path: outputs, the rows' slots and
    the snapshot slots; slots no row names stay as they were. With our kernels the step is one varlen launch
    of each kernel (the snapshots stored from inside the rows); with the library's, the rows as segments."""
    from hybrid.ops.mamba_cuda import MambaCudaKernels

    torch.manual_seed(3)
    decode, prefill, snapshots, written = SNAPSHOT_STEPS[step]
    mixer = make_mixer(cfg, hidden, dtype)
    conv = torch.randn(SLOTS + 1, cfg.conv_dim, cfg.conv_kernel - 1, device=DEV).to(dtype)
    ssm = torch.randn(SLOTS + 1, cfg.num_heads, cfg.head_dim, cfg.state_size, device=DEV) * 0.3
    batch = mixed_batch(decode, prefill)
    batch.state_snapshots = snapshots
    hidden_in = torch.randn(batch.num_tokens, hidden, device=DEV).to(dtype)
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    ref = mixer(hidden_in, dataclasses.replace(batch), conv_ref, ssm_ref)  # torch path
    mixer.kernels = MambaCudaKernels(decode_kernels)
    if decode_kernels == "triton":  # (the scan's first call checks its lean path, which the varlen path needs)
        mixer(torch.randn(9, hidden, device=DEV).to(dtype), mixed_batch([], [(1, 9, True)]), conv.clone(), ssm.clone())
        assert mixer.kernels.chunk_scan.lean is True
    run = dataclasses.replace(batch)
    out = mixer(hidden_in, run, conv, ssm)
    torch.cuda.synchronize()
    assert run.mamba_metadata.varlen is not None  # (the library kernels ignore it: their rows as segments)
    tol = TOL[dtype]
    assert rel_err(out, ref) < tol
    for slot in range(SLOTS):
        if slot not in written:
            assert torch.equal(ssm[slot], ssm_ref[slot]) and torch.equal(conv[slot], conv_ref[slot]), slot
    for slot in written:
        assert rel_err(ssm[slot], ssm_ref[slot]) < tol and rel_err(conv[slot], conv_ref[slot]) < tol, slot
    assert torch.equal(ssm[6], ssm_ref[6]) and torch.equal(conv[6], conv_ref[6])  # the scratch row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_varlen_padding_row_touches_no_slot(dtype):
    """The varlen prefill kernels with a padding row (PAD_SLOT_ID) between real rows, on the device: the real
    rows' conv outputs, y and states are those of the step without it, bit for bit, and no slot (the last one,
    which -1 would index, included) is read or written for it."""
    from hybrid.ops import triton_mamba_varlen as tv

    g = torch.Generator(device=DEV).manual_seed(5)
    spec = [(37, 2, True), (1, 0, True), (9, PAD_SLOT_ID, True), (300, 1, False), (3, SLOTS, True)]
    real = [r for r in spec if r[1] != PAD_SLOT_ID]
    lengths = [n for n, _, _ in spec]
    T, CD, K, H, P, N = sum(lengths), 256, 4, 8, 64, 128
    pad0 = sum(lengths[:2])
    keep = torch.cat([torch.arange(pad0), torch.arange(pad0 + 9, T)]).to(DEV)

    def rows_of(rows_spec):
        return tv.varlen_rows([n for n, _, _ in rows_spec], [s for _, s, _ in rows_spec],
                              [i for _, _, i in rows_spec], torch.device(DEV))

    x = torch.randn(T, CD, device=DEV, generator=g).to(dtype)
    weight, bias = torch.randn(CD, K, device=DEV, generator=g), torch.randn(CD, device=DEV, generator=g)
    conv = torch.randn(SLOTS + 1, CD, K - 1, device=DEV, generator=g).to(dtype)
    conv_want = conv.clone()
    want = tv.conv_prefill_varlen(x[keep], conv_want, rows_of(real), weight, bias)
    got = tv.conv_prefill_varlen(x, conv, rows_of(spec), weight, bias)
    assert torch.equal(got[keep], want) and torch.equal(conv, conv_want)

    xs, y0 = torch.randn(T, H, P, device=DEV, generator=g).to(dtype), torch.randn(T, H, P, device=DEV, generator=g).to(dtype)
    B, C = (torch.randn(T, 1, N, device=DEV, generator=g).to(dtype) for _ in range(2))
    dt = torch.rand(H, T, device=DEV, generator=g) * 0.1
    A = -torch.rand(H, device=DEV, generator=g) - 0.2
    state = torch.randn(SLOTS + 1, H, P, N, device=DEV, generator=g)
    state_want = state.clone()
    y_want = y0[keep].clone()
    tv.finish_rows(y_want, xs[keep], B[keep], C[keep], dt[:, keep].contiguous(), A, state_want, rows_of(real))
    y = y0.clone()
    tv.finish_rows(y, xs, B, C, dt, A, state, rows_of(spec))
    assert torch.equal(y[keep], y_want) and torch.equal(y[pad0:pad0 + 9], y0[pad0:pad0 + 9])
    assert torch.equal(state, state_want)
