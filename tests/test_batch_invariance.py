"""A request's greedy output does not depend on what else the engine is doing.

Each prompt's greedy continuation must be the same
  * alone (its own generate call),
  * in one batch with the others,
  * when it arrives while other requests are mid-decode (engine.add_request / step),
  * when requests must wait for a sequence slot (tiny max_num_seqs),
  * when KV pages run out and sequences are preempted and recomputed,
  * next to requests that sample, return logprobs, or are aborted,
and (since each of these is a greedy run) equal to the HF oracle run alone.

Families: NemotronH (MoE routing + dt clamp), Granite 4.0-H MoE, Bamba (RoPE positions, finite
time_step_limit).
"""
from __future__ import annotations

import pytest

from hf_oracle import MAX_NEW, PROMPT_LENGTHS, describe_divergence, oracle_run

NAMES = ["nemotron_h", "granite_moe", "bamba"]


def _greedy(max_tokens=MAX_NEW, **kw):
    from hybrid import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _prompts(prompts_for, name):
    return [prompts_for(name)[n] for n in PROMPT_LENGTHS]


def _alone(llm, prompts, params=None):
    params = params or _greedy()
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def _assert_same(label, prompts, got, ref, path=None):
    bad = []
    for p, g, r in zip(prompts, got, ref):
        if list(g) != list(r):
            k = next((i for i in range(min(len(g), len(r))) if g[i] != r[i]), min(len(g), len(r)))
            line = f"prompt len {len(p)}: {label} differs from alone at token {k}\n    {label}: {list(g)}\n    alone: {list(r)}"
            if path is not None:
                d = describe_divergence(oracle_run(path, p, len(r)), g)
                line += f"\n    vs HF: {d or 'equal to HF'}"
            bad.append(line)
    assert not bad, "\n".join(bad)


def _assert_hf(path, prompts, got, n_new=MAX_NEW):
    bad = [d for p, g in zip(prompts, got) if (d := describe_divergence(oracle_run(path, p, n_new), g))]
    assert not bad, "runtime != HF:\n" + "\n".join(bad)


def _drain(engine, outs: dict, max_steps=10_000):
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    raise AssertionError("engine did not finish")


@pytest.fixture(scope="module")
def alone_cache():
    return {}


def _alone_ref(alone_cache, make_llm, path, prompts):
    """The runtime's own alone outputs (default LLM), memoised per checkpoint."""
    if path not in alone_cache:
        alone_cache[path] = _alone(make_llm(path), prompts)
    return alone_cache[path]


@pytest.mark.parametrize("budget", [None, 16], ids=["default_budget", "budget16"])
@pytest.mark.parametrize("name", NAMES)
def test_alone_equals_batch(name, budget, tiny_ckpt, prompts_for, make_llm, alone_cache):
    path = tiny_ckpt(name)
    prompts = _prompts(prompts_for, name)
    kwargs = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = make_llm(path, **kwargs)
    alone = _alone(llm, prompts)
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]
    # reversed submission order: different batch rows / slots
    rev = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], _greedy(), use_tqdm=False)][::-1]
    _assert_same("batch", prompts, batch, alone, path)
    _assert_same("reversed batch", prompts, rev, alone, path)
    _assert_hf(path, prompts, alone)
    if budget is None:
        alone_cache[path] = alone


