"""The state sanitizer: bad indices raise StateCorruptionError naming the request and slot."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from hybrid import SamplingParams
from hybrid.errors import RequestFailedError, StateCorruptionError

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine_with_freed_slot(make_llm, path, **kw):
    """Engine where request 'a' finished (its slot 0 freed, poisoned) and 'b' is decoding in slot 1."""
    llm = make_llm(path, max_num_seqs=2, page_size=4, **kw)
    eng = llm.engine
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=1, **GREEDY))
    eng.add_request("b", [8, 9, 10, 11, 12], SamplingParams(max_tokens=8, **GREEDY))
    eng.step()  # both prefill; 'a' finishes at once and frees slot 0
    assert [s.slot for s in eng.running] == [1]
    return llm, eng


def _step_error(eng, pattern: str, steps: int = 1) -> str:
    """Step (up to `steps` times) until a request fails; its error must be a StateCorruptionError
    matching `pattern`. The failure is the request's alone: the engine keeps running."""
    for _ in range(steps):
        failed = [o for o in eng.step() if o.error is not None]
        if failed:
            err = failed[0].error
            assert err.startswith("StateCorruptionError: ") and re.search(pattern, err), err
            assert failed[0].finished and all(c.finish_reason == "error" for c in failed[0].outputs)
            return err
    raise AssertionError("no request failed")


def _patch_batch(monkeypatch, eng, edit):
    orig = eng._build_batch

    def build(chunks):
        return edit(orig(chunks))

    monkeypatch.setattr(eng, "_build_batch", build)


def _with_slots(batch, slots):
    return dataclasses.replace(batch, state_slot=torch.tensor(slots, dtype=torch.long), state_slot_cpu=list(slots))


def test_row_pointing_at_freed_slot(tiny_ckpt, make_llm, monkeypatch):
    llm, eng = _engine_with_freed_slot(make_llm, tiny_ckpt("nemotron_h"), check_state=True)
    assert torch.isnan(llm.state_pool.ssm_state[:, 0]).all()  # freed slots are poisoned
    _patch_batch(monkeypatch, eng, lambda b: _with_slots(b, [0]))
    err = _step_error(eng, r"request 'b'.*slot 0")
    assert "freed" in err or "owns slot 1" in err
    assert not eng.has_unfinished_requests() and llm.state_pool.num_free == 2  # 'b' failed, its slot is back


def test_padding_row_pointing_at_live_slot(tiny_ckpt, make_llm, monkeypatch):
    llm, eng = _engine_with_freed_slot(make_llm, tiny_ckpt("nemotron_h"), check_state=True)

    def pad(b):  # a graph-bucket style padding row appended after the real one, but aimed at slot 1
        return dataclasses.replace(
            _with_slots(b, [1, 1]),
            input_ids=torch.cat([b.input_ids, b.input_ids[:1]]),
            positions=torch.cat([b.positions, torch.zeros(1, dtype=torch.long)]),
            query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
            seq_lens=torch.cat([b.seq_lens, torch.ones(1, dtype=torch.int32)]),
            page_table=torch.cat([b.page_table, torch.zeros_like(b.page_table)]),
            kv_write_loc=torch.cat([b.kv_write_loc, torch.zeros(1, dtype=torch.long)]),
            has_initial_state=torch.tensor([True, False]),
            num_decodes=2, query_lens_cpu=[1, 1], seq_lens_cpu=b.seq_lens_cpu + [1],
            has_initial_state_cpu=[True, False], num_real_requests=1,
        )

    _patch_batch(monkeypatch, eng, pad)
    _step_error(eng, r"padding row 1 .*slot 1 \(live\)")


def test_two_rows_one_slot_and_foreign_slot(tiny_ckpt, make_llm, monkeypatch):
    path = tiny_ckpt("nemotron_h")
    llm = make_llm(path, max_num_seqs=3, page_size=4, check_state=True)
    eng = llm.engine
    eng.add_request("x", [5, 6, 7], SamplingParams(max_tokens=5, **GREEDY))
    eng.add_request("y", [8, 9], SamplingParams(max_tokens=5, **GREEDY))
    eng.step()
    _patch_batch(monkeypatch, eng, lambda b: _with_slots(b, [0, 0]))
    _step_error(eng, r"request 'y' \(branch 0\) \(row 1\).*slot 0 but owns slot 1")


