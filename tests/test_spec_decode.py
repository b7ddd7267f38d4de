"""Prompt-lookup (n-gram) speculative decoding: verify steps, post-verify state commit.

Greedy output with speculation must equal output without it token for token (rejected drafts
leave no trace in the Mamba state or the KV cache), and seeded sampled output too (one draw per
emitted token from the request's own generator, accept iff the draft equals the sampled token).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hybrid import SamplingParams
from hybrid.spec_decode import NgramProposer, SpeculativeConfig, verify_drafts

import tiny_checkpoints as tc

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],  # repetitive
    [9, 30, 41, 12, 77, 3, 50],
    [4],
    list(range(10, 40)),
]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def repetitive_ckpt(tmp_path_factory):
    """A NemotronH whose mixer outputs are scaled down (branch_out_scale 0.2): the next token depends
    mostly on the current one, so greedy outputs fall into cycles and n-gram drafts get accepted,
    while Mamba and attention still shape every logit."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        vocab_size=96, hidden_size=64, hybrid_override_pattern="M*M-M", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, expand=2,
        chunk_size=8, layer_norm_epsilon=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(11)
    model = NemotronHForCausalLM(cfg).to(torch.float32).eval()
    tc._redraw_weights(model, 11, branch_out_scale=0.2, lm_head_std=6.0 / math.sqrt(64))
    return str(tc._finish(model, tmp_path_factory.mktemp("rep") / "nemotron_rep"))


def _run(llm, prompts, sp):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.mark.parametrize("sampled, stop_at, expected", [
    ([1, 2, 3, 4], None, (4, 3)),  # every draft accepted, then the bonus token
    ([1, 9, 3, 4], None, (2, 1)),  # first mismatch at position 1: its sampled token is emitted
    ([7, 2, 3, 4], None, (1, 0)),
    ([1, 2, 3, 4], 1, (2, 2)),  # the token at position 1 ended the sequence (a stop token)
])
def test_verify_drafts_acceptance_rule(sampled, stop_at, expected):
    """The rule the engine applies to a verify row (Engine._finish_verify): accept a draft iff it
    equals the token sampled there; stop at the first mismatch or when the sequence ends."""
    emitted = []

    def emit(j):
        emitted.append(j)
        return sampled[j]

    assert verify_drafts([1, 2, 3], emit, lambda: stop_at is not None and emitted[-1] == stop_at) == expected
    assert emitted == list(range(expected[0]))


