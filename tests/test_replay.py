"""Replay after a preemption: a readmitted sequence prefills its prompt, then replays the tokens it
had already generated through the decode recurrence in ONE step (a replay row, as many tokens as
the budget and the free pages allow), and its outputs equal the run without preemption token for
token. bamba's tiny checkpoint has a finite time_step_limit, so recomputing those tokens with the
prefill scan (which clamps dt) would give a different state there."""
from __future__ import annotations

import pytest
import torch

from graphs.padding import is_plain_decode
from hybrid import SamplingParams

torch.set_num_threads(1)  # 2 cores shared by several people

FAMILIES = ["nemotron_h", "bamba"]
PROMPTS = [[7, 19, 33, 41, 5, 60, 12, 88, 9], [4, 5, 6]]
MAX_TOKENS = (20, 30)  # the second request is the longest: the run's step count is its finish step


def _record(llm) -> list[dict]:
    """Record every executed batch's row kinds (runner.execute is wrapped)."""
    batches: list[dict] = []
    runner = llm.engine.runner
    execute = runner.execute

    def wrapped(batch):
        nd, nv, nr = batch.num_decodes, batch.num_verify, batch.num_replay
        batches.append({
            "num_decodes": nd, "num_verify": nv, "num_replay": nr, "num_prefills": batch.num_prefills,
            "replay_q_lens": batch.query_lens_cpu[nd + nv:nd + nv + nr],
            "num_logits": int(batch.logits_indices.shape[0]), "plain": is_plain_decode(batch),
            "bucket": runner.bucket(batch),
        })
        return execute(batch)

    runner.execute = wrapped
    return batches


def _run(llm, sps, preempt_after: int | None = None) -> list[list[int]]:
    """Run PROMPTS step by step; preempt the second request once it has `preempt_after` outputs."""
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(PROMPTS, sps)):
        eng.add_request(f"r{i}", p, sp)
    seqs = [eng.requests[f"r{i}"].seqs[0] for i in range(len(PROMPTS))]
    preempted = False
    while eng.has_unfinished_requests():
        eng.step()
        victim = seqs[1]
        if preempt_after is not None and not preempted and len(victim.output_token_ids) >= preempt_after:
            assert victim in eng.running
            eng.scheduler.preempt(victim)
            preempted = True
    assert preempt_after is None or preempted
    return [list(s.output_token_ids) for s in seqs]


@pytest.mark.parametrize("check_state", [False, True])
@pytest.mark.parametrize("name", FAMILIES)
def test_preempted_request_catches_up_in_one_replay_step(name, check_state, tiny_ckpt, make_llm):
    path = tiny_ckpt(name)
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    ref_llm = make_llm(path, max_num_seqs=4, page_size=4, max_model_len=64)
    ref = _run(ref_llm, sps)
    ref_steps = ref_llm.engine.stats["steps"]

    llm = make_llm(path, max_num_seqs=4, page_size=4, max_model_len=64, check_state=check_state)
    batches = _record(llm)
    k = 10
    got = _run(llm, sps, preempt_after=k)
    assert got == ref
    assert llm.engine.stats["preemptions"] == 1
    # one step to prefill the prompt again, one step replaying all k generated tokens (the last of
    # which it samples from, as a decode would): one step more than without the preemption
    # (replaying one token per step took k steps more).
    assert llm.engine.stats["steps"] == ref_steps + 1
    replays = [b for b in batches if b["num_replay"]]
    assert len(replays) == 1
    (b,) = replays
    assert b["num_replay"] == 1 and b["replay_q_lens"] == [k]  # tokens [len(prompt), len(prompt) + k)
    assert b["num_decodes"] == 1 and b["num_prefills"] == 0  # the other request decodes alongside
    assert b["num_logits"] == 2  # the decode's row and the replay's last token
    assert not b["plain"] and b["bucket"] is None  # replay batches run eagerly, never as a graph
    assert llm.state_pool.num_free == 4


@pytest.mark.parametrize("name", FAMILIES)
def test_replay_split_by_token_budget(name, tiny_ckpt, make_llm):
    """A budget smaller than the tokens to replay: several replay chunks, only the last one samples."""
    path = tiny_ckpt(name)
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    kw = dict(max_num_seqs=4, page_size=4, max_model_len=64, max_num_batched_tokens=5)
    ref = _run(make_llm(path, **kw), sps)
    llm = make_llm(path, check_state=True, **kw)
    batches = _record(llm)
    k = 12
    got = _run(llm, sps, preempt_after=k)
    assert got == ref
    replays = [b for b in batches if b["num_replay"]]
    # the other request's decode keeps one token of the budget of 5: chunks of 4, 4, 4
    assert [b["replay_q_lens"] for b in replays] == [[4], [4], [4]]
    assert [b["num_logits"] for b in replays] == [1, 1, 2]  # only the chunk reaching the end samples
    assert all(not b["plain"] for b in replays)


@pytest.mark.parametrize("name", FAMILIES)
def test_replay_under_page_pressure(name, tiny_ckpt, make_llm):
    """Preemptions forced by a tiny page budget: replay chunks (sized by the free pages) keep the
    outputs identical; the sanitizer checks every batch."""
    prompts = [[7, 19, 33, 41, 5, 60, 12, 88, 9], [4], [100, 3, 57, 22, 61, 17, 18, 19, 20, 21, 22, 23], [45, 46]]
    path = tiny_ckpt(name)
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 36, 24, 40)]
    ref = make_llm(path, max_num_seqs=4, page_size=4, max_model_len=64).generate(prompts, sps, use_tqdm=False)
    llm = make_llm(path, max_num_seqs=4, page_size=4, max_model_len=64, num_kv_pages=17, check_state=True)
    batches = _record(llm)
    got = llm.generate(prompts, sps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.stats["preemptions"] > 0
    replay_lens = [q for b in batches for q in b["replay_q_lens"]]
    assert replay_lens and max(replay_lens) > 1  # several tokens per replay row
    assert all(not b["plain"] for b in batches if b["num_replay"])
    assert llm.state_pool.num_free == 4 and llm.kv_cache.allocator.num_free == 16
