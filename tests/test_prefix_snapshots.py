"""Prefix-cache snapshots inside a prefill chunk: a chunk runs past its caching points and the Mamba
layers leave the state at each one in the cache's slot (StepBatch.state_snapshots), instead of the
chunk ending there. A second chat turn after a prefix-cache hit is then one prefill step, not two;
the snapshot is what the split path (a chunk ending at the point, then a copy of the slot) stores.
Also: padding and other slots untouched, the sanitizer's check of the snapshots, and the slots of a
failed launch's snapshots given back."""
from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from hybrid import SamplingParams  # noqa: E402
from hybrid.batch import StepBatch  # noqa: E402
from hybrid.errors import RequestFailedError  # noqa: E402
from hybrid.ops import mamba_torch  # noqa: E402

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BASE = [7, 19, 33, 41, 5, 60, 12, 88, 9, 14, 23, 31, 45, 17, 29]  # 15 tokens: cached at 12 (pages of 4)
LONG = [9, 8, 7, 6, 5, 4, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 60, 61, 62, 63, 64, 65, 66]


def _llm(make_llm, path, fused, **kw):
    llm = make_llm(path, page_size=4, enable_prefix_caching=True, check_state=True, **kw)
    assert llm.engine.resources.fused_snapshots  # the CPU runner's torch Mamba path takes them
    llm.engine.resources.fused_snapshots = fused  # False: the old behaviour (a chunk ends at each point)
    return llm


def _steps(llm, prompt, params=GREEDY):
    """(tokens, engine steps) of one request run alone."""
    before = llm.engine.stats["steps"]
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    return list(out), llm.engine.stats["steps"] - before


def _entries(llm):
    """Cached prefix length -> (conv, ssm state of its slot, every layer)."""
    pool = llm.state_pool
    return {len(e.tokens): (pool.conv_state[:, e.slot].clone(), pool.ssm_state[:, e.slot].clone())
            for e in llm.engine.prefix_cache.entries.values()}


@pytest.mark.parametrize("name", ["nemotron_h", "bamba", "falcon_h1"])
def test_second_turn_after_a_hit_is_one_step(name, tiny_ckpt, make_llm):
    """The second turn resumes after 12 cached tokens and has 12 to run, past its own caching point
    (20): one prefill step where the split path takes two, the same greedy tokens as without prefix
    caching, and the prefix up to 20 cached from inside that step."""
    path = tiny_ckpt(name)
    plain = make_llm(path, page_size=4)
    first = _steps(plain, BASE)[0]
    follow = BASE + first + [50, 51, 52]  # 24 tokens: cached at 20
    want = _steps(plain, follow)[0]
    steps = {}
    for fused in (True, False):
        llm = _llm(make_llm, path, fused)
        got_first, steps_first = _steps(llm, BASE)
        got, steps[fused] = _steps(llm, follow)
        assert got_first == first and got == want, f"fused={fused}"
        assert llm.engine.stats["prefix_cache_hit_tokens"] == 12
        assert sorted(len(e.tokens) for e in llm.engine.prefix_cache.entries.values()) == [12, 20]
        # the first turn: 15 prompt tokens past its caching point 12, then 5 decodes
        assert steps_first == GREEDY.max_tokens + (0 if fused else 1)
    assert steps[True] == GREEDY.max_tokens  # one prefill step (it samples the first token), then decodes
    assert steps[False] == GREEDY.max_tokens + 1  # 8 tokens up to the caching point, then the last 4


