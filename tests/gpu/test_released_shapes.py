"""Every released checkpoint's shape (tests/data/released_configs.json) runs on the GPU (issue 20, item 2).

For each table entry, a few-layer model at the checkpoint's real per-layer dims (one layer of each
kind it has: e.g. Nemotron-H "M-*", Nemotron-3-Nano "ME*", Granite / Bamba mamba + attention,
Falcon-H1 two parallel layers) is built with transformers' own classes, random weights, and saved
in the real HF format (bf16, hub-style config.json): tests/released_shapes.py. Vocab is cut to 4096
(it sizes only the embedding / lm_head GEMMs, not the Mamba or attention kernels), time_step_limit
is (0, inf) (no dt clamp, so prefill and decode compute one function), Falcon-H1's muP multipliers
are 1.0 (they fold into weights; see released_shapes). Then, through hybrid.LLM(device="cuda"):

- CUDA graphs are on and replayed, every generated token is teacher-forced against a plain engine
  (gpu_util.assert_greedy_under_reference), with chunked prefill, async scheduling and the state
  sanitizer on; no Mamba layer is on the torch path and attention is not on the torch backend;
- a graph replay of a padded decode batch equals the eager run of the same batch, bit for bit;
- speculative decoding (ngram, K=3) and prefix caching, each teacher-forced the same way.

Which kernels were chosen: the code exposes the attention backend's `name` and the Mamba kernels'
`decode_kernels` (MambaCudaKernels); both are printed (run with -s) and checked. It names no
per-shape choice (e.g. an XQA refusal and its fallback); when a backend grows attributes for that,
`_kernel_report` prints them too.

HYBRID_RELEASED=name1,name2 (or -k name) runs a subset. Budget: a few-layer model is at most ~1.4 B
parameters (Nemotron-3-Nano's 128-expert layer, Granite-H-Small's two 72-expert layers, 2.8 GB in
bf16); each entry builds one checkpoint (on the GPU) and four engines, ~15-30 s of its own. On a
fresh machine the time goes to compiling for each new shape (Triton kernels, mamba-ssm's autotuned
SSD kernels, FlashInfer's JIT per head ratio), so the 15 entries take longer than one 10-minute
device call: run them in groups, e.g. HYBRID_RELEASED=nemotron-h-8b,nemotron-h-47b,nemotron-h-56b,...
"""
from __future__ import annotations

import gc
import logging
import os
import shutil
import sys
import zlib

import pytest
import torch

from hybrid import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import released_shapes  # noqa: E402
from gpu_util import GREEDY, assert_greedy_under_reference  # noqa: E402

NAMES = released_shapes.names()
if os.environ.get("HYBRID_RELEASED"):
    _want = set(os.environ["HYBRID_RELEASED"].split(","))
    NAMES = [n for n in NAMES if n in _want]

VOCAB = released_shapes.GPU_VOCAB
PAGE = 16
MAX_LEN = 256
UTIL = 0.3  # of the H200's memory per engine (at most a reference + two engines are alive at once)
# The logits are bf16: at the real widths they reach |8-16|, where a bf16 step is 0.0625, and the
# engine and the reference (other chunking, other kernels) may round a pair of them 2 steps apart
# (measured: 0.125 nats on nemotron-h-8b). A near-tie is within 4 steps.
NEAR_TIE = 0.25


def flips(e: dict) -> int:
    """Routing flips a test's tokens may show (gpu_util.assert_greedy_under_reference): two for an
    MoE shape (granite-4.0-h-tiny showed one of 0.5 nats in 64 tokens on the H200), none for a dense one."""
    cfg = e["config"]
    return 2 if (cfg.get("num_local_experts") or cfg.get("n_routed_experts")) else 0


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (n,), generator=g).tolist()


# lengths: one token; under one page; several 32-token prefill chunks (chunked while others decode)
PROMPTS = [random_prompt(n, 100 + n) for n in (1, 7, 40, 75)]


def periodic_prompt(period: int, reps: int, seed: int) -> list[int]:
    """A prompt ending in a repeated pattern: its last n-gram recurs, so prompt-lookup drafts exist
    from the first decode step."""
    return random_prompt(3, seed + 1) + random_prompt(period, seed) * reps


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def engine(path: str, **kw) -> LLM:
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("page_size", PAGE)
    kw.setdefault("max_model_len", MAX_LEN)
    kw.setdefault("max_num_batched_tokens", 32)  # prompts of 40 and 75 tokens take several chunks
    kw.setdefault("check_state", True)
    kw.setdefault("gpu_memory_utilization", UTIL)
    return LLM(path, device="cuda", **kw)


def assert_clean(llm: LLM) -> None:
    held = len(llm.engine.prefix_cache) if llm.engine.prefix_cache is not None else 0
    assert llm.state_pool.num_free == llm.state_pool.num_slots - held
    if not held:
        assert llm.kv_cache.allocator.num_free == llm.kv_cache.num_pages - 1


