"""The Mamba state-transition contract: T tokens in, the state rounded to its storage dtype after
each token, on every path (decode, speculative verify, replay). One T-token launch must equal T
one-token decode launches bit for bit: the state at every position and every output, with fp32 and
with bf16 state. Checked on CPU through Triton's interpreter for our kernels (hybrid.ops.triton_mamba
and the CUDA dispatch in hybrid.ops.mamba_cuda), and for the plain-torch reference (Mamba2Mixer).

(On a CUDA machine run in its own process with TRITON_INTERPRET=1, as tests/test_triton_kernels.py;
the compiled kernels: tests/gpu/test_triton_kernels_gpu.py::test_multi_token_launch_equals_decodes.)
"""
import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from hybrid.batch import StepBatch  # noqa: E402

PAD = -1
DTYPES = [torch.float32, torch.bfloat16]


def _tm():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU interpreter tests: run in their own process with TRITON_INTERPRET=1")
    from hybrid.ops import triton_mamba

    return triton_mamba


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_ssm_multi_token_launch_equals_decodes(state_dtype):
    tm = _tm()
    H, P, N, G, T = 4, 16, 16, 2, 4
    slots = [3, PAD, 0]
    b = len(slots)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, T, H, P, generator=g)
    dt = torch.randn(b, T, H, generator=g)
    A = -torch.exp(torch.rand(H, generator=g) * 2)
    B = torch.randn(b, T, G, N, generator=g)
    C = torch.randn(b, T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g) * 0.5
    state0 = torch.randn(5, H, P, N, generator=g).to(state_dtype)
    idx = torch.tensor(slots)

    # T one-token decodes, in place
    dec = state0.clone()
    dec_states, dec_y = [], []
    for t in range(T):
        dec_y.append(tm.selective_state_update(dec, x[:, t], dt[:, t], A, B[:, t], C[:, t], D, dt_bias, idx,
                                               block_p=8))
        dec_states.append(dec.clone())

    # verify: one T-token launch, the state after every token into the scratch
    inter = torch.zeros(b, T, H, P, N, dtype=state_dtype)
    ver = state0.clone()
    y = tm.selective_state_update(ver, x, dt, A, B, C, D, dt_bias, idx, intermediate_states=inter, block_p=8)
    assert torch.equal(ver, state0)
    # replay: one T-token launch in place
    rep = state0.clone()
    y_rep = tm.selective_state_update(rep, x, dt, A, B, C, D, dt_bias, idx, block_p=8)

    live = [i for i, s in enumerate(slots) if s >= 0]  # a padding row is no sequence: each decode starts at 0
    for t in range(T):
        assert torch.equal(y[live, t], dec_y[t][live]), f"verify output differs from decode at token {t}"
        assert torch.equal(y_rep[live, t], dec_y[t][live]), f"replay output differs from decode at token {t}"
        for i in live:
            assert torch.equal(inter[i, t], dec_states[t][slots[i]]), f"verify state differs at token {t}"
    assert torch.equal(rep, dec_states[-1]), "replay's final state differs from T decodes"


@pytest.mark.parametrize("conv_dtype", DTYPES)
def test_conv_multi_token_launch_equals_decodes(conv_dtype):
    """x in fp32, history stored in conv_dtype: a decode reads its past tokens back rounded."""
    tm = _tm()
    CD, K, T = 48, 4, 5  # T > K-1: the window leaves the stored history
    slots = [3, PAD, 0]
    b = len(slots)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(b, T, CD, generator=g)
    conv0 = torch.randn(5, CD, K - 1, generator=g).to(conv_dtype)
    weight = torch.randn(CD, K, generator=g) * 0.5
    bias = torch.randn(CD, generator=g)
    idx = torch.tensor(slots)

    dec = conv0.clone()
    dec_states, dec_y = [], []
    for t in range(T):
        dec_y.append(tm.conv_state_update(x[:, t], dec, weight, bias, idx, "silu", block_c=32))
        dec_states.append(dec.clone())
    inter = torch.zeros(b, T, CD, K - 1, dtype=conv_dtype)
    ver = conv0.clone()
    y = tm.conv_state_update(x, ver, weight, bias, idx, "silu", intermediate_states=inter, block_c=32)
    assert torch.equal(ver, conv0)
    rep = conv0.clone()
    y_rep = tm.conv_state_update(x, rep, weight, bias, idx, "silu", block_c=32)

    live = [i for i, s in enumerate(slots) if s >= 0]
    for t in range(T):
        assert torch.equal(y[live, t], dec_y[t][live]), f"verify conv output differs from decode at token {t}"
        assert torch.equal(y_rep[live, t], dec_y[t][live]), f"replay conv output differs from decode at token {t}"
        for i in live:
            assert torch.equal(inter[i, t], dec_states[t][slots[i]]), f"verify conv state differs at token {t}"
    assert torch.equal(rep, dec_states[-1])


# ---------------------------------------------------------------- the mixer's paths


