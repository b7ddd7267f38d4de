"""LLM's device and size defaults (issue 14 item 1): device="auto", the CPU and CUDA defaults of
max_num_seqs / max_num_batched_tokens / max_model_len (explicit values always win), the CUDA
shrink ladder and the max_model_len cap from the memory plan, and the startup log."""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from hybrid import LLM, CapacityError, ConfigurationError
from hybrid.llm import (
    CPU_MAX_MODEL_LEN, CPU_MAX_NUM_BATCHED_TOKENS, CPU_MAX_NUM_SEQS, CUDA_MAX_NUM_BATCHED_TOKENS, CUDA_MAX_NUM_SEQS,
    MIN_DEFAULT_BATCHED_TOKENS, EngineSizes, default_sizes, fit_max_model_len, resolve_device, smaller_sizes,
)
from hybrid.model_source import DEFAULT_MODEL_DIR


# ---------------------------------------------------------------------------------- device
def test_auto_is_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device() == torch.device("cpu")
    with pytest.raises(ConfigurationError, match="CUDA is not available"):
        resolve_device("cuda")


def test_auto_is_cuda_when_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")  # an explicit device wins


def test_bad_devices():
    for bad in ("tpu", "nonsense", "meta"):
        with pytest.raises(ConfigurationError):
            resolve_device(bad)