def test_write_into_shared_prompt_page(tiny_ckpt, make_llm, monkeypatch):
    """A fork that forgot copy-on-write of the partial page would write into a shared page."""
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=4, page_size=4, check_state=True)
    eng, alloc = llm.engine, llm.kv_cache.allocator
    eng.add_request("f", [5, 6, 7, 8, 9, 10], SamplingParams(n=2, max_tokens=5, **GREEDY))
    eng.step()  # prefill + fork
    child = next(s for s in eng.running if s.index == 1)
    parent = next(s for s in eng.running if s.index == 0)
    alloc.release([child.pages[1]])  # simulate a missing CoW: child shares the parent's partial page
    child.pages[1] = parent.pages[1]
    alloc.share([parent.pages[1]])
    _step_error(eng, r"request 'f' \(branch [01]\).*KV page .* refcount 2 \(shared")


def test_poisoned_read_shows_up_as_nan(tiny_ckpt, make_llm, monkeypatch):
    """Even past the index checks, a read of a freed slot yields NaN logits, which are reported."""
    llm, eng = _engine_with_freed_slot(make_llm, tiny_ckpt("nemotron_h"), check_state=True)
    monkeypatch.setattr(eng.sanitizer, "check_batch", lambda batch, chunks: None)
    _patch_batch(monkeypatch, eng, lambda b: _with_slots(b, [0]))
    _step_error(eng, r"request 'b'.*NaN.*held NaN before the step.*poisoned \(freed\) state")


def test_off_by_default_costs_nothing(tiny_ckpt, make_llm, monkeypatch):
    monkeypatch.delenv("HYBRID_CHECK_STATE", raising=False)
    llm, eng = _engine_with_freed_slot(make_llm, tiny_ckpt("nemotron_h"))
    assert not eng.check_state and not llm.state_pool.poison_freed
    assert not torch.isnan(llm.state_pool.ssm_state).any()
    calls = []
    monkeypatch.setattr(eng.sanitizer, "check_batch", lambda *a: calls.append(a))
    while eng.has_unfinished_requests():
        eng.step()
    assert calls == []


def test_env_var_turns_it_on(tiny_ckpt, make_llm, monkeypatch):
    monkeypatch.setenv("HYBRID_CHECK_STATE", "1")
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2, page_size=4)
    assert llm.engine.check_state and llm.state_pool.poison_freed
    assert not make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2, check_state=False).engine.check_state


