"""Hardening of the engine and the Python API (issue 12): large seeds, lone surrogates, generate()
validating everything before queueing anything, failed steps that fail only their requests, and
non-finite logits."""
from __future__ import annotations

import pytest
import torch

from hybrid import SamplingParams
from hybrid.errors import HybridError, InvalidRequestError

torch.set_num_threads(1)

GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------------------------------------
# 5. seeds of any size
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [2**62, 2**63, 2**64 - 1, 2**70, 3 * 10**15, -1, -(2**70)])
def test_any_int_seed_samples_deterministically(seed, tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2)
    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=seed, ignore_eos=True)
    a = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert len(a) == 6 and a == b


def test_seed_is_reduced_modulo_2_64(tiny_ckpt, make_llm):
    """Documented: seeds that differ by a multiple of 2**64 sample the same tokens; others do not."""
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2)

    def run(seed):
        sp = SamplingParams(temperature=1.0, max_tokens=8, seed=seed, ignore_eos=True)
        return llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids

    assert run(2**70 + 3) == run(2**70 + 3 + 2**64) == run(2**70 + 3 - 5 * 2**64)
    assert len({tuple(run(s)) for s in (1, 2, 3, 2**70)}) > 1


def test_engine_seed_of_any_size(tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2, seed=2**80)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("seed", [True, 1.5, "7"])
def test_non_int_seed_is_invalid(seed):
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=seed)


# ---------------------------------------------------------------------------------------------
# 6. lone UTF-16 surrogates
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_llm():
    from hybrid import LLM

    return LLM(None, device="cpu", dtype="float32", max_num_seqs=4)


@pytest.mark.parametrize("text", ["abc\ud800def", "\udfff", "ok \ud83d"])
def test_lone_surrogate_prompt_is_invalid(text, default_llm):
    with pytest.raises(InvalidRequestError, match=r"surrogate U\+D[89A-F]"):
        default_llm.generate(text, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="surrogate"):
        default_llm.tokenizer.encode(text)
    assert not default_llm.engine.has_unfinished_requests()


