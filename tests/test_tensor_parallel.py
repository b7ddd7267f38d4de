"""Tensor parallelism on CPU (gloo, 2 processes): tensor_parallel_size=2 against 1 for every family.

Tolerance: fp32, the same greedy tokens, and the top-5 logprobs of every generated token within
LOGPROB_TOL (2e-4, absolute) of tensor_parallel_size=1. The sums differ only in their order (the
row-parallel all-reduce adds the ranks' partial products; measured up to ~5e-5 on zamba2).
One LLM per family and setting (a tp=2 LLM costs a spawned process: ~3 s here)."""
from __future__ import annotations

import os
import signal
import time

import pytest
import tiny_checkpoints

from hybrid import LLM, SamplingParams
from hybrid.errors import ConfigurationError, EngineDeadError

LOGPROB_TOL = 2e-4
FAMILIES = ["nemotron_h", "granite_dense", "granite_moe", "bamba", "falcon_h1", "falcon_h1_norm", "zamba2",
            "zamba2_rope", "nemotron_h_sharded", "nemotron_h_latent"]
PROMPTS = [[5, 9, 13, 22, 7, 31, 40, 11, 12, 50, 6], [8, 19, 33], list(range(4, 30))]


def _llm(path, **kw) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", **kw)


def _close(llm: LLM) -> None:
    if llm.parallel is not None:
        llm.parallel.shutdown()