def _batch(kind, slots, q_lens, scratch=None, scratch_tensors=None):
    """A step of only verify rows or only replay rows (plus nothing else)."""
    n_tok, n = sum(q_lens), len(q_lens)
    z = torch.zeros(n_tok, dtype=torch.long)
    extra = dict(num_verify=n, scratch_index=torch.tensor(scratch),
                 scratch_index_cpu=list(scratch), state_scratch=scratch_tensors) if kind == "verify" \
        else dict(num_replay=n)
    return StepBatch(
        input_ids=z, positions=z, query_start_loc=torch.zeros(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(q_lens, dtype=torch.int32), page_table=torch.zeros(n, 1, dtype=torch.int32),
        kv_write_loc=z, state_slot=torch.tensor(slots), has_initial_state=torch.ones(n, dtype=torch.bool),
        logits_indices=torch.arange(n_tok), num_decodes=0, num_prefills=0, query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(q_lens), state_slot_cpu=list(slots), has_initial_state_cpu=[True] * n, **extra,
    )


def _setup(tiny_ckpt, make_llm, ssm_dtype):
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=4, mamba_ssm_dtype=ssm_dtype)
    mixer = llm.model.mamba_mixers()[0]
    pool = llm.state_pool
    pool.enable_spec_scratch(3, 4)
    g = torch.Generator().manual_seed(0)
    conv, ssm = pool.layer(mixer.layer_index)
    conv.copy_(torch.randn(conv.shape, generator=g))
    ssm.copy_(torch.randn(ssm.shape, generator=g) * 0.3)
    return mixer, pool, g


@pytest.mark.parametrize("ssm_dtype", DTYPES)
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_verify_and_replay_equal_decodes(tiny_ckpt, make_llm, ssm_dtype, impl):
    """A verify step's scratch (every position) and outputs, and a replay step's slots and outputs,
    equal the same tokens decoded one step at a time, bit for bit: our Triton dispatch
    (mamba_cuda.triton_verify / triton_replay vs triton_recurrence) and the torch reference
    (Mamba2Mixer._verify / _replay vs _recurrence_step)."""
    mixer, pool, g = _setup(tiny_ckpt, make_llm, ssm_dtype)
    cfg = mixer.cfg
    conv, ssm = pool.layer(mixer.layer_index)
    conv0, ssm0 = conv.clone(), ssm.clone()
    slots, q_lens, scratch = [3, 0, 2], [3, 2, 4], [1, 0, 2]  # two token counts: two launches
    n_tok = sum(q_lens)
    first = [sum(q_lens[:i]) for i in range(len(q_lens))]
    xBC = torch.randn(n_tok, cfg.conv_dim, generator=g)
    dt = torch.randn(n_tok, cfg.num_heads, generator=g) * 0.5
    A = -torch.exp(mixer.A_log.float())
    H, P = cfg.num_heads, cfg.head_dim
    if impl == "triton":
        tm = _tm()
        from hybrid.ops import mamba_cuda

        params = {"A": A, "D": mixer.D.float(), "dt_bias": mixer.dt_bias.float()}

        def decode(tok, idx):
            return mamba_cuda.triton_recurrence(tm, mixer, params, xBC[tok], dt[tok], conv, ssm, idx).float()

        def verify(y, b):
            mamba_cuda.triton_verify(tm, mixer, xBC, dt, params, y, b, conv, ssm)

        def replay(y, b):
            mamba_cuda.triton_replay(tm, mixer, xBC, dt, params, y, b, conv, ssm)
    else:
        def decode(tok, idx):
            return mixer._recurrence_step(xBC[tok], dt[tok], A, conv, ssm, idx)

        def verify(y, b):
            mixer._verify(xBC, dt, A, y, b, conv, ssm)

        def replay(y, b):
            mixer._replay(xBC, dt, A, y, b, conv, ssm)

    # the reference: each row's tokens as one-token decode steps on its slot
    y_dec = torch.zeros(n_tok, H, P)
    states = {}  # (row, position) -> (conv, ssm) of the slot after that token
    for j in range(max(q_lens)):
        rows = [i for i, q in enumerate(q_lens) if q > j]
        tok = torch.tensor([first[i] + j for i in rows])
        y_dec[tok] = decode(tok, torch.tensor([slots[i] for i in rows]))
        for i in rows:
            states[i, j] = (conv[slots[i]].clone(), ssm[slots[i]].clone())
    decoded = (conv.clone(), ssm.clone())

    conv.copy_(conv0)
    ssm.copy_(ssm0)
    pool.spec_conv.zero_()
    pool.spec_ssm.zero_()
    y = torch.zeros(n_tok, H, P)
    verify(y, _batch("verify", slots, q_lens, scratch, pool.spec_scratch))
    assert torch.equal(conv, conv0) and torch.equal(ssm, ssm0), "verify wrote a slot"
    assert torch.equal(y, y_dec), "verify outputs differ from decoding"
    for (i, j), (c, s) in states.items():
        assert torch.equal(pool.spec_conv[mixer.layer_index, scratch[i], j], c), f"conv state, row {i} token {j}"
        assert torch.equal(pool.spec_ssm[mixer.layer_index, scratch[i], j], s), f"ssm state, row {i} token {j}"

    y = torch.zeros(n_tok, H, P)
    replay(y, _batch("replay", slots, q_lens))
    assert torch.equal(y, y_dec), "replay outputs differ from decoding"
    assert torch.equal(conv, decoded[0]) and torch.equal(ssm, decoded[1]), "replay's slots differ from decoding"