def test_valid_astral_characters_still_encode(default_llm):
    out = default_llm.generate("In the beginning \U0001F600", SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# ---------------------------------------------------------------------------------------------
# 8. generate() validates everything before queueing anything
# ---------------------------------------------------------------------------------------------

def _ok(n=4):
    return SamplingParams(max_tokens=n, **GREEDY)


@pytest.mark.parametrize("bad", [
    SamplingParams(max_tokens=4, logit_bias={99999: 1.0}),  # vocabulary-dependent: only the engine knows
    SamplingParams(max_tokens=4, logit_bias={-1: 1.0}),
])
def test_bad_params_in_a_batch_leave_nothing_queued(bad, default_llm):
    llm = default_llm
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate(["a", "b", "c"], [_ok(), bad, _ok()], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    # the next call runs its own prompts only, and they match a fresh run
    got = llm.generate(["d"], _ok(), use_tqdm=False)
    assert len(got) == 1 and got[0].prompt == "d"


@pytest.mark.parametrize("prompts", [["a", "b\ud800"], ["a", 42], ["a", ""], ["a", [1, 10**9]], ["a", [True]]])
def test_bad_prompt_in_a_batch_leaves_nothing_queued(prompts, default_llm):
    with pytest.raises(InvalidRequestError, match="prompt 1"):
        default_llm.generate(prompts, _ok(), use_tqdm=False)
    assert not default_llm.engine.has_unfinished_requests() and not default_llm.engine.requests


@pytest.mark.parametrize("args", [(42,), (None,), (3.5,), ({"a": 1},), (["a"], "x"), (["a"], 5), (["a"], [None]),
                                  (["a", "b"], [SamplingParams()]), (["a"], {"max_tokens": 3})])
def test_generate_wrong_types_are_invalid_requests(args, default_llm):
    with pytest.raises(InvalidRequestError):
        default_llm.generate(*args, use_tqdm=False)
    assert not default_llm.engine.has_unfinished_requests() and not default_llm.engine.requests


def test_params_mutated_into_invalid_values_are_caught(default_llm):
    sp = _ok()
    sp.max_tokens = "many"
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        default_llm.generate(["a", "b"], [_ok(), sp], use_tqdm=False)
    assert not default_llm.engine.requests


def test_engine_add_request_validates_types(default_llm):
    eng = default_llm.engine
    with pytest.raises(InvalidRequestError):
        eng.add_request("x", 42, _ok())
    with pytest.raises(InvalidRequestError):
        eng.add_request("x", [5, 6], "params")
    assert not eng.requests and not eng.has_unfinished_requests()


def test_async_validate_checks_vocabulary_dependent_params(default_llm):
    """AsyncEngine.validate (what the server calls before answering) refuses what add_request would."""
    from hybrid.async_engine import AsyncEngine

    ae = AsyncEngine(default_llm.engine)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        ae.validate([5, 6], SamplingParams(max_tokens=2, logit_bias={99999: 5.0}))


# ---------------------------------------------------------------------------------------------
# 3. a failed step fails its requests only; the engine keeps serving
# ---------------------------------------------------------------------------------------------

PROMPTS = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [12, 13], "x": [20, 21, 22, 23, 24, 25, 26, 27, 28, 29],
           "c": [30, 31, 32, 33], "d": [40, 41, 42, 43, 44, 45]}


def _params(rid):
    if rid == "c":  # one seeded sampled request: its tokens do not depend on the batch either
        return SamplingParams(temperature=0.9, max_tokens=10, seed=11, ignore_eos=True)
    return SamplingParams(max_tokens=10, **GREEDY)


@pytest.fixture(scope="module")
def solo(tiny_ckpt):
    """Each prompt's tokens when it runs alone."""
    from hybrid import LLM

    llm = LLM(tiny_ckpt("nemotron_h"), device="cpu", dtype="float32", max_num_seqs=2)
    return {rid: llm.generate([p], _params(rid), use_tqdm=False)[0].outputs[0].token_ids for rid, p in PROMPTS.items()}


def _inject(monkeypatch, eng, rid, at=1, error=None):
    """Make the runner raise once, in the `at`-th step whose batch holds request `rid`; returns the
    request ids that were in that step."""
    real = eng.runner.execute
    seen = {"n": 0, "in_step": None}

    def execute(batch):
        req = eng.requests.get(rid)
        slot = req.seqs[0].slot if req is not None else None
        if seen["in_step"] is None and slot is not None and slot in batch.state_slot_cpu:
            seen["n"] += 1
            if seen["n"] == at:
                seen["in_step"] = sorted({s.request_id for s in eng.running if s.slot in batch.state_slot_cpu})
                raise error or RuntimeError("injected fault")
        return real(batch)

    monkeypatch.setattr(eng.runner, "execute", execute)
    return seen


def _run(eng, rids):
    outs = {}
    for rid in rids:
        eng.add_request(rid, PROMPTS[rid], _params(rid))
    for _ in range(500):
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        if not eng.has_unfinished_requests():
            break
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("max_num_seqs,at,num_kv_pages", [(1, 1, None), (1, 4, None), (3, 1, None), (3, 5, None),
                                                         (3, 6, 10)])  # (scarce pages: preemptions too)
def test_failed_step_fails_only_its_requests(async_scheduling, max_num_seqs, at, num_kv_pages, solo, tiny_ckpt,
                                             make_llm, monkeypatch):
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=max_num_seqs, page_size=4, max_model_len=24,
                   max_num_batched_tokens=8, async_scheduling=async_scheduling, num_kv_pages=num_kv_pages)
    eng = llm.engine
    slots0, pages0 = llm.state_pool.num_free, llm.kv_cache.allocator.num_free
    seen = _inject(monkeypatch, eng, "x", at=at)
    outs = _run(eng, ["a", "b", "x", "c", "d"])
    failed = seen["in_step"]
    assert failed and "x" in failed
    assert set(outs) == set(PROMPTS)
    for rid, out in outs.items():
        if rid in failed:
            assert out.error is not None and "RuntimeError: injected fault" in out.error
            assert out.outputs[0].finish_reason == "error"
        else:  # untouched by the failure: exactly its solo tokens
            assert out.error is None and out.outputs[0].token_ids == solo[rid], rid
    assert len(failed) < len(PROMPTS)  # somebody survived
    assert llm.state_pool.num_free == slots0 and llm.kv_cache.allocator.num_free == pages0
    assert not eng.resources.num_deferred and not eng.requests
    # the engine keeps serving: the failed prompts now run to their solo tokens
    again = _run(eng, failed)
    assert all(again[r].error is None and again[r].outputs[0].token_ids == solo[r] for r in failed)
    assert llm.state_pool.num_free == slots0 and llm.kv_cache.allocator.num_free == pages0