def test_silent_on_a_mixed_workload(tiny_ckpt, make_llm):
    """Forks, speculation, preemption, slot reuse, sampling: no false positives, same outputs."""
    path = tiny_ckpt("nemotron_h")
    prompts = [[5, 6, 7, 5, 6, 7, 5], [4], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21]]
    sps = [SamplingParams(n=3, max_tokens=20, **GREEDY), SamplingParams(max_tokens=25, **GREEDY),
           SamplingParams(temperature=0.9, max_tokens=22, seed=3, ignore_eos=True),
           SamplingParams(n=2, temperature=0.5, max_tokens=18, seed=4, ignore_eos=True)]
    ref = make_llm(path, max_num_seqs=8, page_size=4, max_model_len=48).generate(prompts, sps, use_tqdm=False)
    llm = make_llm(path, max_num_seqs=3, page_size=4, max_model_len=48, num_kv_pages=14, check_state=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    got = llm.generate(prompts, sps, use_tqdm=False)
    for r, g in zip(ref, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in r.outputs]
    assert llm.engine.stats["preemptions"] > 0 and llm.engine.stats["spec_verify_rows"] > 0
    assert llm.state_pool.num_free == 3 and llm.kv_cache.allocator.num_free == 13


def test_padding_rows_added_by_the_runner_are_checked(tiny_ckpt, make_llm, monkeypatch):
    """Decode batches padded to a bucket (what the CUDA-graph runner replays) are checked as they ran:
    silent on correct padding, and a padding row pointed at a live slot fails the step it ran in."""
    import graphs.runner as runner_module

    path = tiny_ckpt("nemotron_h")
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]  # 3 decoding requests -> padded to the bucket of 4
    ref = make_llm(path, max_num_seqs=4, page_size=4).generate(prompts, sp, use_tqdm=False)
    llm = make_llm(path, max_num_seqs=4, page_size=4, check_state=True)
    llm.runner.pad_decode = True  # pad decode batches to buckets 1, 2, 4 on CPU, as the graph runner does
    ran = []
    real_checks = llm.engine.sanitizer.device_checks

    def record(expected):
        inputs = llm.runner.inputs_that_ran()
        ran.append((inputs.num_real_requests, int(inputs.state_slot.shape[0])))
        return real_checks(expected)

    monkeypatch.setattr(llm.engine.sanitizer, "device_checks", record)
    out = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert llm.runner.stats["padded_eager"] > 0 and (3, 4) in ran  # the padded batches were checked

    real_pad = runner_module.pad_decode_batch

    def pad_onto_a_live_slot(batch, size, page_size):
        padded = real_pad(batch, size, page_size)
        slots = list(padded.state_slot_cpu)
        slots[-1] = batch.state_slot_cpu[0]
        return dataclasses.replace(padded, state_slot_cpu=slots, state_slot=torch.tensor(slots))

    monkeypatch.setattr(runner_module, "pad_decode_batch", pad_onto_a_live_slot)
    with pytest.raises(RequestFailedError, match="StateCorruptionError: .*padding row 3 ran with a wrong Mamba slot") as e:
        llm.generate(prompts, sp, use_tqdm=False)
    assert sorted(e.value.failed) == [0, 1, 2]  # all three were in the step
    assert llm.state_pool.num_free == llm.state_pool.num_slots and not llm.engine.has_unfinished_requests()


def _tamper_device_copy(monkeypatch, eng, field, edit):
    """The batch's device tensor `field` edited after the host copies were made (what a race or a
    wrong graph-buffer fill would do): only the device half of the sanitizer can see it."""
    _patch_batch(monkeypatch, eng, lambda b: dataclasses.replace(b, **{field: edit(getattr(b, field).clone())}))


@pytest.mark.parametrize("field,pattern", [
    ("state_slot", r"request 'b' \(branch 0\) ran with a wrong Mamba slot 0 \(owns slot 1\)"),
    ("kv_write_loc", r"request 'b' \(branch 0\) ran with a wrong KV write rows"),
    ("page_table", r"request 'b' \(branch 0\) ran with a wrong page table"),
])
def test_device_copies_that_differ_from_the_host_copies(tiny_ckpt, make_llm, monkeypatch, field, pattern):
    llm, eng = _engine_with_freed_slot(make_llm, tiny_ckpt("nemotron_h"), check_state=True)
    edits = {"state_slot": lambda t: t.fill_(0), "kv_write_loc": lambda t: t + 1,
             "page_table": lambda t: t.index_fill_(1, torch.tensor([0]), 0)}
    _tamper_device_copy(monkeypatch, eng, field, edits[field])
    err = _step_error(eng, pattern)
    assert "differ from what the sanitizer checked" in err
    assert not eng.has_unfinished_requests() and llm.state_pool.num_free == 2


def test_host_seq_len_that_is_not_the_requests(tiny_ckpt, make_llm, monkeypatch):
    """The host copy of a row's KV length one past its request's (the kernels would read a KV position
    the request never wrote): the host half refuses the step, naming the row."""
    llm, eng = _engine_with_freed_slot(make_llm, tiny_ckpt("nemotron_h"), check_state=True)

    def longer(b):
        lens = [s + 1 for s in b.seq_lens_cpu]
        return dataclasses.replace(b, seq_lens=torch.tensor(lens, dtype=torch.int32), seq_lens_cpu=lens)

    _patch_batch(monkeypatch, eng, longer)
    _step_error(eng, r"request 'b' \(branch 0\) \(row 0, Mamba slot 1\) would run 1 tokens to KV length 7, "
                     r"but it has 5 tokens in the cache and 1 to run")
    assert not eng.has_unfinished_requests() and llm.state_pool.num_free == 2


