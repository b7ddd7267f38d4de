"""/v1/completions with `echo` (issue 14 item 6): the prompt's text before each choice, and with
`logprobs` the prompt tokens' logprobs too (null for the first), as the OpenAI API and vLLM return
them; `max_tokens: 0` scores a text without generating (what evaluation harnesses send). The
logprobs equal the Python API's SamplingParams(prompt_logprobs=k)."""
from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from server_utils import ServerThread, shared_tiny_chat_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import torch

    from hybrid import LLM
    from hybrid.server import build_app

    torch.set_num_threads(1)
    llm = LLM(str(shared_tiny_chat_checkpoint(tmp_path_factory)), device="cpu", max_num_seqs=2, max_model_len=128,
              max_num_batched_tokens=64)
    with ServerThread(build_app(llm)) as srv:
        yield llm, srv


def _post(srv, **body):
    return httpx.post(srv.base_url + "/v1/completions", timeout=60, json={"temperature": 0, **body})


def _assert_close_logprobs(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None) and (g is None or math.isclose(g, w, abs_tol=1e-5)), (got, want)


def test_echo_scores_the_prompt(served):
    from hybrid import LLM, SamplingParams

    llm, srv = served
    model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
    text = "hello there, general"
    r = _post(srv, model=model, prompt=text, echo=True, max_tokens=0, logprobs=2)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == text
    lp = choice["logprobs"]
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == text and lp["text_offset"][0] == 0
    # the reference from an LLM of its own: the served one's engine is driven by the server's thread
    ref = LLM(llm.model_dir, device="cpu", max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64)
    want = ref.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0), use_tqdm=False)[0]
    for i in range(1, len(ids)):
        assert math.isclose(lp["token_logprobs"][i], want.prompt_logprobs[i][ids[i]], abs_tol=1e-5)
        top = lp["top_logprobs"][i]  # the 2 most likely, and the prompt's own token where it is not among them
        assert 2 <= len(top) <= 3 and math.isclose(top[lp["tokens"][i]], lp["token_logprobs"][i], abs_tol=1e-6)
    assert r.json()["usage"]["completion_tokens"] == 0

    # echo with generation: prompt, then the completion; logprobs cover both, offsets run on
    r = _post(srv, model=model, prompt=text, echo=True, max_tokens=3, logprobs=1)
    choice = r.json()["choices"][0]
    plain = _post(srv, model=model, prompt=text, max_tokens=3).json()["choices"][0]["text"]
    assert choice["text"] == text + plain
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 and lp["text_offset"][len(ids)] == len(text)

    # echo without logprobs: the text only
    r = _post(srv, model=model, prompt=text, echo=True, max_tokens=2)
    assert r.json()["choices"][0]["text"].startswith(text) and r.json()["choices"][0]["logprobs"] is None
    # streamed (as vLLM streams it): the prompt's text and logprobs open each choice's first chunk; joined, the
    # chunks are the whole response's text and logprobs, with max_tokens 0 (the prompt alone) too
    for body in ({"max_tokens": 3, "logprobs": 1}, {"max_tokens": 0, "logprobs": 2}, {"max_tokens": 0},
                 {"max_tokens": 2, "logprobs": 0, "n": 2, "prompt": [text, "general there"]}):
        body = {"model": model, "prompt": text, "echo": True, **body}
        whole = _post(srv, **body).json()
        with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=60,
                          json={"temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                                **body}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        for want in whole["choices"]:
            mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == want["index"]]
            assert "".join(ch["text"] for ch in mine) == want["text"], body
            assert mine[-1]["finish_reason"] == want["finish_reason"]
            if want["logprobs"] is None:
                assert all(ch["logprobs"] is None for ch in mine)
                continue
            got = {key: [v for ch in mine if ch["logprobs"] for v in ch["logprobs"][key]] for key in want["logprobs"]}
            # tokens and offsets exactly; the values to float tolerance: the streamed and the whole request are
            # two runs, and their prompts may share a prefill step with different neighbours (on the CPU a row's
            # last digits depend on its batch)
            assert got["tokens"] == want["logprobs"]["tokens"], body
            assert got["text_offset"] == want["logprobs"]["text_offset"], body
            _assert_close_logprobs(got["token_logprobs"], want["logprobs"]["token_logprobs"])
            for g, w in zip(got["top_logprobs"], want["logprobs"]["top_logprobs"], strict=True):
                assert (g is None) == (w is None) and (g is None or g.keys() == w.keys()), body
                if g is not None:
                    _assert_close_logprobs([g[k] for k in w], list(w.values()))
        assert chunks[-1]["usage"] == whole["usage"]
    r = _post(srv, model=model, prompt=text, max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_field(served):
    """vLLM's `prompt_logprobs` extra: each prompt token's logprob (null for the first), its rank and the top
    k, as {token id: {logprob, rank, decoded_token}}: on each completion choice and on the chat response;
    the values equal the Python API's; refused with stream."""
    from hybrid import LLM, SamplingParams

    llm, srv = served
    model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
    text = "hello there"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    ref = LLM(llm.model_dir, device="cpu", max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64)
    want = ref.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0),
                        use_tqdm=False)[0].prompt_logprobs
    r = _post(srv, model=model, prompt=[text, text], max_tokens=2, prompt_logprobs=2)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        rows = choice["prompt_logprobs"]
        assert len(rows) == len(ids) and rows[0] is None
        for i in range(1, len(ids)):
            row = {int(t): e for t, e in rows[i].items()}
            assert ids[i] in row and next(iter(row)) == ids[i]  # the prompt token first
            assert {t for t, e in row.items() if e["rank"] <= 2} >= {t for t, v in want[i].items() if v.rank <= 2}
            for t, e in row.items():
                assert math.isclose(e["logprob"], want[i][t], abs_tol=1e-5) and e["rank"] == want[i][t].rank
                assert e["decoded_token"] == llm.tokenizer.decode([t], skip_special_tokens=False)
    assert r.json()["choices"][0]["logprobs"] is None  # (prompt_logprobs alone asks no output logprobs)

    chat = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                            "prompt_logprobs": 1, "temperature": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(1 <= len(row) <= 2 for row in chat["prompt_logprobs"][1:])
    r = _post(srv, model=model, prompt=text, max_tokens=2, prompt_logprobs=1, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    assert "prompt_logprobs" not in _post(srv, model=model, prompt=text, max_tokens=2).json()["choices"][0]


def test_stop_reason_and_constraint_errors(served):
    """vLLM's stop_reason: the stop string (or token id) that ended a choice, None otherwise, streamed on the
    finishing chunk too; a grammar that does not compile is blamed on the field that carried it."""
    llm, srv = served
    model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
    free = _post(srv, model=model, prompt="hello", max_tokens=6, ignore_eos=True).json()["choices"][0]
    assert free["finish_reason"] == "length" and free["stop_reason"] is None
    stop = free["text"][2:4]
    cut = _post(srv, model=model, prompt="hello", max_tokens=6, ignore_eos=True, stop=[stop]).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=60,
                      json={"model": model, "prompt": "hello", "max_tokens": 6, "ignore_eos": True, "stop": [stop],
                            "stream": True, "temperature": 0}) as s:
        import json as _json
        chunks = [_json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    last = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert last and last[-1]["stop_reason"] == stop
    # the model's own end-of-sequence token: stop_reason None (as vLLM); a stop token the request names: its id
    eos = llm.tokenizer.eos_token_id
    assert eos is not None
    ended = _post(srv, model=model, prompt="hello", max_tokens=6, logit_bias={str(eos): 100}).json()["choices"][0]
    assert ended["finish_reason"] == "stop" and ended["stop_reason"] is None
    other = (eos + 1) % llm.config.vocab_size
    named = _post(srv, model=model, prompt="hello", max_tokens=6, logit_bias={str(other): 100},
                  stop_token_ids=[other]).json()["choices"][0]
    assert named["finish_reason"] == "stop" and named["stop_reason"] == other
    for field, value in (("guided_regex", "(["), ("response_format", {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nonsense"}}})):
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60,
                       json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                             field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        r = _post(srv, model=model, prompt="hi", max_tokens=2, **{field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_ignored_fields_are_logged_once(served, caplog):
    """A field the server never reads is logged (vLLM's habit: a misspelt field does not pass unnoticed),
    once per endpoint and field; the fields it does read, and OpenAI's bookkeeping ones, are not."""
    import logging

    llm, srv = served
    model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
    known = {"model": model, "max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.0, "seed": 1,
             "n": 1, "stop": ["zz"], "stop_token_ids": [3], "ignore_eos": True, "presence_penalty": 0.1,
             "frequency_penalty": 0.1, "repetition_penalty": 1.1, "logit_bias": {"5": 1}, "min_tokens": 1,
             "skip_special_tokens": True, "include_stop_str_in_output": False, "user": "u", "stream": False,
             "priority": 0, "return_tokens_as_token_ids": False, "truncate_prompt_tokens": 8, "metadata": {}}
    chat_msgs = [{"role": "user", "content": "hi"}]
    with caplog.at_level(logging.WARNING, logger="hybrid.server.handlers"):
        assert _post(srv, prompt="hi", logprobs=1, best_of=1, **known).status_code == 200
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60,
                       json={**{k: v for k, v in known.items() if k != "max_tokens"}, "messages": chat_msgs,
                             "logprobs": True, "top_logprobs": 1, "max_completion_tokens": 2, "parallel_tool_calls": True, "add_generation_prompt": True,
                             "chat_template_kwargs": {"x": 1}, "stream_options": None, "store": False})
        assert r.status_code == 200, r.text
        assert not [rec for rec in caplog.records if "ignored" in rec.getMessage()], caplog.text
        for _ in range(2):  # two misspelt fields: logged, the first time only
            r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60,
                           json={"model": model, "messages": chat_msgs, "max_tokens": 2, "temprature": 0,
                                 "logprob": True})
            assert r.status_code == 200, r.text
    logged = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(logged) == 1 and "logprob, temprature" in logged[0] and "/v1/chat/completions" in logged[0], logged


def test_chat_echo(served):
    """vLLM's chat `echo`: with the last message the assistant's (continued), the reply's content starts
    with it, whole and streamed; otherwise nothing is added."""
    llm, srv = served
    model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
    base = {"model": model, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "continue_final_message": True,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well, "}]}
    url = srv.base_url + "/v1/chat/completions"
    plain = httpx.post(url, timeout=60, json=base).json()["choices"][0]["message"]["content"]
    echoed = httpx.post(url, timeout=60, json={**base, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "Well, " + plain
    import json as _json
    with httpx.stream("POST", url, timeout=60, json={**base, "echo": True, "stream": True}) as s:
        chunks = [_json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == echoed
    user_last = {**base, "continue_final_message": False, "echo": True, "messages": base["messages"][:1]}
    fresh = httpx.post(url, timeout=60, json={**user_last, "echo": False}).json()["choices"][0]["message"]["content"]
    assert httpx.post(url, timeout=60, json=user_last).json()["choices"][0]["message"]["content"] == fresh