@pytest.mark.parametrize("async_scheduling,speculation", [(False, True), (True, False)])
def test_failed_step_with_prefix_caching_and_speculation(async_scheduling, speculation, solo, tiny_ckpt, make_llm,
                                                         monkeypatch):
    """The failed requests' cached prefixes are dropped, nothing else leaks (the cache keeps only
    what it holds), and the others still match their solo runs."""
    spec = {"method": "ngram", "num_speculative_tokens": 2} if speculation else None
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=3, page_size=4, max_num_batched_tokens=8,
                   async_scheduling=async_scheduling, enable_prefix_caching=True, speculative_config=spec)
    eng = llm.engine
    slots0, pages0 = llm.state_pool.num_free, llm.kv_cache.allocator.num_free
    seen = _inject(monkeypatch, eng, "x", at=4)
    outs = _run(eng, ["x", "a", "b", "c", "d"])
    failed = seen["in_step"]
    assert "x" in failed and len(failed) < len(PROMPTS)
    for rid, out in outs.items():
        assert (out.error is not None) == (rid in failed)
        if rid not in failed:
            assert out.outputs[0].token_ids == solo[rid], rid
    cache = eng.prefix_cache
    assert not any(PROMPTS[r][:len(e.tokens)] == list(e.tokens) for r in failed for e in cache.entries.values())
    held_pages = {p for e in cache.entries.values() for p in e.pages}
    assert llm.state_pool.num_free + len(cache) == slots0
    assert llm.kv_cache.allocator.num_free + len(held_pages) == pages0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_failure_while_finishing_a_step(async_scheduling, solo, tiny_ckpt, make_llm, monkeypatch):
    """An exception while a step's tokens are applied (here: x's 3rd token) fails the requests of
    that step; with async scheduling the step launched meanwhile is finished without them."""
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=1, page_size=4, async_scheduling=async_scheduling)
    eng = llm.engine
    slots0, pages0 = llm.state_pool.num_free, llm.kv_cache.allocator.num_free
    real = eng._append_token

    def append(seq, token, logprobs):
        if seq.request_id == "x" and len(seq.output_token_ids) == 2:
            raise ValueError("bad token bookkeeping")
        real(seq, token, logprobs)

    monkeypatch.setattr(eng, "_append_token", append)
    outs = _run(eng, ["a", "x", "b"])
    assert "ValueError: bad token bookkeeping" in outs["x"].error and outs["x"].outputs[0].token_ids == solo["x"][:2]
    assert outs["a"].outputs[0].token_ids == solo["a"] and outs["b"].outputs[0].token_ids == solo["b"]
    assert llm.state_pool.num_free == slots0 and llm.kv_cache.allocator.num_free == pages0


def test_scheduler_failure_fails_every_request_and_the_engine_recovers(solo, tiny_ckpt, make_llm, monkeypatch):
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2, page_size=4)
    eng = llm.engine
    slots0, pages0 = llm.state_pool.num_free, llm.kv_cache.allocator.num_free
    real = eng._schedule
    calls = {"n": 0}

    def schedule():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyError("scheduler bug")
        return real()

    monkeypatch.setattr(eng, "_schedule", schedule)
    outs = _run(eng, ["a", "b", "c"])
    assert all("KeyError" in o.error for o in outs.values())
    assert llm.state_pool.num_free == slots0 and llm.kv_cache.allocator.num_free == pages0
    assert _run(eng, ["d"])["d"].outputs[0].token_ids == solo["d"]