def _assert_same(a, b) -> None:
    """Same tokens on every output of every request; logprobs within LOGPROB_TOL."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for oa, ob in zip(ra.outputs, rb.outputs):
            assert oa.token_ids == ob.token_ids
            if oa.logprobs is None:
                continue
            for la, lb in zip(oa.logprobs, ob.logprobs):
                for tok in set(la) & set(lb):
                    va, vb = la[tok], lb[tok]
                    va, vb = getattr(va, "logprob", va), getattr(vb, "logprob", vb)
                    assert abs(va - vb) <= LOGPROB_TOL, (tok, va, vb)


def _compare(path, params, prompts=PROMPTS, **kw) -> tuple[LLM, LLM]:
    one = _llm(path, **kw)
    out1 = one.generate(prompts, params, use_tqdm=False)
    two = _llm(path, tensor_parallel_size=2, **kw)
    try:
        assert two.parallel is not None and len(two.parallel.procs) == 1
        _assert_same(out1, two.generate(prompts, params, use_tqdm=False))
    finally:
        _close(two)
    return one, two


@pytest.mark.parametrize("name", FAMILIES)
def test_tp2_matches_tp1_greedy(tiny_ckpt, name):
    _compare(tiny_ckpt(name), SamplingParams(max_tokens=10, temperature=0.0, logprobs=5))


def test_tp2_replicated_kv_head_and_padded_vocab(tmp_path):
    """One kv head (replicated on both ranks) and an odd vocabulary (the last rank's rows padded)."""
    p = tiny_checkpoints.build_zamba2(tmp_path / "z", seed=21, n_kv_heads=1, attention_adapters=False,
                                      vocab_size=177)
    _compare(p, SamplingParams(max_tokens=8, temperature=0.0, logprobs=5))


def test_tp2_n_sampling_speculation(tiny_ckpt):
    """n > 1 (forks copy the parent's slot on every rank) with seeded sampling, then ngram speculation
    (verify scratch on every rank, the accepted position committed everywhere)."""
    path = tiny_ckpt("nemotron_h")
    _compare(path, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, logprobs=2))
    rep = [4, 5, 6, 7, 8, 4, 5, 6, 7, 8, 4, 5, 6, 7, 8]  # repeats: the ngram proposer drafts
    one, two = _compare(path, SamplingParams(max_tokens=12, temperature=0.0, logprobs=3), prompts=[rep, PROMPTS[0]],
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert two.engine.stats["spec_draft_tokens"] > 0 and \
        two.engine.stats["spec_accepted_tokens"] == one.engine.stats["spec_accepted_tokens"]


def test_tp2_prefix_caching_preemption_sanitizer(tiny_ckpt):
    """Prefix-cache snapshots and hits, preemption (too few KV pages for all the sequences) and the
    state sanitizer, all with the slots the driver decides applied on both ranks."""
    path = tiny_ckpt("granite_moe")
    shared = list(range(4, 40))
    prompts = [shared + [50 + i] for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3)
    kw = dict(enable_prefix_caching=True, num_kv_pages=16, max_num_seqs=4, page_size=8, max_model_len=64,
              check_state=True)
    one = _llm(path, **kw)
    out1 = one.generate(prompts[:1], params, use_tqdm=False) + one.generate(prompts[1:], params, use_tqdm=False)
    two = _llm(path, tensor_parallel_size=2, **kw)
    try:
        out2 = two.generate(prompts[:1], params, use_tqdm=False) + two.generate(prompts[1:], params, use_tqdm=False)
        _assert_same(out1, out2)
        for key in ("prefix_cache_hits", "preemptions"):
            assert two.engine.stats[key] == one.engine.stats[key] > 0, key
        # per rank: the slots freed (and poisoned by the sanitizer) are those of tp=1, on both ranks
        from hybrid.parallel.protocol import slots_with_nan

        poisoned = slots_with_nan(one.state_pool)
        assert any(poisoned) and two.parallel.slots_with_nan_per_rank() == [poisoned, poisoned]
    finally:
        _close(two)


def test_killed_worker_ends_engine(tiny_ckpt):
    llm = _llm(tiny_ckpt("bamba"), tensor_parallel_size=2)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
        os.kill(llm.parallel.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker rank 1 .* died"):
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert time.monotonic() - start < 10
        with pytest.raises(EngineDeadError):  # and it stays down
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
    finally:
        _close(llm)


def test_raising_worker_ends_engine(tiny_ckpt, monkeypatch):
    monkeypatch.setenv("HYBRID_TP_FAULT_RANK1_STEP", "3")  # read by the spawned worker
    llm = _llm(tiny_ckpt("bamba"), tensor_parallel_size=2)
    try:
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="(?s)worker rank 1 failed.*injected fault at step 3"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        _close(llm)


def test_shapes_that_do_not_divide_are_refused(tiny_ckpt):
    # nemotron_h: 8 Mamba heads, 4 attention heads, 2 kv heads, 2 groups: 3 divides none of them
    with pytest.raises(ConfigurationError, match=r"tensor_parallel_size=3 .*Mamba heads \(num_heads=8\).*"
                                                 r"attention heads \(num_attention_heads=4\)"):
        _llm(tiny_ckpt("nemotron_h"), tensor_parallel_size=3)
    with pytest.raises(ConfigurationError, match="tensor_parallel_size must be an integer >= 1"):
        _llm(tiny_ckpt("nemotron_h"), tensor_parallel_size=0)


def test_shape_rules():
    """The rules without processes: which shapes a size divides, the local config of a rank."""
    import dataclasses

    from hybrid.config import AttentionConfig, MambaConfig, ModelConfig
    from hybrid.parallel.sharding import ShardRules, check_shapes, local_config

    m = MambaConfig(num_heads=8, head_dim=4, n_groups=2, state_size=4, conv_kernel=4, chunk_size=8, conv_bias=True,
                    proj_bias=False, norm_eps=1e-5, dt_limit=(0.0, float("inf")))
    a = AttentionConfig(num_heads=8, num_kv_heads=2, head_dim=4, scale=0.5, bias=False, rope_theta=None, rotary_dim=4)
    cfg = ModelConfig(family="bamba", vocab_size=11, hidden_size=16, layer_types=("mamba", "attention"),
                      norm_eps=1e-5, mamba=m, attention=a, intermediate_size=24, mlp_act="silu", moe=None,
                      tie_word_embeddings=True, max_position_embeddings=64, eos_token_ids=(0,), bos_token_id=None,
                      torch_dtype="float32")
    check_shapes(cfg, 4)  # 2 groups and 2 kv heads: each replicated on 2 of 4 ranks
    loc = local_config(cfg, 4)
    assert (loc.mamba.num_heads, loc.mamba.n_groups, loc.attention.num_heads, loc.attention.num_kv_heads,
            loc.intermediate_size, loc.vocab_size) == (2, 1, 2, 1, 6, 3)
    # rank 3 of 4: heads 6-7, group 1 (heads 4-7), kv head 1 (q heads 4-7)
    rules = ShardRules(cfg, 4, 3)
    assert rules.mamba_heads == [(6, 8)] and rules.mamba_in[2] == (2 * 32 + 4, 2 * 32 + 8)
    assert rules.qkv == [(24, 32), (32 + 4, 32 + 8), (40 + 4, 40 + 8)]
    with pytest.raises(ConfigurationError, match=r"Mamba groups \(n_groups=2: neither divides the other\)"):
        check_shapes(dataclasses.replace(cfg, mamba=dataclasses.replace(m, num_heads=6, n_groups=2)), 3)
    with pytest.raises(ConfigurationError, match=r"MLP width \(intermediate_size=24\)"):
        check_shapes(cfg, 16)


def test_cli_flag(capsys):
    """`hybrid generate --tensor-parallel-size 2` on the bundled model prints what one process does."""
    from hybrid.cli import main

    args = ["generate", "--prompt", "And the LORD said unto Moses,", "--max-tokens", "8", "--device", "cpu"]
    assert main(args) == 0
    one = capsys.readouterr().out
    assert main(args + ["--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == one
