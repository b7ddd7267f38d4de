"""The trtllm backend's bookkeeping, on CPU with a stand-in flashinfer module (the kernels themselves
run on the GPU: tests/gpu). What is checked here:
- each kernel family gets its own workspace: XQA's semaphores (start of the decode workspace) can
  never be written by FlashInfer's split-KV prefill (offset 0 of its float workspace);
- prefill plans rotate through a ring of wrappers, and a wrapper is re-planned only after waiting
  on the event recorded after its previous plan (its pinned staging copy may still be queued under
  async scheduling);
- head dims without a FlashInfer prefill kernel run our Triton paged prefill kernel (through the
  interpreter here), logged once.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

pytest.importorskip("triton")


class FakeEvent:
    log: list = []

    def __init__(self) -> None:
        self.id = len(FakeEvent.log)

    def record(self) -> None:
        FakeEvent.log.append(("record", self.id))

    def synchronize(self) -> None:
        FakeEvent.log.append(("wait", self.id))


class FakeWrapper:
    def __init__(self, workspace, kv_layout) -> None:
        self.workspace = workspace
        self.plans = []

    def plan(self, *args, **kwargs) -> None:
        FakeEvent.log.append(("plan", id(self)))
        self.plans.append(args)

    def run(self, q, kv_layer):
        return torch.zeros_like(q)


@pytest.fixture
def backend(monkeypatch):
    decode_calls = []
    fi = types.ModuleType("flashinfer")
    fi.BatchPrefillWithPagedKVCacheWrapper = FakeWrapper
    fi_decode = types.ModuleType("flashinfer.decode")

    def fake_decode(**kw):
        decode_calls.append(kw["workspace_buffer"])
        b.decode_kwargs.append(kw)
        return torch.zeros_like(kw["query"])

    fi_decode.trtllm_batch_decode_with_kv_cache = fake_decode
    fi.decode = fi_decode
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", fi_decode)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    import attention.trtllm as trt

    monkeypatch.setattr(trt, "_WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(trt, "write_kv_fused", lambda *a: None)
    FakeEvent.log = []
    b = trt.TrtllmAttentionBackend()
    b.decode_calls = decode_calls
    b.decode_kwargs = []
    return b


def _batch(query_lens, seq_lens, page_size=16):
    from hybrid.batch import StepBatch

    n = len(query_lens)
    width = max(-(-s // page_size) for s in seq_lens)
    table = torch.arange(1, 1 + n * width, dtype=torch.int32).view(n, width)
    T = sum(query_lens)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    decodes = sum(q == 1 for q in query_lens) if all(q == 1 for q in query_lens) else 0
    return StepBatch(
        input_ids=torch.zeros(T, dtype=torch.long), positions=torch.zeros(T, dtype=torch.long), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), page_table=table, kv_write_loc=torch.zeros(T, dtype=torch.long),
        state_slot=torch.arange(n), has_initial_state=torch.ones(n, dtype=torch.bool),
        logits_indices=qsl[1:].long() - 1, num_decodes=decodes, num_prefills=n - decodes,
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens), state_slot_cpu=list(range(n)),
        has_initial_state_cpu=[True] * n,
    )


def _run(backend, batch, heads=4, kv_heads=2, head_dim=64):
    T = batch.num_tokens
    q = torch.randn(T, heads, head_dim, dtype=torch.bfloat16)
    kv = torch.zeros(40, 2, kv_heads, 16, head_dim, dtype=torch.bfloat16)
    k = torch.randn(T, kv_heads, head_dim, dtype=torch.bfloat16)
    return backend.forward(q, k, k, kv, batch, 0.125)


def test_decode_and_prefill_never_share_a_workspace(backend):
    _run(backend, _batch([5, 3], [300, 40]))  # a short chunk over a long history: split-KV prefill
    _run(backend, _batch([1, 1], [301, 41]))  # then a decode
    _run(backend, _batch([7], [7]))  # the second prefill wrapper of the ring
    decode_ws = backend.decode_calls[0]
    prefill_ws = [w.workspace for w in backend._plans._wrappers]
    assert len(prefill_ws) == 2
    buffers = [decode_ws] + prefill_ws
    ptrs = {b.untyped_storage().data_ptr() for b in buffers}
    assert len(ptrs) == len(buffers), "two kernel families share a workspace"


def test_prefill_plans_rotate_and_wait_for_their_previous_copies(backend):
    wrappers = []
    for step in range(5):
        b = _batch([4, 2], [20 + step, 10])
        _run(backend, b)
        _run(backend, b)  # the next attention layer of the same step: no new plan
        wrappers.append(backend._plans.current)
    assert wrappers[0] is not wrappers[1] and wrappers[0] is wrappers[2] is wrappers[4]
    assert sum(len(w.plans) for w in backend._plans._wrappers) == 5  # one plan per step
    log = FakeEvent.log
    plans = [i for i, e in enumerate(log) if e[0] == "plan"]
    # from the third plan on, each is preceded by a wait on the event recorded after the plan two steps back
    for n, i in enumerate(plans[2:], start=2):
        recorded = [e[1] for e in log[: plans[n - 2] + 2] if e[0] == "record"][-1]
        assert log[i - 1] == ("wait", recorded)


def test_head_dim_without_prefill_kernel_runs_the_triton_kernel_logged_once(backend, caplog):
    """Zamba2's 160 / 224-wide heads have no FlashInfer prefill kernel: the prefill runs our Triton
    paged prefill kernel (attention/triton_prefill.py; here through the interpreter), which matches
    the torch reference over the same pages, and the log says so once, not per layer or step."""
    import logging
    import os

    from attention.reference import TorchAttentionBackend

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernel on CPU tensors: needs TRITON_INTERPRET=1 (tests/conftest.py)")
    batch = _batch([1, 5, 3], [30, 37, 3])  # a decode row, a chunk over a history, a first chunk
    g = torch.Generator().manual_seed(0)
    # fp16: Triton's interpreter multiplies bf16 tiles as raw bits (tests/test_triton_prefill_attention.py)
    q = torch.randn(batch.num_tokens, 4, 160, generator=g).half()
    kv = torch.randn(40, 2, 2, 16, 160, generator=g).half()
    with caplog.at_level(logging.INFO, logger="attention.trtllm"):
        out = backend.forward(q, q[:, :2], q[:, :2], kv, batch, 160 ** -0.5)
        backend.forward(q, q[:, :2], q[:, :2], kv, batch, 160 ** -0.5)
    logged = [r for r in caplog.records if "head dim 160" in r.getMessage()]
    assert len(logged) == 1 and "triton_prefill" in logged[0].getMessage()
    ref = TorchAttentionBackend().attend(q.float(), kv.float(), batch, 160 ** -0.5)
    assert out.shape == (batch.num_tokens, 4 * 160) and torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
    assert not backend._plans or not any(w.plans for w in backend._plans._wrappers), "no FlashInfer prefill plan"


def test_padded_verify_steps_use_the_decode_kernel_with_a_causal_mask(backend):
    """A padded verify step (every row K+1 tokens: graphs/padding.pad_verify_batch) runs on the decode
    kernel in its speculative mode (no prefill plan: capturable), with XQA's bit-packed causal mask
    over each request's new tokens; the mask is built once per shape and reused."""
    import dataclasses

    for step in range(2):
        b = dataclasses.replace(_batch([4, 4, 4], [20, 9, 33]), num_decodes=0, num_prefills=0, num_verify=3,
                                uniform_q_len=4)
        out = _run(backend, b)
        assert out.shape == (12, 4 * 64)
    kw = backend.decode_kwargs[-1]
    assert kw["q_len_per_req"] == 4 and backend._plans is None  # no prefill wrapper was planned
    mask = kw["mask"]
    assert mask.dtype == torch.uint16 and mask.shape == (3, 4, 2)
    assert mask[0].tolist() == [[1, 0], [3, 0], [7, 0], [15, 0]] and torch.equal(mask[2], mask[0])
    assert backend.decode_kwargs[0]["mask"] is mask
    assert torch.equal(kw["seq_lens"], b.seq_lens) and kw["block_tables"] is b.page_table
    wide = backend._causal_mask(1, 33, torch.device("cpu"))
    assert wide.shape == (1, 33, 4) and wide[0, 32].tolist() == [65535, 65535, 1, 0]