def test_a_context_count_past_the_sequence_is_refused(tiny_ckpt, make_llm):
    """The scheduler's count of a sequence's cached tokens runs past the tokens it has (a bookkeeping
    bug: the batch builder would read past them): the host half refuses the step before it runs."""
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2, page_size=4, check_state=True, async_scheduling=True)
    eng = llm.engine
    eng.add_request("b", [8, 9, 10, 11, 12], SamplingParams(max_tokens=8, **GREEDY))
    eng.add_request("c", [5, 6, 7], SamplingParams(max_tokens=8, **GREEDY))
    eng.step()
    eng.step()  # decode steps in flight: the next batch takes b's pending token from the last one
    seq = next(s for s in eng.running if s.request_id == "b")
    seq.num_computed += 2
    _step_error(eng, r"request 'b' \(branch 0\) \(row \d, Mamba slot \d\) would run to KV length \d+, past the "
                     r"\d+ tokens it has", steps=2)
    while eng.has_unfinished_requests():
        eng.step()
    assert llm.state_pool.num_free == llm.state_pool.num_slots


@pytest.mark.parametrize("case", ["decode_undercount", "prefill_skips_tokens"])
def test_a_context_count_off_within_the_sequence_is_refused(tiny_ckpt, make_llm, case):
    """The scheduler's count of a sequence's cached tokens is off but stays within the tokens it has,
    so every length the batch states is self-consistent: one token too few while decoding (its state
    would absorb that token twice) or a prefill chunk that skips prompt tokens. The slot's own ledger
    of absorbed tokens refuses the step; without the check the first case silently changes the
    output. The step's requests fail, and the engine serves the next ones."""
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2, page_size=4, check_state=True,
                   max_num_batched_tokens=4 if case == "prefill_skips_tokens" else None)
    eng = llm.engine
    eng.add_request("b", [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], SamplingParams(max_tokens=8, **GREEDY))
    eng.add_request("c", [5, 6, 7], SamplingParams(max_tokens=8, **GREEDY))
    eng.step()
    if case == "decode_undercount":
        eng.step()
        eng.step()
    seq = next(s for s in eng.running if s.request_id == "b")
    if case == "decode_undercount":
        assert seq.is_decoding
        seq.num_computed -= 1
    else:
        assert not seq.is_decoding and 0 < seq.num_computed < len(seq.prompt_token_ids) - 2
        seq.num_computed += 2
    _step_error(eng, r"request 'b' \(branch 0\) \(row \d, Mamba slot \d\) would run on a context of \d+ tokens, "
                     r"but the state in its slot has absorbed \d+", steps=3)
    eng.add_request("d", [5, 6, 7], SamplingParams(max_tokens=8, **GREEDY))  # the engine serves on
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done["d"].error is None and len(done["d"].outputs[0].token_ids) == 8
    assert llm.state_pool.num_free == llm.state_pool.num_slots and not llm.engine.resources.state_tokens


@pytest.mark.parametrize("delta", [1, -1])
def test_device_seq_len_that_differs_from_the_host_copy(tiny_ckpt, make_llm, monkeypatch, delta):
    llm, eng = _engine_with_freed_slot(make_llm, tiny_ckpt("nemotron_h"), check_state=True)
    _tamper_device_copy(monkeypatch, eng, "seq_lens", lambda t: t + delta)
    err = _step_error(eng, r"request 'b' \(branch 0\) ran with a wrong KV length")
    assert "differ from what the sanitizer checked" in err
    assert not eng.has_unfinished_requests() and llm.state_pool.num_free == 2