def test_generate_raises_naming_the_failed_prompts_and_keeps_the_others(solo, tiny_ckpt, make_llm, monkeypatch):
    from hybrid.errors import RequestFailedError

    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=1, page_size=4)
    rids = ["a", "x", "b"]
    real = llm.runner.execute
    fired = []

    def execute(batch):
        if not fired and any(s.prompt_token_ids == PROMPTS["x"] for s in llm.engine.running):
            fired.append(1)
            raise RuntimeError("injected fault")
        return real(batch)

    monkeypatch.setattr(llm.runner, "execute", execute)
    with pytest.raises(RequestFailedError, match=r"1 of 3 requests failed; prompt 1: RuntimeError: injected") as e:
        llm.generate([PROMPTS[r] for r in rids], [_params(r) for r in rids], use_tqdm=False)
    assert list(e.value.failed) == [1] and isinstance(e.value, HybridError)
    outs = e.value.outputs
    assert outs[1].outputs[0].finish_reason == "error"
    assert outs[0].outputs[0].token_ids == solo["a"] and outs[2].outputs[0].token_ids == solo["b"]
    # nothing left behind: the next call is clean
    assert llm.generate([PROMPTS["x"]], _params("x"), use_tqdm=False)[0].outputs[0].token_ids == solo["x"]


# ---------------------------------------------------------------------------------------------
# 3. an unrecoverable device error stops the engine, and says why
# ---------------------------------------------------------------------------------------------

FATAL = "CUDA error: an illegal memory access was encountered"


def test_fatal_device_error_stops_the_engine(tiny_ckpt, make_llm, monkeypatch):
    from hybrid.errors import EngineDeadError

    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2, page_size=4)
    eng = llm.engine
    _inject(monkeypatch, eng, "x", at=2, error=RuntimeError(FATAL))
    for rid in ("a", "x"):
        eng.add_request(rid, PROMPTS[rid], _params(rid))
    with pytest.raises(EngineDeadError, match="illegal memory access"):
        for _ in range(20):
            eng.step()
    assert eng.dead is not None and "illegal memory access" in str(eng.dead)
    assert not eng.has_unfinished_requests()
    with pytest.raises(EngineDeadError):
        eng.step()
    with pytest.raises(EngineDeadError):
        eng.add_request("z", [5, 6], _params("z"))
    eng.abort_request("a")  # harmless
    with pytest.raises(EngineDeadError, match="illegal memory access"):
        llm.generate([[5, 6]], _params("z"), use_tqdm=False)


@pytest.mark.parametrize("message,fatal", [
    (FATAL, True), ("CUDA error: device-side assert triggered", True),
    ("Triton Error [CUDA]: unspecified launch failure", True), ("CUDA error: misaligned address", True),
    ("shape mismatch", False), ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
])
def test_which_device_errors_are_fatal(message, fatal):
    from hybrid.errors import is_fatal_device_error

    assert is_fatal_device_error(RuntimeError(message)) is fatal
    assert not is_fatal_device_error(torch.OutOfMemoryError(FATAL))  # out of memory is recoverable


# ---------------------------------------------------------------------------------------------
# 3. AsyncEngine: the failed request's stream ends with an error, the others complete
# ---------------------------------------------------------------------------------------------

async def _collect(ae, rid):
    out = None
    async for out in ae.generate(PROMPTS[rid], _params(rid), request_id=rid):
        pass
    return out


def test_async_engine_survives_a_failed_step(solo, tiny_ckpt, make_llm, monkeypatch):
    import asyncio

    from hybrid.async_engine import AsyncEngine
    from hybrid.errors import RequestFailedError

    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=1, page_size=4)
    seen = _inject(monkeypatch, llm.engine, "x", at=2)
    ae = AsyncEngine(llm.engine, idle_wait_s=0.01)
    ae.start()
    try:
        async def main():
            return await asyncio.gather(*[_collect(ae, r) for r in ("a", "x", "b")], return_exceptions=True)

        a, x, b = asyncio.run(main())
        assert seen["in_step"] == ["x"]
        assert isinstance(x, RequestFailedError) and "injected fault" in str(x)
        assert a.outputs[0].token_ids == solo["a"] and b.outputs[0].token_ids == solo["b"]
        assert ae.dead is None and ae.dead_reason is None
        later = asyncio.run(_collect(ae, "x"))  # still serving
        assert later.outputs[0].token_ids == solo["x"]
    finally:
        ae.shutdown()
    assert llm.state_pool.num_free == 1