def test_xqa_builds_only_for_unpadded_heads():
    from attention.trtllm import xqa_builds

    assert all(xqa_builds(d) for d in (16, 32, 64, 128, 256))
    assert not any(xqa_builds(d) for d in (80, 96, 160, 224, 512))


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_decode_and_verify_at_a_head_dim_xqa_cannot_build_run_the_triton_kernel(backend, kind):
    """sm_90's XQA refuses to build for a 160-wide head (Zamba2-2.7B: a static assertion at JIT time,
    seen on the H200): decode and padded verify steps at such a head dim run our Triton paged kernel,
    which matches the torch reference and never calls the decode entry point."""
    import dataclasses
    import os

    from attention.reference import TorchAttentionBackend

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernel on CPU tensors: needs TRITON_INTERPRET=1 (tests/conftest.py)")
    if kind == "decode":
        batch = _batch([1, 1, 1], [30, 7, 17])
    else:
        batch = dataclasses.replace(_batch([3, 3], [20, 9]), num_decodes=0, num_prefills=0, num_verify=2,
                                    uniform_q_len=3)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch.num_tokens, 4, 160, generator=g).half()
    kv = torch.randn(40, 2, 2, 16, 160, generator=g).half()
    out = backend.forward(q, q[:, :2], q[:, :2], kv, batch, 160 ** -0.5)
    ref = TorchAttentionBackend().attend(q.float(), kv.float(), batch, 160 ** -0.5)
    assert backend.decode_calls == [], "the XQA entry point was called for a head dim it cannot build"
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_sm100_runs_the_triton_kernel_at_head_dims_outside_64_128_256(backend, kind):
    """On sm_100 the decode and context entry points are trtllm-gen's prebuilt kernels (64/128/256
    heads): a 160-wide head runs the Triton kernel in every kind of step there too."""
    import os

    from attention.reference import TorchAttentionBackend
    from attention.trtllm import decode_kernel_builds

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernel on CPU tensors: needs TRITON_INTERPRET=1 (tests/conftest.py)")
    assert decode_kernel_builds(128, 10) and not decode_kernel_builds(160, 10) and decode_kernel_builds(16, 9)
    backend._sm = 10
    backend.context_sm100 = lambda *a, **k: pytest.fail("trtllm-gen's context kernel at head dim 160")
    batch = _batch([1, 1], [30, 7]) if kind == "decode" else _batch([5, 3], [37, 3])
    g = torch.Generator().manual_seed(2)
    q = torch.randn(batch.num_tokens, 4, 160, generator=g).half()
    kv = torch.randn(40, 2, 2, 16, 160, generator=g).half()
    out = backend.forward(q, q[:, :2], q[:, :2], kv, batch, 160 ** -0.5)
    ref = TorchAttentionBackend().attend(q.float(), kv.float(), batch, 160 ** -0.5)
    assert backend.decode_calls == []
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2