@pytest.mark.parametrize("wrong", ["past_its_table", "under_its_tokens"])
def test_padded_verify_steps_pass_and_a_wrong_padded_length_fails(tiny_ckpt, make_llm, monkeypatch, wrong):
    """A padded verify step's real rows run with their padding tokens added to their KV length, and
    its padding rows with their own q_len: the check passes them (no false alarm over many steps),
    and fails a padding row whose length would reach past its page-table row, or is shorter than
    the tokens it runs."""
    import graphs.runner as runner_module

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=4, page_size=4, check_state=True, speculative_config=spec)
    eng = llm.engine
    llm.runner.pad_verify = True
    eng.scheduler.proposer.propose = lambda tokens, k: [tokens[-1]] * (1 + len(tokens) % k)  # uneven drafts
    for rid, prompt in (("a", [5, 6, 7]), ("b", [8, 9]), ("c", [10, 11, 12])):
        eng.add_request(rid, prompt, SamplingParams(max_tokens=6, **GREEDY))
    while eng.has_unfinished_requests():
        assert all(o.error is None for o in eng.step())
    assert llm.runner.stats["padded_verify_eager"] > 0

    real_pad = runner_module.pad_verify_batch

    def too_long(*a):
        padded, rows = real_pad(*a)
        if padded.num_real_requests < padded.num_requests:  # a padding row: past its page-table row
            lens = padded.seq_lens.clone()
            lens[-1] = padded.page_table.shape[1] * 4 + 1 if wrong == "past_its_table" else padded.uniform_q_len - 1
            padded = dataclasses.replace(padded, seq_lens=lens)
        return padded, rows

    monkeypatch.setattr(runner_module, "pad_verify_batch", too_long)
    for rid, prompt in (("d", [5, 6, 7]), ("e", [8, 9]), ("f", [10, 11, 12])):
        eng.add_request(rid, prompt, SamplingParams(max_tokens=8, **GREEDY))
    _step_error(eng, r"padding row 3 ran with a wrong KV length", steps=6)
    monkeypatch.undo()
    while eng.has_unfinished_requests():
        eng.step()
    assert llm.state_pool.num_free == llm.state_pool.num_slots