def _kernel_report(llm: LLM) -> dict:
    """What the code says it chose, for the log: attention backend, Mamba kernels, fused ops, and any
    per-shape selection a backend exposes (none does yet)."""
    backend = llm.runner.ctx.attention_backend
    mixers = llm.model.mamba_mixers()
    kernels = {type(m.kernels).__name__ if m.kernels is not None else "torch" for m in mixers}
    decode = {getattr(m.kernels, "decode_kernels", None) for m in mixers if m.kernels is not None}
    report = {"attention_backend": getattr(backend, "name", type(backend).__name__),
              "mamba_kernels": sorted(kernels), "mamba_decode_kernels": sorted(str(d) for d in decode),
              "use_graphs": llm.runner.use_graphs}
    for attr in ("kernel_names", "selected_kernels", "chosen", "describe"):
        value = getattr(backend, attr, None)
        if value is not None:
            report[f"attention_backend.{attr}"] = value() if callable(value) else value
    return report


def assert_no_silent_torch_path(llm: LLM) -> None:
    report = _kernel_report(llm)
    print(f"\n{llm.model_dir}: {report}")
    assert report["attention_backend"] != "torch", report
    assert report["mamba_kernels"] == ["MambaCudaKernels"], report  # every Mamba layer on the CUDA kernels
    # the trtllm backend runs prefill on FlashInfer for head dims 64/128/256 and on our Triton paged
    # prefill kernel for the others (Zamba2's 160 / 224): that kernel must be there, never the torch
    # reference
    from attention import trtllm, triton_prefill

    dims = getattr(trtllm, "_PREFILL_HEAD_DIMS", None)
    if report["attention_backend"] == "trtllm" and dims is not None and torch.cuda.get_device_capability()[0] < 10:
        assert llm.config.attention.head_dim in dims or triton_prefill.HAS_TRITON, llm.config.attention.head_dim


# ----------------------------------------------------------------------------------------------
# fixtures: one checkpoint per table entry (built, served, deleted before the next one)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=NAMES)
def released(request, tmp_path_factory):
    e = released_shapes.entry(request.param)
    path = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    released_shapes.build_checkpoint(e, path, device="cuda", seed=zlib.crc32(request.param.encode()) % 2**31)
    _free()
    yield e, str(path)
    shutil.rmtree(path, ignore_errors=True)
    _free()


@pytest.fixture(scope="module")
def reference(released):
    """The plain engine the tokens are teacher-forced against: eager, synchronous, whole prompts in
    one chunk."""
    _, path = released
    ref = LLM(path, device="cuda", enforce_eager=True, async_scheduling=False, max_num_seqs=8, page_size=PAGE,
              max_model_len=MAX_LEN, max_num_batched_tokens=2048, gpu_memory_utilization=UTIL)
    yield ref
    del ref
    _free()


@pytest.fixture(scope="module")
def graphs_llm(released, caplog_module):
    _, path = released
    with caplog_module():
        llm = engine(path, max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8])
    yield llm
    del llm
    _free()


@pytest.fixture(scope="module")
def caplog_module():
    """Collect the hybrid logger's startup lines (memory plan, graph capture, kernel warnings) and
    print them: the log is where a kernel choice or fallback would be named."""
    import contextlib

    @contextlib.contextmanager
    def collect():
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append
        log = logging.getLogger("hybrid")
        old = log.level
        log.setLevel(logging.INFO)
        log.addHandler(handler)
        try:
            yield records
        finally:
            log.removeHandler(handler)
            log.setLevel(old)
            for r in records:
                print(f"[hybrid {r.levelname}] {r.getMessage()}")
            assert not [r for r in records if "torch path" in r.getMessage()], "a Mamba layer fell back to torch"

    return collect


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------


def test_graphs_teacher_forced(released, reference, graphs_llm):
    e, _ = released
    llm = graphs_llm
    assert llm.dtype == torch.bfloat16 and llm.runner.use_graphs, e["name"]
    assert_no_silent_torch_path(llm)
    sp = SamplingParams(max_tokens=16, **GREEDY)
    got = tokens(llm.generate(PROMPTS, sp, use_tqdm=False))
    assert [len(g) for g in got] == [16] * len(PROMPTS)
    assert llm.runner.stats["graph_replays"] > 0, "decode did not replay graphs"
    assert_greedy_under_reference(reference, PROMPTS, got, NEAR_TIE, routing_flips=flips(e))
    assert_clean(llm)