def test_llm_default_device_is_auto(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    llm = LLM()  # the bundled model, device="auto" -> cpu here
    assert llm.device == torch.device("cpu") and llm.dtype == torch.float32
    assert (llm.max_num_seqs, llm.max_num_batched_tokens) == (CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS)
    assert llm.max_model_len == 2048  # the bundled config's max_position_embeddings
    assert llm.engine.max_num_seqs == 8 and llm.engine.max_num_batched_tokens == 256


# ---------------------------------------------------------------------------------- sizes
def test_default_sizes_cpu():
    assert default_sizes("cpu", 2048) == EngineSizes(8, 256, 2048)
    assert default_sizes("cpu", 131072) == EngineSizes(8, 256, CPU_MAX_MODEL_LEN)  # capped on CPU
    assert default_sizes("cpu", 131072, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=9000) == \
        EngineSizes(3, 64, 9000)  # explicit values win, even past the cap


def test_default_sizes_cuda():
    assert default_sizes("cuda", 131072) == EngineSizes(CUDA_MAX_NUM_SEQS, CUDA_MAX_NUM_BATCHED_TOKENS, None)
    assert (CUDA_MAX_NUM_SEQS, CUDA_MAX_NUM_BATCHED_TOKENS) == (256, 8192)
    assert default_sizes("cuda", 131072, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=4096) == \
        EngineSizes(8, 256, 4096)


def test_smaller_sizes_shrinks_only_what_was_defaulted():
    s = EngineSizes(256, 8192, None)
    seen = []
    while s is not None:
        seen.append((s.max_num_seqs, s.max_num_batched_tokens))
        s = smaller_sizes(s, max_num_seqs_given=False, max_num_batched_tokens_given=False)
    assert seen[:3] == [(256, 8192), (128, 8192), (64, 8192)]
    assert (1, 8192) in seen and seen[-1] == (1, MIN_DEFAULT_BATCHED_TOKENS)
    assert [b for _, b in seen[seen.index((1, 8192)):]] == [8192, 4096, 2048, 1024, 512, 256]
    # explicit values are never changed
    assert smaller_sizes(EngineSizes(8, 8192, None), max_num_seqs_given=True,
                         max_num_batched_tokens_given=False) == EngineSizes(8, 4096, None)
    assert smaller_sizes(EngineSizes(256, 100, None), max_num_seqs_given=False,
                         max_num_batched_tokens_given=True) == EngineSizes(128, 100, None)
    assert smaller_sizes(EngineSizes(256, 8192, None), max_num_seqs_given=True,
                         max_num_batched_tokens_given=True) is None


@pytest.mark.parametrize("spec,extra", [(0, 0), (3, 0), (0, 5)])
def test_fit_max_model_len_is_what_split_budget_accepts(spec, extra):
    from graphs.memory import split_budget

    MiB = 2**20
    kw = dict(slot_bytes=3 * MiB, page_bytes=MiB // 4, page_size=16, max_num_seqs=256, extra_state_slots=extra,
              num_speculative_tokens=spec)
    budget = 40 * 2**30 + 12345
    fit = fit_max_model_len(budget_bytes=budget, **kw)
    assert fit % 16 == 0 and fit > 16
    _, _, pages = split_budget(budget, max_model_len=fit, **kw)  # one sequence of `fit` fits...
    assert pages >= fit // 16 + 1
    with pytest.raises(CapacityError):  # ... one page more does not
        split_budget(budget, max_model_len=fit + 16, **kw)
    # a given num_kv_pages caps it too (less the dummy page)
    assert fit_max_model_len(budget_bytes=budget, num_kv_pages=101, **kw) == 100 * 16


def test_fit_max_model_len_edge_cases():
    kw = dict(slot_bytes=100, page_size=16, max_num_seqs=4)
    assert fit_max_model_len(budget_bytes=10**6, page_bytes=0, **kw) is None  # no attention: no KV limit
    assert fit_max_model_len(budget_bytes=10, page_bytes=64, **kw) == 0  # not even the state fits
    # 5 slots (4 + scratch row) = 500 bytes, 1000 left = 15 pages of 64, one the dummy: 14 * 16 tokens
    assert fit_max_model_len(budget_bytes=1500, page_bytes=64, **kw) == 14 * 16


# ---------------------------------------------------------------------------------- LLM on CPU
@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    """The bundled model with max_position_embeddings 32768 (it is NoPE: any length runs)."""
    p = tmp_path_factory.mktemp("long") / "ckpt"
    shutil.copytree(DEFAULT_MODEL_DIR, p)
    cfg = json.loads((p / "config.json").read_text())
    cfg["max_position_embeddings"] = 32768
    (p / "config.json").write_text(json.dumps(cfg))
    return str(p)


def test_cpu_caps_the_config_context(long_ckpt):
    llm = LLM(long_ckpt, device="cpu")
    assert llm.max_model_len == CPU_MAX_MODEL_LEN and llm.engine.max_model_len == CPU_MAX_MODEL_LEN


def test_explicit_values_win(long_ckpt):
    llm = LLM(long_ckpt, device="cpu", max_num_seqs=3, max_num_batched_tokens=32, max_model_len=6000)
    assert (llm.max_num_seqs, llm.max_num_batched_tokens, llm.max_model_len) == (3, 32, 6000)
    assert llm.engine.max_num_seqs == 3 and llm.state_pool.num_slots >= 3


def test_explicit_none_is_the_default():
    llm = LLM(None, device="cpu", max_num_seqs=None, max_num_batched_tokens=None, max_model_len=None)
    assert (llm.max_num_seqs, llm.max_num_batched_tokens) == (8, 256)


@pytest.mark.parametrize("kw", [dict(max_num_seqs=0), dict(max_num_batched_tokens=-1), dict(max_num_seqs=2.5),
                                dict(max_model_len=1), dict(max_num_seqs=True)])
def test_bad_sizes_are_configuration_errors(kw):
    with pytest.raises(ConfigurationError):
        LLM(None, device="cpu", **kw)


def test_startup_log_states_the_configuration(caplog):
    with caplog.at_level(logging.INFO, logger="hybrid"):
        LLM(None, device="cpu", enable_prefix_caching=True, prefix_cache_entries=2)
    [line] = [r.getMessage() for r in caplog.records if "max_num_seqs" in r.getMessage()]
    for part in ("on cpu", "weights float32", "SSM state float32", "max_model_len 2048",
                 "max_num_seqs 8 (Mamba state slots: 10, 2 of them for cached prefixes)",
                 "max_num_batched_tokens 256", "KV cache 1024 pages x 16 tokens"):
        assert part in line, (part, line)


def test_startup_log_bf16_state(caplog):
    with caplog.at_level(logging.INFO, logger="hybrid"):
        LLM(None, device="cpu", dtype="bfloat16", mamba_ssm_dtype="bfloat16", max_model_len=64)
    [line] = [r.getMessage() for r in caplog.records if "max_num_seqs" in r.getMessage()]
    assert "weights bfloat16" in line and "SSM state bfloat16" in line and "max_model_len 64 (given)" in line
    assert os.path.basename(DEFAULT_MODEL_DIR) in line


# ---------------------------------------------------------------------------------- CUDA planning (fake plans)
def _fake_planner(budget_for, *, slot_bytes, page_bytes, page_size=16, num_kv_pages=None, extra=0, spec=0):
    """plan(sizes, max_model_len) as plan_memory behaves: a budget that depends on the sizes (the
    activation peak grows with the chunk, the graph reserve with max_num_seqs), split_budget's
    CapacityError when the slots and one sequence do not fit."""
    from graphs.memory import MemoryPlan, split_budget

    calls = []

    def plan(sizes, max_model_len):
        calls.append((sizes.max_num_seqs, sizes.max_num_batched_tokens, max_model_len))
        budget = budget_for(sizes)
        _, spec_bytes, pages = split_budget(budget, slot_bytes=slot_bytes, page_bytes=page_bytes, page_size=page_size,
                                            max_num_seqs=sizes.max_num_seqs, max_model_len=max_model_len,
                                            extra_state_slots=extra, num_speculative_tokens=spec,
                                            num_kv_pages=num_kv_pages)
        return MemoryPlan(num_slots=sizes.max_num_seqs + extra, num_kv_pages=pages, budget_bytes=budget,
                          slot_bytes=slot_bytes, page_bytes=page_bytes, activation_bytes=0, weight_bytes=0,
                          max_tokens=(pages - 1) * page_size, spec_scratch_bytes=spec_bytes)

    return plan, calls


def _plan(plan, sizes, mpe, **kw):
    from hybrid.llm import plan_cuda_sizes

    kw.setdefault("max_num_seqs_given", False)
    kw.setdefault("max_num_batched_tokens_given", False)
    kw.setdefault("num_kv_pages", None)
    return plan_cuda_sizes(plan, sizes, max_position_embeddings=mpe, page_size=16, **kw)


MiB = 2**20


def test_cuda_plan_takes_the_config_context_when_it_fits():
    plan, calls = _fake_planner(lambda s: 64 * 2**30, slot_bytes=MiB, page_bytes=MiB // 8)
    sizes, mp, capped = _plan(plan, default_sizes("cuda", 131072), 131072)
    assert sizes == EngineSizes(256, 8192, 131072) and not capped
    assert calls == [(256, 8192, 8192)]  # planned at one chunk, then grown
    # the KV pages split again for the full length: up to 256 sequences of 131072 tokens, as memory allows
    pages_per_seq = 131072 // 16
    assert pages_per_seq + 1 <= mp.num_kv_pages <= 256 * pages_per_seq + 1
    assert mp.max_tokens == (mp.num_kv_pages - 1) * 16


def test_cuda_plan_caps_max_model_len_by_memory():
    budget = 2**30
    plan, _ = _fake_planner(lambda s: budget, slot_bytes=MiB, page_bytes=MiB // 8)
    sizes, mp, capped = _plan(plan, default_sizes("cuda", 131072), 131072)
    assert capped and sizes.max_num_seqs == 256
    # 257 slots of 1 MiB leave 767 MiB: 6136 pages of 1/8 MiB, one the dummy
    assert sizes.max_model_len == (6136 - 1) * 16
    assert mp.num_kv_pages == 6136  # exactly one sequence of that length


def test_cuda_plan_shrinks_defaulted_seqs_when_state_does_not_fit():
    # 100 MiB slots: 256 of them (25 GiB) do not fit in 10 GiB, 64 do (6.4 GiB)
    plan, calls = _fake_planner(lambda s: 10 * 2**30, slot_bytes=100 * MiB, page_bytes=MiB // 8)
    sizes, mp, capped = _plan(plan, default_sizes("cuda", 32768), 32768)
    assert [c[0] for c in calls] == [256, 128, 64]
    assert sizes == EngineSizes(64, 8192, 32768) and not capped


def test_cuda_plan_keeps_explicit_values_and_raises():
    plan, calls = _fake_planner(lambda s: 10 * 2**30, slot_bytes=100 * MiB, page_bytes=MiB // 8)
    with pytest.raises(CapacityError, match="max_num_seqs=256"):
        _plan(plan, default_sizes("cuda", 32768, max_num_seqs=256), 32768, max_num_seqs_given=True,
              max_num_batched_tokens_given=False)
    assert {c[0] for c in calls} == {256}  # only max_num_batched_tokens was tried smaller
    # an explicit max_model_len is planned as given, never capped
    plan, calls = _fake_planner(lambda s: 64 * 2**30, slot_bytes=MiB, page_bytes=MiB // 8)
    sizes, _, capped = _plan(plan, default_sizes("cuda", 131072, max_model_len=1000), 131072)
    assert sizes.max_model_len == 1000 and not capped and calls == [(256, 8192, 1000)]


def test_cuda_plan_error_when_not_one_sequence_fits():
    # the state fits, but not one chunk of KV: every default shrinks, then the plan's error is raised
    plan, calls = _fake_planner(lambda s: 30 * MiB, slot_bytes=MiB, page_bytes=2 * MiB)
    with pytest.raises(CapacityError, match="do not fit"):
        _plan(plan, default_sizes("cuda", 32768), 32768)
    assert calls[-1] == (1, MIN_DEFAULT_BATCHED_TOKENS, MIN_DEFAULT_BATCHED_TOKENS)


def test_cuda_plan_with_prefix_cache_speculation_and_given_pages():
    extra = lambda seqs: seqs  # noqa: E731 - the prefix cache's default: one slot per sequence
    plan, calls = _fake_planner(lambda s: 4 * 2**30, slot_bytes=MiB, page_bytes=MiB // 8, extra=256, spec=2,
                                num_kv_pages=5001)
    sizes, mp, capped = _plan(plan, default_sizes("cuda", 131072), 131072, extra_state_slots=extra,
                              num_speculative_tokens=2, num_kv_pages=5001)
    assert sizes.max_model_len == 5000 * 16 and capped and mp.num_kv_pages == 5001
    # without attention layers (no KV) the config's whole context is taken
    plan, _ = _fake_planner(lambda s: 4 * 2**30, slot_bytes=MiB, page_bytes=0)
    sizes, _, capped = _plan(plan, default_sizes("cuda", 1 << 20), 1 << 20)
    assert sizes.max_model_len == 1 << 20 and not capped


def test_startup_phases_are_timed_and_logged(tiny_ckpt, caplog):
    """Startup says where its time went (issue 15: load, memory plan / JIT, capture), in the log and
    in LLM.startup_phases; on CPU there is no memory plan and no graph capture."""
    import logging

    with caplog.at_level(logging.INFO, logger="hybrid"):
        llm = LLM(tiny_ckpt("granite_dense"), device="cpu", max_num_seqs=2)
    assert list(llm.startup_phases) == ["load weights", "state pool and KV cache", "engine"]
    assert all(t >= 0 for t in llm.startup_phases.values())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("startup "))
    assert "load weights" in line and "engine" in line