def test_async_engine_reports_a_dead_engine(tiny_ckpt, make_llm, monkeypatch):
    import asyncio

    from hybrid.async_engine import AsyncEngine
    from hybrid.errors import EngineDeadError

    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2, page_size=4)
    _inject(monkeypatch, llm.engine, "x", at=2, error=RuntimeError(FATAL))
    ae = AsyncEngine(llm.engine, idle_wait_s=0.01)
    ae.start()
    try:
        async def main():
            return await asyncio.gather(*[_collect(ae, r) for r in ("a", "x")], return_exceptions=True)

        results = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert isinstance(ae.dead, EngineDeadError) and "illegal memory access" in ae.dead_reason
        with pytest.raises(EngineDeadError, match="illegal memory access"):
            asyncio.run(_collect(ae, "b"))
    finally:
        ae.shutdown()


# ---------------------------------------------------------------------------------------------
# 12. non-finite logits fail the affected request with a clear error
# ---------------------------------------------------------------------------------------------

NAN_TOKEN = 50


@pytest.fixture(scope="module")
def nan_ckpt(tiny_ckpt, tmp_path_factory):
    """nemotron_h (untied embeddings) whose embedding row NAN_TOKEN is NaN: only prompts holding that
    token see NaN, the others run as usual."""
    import shutil

    from safetensors.torch import load_file, save_file

    p = tmp_path_factory.mktemp("nan") / "ckpt"
    shutil.copytree(tiny_ckpt("nemotron_h"), p)
    f = str(p / "model.safetensors")
    t = load_file(f)
    t["backbone.embeddings.weight"][NAN_TOKEN] = float("nan")
    save_file(t, f, metadata={"format": "pt"})
    return p


@pytest.mark.parametrize("check_state", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_nan_weight_fails_only_the_affected_request(check_state, async_scheduling, nan_ckpt, make_llm):
    from hybrid.errors import RequestFailedError

    prompts = [[5, 6, 7, 8], [9, 10, NAN_TOKEN, 11, 12, 13, 14, 15, 16, 17, 18], [19, 20, 21]]
    sps = [_params("a"), SamplingParams(max_tokens=10, logprobs=2, **GREEDY), _params("c")]
    ref = make_llm(nan_ckpt, max_num_seqs=1)
    solo = [ref.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts[::2], sps[::2])]
    llm = make_llm(nan_ckpt, max_num_seqs=3, page_size=4, max_num_batched_tokens=6, check_state=check_state,
                   async_scheduling=async_scheduling)
    slots0, pages0 = llm.state_pool.num_free, llm.kv_cache.allocator.num_free
    with pytest.raises(RequestFailedError, match="prompt 1: NonFiniteLogitsError") as e:
        llm.generate(prompts, sps, use_tqdm=False)
    outs = e.value.outputs
    assert list(e.value.failed) == [1]
    err = outs[1].error
    assert "request '1'" in err and "non-finite" in err and "poisoned" not in err, err
    if check_state:  # the sanitizer tells a NaN made by the forward from a read of freed state
        assert "finite before the step" in err and "not a read of freed state" in err, err
    assert outs[1].outputs[0].token_ids == [] and outs[1].outputs[0].finish_reason == "error"
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == solo
    assert llm.state_pool.num_free == slots0 and llm.kv_cache.allocator.num_free == pages0