@pytest.mark.parametrize("ssm_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["nemotron_h", "bamba"])
def test_snapshot_equals_what_the_split_path_stores(name, ssm_dtype, tiny_ckpt, make_llm):
    """Every cached slot (conv and SSM state, every layer) after a first turn cached every 8 tokens
    (its 27-token prompt: three points inside one chunk) and a second turn after a hit equals the
    split path's, in fp32 and bf16 SSM state. The Mamba math is the split path's bit for bit (the
    mixer test below); what differs is only the other layers' matmuls over more rows, by ulps."""
    path = tiny_ckpt(name)
    got = {}
    for fused in (True, False):
        llm = _llm(make_llm, path, fused, prefix_cache_interval=8, mamba_ssm_dtype=ssm_dtype)
        first, steps = _steps(llm, LONG)
        assert steps == GREEDY.max_tokens + (0 if fused else 3)  # points 8, 16 and 24 inside the prompt
        second, _ = _steps(llm, LONG + first + [50, 51, 52, 53, 54])
        got[fused] = (first, second, _entries(llm))
    assert got[True][:2] == got[False][:2]
    fused, split = got[True][2], got[False][2]
    assert sorted(fused) == sorted(split) == [8, 16, 24, 32, 36]  # the second turn: a hit at 24, then 32, 36
    tol = dict(rtol=1e-5, atol=1e-5) if ssm_dtype == "float32" else dict(rtol=2 ** -7, atol=1e-5)
    for n in split:
        torch.testing.assert_close(fused[n][0], split[n][0], rtol=1e-5, atol=1e-5, msg=f"conv state after {n}")
        torch.testing.assert_close(fused[n][1], split[n][1], **tol, msg=f"SSM state after {n}")
        assert fused[n][1].dtype == getattr(torch, ssm_dtype)


# ---------------------------------------------------------------- one mixer, bit for bit

def _prefill_batch(rows):
    """A prefill-only step: rows (slot, length, has_initial_state, snapshots [(t, slot)])."""
    q = [r[1] for r in rows]
    n, t = len(rows), sum(q)
    z = torch.zeros(t, dtype=torch.long)
    return StepBatch(
        input_ids=z, positions=z, query_start_loc=torch.zeros(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(q, dtype=torch.int32), page_table=torch.zeros(n, 1, dtype=torch.int32),
        kv_write_loc=z, state_slot=torch.tensor([r[0] for r in rows]),
        has_initial_state=torch.tensor([r[2] for r in rows]), logits_indices=torch.arange(t), num_decodes=0,
        num_prefills=n, query_lens_cpu=q, seq_lens_cpu=q, state_slot_cpu=[r[0] for r in rows],
        has_initial_state_cpu=[r[2] for r in rows],
        state_snapshots=tuple((i, tt, s) for i, r in enumerate(rows) for tt, s in r[3]),
    )


def _fake_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                     dt_softplus=True, dt_limit=(0.0, float("inf")), return_final_states=True):
    """mamba-ssm's mamba_chunk_scan_combined (batch 1) on the torch reference scan, for the CUDA
    dispatch's logic on CPU."""
    y, final = mamba_torch.ssm_prefill(x[0], dt[0], A, B[0], C[0], D, dt_bias, dt_limit, chunk_size,
                                       initial_states[0] if initial_states is not None else None)
    return y[None].to(x.dtype), final[None]


def _cuda_dispatch():
    """MambaCudaKernels with our Triton conv (CPU interpreter) and the fake chunk scan."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU interpreter tests: run in their own process with TRITON_INTERPRET=1")
    from hybrid.ops import mamba_cuda, triton_mamba

    k = object.__new__(mamba_cuda.MambaCudaKernels)
    k.chunk_scan, k.decode_kernels, k.triton, k._params = _fake_chunk_scan, "triton", triton_mamba, {}
    k.supports_verify = k.supports_snapshots = True
    return k


@pytest.mark.parametrize("ssm_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["torch", "cuda_dispatch"])
def test_mixer_snapshots_equal_split_chunks(tiny_ckpt, make_llm, ssm_dtype, impl):
    """One Mamba mixer, in_proj and out_proj made the identity (so that nothing but the Mamba ops
    sees the row counts): a step of prefill rows with snapshots (one inside the conv's first K-1
    tokens, two in one row, one in a first chunk) leaves in each snapshot slot exactly the state the
    same row leaves in its own slot when run as chunks ending at those points, and gives the same
    outputs and final states; a padding row and every other slot (the scratch row too) are untouched."""
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=8, mamba_ssm_dtype=ssm_dtype)
    mixer = llm.model.mamba_mixers()[0]
    mixer.in_proj, mixer.out_proj = torch.nn.Identity(), torch.nn.Identity()
    if impl == "cuda_dispatch":
        mixer.kernels = _cuda_dispatch()
    cfg = mixer.cfg
    width = cfg.intermediate_size + cfg.conv_dim + cfg.num_heads
    conv, ssm = llm.state_pool.layer(mixer.layer_index)
    g = torch.Generator().manual_seed(0)
    conv.copy_(torch.randn(conv.shape, generator=g))
    ssm.copy_(torch.randn(ssm.shape, generator=g) * 0.3)
    conv0, ssm0 = conv.clone(), ssm.clone()
    assert cfg.conv_kernel - 1 == 3 and cfg.chunk_size == 8
    # (slot, length, has_initial_state, snapshots): slot -1 is a padding row
    rows = [(1, 21, True, [(2, 5), (11, 6)]), (-1, 3, False, []), (2, 9, False, [(4, 7)]), (3, 5, True, [])]
    hidden = torch.randn(sum(r[1] for r in rows), width, generator=g)

    out = mixer(hidden, _prefill_batch(rows), conv, ssm)
    fused = (conv.clone(), ssm.clone())

    # the split path: each row's chunk as chunks ending at its snapshot points, its slot kept after each
    conv.copy_(conv0)
    ssm.copy_(ssm0)
    want_out = torch.zeros_like(out)
    kept = {}  # snapshot slot -> (conv, ssm) of the row's slot after the chunk ending there
    start = 0
    for slot, length, has_init, snaps in rows:
        if slot >= 0:
            a = 0
            for b, dst in snaps + [(length, None)]:
                piece = _prefill_batch([(slot, b - a, has_init or a > 0, [])])
                want_out[start + a:start + b] = mixer(hidden[start + a:start + b], piece, conv, ssm)
                if dst is not None:
                    kept[dst] = (conv[slot].clone(), ssm[slot].clone())
                a = b
        start += length
    split = (conv.clone(), ssm.clone())

    real = [r for r in rows if r[0] >= 0]
    for dst, (c, s) in kept.items():
        assert torch.equal(fused[0][dst], c), f"conv snapshot in slot {dst}"
        assert torch.equal(fused[1][dst], s), f"SSM snapshot in slot {dst}"
    for slot, *_ in real:
        assert torch.equal(fused[0][slot], split[0][slot]) and torch.equal(fused[1][slot], split[1][slot]), slot
    assert torch.equal(out[:21], want_out[:21]) and torch.equal(out[24:], want_out[24:])  # (21:24: padding)
    written = {r[0] for r in real} | set(kept)
    for s in range(conv.shape[0]):  # the other slots, the scratch row included
        if s not in written:
            assert torch.equal(fused[0][s], conv0[s]) and torch.equal(fused[1][s], ssm0[s]), f"slot {s} written"


# ---------------------------------------------------------------- engine bookkeeping

def test_sanitizer_refuses_an_unplanned_snapshot(tiny_ckpt, make_llm, monkeypatch):
    """A batch whose snapshot the resources did not plan (here: into the other row's slot) is refused
    before it runs; both requests of the step fail, and nothing leaks."""
    llm = _llm(make_llm, tiny_ckpt("nemotron_h"), True)
    eng = llm.engine
    slots0, pages0 = llm.state_pool.num_free, llm.kv_cache.allocator.num_free
    real = eng.launcher.build_batch

    def build(out, in_flight):
        batch = real(out, in_flight)
        if len(out.chunks) == 2 and not any(c.is_decode for c in out.chunks):
            batch.state_snapshots = ((0, 1, out.chunks[1].seq.slot),)
        return batch

    monkeypatch.setattr(eng.launcher, "build_batch", build)
    with pytest.raises(RequestFailedError, match=r"2 of 2 requests failed.*state snapshots \[\(0, 1, 1\)\] are not the planned"):
        llm.generate([BASE, LONG], GREEDY, use_tqdm=False)
    assert llm.state_pool.num_free == slots0 and llm.kv_cache.allocator.num_free == pages0


def test_failed_launch_gives_its_snapshot_slots_back(tiny_ckpt, make_llm, monkeypatch):
    """The forward of a step with planned snapshots raises: the request fails, the snapshot slots go
    back (nothing is cached from that step), and the engine then serves the same prompt."""
    llm = _llm(make_llm, tiny_ckpt("bamba"), True, prefix_cache_interval=8)
    eng = llm.engine
    slots0, pages0 = llm.state_pool.num_free, llm.kv_cache.allocator.num_free
    real = eng.runner.execute
    seen = []

    def execute(batch):
        if batch.state_snapshots and not seen:
            seen.append(batch.state_snapshots)
            raise RuntimeError("injected fault")
        return real(batch)

    monkeypatch.setattr(eng.runner, "execute", execute)
    with pytest.raises(RequestFailedError, match="injected fault"):
        llm.generate([LONG], GREEDY, use_tqdm=False)
    assert len(seen[0]) == 3
    assert len(eng.prefix_cache) == 0
    assert llm.state_pool.num_free == slots0 and llm.kv_cache.allocator.num_free == pages0
    again = llm.generate([LONG], GREEDY, use_tqdm=False)[0]
    assert again.error is None and len(eng.prefix_cache) == 3
    assert llm.state_pool.num_free == slots0 - 3
