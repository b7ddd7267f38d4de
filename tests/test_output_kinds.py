"""What Engine.step() returns per request (Engine.add_request(output_kind=...)): "cumulative"
(everything so far after every step), "delta" (only what is new), "final" (one output at the end).
The three describe the same generation; delta and final keep the per-step host cost flat."""
from __future__ import annotations

import pytest

from hybrid import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [11], [40, 41, 42]]


def _run(engine, kind: str, params: SamplingParams) -> dict[str, list]:
    """Step until every request finished; every output seen, per request id, in order."""
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{kind}-{i}", p, params, output_kind=kind)
    seen: dict[str, list] = {f"{kind}-{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
    SamplingParams(n=2, max_tokens=9, temperature=0.8, seed=3, ignore_eos=True, logprobs=1),
], ids=["greedy-logprobs", "n2-sampled"])
def test_delta_and_final_describe_the_cumulative_run(tiny_ckpt, make_llm, params):
    engine = make_llm(tiny_ckpt("granite_dense"), max_num_seqs=8).engine
    cumulative = _run(engine, "cumulative", params)
    delta = _run(engine, "delta", params)
    final = _run(engine, "final", params)
    for i in range(len(PROMPTS)):
        full = cumulative[f"cumulative-{i}"][-1]
        assert full.finished and len(cumulative[f"cumulative-{i}"]) > 1
        # final: exactly one output, the finished one, equal to the cumulative run's last
        (last,) = final[f"final-{i}"]
        assert last.finished
        # delta: concatenated, the pieces are the whole output; no token is reported twice
        deltas = delta[f"delta-{i}"]
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        for c_full, c_last in zip(full.outputs, last.outputs):
            idx = c_full.index
            pieces = [c for d in deltas for c in d.outputs if c.index == idx]
            assert [t for c in pieces for t in c.token_ids] == c_full.token_ids == c_last.token_ids
            assert [lp for c in pieces for lp in c.logprobs] == c_full.logprobs == c_last.logprobs
            assert pieces[-1].text == c_full.text == c_last.text  # text: always the whole text
            assert pieces[-1].finish_reason == c_full.finish_reason == c_last.finish_reason == "length"
        assert max(len(c.token_ids) for d in deltas[1:] for c in d.outputs) <= 1  # one token a step


def test_unknown_output_kind_is_refused(tiny_ckpt, make_llm):
    engine = make_llm(tiny_ckpt("granite_dense")).engine
    with pytest.raises(ValueError, match="output_kind"):
        engine.add_request("x", [1, 2], SamplingParams(max_tokens=2), output_kind="streaming")
    assert not engine.has_unfinished_requests()