@pytest.mark.parametrize("budget", [None, 16], ids=["default_budget", "budget16"])
@pytest.mark.parametrize("name", NAMES)
def test_arrival_mid_decode(name, budget, tiny_ckpt, prompts_for, make_llm, alone_cache):
    """Requests injected while others are decoding (and one aborted) do not change anything."""
    path = tiny_ckpt(name)
    prompts = _prompts(prompts_for, name)
    ref = _alone_ref(alone_cache, make_llm, path, prompts)
    kwargs = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = make_llm(path, **kwargs)
    eng = llm.engine
    outs: dict = {}

    def step(n):
        for _ in range(n):
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o

    # two requests start; after 5 steps both are decoding
    eng.add_request("r5", prompts[1], _greedy())
    eng.add_request("r1", prompts[0], _greedy())
    step(5)
    # a long prompt arrives: its (chunked) prefill shares steps with the decodes
    eng.add_request("r27", prompts[4], _greedy())
    # a victim that will be aborted mid-prefill/decode
    eng.add_request("victim", prompts[3], _greedy(max_tokens=64))
    step(3)
    eng.add_request("r8", prompts[2], _greedy())
    step(2)
    eng.abort_request("victim")
    step(4)
    eng.add_request("r17", prompts[3], _greedy())
    _drain(eng, outs)
    assert "victim" not in outs or outs["victim"].outputs[0].finish_reason not in ("length", "stop")
    order = ["r1", "r5", "r8", "r17", "r27"]
    assert set(order) <= set(outs), sorted(outs)
    got = [outs[r].outputs[0].token_ids for r in order]
    _assert_same("mid-decode arrival", prompts, got, ref, path)


@pytest.mark.parametrize("max_num_seqs", [1, 2])
@pytest.mark.parametrize("name", NAMES)
def test_waiting_for_slots(name, max_num_seqs, tiny_ckpt, prompts_for, make_llm, alone_cache):
    """More requests than sequence slots: the rest wait, then reuse freed slots (state reset)."""
    path = tiny_ckpt(name)
    prompts = _prompts(prompts_for, name)
    ref = _alone_ref(alone_cache, make_llm, path, prompts)
    llm = make_llm(path, max_num_seqs=max_num_seqs, max_num_batched_tokens=16)
    # different max_tokens so slots free up at different times
    params = [_greedy(max_tokens=MAX_NEW - 3 * i) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    _assert_same(f"max_num_seqs={max_num_seqs}", prompts, got, [r[: MAX_NEW - 3 * i] for i, r in enumerate(ref)], path)


@pytest.mark.parametrize("name", NAMES)
def test_kv_page_pressure(name, tiny_ckpt, prompts_for, make_llm, alone_cache):
    """So few KV pages that running sequences must be preempted (and later recomputed)."""
    path = tiny_ckpt(name)
    prompts = _prompts(prompts_for, name)
    ref = _alone_ref(alone_cache, make_llm, path, prompts)
    # 6 usable pages of 16 tokens; each request needs up to 4 (27 + 32 tokens)
    llm = make_llm(path, max_model_len=64, page_size=16, num_kv_pages=7, max_num_seqs=5)
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    stats = getattr(llm.engine, "stats", None)
    _assert_same(f"under KV pressure (engine stats {stats})", prompts, got, ref, path)


@pytest.mark.parametrize("name", ["nemotron_h", "granite_moe"])
def test_mixed_sampling_params(name, tiny_ckpt, prompts_for, make_llm, alone_cache):
    """Greedy requests next to sampled / logprob / short requests keep their outputs."""
    from hybrid import SamplingParams

    path = tiny_ckpt(name)
    prompts = _prompts(prompts_for, name)
    ref = _alone_ref(alone_cache, make_llm, path, prompts)
    llm = make_llm(path)
    params = [
        _greedy(),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=123, max_tokens=MAX_NEW, ignore_eos=True),
        _greedy(logprobs=3),
        SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True),
        _greedy(),
    ]
    all_prompts = prompts + prompts[:3]
    all_params = params + [SamplingParams(temperature=1.3, seed=7, max_tokens=40, ignore_eos=True)] * 3
    outs = llm.generate(all_prompts, all_params, use_tqdm=False)
    greedy_idx = [0, 2, 4]
    got = [outs[i].outputs[0].token_ids for i in greedy_idx]
    _assert_same("mixed batch", [prompts[i] for i in greedy_idx], got, [ref[i] for i in greedy_idx], path)
    assert len(outs[3].outputs[0].token_ids) == 5
    assert len(outs[1].outputs[0].token_ids) == MAX_NEW