def test_proposer():
    prop = NgramProposer(SpeculativeConfig.from_dict(SPEC))
    assert prop.propose([1, 2, 3, 9, 1, 2, 3], 5) == [9, 1, 2]  # 3-gram match, K=3 tokens after it
    assert prop.propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # capped by the room left
    assert prop.propose([5, 1, 7, 7, 2, 7], 3) == [2, 7, 2]  # falls back to the 1-gram, periodic
    assert prop.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert prop.propose([4, 4, 4, 4], 3) == [4, 4, 4]
    assert prop.propose([1, 2, 3, 1, 2], 3) == [3, 1, 2]
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.from_dict({"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})


@pytest.mark.parametrize("which", ["repetitive", "nemotron_h"])
def test_greedy_equal_with_and_without_speculation(which, repetitive_ckpt, tiny_ckpt, make_llm):
    path = repetitive_ckpt if which == "repetitive" else tiny_ckpt("nemotron_h")
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = _run(make_llm(path, max_num_seqs=4, page_size=4), PROMPTS, sp)
    drafted = accepted = 0
    for batch_size in (1, 4):
        llm = make_llm(path, max_num_seqs=4, page_size=4, speculative_config=SPEC, check_state=batch_size == 4)
        got = []
        for i in range(0, len(PROMPTS), batch_size):
            got += _run(llm, PROMPTS[i:i + batch_size], sp)
        assert got == ref, f"batch size {batch_size}"
        st = llm.engine.stats
        assert st["spec_verify_rows"] > 0
        drafted += st["spec_draft_tokens"]
        accepted += st["spec_accepted_tokens"]
        assert llm.state_pool.num_free == 4 and llm.kv_cache.allocator.num_free == llm.kv_cache.num_pages - 1
    rate = accepted / drafted
    print(f"{which}: acceptance {accepted}/{drafted} = {rate:.3f}")
    assert 0 < rate < 1  # drafts are both accepted and rejected
    if which == "repetitive":
        assert rate > 0.2
        # fewer forward passes than generated tokens: several tokens per verify step
        assert llm.engine.stats["steps"] < llm.engine.stats["generated_tokens"]


def test_acceptance_rate_reported(repetitive_ckpt, make_llm):
    llm = make_llm(repetitive_ckpt, max_num_seqs=2, page_size=4, speculative_config=SPEC)
    assert llm.engine.spec_acceptance_rate() is None
    _run(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    rate = llm.engine.spec_acceptance_rate()
    assert rate == llm.engine.stats["spec_accepted_tokens"] / llm.engine.stats["spec_draft_tokens"]


def test_seeded_sampling_unchanged_by_speculation(repetitive_ckpt, make_llm):
    """One draw per emitted token from the request's generator: the same tokens as without it."""
    sps = [SamplingParams(temperature=t, top_k=k, max_tokens=30, seed=s, ignore_eos=True, logprobs=2)
           for t, k, s in ((0.3, -1, 1), (0.5, 5, 2), (0.2, -1, 3), (1.0, -1, 4))]
    base = make_llm(repetitive_ckpt, max_num_seqs=4, page_size=4)
    spec = make_llm(repetitive_ckpt, max_num_seqs=4, page_size=4, speculative_config=SPEC, check_state=True)
    ref = base.generate(PROMPTS, sps, use_tqdm=False)
    got = spec.generate(PROMPTS, sps, use_tqdm=False)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == len(r.outputs[0].token_ids)
        for a, b in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert spec.engine.stats["spec_accepted_tokens"] > 0


def test_speculation_with_forks_stops_and_tight_pages(repetitive_ckpt, make_llm):
    """n > 1, max_tokens/stop tokens inside an accepted run, and a page budget that forces
    preemption: still identical to the plain engine."""
    path = repetitive_ckpt
    sps = [SamplingParams(n=2, temperature=0.0, max_tokens=33, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    base = make_llm(path, max_num_seqs=4, page_size=4, max_model_len=64)
    ref = base.generate(PROMPTS, sps, use_tqdm=False)
    stop_tok = ref[2].outputs[0].token_ids[20]
    sps[2] = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_tok])
    ref = base.generate(PROMPTS, sps, use_tqdm=False)
    tight = make_llm(path, max_num_seqs=4, page_size=4, max_model_len=64, num_kv_pages=20,
                     speculative_config=SPEC, check_state=True)
    got = tight.generate(PROMPTS, sps, use_tqdm=False)
    for r, g in zip(ref, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in r.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in r.outputs]
    assert len(got[0].outputs) == 2 and got[2].outputs[0].token_ids[-1] == stop_tok
    assert len(got[1].outputs[0].token_ids) == 17
    assert tight.engine.stats["preemptions"] > 0
    assert tight.engine.stats["spec_accepted_tokens"] > 0
    assert tight.state_pool.num_free == 4 and tight.kv_cache.allocator.num_free == 19


@pytest.mark.parametrize("ssm_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", ["repetitive", "granite_moe"])
def test_padded_verify_steps_change_nothing(which, ssm_dtype, repetitive_ckpt, tiny_ckpt, make_llm):
    """The runner's padded verify path (graphs/padding.pad_verify_batch: every row padded to K+1
    tokens, the batch to a bucket; the verify graphs' shape, run eagerly here): the same tokens
    and log-probabilities as the unpadded verify steps and as no speculation, in both state dtypes,
    with the state sanitizer checking the padded index tensors as they ran."""
    path = repetitive_ckpt if which == "repetitive" else tiny_ckpt(which)
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
    kw = dict(max_num_seqs=4, page_size=4, mamba_ssm_dtype=ssm_dtype)

    def run(llm):  # one prompt at a time, then pairs: steps of verify rows only (padded to 1 and 2 rows)
        outs = [o for p in PROMPTS for o in llm.generate([p], sp, use_tqdm=False)]
        outs += llm.generate(PROMPTS[:2], sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]

    ref_tokens, _ = run(make_llm(path, **kw))
    plain = make_llm(path, speculative_config=SPEC, **kw)
    padded = make_llm(path, speculative_config=SPEC, check_state=True, **kw)
    padded.runner.pad_verify = True
    assert padded.runner.verify_q_len == 4 and padded.runner.verify_sizes == [1, 2, 4]
    plain_tokens, plain_lp = run(plain)
    padded_tokens, padded_lp = run(padded)
    assert padded_tokens == plain_tokens == ref_tokens
    assert padded.runner.stats["padded_verify_eager"] > 0 and plain.runner.stats["padded_verify_eager"] == 0
    for a, b in zip(plain_lp, padded_lp):
        for pa, pb in zip(a, b):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert math.isclose(pa[t], pb[t], rel_tol=1e-4, abs_tol=1e-4)
    assert padded.engine.stats["spec_accepted_tokens"] == plain.engine.stats["spec_accepted_tokens"]
    assert padded.engine.stats["spec_accepted_tokens"] > 0 or which != "repetitive"
    assert padded.state_pool.num_free == 4


def test_verify_buckets_stay_within_the_verify_scratch(repetitive_ckpt, make_llm):
    """cuda_graph_sizes above max_num_seqs: verify steps are padded only to buckets the verify
    scratch (one row per sequence) can hold, so padding rows never run past its end."""
    from graphs.memory import GRAPH_RESERVE_BYTES, graph_reserve_bytes
    from graphs.padding import verify_graph_sizes

    assert verify_graph_sizes([1, 2, 4, 8, 16, 24], 3) == [1, 2]
    assert verify_graph_sizes([1, 2, 4, 8, 16, 24], 256) == [1, 2, 4, 8, 16]
    assert graph_reserve_bytes([1, 2, 4, 8], 10, 4, max_num_seqs=3) == GRAPH_RESERVE_BYTES + (15 + 3 * 4) * 10 * 4
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9], [11, 12, 13, 11, 12, 13, 11]]

    def run(llm):  # all three (no bucket holds 3 verify rows: unpadded), then two (padded to 2)
        return [o.outputs[0].token_ids for batch in (prompts, prompts[:2]) for o in llm.generate(batch, sp, use_tqdm=False)]

    want = run(make_llm(repetitive_ckpt, max_num_seqs=3))
    llm = make_llm(repetitive_ckpt, max_num_seqs=3, cuda_graph_sizes=[1, 2, 4, 8], speculative_config=spec)
    assert llm.runner.verify_sizes == [1, 2]
    llm.runner.pad_verify = True
    llm.engine.scheduler.proposer.propose = lambda tokens, k: [tokens[-1]] * k  # drafts at every step
    assert run(llm) == want and llm.runner.stats["padded_verify_eager"] > 0


@pytest.mark.parametrize("which", ["repetitive", "granite_moe"])
def test_replay_verify_imitated_on_cpu(which, repetitive_ckpt, tiny_ckpt, make_llm):
    """ModelRunner.replay_verify (the default path of verify steps on CUDA) with each "graph" an
    eager forward of the verify buffers: the batch padded and copied into the buffers, the logits
    rows picked from the bucket's output, the sanitizer checking the buffers as they ran, with the
    host lists of the batch they were filled from. The same tokens as without speculation."""
    from graphs.padding import padding_verify_batch, verify_page_columns
    from state_pool.util import cdiv

    path = repetitive_ckpt if which == "repetitive" else tiny_ckpt(which)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    kw = dict(max_num_seqs=4, page_size=4)

    def run(llm):
        outs = [o for p in PROMPTS[:3] for o in llm.generate([p], sp, use_tqdm=False)]
        outs += llm.generate(PROMPTS[:3], sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    want = run(make_llm(path, **kw))
    llm = make_llm(path, speculative_config=SPEC, check_state=True, **kw)
    runner = llm.runner
    q, ps = runner.verify_q_len, runner.page_size
    runner.verify_buffers = padding_verify_batch(max(runner.verify_sizes), q, ps, torch.device("cpu"),
                                                 verify_page_columns(cdiv(runner.max_model_len, ps), q, ps),
                                                 llm.state_pool.spec_scratch)
    ran = []

    class EagerGraph:  # what a captured verify graph computes, from the buffers
        def __init__(self, size: int) -> None:
            self.size = size
            self.out = torch.zeros(size * q, llm.config.vocab_size)

        def replay(self) -> None:
            # the kernels read only the buffers (device tensors); the CPU's torch attention reads the
            # host lists, so here they are taken from the buffers as filled
            view = runner._verify_view(self.size)
            view = dataclasses.replace(view, seq_lens_cpu=view.seq_lens.tolist(), state_slot_cpu=view.state_slot.tolist(),
                                       scratch_index_cpu=view.scratch_index.tolist())
            ran.append(view.state_slot_cpu)
            self.out.copy_(runner.model(view, runner.ctx))

    runner.pad_verify = True
    runner.verify_graphs = {s: (g, g.out) for s in runner.verify_sizes for g in [EagerGraph(s)]}
    llm.engine.scheduler.proposer.propose = lambda tokens, k: [tokens[-1]] * k  # drafts at every step
    that_ran = []
    real_replay = runner.replay_verify

    def replay_verify(batch, size):  # the sanitizer's view: the buffers with the filled batch's host lists
        out = real_replay(batch, size)
        got = runner.inputs_that_ran()
        that_ran.append((batch.num_requests, got.num_real_requests, got.state_slot_cpu == got.state_slot.tolist(),
                         got.seq_lens_cpu == got.seq_lens.tolist()))
        return out

    runner.replay_verify = replay_verify
    assert run(llm) == want
    assert runner.stats["verify_graph_replays"] == len(ran) > 0 and runner.stats["padded_verify_eager"] == 0
    assert any(-1 in slots for slots in ran)  # padded buckets ran (padding rows on PAD_SLOT_ID)
    assert all(rec == (rec[0], rec[0], True, True) for rec in that_ran), that_ran


def test_pad_verify_batch_layout():
    """Row r's real tokens keep their order at r * Q + j; padding tokens repeat the row's last token
    position, write the dummy page and lengthen the row's KV; padding rows take unused scratch rows."""
    from attention.kv_cache import DUMMY_PAGE
    from graphs.padding import is_plain_verify, pad_verify_batch
    from state_pool.pool import PAD_SLOT_ID
    from state_pool.step_batch import StepBatch

    ps, Q = 4, 4
    q_lens, hist = [2, 4, 1], [5, 2, 9]
    starts = [0, 2, 6]
    positions = [h + j for h, q in zip(hist, q_lens) for j in range(q)]
    pages = [[1, 2, 3], [4, 5, 0], [6, 7, 8]]
    loc = [pages[r][p // ps] * ps + p % ps for r, (h, q) in enumerate(zip(hist, q_lens)) for p in range(h, h + q)]
    scratch = (torch.zeros(1, 4, Q, 2), torch.zeros(1, 4, Q, 2))
    b = StepBatch(
        input_ids=torch.tensor([11, 12, 21, 22, 23, 24, 31]), positions=torch.tensor(positions),
        query_start_loc=torch.tensor([0, 2, 6, 7], dtype=torch.int32),
        seq_lens=torch.tensor([h + q for h, q in zip(hist, q_lens)], dtype=torch.int32),
        page_table=torch.tensor(pages, dtype=torch.int32), kv_write_loc=torch.tensor(loc),
        state_slot=torch.tensor([3, 0, 2]), has_initial_state=torch.ones(3, dtype=torch.bool),
        logits_indices=torch.arange(7), num_decodes=0, num_prefills=0, query_lens_cpu=q_lens,
        seq_lens_cpu=[h + q for h, q in zip(hist, q_lens)], state_slot_cpu=[3, 0, 2],
        has_initial_state_cpu=[True] * 3, num_verify=3, scratch_index=torch.tensor([0, 1, 2]),
        scratch_index_cpu=[0, 1, 2], state_scratch=scratch)
    assert is_plain_verify(b)
    p, rows = pad_verify_batch(b, 4, Q, ps)
    assert rows.tolist() == [0, 1, 4, 5, 6, 7, 8]
    assert torch.equal(p.input_ids[rows], b.input_ids) and torch.equal(p.kv_write_loc[rows], b.kv_write_loc)
    assert torch.equal(p.positions[rows], b.positions)
    pad_tok = [i for i in range(16) if i not in rows.tolist()]
    assert (p.kv_write_loc[pad_tok] // ps == DUMMY_PAGE).all()
    assert p.positions[[2, 3]].tolist() == [6, 6] and p.positions[[9, 10, 11]].tolist() == [9, 9, 9]
    assert p.positions[12:].tolist() == [0] * 4
    assert p.seq_lens.tolist() == [9, 6, 13, 4] and p.seq_lens_cpu == [9, 6, 13, 4]
    assert p.query_start_loc.tolist() == [0, 4, 8, 12, 16] and p.query_lens_cpu == [Q] * 4
    assert p.page_table.shape[1] == 3 + 1 and (p.page_table[:, 3] == DUMMY_PAGE).all()
    assert (p.page_table[3] == DUMMY_PAGE).all() and torch.equal(p.page_table[:3, :3], b.page_table)
    assert p.state_slot.tolist() == [3, 0, 2, PAD_SLOT_ID] and p.scratch_index.tolist() == [0, 1, 2, 3]
    assert p.num_real_requests == 3 and p.uniform_q_len == Q and p.num_verify == 4
    assert torch.equal(p.logits_indices, torch.arange(16))
    with pytest.raises(ValueError):
        pad_verify_batch(b, 4, 3, ps)  # a row longer than the padded q_len


def test_padded_verify_batches_are_checked(repetitive_ckpt, make_llm, monkeypatch):
    """Verify steps padded to K+1 tokens a row (graphs/padding.pad_verify_batch, the verify graphs'
    shape) are checked as they ran: silent on correct padding, and a padding token whose KV write
    lands in the row's own page instead of the dummy page fails the step's request."""
    import graphs.runner as runner_module

    import dataclasses

    from hybrid.errors import RequestFailedError

    path = repetitive_ckpt
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompt = PROMPTS[0]
    llm = make_llm(path, max_num_seqs=4, page_size=4, check_state=True, speculative_config=SPEC)
    llm.runner.pad_verify = True
    ref = make_llm(path, max_num_seqs=4, page_size=4).generate([prompt], sp, use_tqdm=False)
    out = llm.generate([prompt], sp, use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert llm.runner.stats["padded_verify_eager"] > 0

    real_pad = runner_module.pad_verify_batch

    def pad_token_into_own_page(batch, size, q_len, page_size):
        padded, rows = real_pad(batch, size, q_len, page_size)
        loc = padded.kv_write_loc.clone()
        pad_tokens = [t for t in range(loc.shape[0]) if t not in set(rows.tolist()) and t < q_len]
        if pad_tokens:  # row 0 has padding tokens: point one at its own last real KV row
            loc[pad_tokens[0]] = loc[rows[0]]
        return dataclasses.replace(padded, kv_write_loc=loc), rows

    monkeypatch.setattr(runner_module, "pad_verify_batch", pad_token_into_own_page)
    with pytest.raises(RequestFailedError, match="StateCorruptionError: .*ran with a wrong KV write rows"):
        llm.generate([prompt], sp, use_tqdm=False)
    assert llm.state_pool.num_free == llm.state_pool.num_slots and not llm.engine.has_unfinished_requests()