def test_which_decode_kernel_each_architecture_gets():
    """FlashInfer's trtllm decode entry point runs XQA on sm_90 / sm_120 (unpadded power-of-two heads)
    and trtllm-gen on sm_100 (64/128/256 assumed); GPUs before sm_90 (A100, L40S) have neither, so
    every head dim is our Triton kernel's there."""
    from attention.trtllm import decode_kernel_builds, uses_trtllm_gen

    assert [uses_trtllm_gen(sm) for sm in (8, 9, 10, 12)] == [False, False, True, False]
    for sm in (9, 12):
        assert decode_kernel_builds(128, sm) and decode_kernel_builds(16, sm) and not decode_kernel_builds(160, sm)
    assert decode_kernel_builds(128, 10) and not decode_kernel_builds(16, 10) and not decode_kernel_builds(160, 10)
    assert not any(decode_kernel_builds(d, sm) for d in (64, 128, 256) for sm in (7, 8))


@pytest.mark.parametrize("sm", [8, 12])
def test_architectures_without_trtllm_gen_route_each_step(backend, sm):
    """sm_80 (no XQA, no trtllm-gen): decode steps run the Triton kernel, never the decode entry point,
    and prefill steps FlashInfer's paged prefill wrapper. sm_120 (XQA, no trtllm-gen): verify steps
    pass XQA its causal mask, and prefill never reaches the sm_100 context kernel."""
    import dataclasses
    import os

    if sm == 8 and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernel on CPU tensors: needs TRITON_INTERPRET=1 (tests/conftest.py)")
    backend._sm = sm
    backend.context_sm100 = lambda *a, **k: pytest.fail("the sm_100 context kernel off sm_100")
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(40, 2, 2, 16, 64, generator=g).half()
    if sm == 8:
        batch = _batch([1, 1], [30, 7])
        q = torch.randn(batch.num_tokens, 4, 64, generator=g).half()
        out = backend.forward(q, q[:, :2], q[:, :2], kv, batch, 64 ** -0.5)
        from attention.reference import TorchAttentionBackend

        ref = TorchAttentionBackend().attend(q.float(), kv.float(), batch, 64 ** -0.5)
        assert backend.decode_calls == [], "XQA was called on sm_80"
        assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
    else:
        b = dataclasses.replace(_batch([4, 4], [20, 9]), num_decodes=0, num_prefills=0, num_verify=2, uniform_q_len=4)
        _run(backend, b)
        assert "mask" in backend.decode_kwargs[-1]
    prefill = _batch([5, 3], [37, 3])
    q = torch.randn(prefill.num_tokens, 4, 64, generator=g).half()
    backend.forward(q, q[:, :2], q[:, :2], kv, prefill, 64 ** -0.5)
    assert backend._plans is not None and any(w.plans for w in backend._plans._wrappers), "FlashInfer's prefill"