@pytest.mark.parametrize("edit,pad", [
    (lambda t: t.fill_(0), False),  # two verify rows on one scratch row
    (lambda t: t.fill_(0), True),
    (lambda t: t + 50, False),  # past the scratch's end (padded, the CPU's torch indexing refuses it first)
])
def test_verify_scratch_rows_as_they_ran(tiny_ckpt, make_llm, monkeypatch, edit, pad):
    """The device copy of a verify step's scratch rows (what the Triton kernels write the per-token
    states into) is checked as it ran, in the padded verify step too: rows sharing one, or one
    outside the scratch, fail the step's requests; the engine serves on."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=4, page_size=4, check_state=True, speculative_config=spec)
    eng = llm.engine
    llm.runner.pad_verify = pad
    eng.scheduler.proposer.propose = lambda tokens, k: [tokens[-1]] * k  # drafts at every step
    for rid, prompt in (("a", [5, 6, 7]), ("b", [8, 9]), ("c", [10, 11, 12])):
        eng.add_request(rid, prompt, SamplingParams(max_tokens=8, **GREEDY))
    tamper = lambda b: dataclasses.replace(b, scratch_index=edit(b.scratch_index.clone())) if b.num_verify > 1 else b
    if pad:  # the padded batch (what runs; built from the host lists, so it is tampered after padding)
        import graphs.runner as runner_module

        real_pad = runner_module.pad_verify_batch
        monkeypatch.setattr(runner_module, "pad_verify_batch",
                            lambda *a: (lambda padded, rows: (tamper(padded), rows))(*real_pad(*a)))
    else:
        _patch_batch(monkeypatch, eng, tamper)
    err = _step_error(eng, r"ran with a wrong verify scratch row", steps=4)
    assert "differ from what the sanitizer checked" in err
    monkeypatch.undo()
    while eng.has_unfinished_requests():
        eng.step()
    assert llm.state_pool.num_free == llm.state_pool.num_slots
    assert llm.runner.stats["padded_verify_eager"] > 0 or not pad


def test_a_faulty_row_fails_the_owner_of_the_slot_it_named(tiny_ckpt, make_llm, monkeypatch):
    """A row that ran on another request's slot wrote that state: the owner fails too, even when it
    was not in the step; requests neither touched nor in the step go on."""
    path = tiny_ckpt("nemotron_h")
    llm = make_llm(path, max_num_seqs=3, page_size=4, check_state=True)
    eng = llm.engine
    for rid, prompt in (("x", [5, 6, 7]), ("y", [8, 9]), ("z", [10, 11, 12])):
        eng.add_request(rid, prompt, SamplingParams(max_tokens=6, **GREEDY))
    eng.step()
    slots = {s.request_id: s.slot for s in eng.running}
    real_build = eng._build_batch

    def only_x_onto_y(out):  # schedule just 'x', and run it on y's slot (device copy only)
        out.chunks[:] = [c for c in out.chunks if c.seq.request_id == "x"]
        b = real_build(out)
        return dataclasses.replace(b, state_slot=torch.full_like(b.state_slot, slots["y"]))

    monkeypatch.setattr(eng, "_build_batch", only_x_onto_y)
    failed = {o.request_id: o.error for o in eng.step() if o.error is not None}
    assert set(failed) == {"x", "y"}, failed
    assert all("ran with a wrong Mamba slot" in e for e in failed.values())
    monkeypatch.undo()
    while eng.has_unfinished_requests():
        eng.step()
    assert llm.state_pool.num_free == 3


def test_workspace_regions_that_must_stay_zero(tiny_ckpt, make_llm, monkeypatch):
    """A backend workspace region that is not zero after a step (XQA's semaphores on CUDA) fails the
    step's requests; the region is cleared, and the engine serves the next requests."""
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2, page_size=4, check_state=True)
    backend = llm.runner.ctx.attention_backend
    region = torch.zeros(16, dtype=torch.int32)
    monkeypatch.setattr(backend, "must_stay_zero", lambda: [("test semaphores", region)], raising=False)
    monkeypatch.setattr(backend, "clear_regions", lambda: region.zero_(), raising=False)
    sp = SamplingParams(max_tokens=3, **GREEDY)
    assert llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids  # clean: silent
    region[3] = 1
    with pytest.raises(RequestFailedError, match="must stay zero.*test semaphores"):
        llm.generate([[5, 6, 7]], sp, use_tqdm=False)
    assert not region.any() and len(llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_the_host_half_reads_no_device_tensor(tiny_ckpt, make_llm, monkeypatch):
    """check_batch works from the host copies alone: on a batch whose tensors are on the meta device
    (any read of their values raises) it still passes a correct batch and refuses a wrong slot."""
    llm, eng = _engine_with_freed_slot(make_llm, tiny_ckpt("nemotron_h"), check_state=True)
    seen = []
    real_check = eng.sanitizer.check_batch

    def on_meta(batch, chunks):
        fields = {f.name: getattr(batch, f.name).to("meta") for f in dataclasses.fields(batch)
                  if isinstance(getattr(batch, f.name), torch.Tensor)}
        seen.append(real_check(dataclasses.replace(batch, **fields), chunks))
        return real_check(batch, chunks)

    monkeypatch.setattr(eng.sanitizer, "check_batch", on_meta)
    eng.step()
    assert seen and seen[0].slots == [1]
    _patch_batch(monkeypatch, eng, lambda b: _with_slots(b, [0]))
    _step_error(eng, r"request 'b'.*slot 0")


def test_poisoned_read_is_reported_under_async_scheduling(tiny_ckpt, make_llm, monkeypatch):
    """With steps in flight the NaN flags travel back with the tokens: the culprit is still named."""
    llm = make_llm(tiny_ckpt("nemotron_h"), max_num_seqs=2, page_size=4, check_state=True, async_scheduling=True)
    eng = llm.engine
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=1, **GREEDY))
    eng.add_request("b", [8, 9, 10, 11, 12], SamplingParams(max_tokens=12, **GREEDY))
    for _ in range(4):  # 'a' stops; its slot is freed (and poisoned) once no launched step uses it
        eng.step()
    assert torch.isnan(llm.state_pool.ssm_state[:, 0]).all() and [s.slot for s in eng.running] == [1]
    monkeypatch.setattr(eng.sanitizer, "check_batch", lambda batch, chunks: None)
    _patch_batch(monkeypatch, eng, lambda b: _with_slots(b, [0]))
    _step_error(eng, r"request 'b'.*NaN.*held NaN before the step", steps=2)