def test_nan_weight_everywhere_is_a_clear_error_not_garbage(tiny_ckpt, tmp_path, make_llm):
    """A NaN in a weight every request uses: every request fails, none returns all-zero tokens or NaN
    logprobs (which a JSON encoder would then choke on)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hybrid.errors import RequestFailedError

    p = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("granite_dense"), p)
    t = load_file(str(p / "model.safetensors"))
    t["model.layers.0.mamba.out_proj.weight"][0, 0] = float("inf")  # inf * 0 ... -> NaN downstream
    t["model.layers.1.self_attn.o_proj.weight"][2, 3] = float("nan")
    save_file(t, str(p / "model.safetensors"), metadata={"format": "pt"})
    llm = make_llm(p, max_num_seqs=2)
    with pytest.raises(RequestFailedError, match="2 of 2 requests failed.*non-finite") as e:
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, logprobs=3, **GREEDY), use_tqdm=False)
    assert all(o.outputs[0].token_ids == [] for o in e.value.outputs)
    assert llm.state_pool.num_free == 2 and not llm.engine.has_unfinished_requests()


def test_sanitizer_catches_nan_in_a_chunk_that_samples_nothing(nan_ckpt, make_llm):
    """Under check_state the state is checked after every chunk: a long prompt's first chunk (no logits
    sampled) that makes NaN fails at once, blamed on the forward, not on a freed slot."""
    llm = make_llm(nan_ckpt, max_num_seqs=2, page_size=4, max_num_batched_tokens=4, check_state=True)
    eng = llm.engine
    eng.add_request("n", [NAN_TOKEN, 5, 6, 7, 8, 9, 10, 11, 12, 13], _params("a"))
    out = eng.step()
    assert len(out) == 1 and out[0].error is not None, out
    assert out[0].error.startswith("NonFiniteLogitsError") and "not a read of freed state" in out[0].error
    assert eng.stats["prompt_tokens"] == 4 and llm.state_pool.num_free == 2


# ---------------------------------------------------------------------------------------------
# bad engine arguments: ConfigurationError (a ValueError and a HybridError: the CLI's `error: ...`)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    ({"dtype": "float8"}, "dtype"), ({"mamba_ssm_dtype": "int8"}, "mamba_ssm_dtype"),
    ({"device": "gpu"}, "device"), ({"device": "tpu:0"}, "device"),
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"max_num_seqs": 2.5}, "max_num_seqs"),
    ({"page_size": 0}, "page_size"), ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
    ({"max_model_len": 0}, "max_model_len"), ({"max_model_len": 1}, "max_model_len"),
    ({"num_kv_pages": 1}, "num_kv_pages"), ({"seed": "x"}, "seed"), ({"seed": True}, "seed"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"), ({"mamba_decode_kernels": "cuda"}, "mamba_decode"),
    ({"prefix_cache_interval": -4}, "prefix_cache_interval"),
    ({"enable_prefix_caching": True, "prefix_cache_entries": 0}, "prefix_cache_entries"),
    ({"speculative_config": {"method": "eagle"}}, "method"),
])
def test_bad_engine_arguments(kwargs, match, tiny_ckpt):
    from hybrid import LLM
    from hybrid.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=match) as e:
        LLM(tiny_ckpt("nemotron_h"), **{"device": "cpu", **kwargs})
    assert isinstance(e.value, ValueError) and isinstance(e.value, HybridError)


def test_cli_reports_bad_engine_arguments(capsys):
    from hybrid.cli import main

    assert main(["generate", "--prompt", "x", "--device", "cpu", "--max-num-seqs", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: max_num_seqs")
    assert main(["generate", "--prompt", "x", "--device", "cpu", "--dtype", "float8"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown dtype")


@pytest.mark.parametrize("temperature", [1e-6, 1e-20, 1e-40, 5e-324])
def test_tiny_temperatures_sample_the_argmax(temperature):
    """logits / 1e-40 overflows to inf and the softmax to NaN: a tiny temperature is greedy instead."""
    from hybrid.sampling import sample_tokens

    logits = torch.tensor([[1.0, 5.0, 3.0, -2.0], [0.5, -1.0, 0.2, 7.0]])
    sp = SamplingParams(temperature=temperature)
    assert sp.greedy
    tokens, finite = sample_tokens(logits, [sp, sp], [torch.Generator().manual_seed(0)] * 2)
    assert tokens.tolist() == [1, 3] and finite.all()


# ---------------------------------------------------------------------------------------------
# the admission cap: lowered and raised at run time, never above the configured max_num_seqs
# ---------------------------------------------------------------------------------------------

def test_max_num_seqs_cap_stays_within_the_config(tiny_ckpt, make_llm):
    """Engine.max_num_seqs may be lowered (and raised back) at run time; a value above the configured one
    would hand a sequence the prefix cache's slot and a verify scratch row never allocated: a clear error,
    the cap unchanged and the engine serving as before."""
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2, enable_prefix_caching=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    eng = llm.engine
    sp = SamplingParams(max_tokens=5, **GREEDY)
    prompts = [[5, 6, 7, 5, 6, 7], [8, 9, 8, 9, 8], [11, 12, 13]]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    for bad in (3, 0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="max_num_seqs"):
            eng.max_num_seqs = bad
        assert eng.max_num_seqs == 2
    eng.max_num_seqs = 1
    seen = []
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, sp, output_kind="final")
    while eng.has_unfinished_requests():
        eng.step()
        seen.append(len(eng.running))
    assert max(seen) == 1  # the lowered cap admits one at a time
    eng.max_num_seqs = 2
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