def test_graph_replay_equals_eager_on_a_decode_batch(released, graphs_llm):
    """tests/gpu/test_graphs.py's check at the released shape: one padded decode batch (3 rows in
    the 4-row graph, slots out of order), state and KV randomized; the replay and an eager run of
    the same padded batch give the same logits and the same live states, bit for bit."""
    import dataclasses

    from graphs.padding import pad_decode_batch
    from test_graph_padding import decode_batch

    llm = graphs_llm
    slots, seq_lens = [7, 2, 0], [5, 8, 11]
    pages = [[1 + 2 * i, 2 + 2 * i] for i in range(len(slots))]
    cpu = decode_batch(slots, seq_lens, pages, llm.config.vocab_size, llm.engine.max_pages_per_seq, seed=3)
    batch = dataclasses.replace(cpu, **{f: getattr(cpu, f).to(llm.device) for f in (
        "input_ids", "positions", "query_start_loc", "seq_lens", "page_table", "kv_write_loc", "state_slot",
        "has_initial_state", "logits_indices")})
    pool, kv = llm.state_pool, llm.kv_cache
    g = torch.Generator(device=llm.device).manual_seed(0)
    pool.conv_state.copy_(torch.randn(pool.conv_state.shape, generator=g, device=llm.device))
    pool.ssm_state.copy_(torch.randn(pool.ssm_state.shape, generator=g, device=llm.device) * 0.3)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=g, device=llm.device))
    snap = [pool.conv_state.clone(), pool.ssm_state.clone(), kv.kv.clone()]
    size = min(s for s in llm.runner.capture_sizes if s >= len(slots))
    assert size in llm.runner.graphs
    eager = llm.runner.model(pad_decode_batch(batch, size, PAGE), llm.runner.ctx)[: len(slots)]
    after_eager = [pool.conv_state.clone(), pool.ssm_state.clone(), kv.kv.clone()]
    pool.conv_state.copy_(snap[0])
    pool.ssm_state.copy_(snap[1])
    kv.kv.copy_(snap[2])
    replays = llm.runner.stats["graph_replays"]
    out = llm.runner.execute(batch)
    torch.cuda.synchronize()
    assert llm.runner.stats["graph_replays"] == replays + 1
    assert torch.isfinite(out).all()
    assert torch.equal(out, eager)
    live = list(range(pool.num_slots))
    assert torch.equal(pool.conv_state[:, live], after_eager[0][:, live])
    assert torch.equal(pool.ssm_state[:, live], after_eager[1][:, live])
    assert torch.equal(kv.kv[:, 1:], after_eager[2][:, 1:])  # all but the dummy page


def test_speculative_decoding_teacher_forced(released, reference):
    """ngram speculation, K=3. A random-weight model's greedy tokens rarely recur in a prompt (the
    vocabulary has 4096 tokens), so the outputs are held to 8 tokens that every prompt contains
    (logit bias +20): each new token's 1-gram then has an earlier occurrence and drafts exist at
    every step; which of the 8 is chosen, and so which drafts are accepted, is still the model's.
    The bias does not bound the choice: a random-weight model's logits may spread past 20 nats
    (Nemotron-3-Nano's do: the same tokens outside the 8 with and without speculation, eager or
    graphs, on the H200: bench/results/diagnose_spec_nemotron_nano_*), so the check is the
    teacher-forced one on the biased scores."""
    e, path = released
    allowed = random_prompt(8, 99)
    bias = {t: 20.0 for t in allowed}
    prompts = [periodic_prompt(5, 4, 1) + allowed, periodic_prompt(3, 6, 2) + allowed, PROMPTS[2] + allowed]
    llm = engine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        assert llm.runner.use_graphs
        assert_no_silent_torch_path(llm)
        sp = SamplingParams(max_tokens=20, logit_bias=bias, **GREEDY)
        got = tokens(llm.generate(prompts, sp, use_tqdm=False))
        assert llm.engine.stats["spec_draft_tokens"] > 0
        print(f"\nspeculation: {llm.engine.stats['spec_accepted_tokens']} of "
              f"{llm.engine.stats['spec_draft_tokens']} drafts accepted")
        assert_greedy_under_reference(reference, prompts, got, NEAR_TIE, logit_bias=bias, routing_flips=flips(e))
        assert_clean(llm)
    finally:
        del llm
        _free()


def test_prefix_caching_teacher_forced(released, reference):
    e, path = released
    first = random_prompt(3 * PAGE + 1, 7)  # cached at its last page boundary (48 tokens)
    follow = [first + random_prompt(9, 8), first + random_prompt(30, 9)]
    llm = engine(path, enable_prefix_caching=True)
    try:
        assert llm.runner.use_graphs
        sp = SamplingParams(max_tokens=12, **GREEDY)
        got_first = tokens(llm.generate([first], sp, use_tqdm=False))
        assert llm.engine.stats["prefix_cache_hits"] == 0 and len(llm.engine.prefix_cache) == 1
        got = tokens(llm.generate(follow, sp, use_tqdm=False))
        assert llm.runner.stats["graph_replays"] > 0
        stats = llm.engine.stats
        assert stats["prefix_cache_hits"] >= 2 and stats["prefix_cache_hit_tokens"] >= 2 * 3 * PAGE, stats
        assert_greedy_under_reference(reference, [first] + follow, got_first + got, NEAR_TIE, routing_flips=flips(e))
        assert_clean(llm)
    finally:
        del llm
        _free()
