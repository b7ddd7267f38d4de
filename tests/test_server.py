"""The OpenAI-compatible HTTP server: a real uvicorn server on a loopback port, queried with the
official openai client (and httpx for raw requests)."""
from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from server_utils import ServerThread, build_tiny_chat_checkpoint, wait_until  # noqa: E402

MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def chat_ckpt(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("server_ckpt") / "tiny-chat")


@pytest.fixture(scope="module")
def served(chat_ckpt):
    from hybrid import LLM
    from hybrid.server import build_app

    llm = LLM(str(chat_ckpt), max_num_seqs=4, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=128)
    app = build_app(llm, max_queued_requests=64)
    with ServerThread(app) as srv:
        srv.llm = llm
        srv.initial_free = (llm.state_pool.num_free, llm.kv_cache.allocator.num_free)
        yield srv


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


MODEL = "tiny-chat"
GREEDY = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})


def _no_leaks(served) -> bool:
    llm = served.llm
    return wait_until(lambda: (llm.state_pool.num_free, llm.kv_cache.allocator.num_free) == served.initial_free)


def test_health_and_models(served, client):
    assert httpx.get(served.base_url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(prompt="Hello world", max_tokens=20, **GREEDY)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 20
    text = full.choices[0].text
    assert text
    chunks = list(client.completions.create(prompt="Hello world", max_tokens=20, stream=True, **GREEDY))
    deltas = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(deltas) == text
    assert len([d for d in deltas if d]) > 5  # incremental, not one blob
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_equals_non_stream(served, client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    full = client.chat.completions.create(messages=msgs, max_tokens=16, **GREEDY)
    rendered = "<system>be brief\n<user>hi there\n<assistant>"
    assert full.usage.prompt_tokens == len(served.llm.tokenizer.encode(rendered, add_special_tokens=False))
    assert full.choices[0].message.role == "assistant"
    text = full.choices[0].message.content
    assert full.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(messages=msgs, max_tokens=16, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats(served, client, endpoint):
    """stream_options {"include_usage": true, "continuous_usage_stats": true} (vLLM's extension): every chunk
    carries the usage so far, its completion tokens never decreasing and ending at the request's; the last
    chunk is the usage alone, as with include_usage only. Without include_usage it has no effect."""
    def stream(**options):
        kw = dict(max_tokens=12, stream=True, stream_options=options, **GREEDY)
        if endpoint == "chat":
            return list(client.chat.completions.create(messages=[{"role": "user", "content": "count"}], **kw))
        return list(client.completions.create(prompt="Hello world", **kw))

    chunks = stream(include_usage=True, continuous_usage_stats=True)
    assert all(c.usage is not None for c in chunks)
    prompt = chunks[0].usage.prompt_tokens
    assert prompt > 0 and all(c.usage.prompt_tokens == prompt for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12 and counts[0] < 12
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chunks)
    assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason == "length"
    plain = stream(include_usage=True)
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in stream(include_usage=False, continuous_usage_stats=True))


def test_continuous_usage_stats_are_per_choice(served, client):
    """With several prompts and n > 1, each chunk's usage is its own choice's, as vLLM's: its prompt's tokens and
    the choice's tokens so far (counting 1, 2, ... per choice); the last chunk has the request's totals."""
    prompts = ["Hello world", "And the LORD said unto Moses, speak"]
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=5, stream=True, temperature=1.0, seed=1,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    lengths = [len(served.llm.tokenizer.encode(p)) for p in prompts]
    seen: dict[int, list[int]] = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        assert c.usage.prompt_tokens == lengths[choice.index // 2], (choice.index, c.usage)
        seen.setdefault(choice.index, []).append(c.usage.completion_tokens)
    assert sorted(seen) == [0, 1, 2, 3]
    for counts in seen.values():
        assert counts == sorted(counts) and counts[-1] == 5 and counts[0] <= 1, counts
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == sum(lengths)
    assert chunks[-1].usage.completion_tokens == 20


def test_return_tokens_as_token_ids(served, client, chat_ckpt):
    """return_tokens_as_token_ids: the logprobs of both endpoints name each token "token_id:ID"; the ids are
    those of the same request's tokens by text, and the log-probabilities are the same. A server built with
    the flag on does it by default; a request's false wins."""
    from hybrid.server import build_app

    tok = served.llm.tokenizer
    kw = dict(max_tokens=6, logprobs=2, **GREEDY)
    as_text = client.completions.create(prompt="Hello world", **kw).choices[0].logprobs
    as_ids = client.completions.create(prompt="Hello world", **{**kw, "extra_body": {
        **GREEDY["extra_body"], "return_tokens_as_token_ids": True}}).choices[0].logprobs
    ids = [int(t.removeprefix("token_id:")) for t in as_ids.tokens]
    assert all(t.startswith("token_id:") for t in as_ids.tokens)
    assert [tok.decode([i]) for i in ids] == as_text.tokens and as_ids.token_logprobs == as_text.token_logprobs
    for top_ids, top_text in zip(as_ids.top_logprobs, as_text.top_logprobs):
        assert {tok.decode([int(k.removeprefix("token_id:"))]): v for k, v in top_ids.items()} == top_text
    chat_kw = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    text_content = client.chat.completions.create(**chat_kw).choices[0].logprobs.content
    chat_kw["extra_body"] = {**GREEDY["extra_body"], "return_tokens_as_token_ids": True}
    id_content = client.chat.completions.create(**chat_kw).choices[0].logprobs.content
    assert [tok.decode([int(e.token.removeprefix("token_id:"))]) for e in id_content] == [e.token for e in text_content]
    assert all(e.top_logprobs[0].token.startswith("token_id:") for e in id_content)
    # the server's default (not started: its handlers only); a request's own false wins over it
    handlers = build_app(served.llm, return_tokens_as_token_ids=True).state.server
    assert handlers.logprob_token_str(None)(7) == "token_id:7"
    assert handlers.logprob_token_str(False)(7) == tok.decode([7])
    r = httpx.post(served.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                              "return_tokens_as_token_ids": "yes"})
    assert r.status_code == 400 and "return_tokens_as_token_ids" in r.text


def test_prompt_tokens_details_count_the_prefix_cache(chat_ckpt):
    """--enable-prompt-tokens-details with prefix caching: usage.prompt_tokens_details.cached_tokens is 0 for
    the first request and the cached prefix's tokens for a second one that starts the same (whole and
    streamed); /v1/responses reports them as input_tokens_details.cached_tokens. Without the flag, no details."""
    from hybrid import LLM
    from hybrid.server import build_app

    llm = LLM(str(chat_ckpt), max_num_seqs=2, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=128,
              enable_prefix_caching=True, page_size=4, prefix_cache_interval=8)
    with ServerThread(build_app(llm, enable_prompt_tokens_details=True)) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        system = "you answer in one short line, always politely, and never more than that. "
        first = c.completions.create(prompt=system + "first", max_tokens=2, **GREEDY)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        second = c.completions.create(prompt=system + "second", max_tokens=2, **GREEDY)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 8 <= cached < second.usage.prompt_tokens and cached % 8 == 0
        chunks = list(c.completions.create(prompt=system + "third", max_tokens=2, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached
        # (rendered with the chat template: a prefix of their own)
        r = [c.responses.create(model=MODEL, input=system + end, max_output_tokens=2, temperature=0)
             for end in ("fourth", "fifth")]
        assert r[0].usage.input_tokens_details.cached_tokens == 0
        assert r[1].usage.input_tokens_details.cached_tokens >= 8
    # the same count on LLM.generate's outputs (its own tokenization: a prefix of its own)
    plain = [llm.generate([system + end], use_tqdm=False)[0] for end in ("sixth", "seventh")]
    assert plain[0].num_cached_tokens == 0 and plain[1].num_cached_tokens >= 8


def test_priority_field(served, chat_ckpt):
    """A request's `priority`: a 400 naming it on a first-come server (as vLLM's), served by one started with
    scheduling_policy="priority" (both endpoints, streamed too); a non-integer is a 400 either way."""
    from hybrid import LLM
    from hybrid.server import build_app

    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "priority": 3}
    r = httpx.post(served.base_url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority" and "scheduling" in r.text
    llm = LLM(str(chat_ckpt), max_num_seqs=2, max_model_len=MAX_MODEL_LEN, scheduling_policy="priority")
    with ServerThread(build_app(llm)) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        extra = {**GREEDY["extra_body"], "priority": -4}
        kw = {**GREEDY, "extra_body": extra, "max_tokens": 3}
        assert c.completions.create(prompt="hi", **kw).usage.completion_tokens == 3
        chat = list(c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], stream=True, **kw))
        assert chat[-1].choices[0].finish_reason == "length"
        r = httpx.post(srv.base_url + "/v1/completions", json={**body, "priority": "high"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_no_prompt_tokens_details_by_default(served):
    r = httpx.post(served.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and "prompt_tokens_details" not in r.json()["usage"]


def test_stop_strings_across_tokens(client):
    base = client.completions.create(prompt="The quick brown fox", max_tokens=40, **GREEDY).choices[0].text
    assert len(base) > 20
    stop = base[12:15]  # 3 characters: usually spans a token boundary
    expected = base[: base.find(stop)]
    out = client.completions.create(prompt="The quick brown fox", max_tokens=40, stop=[stop, "@@@@"], **GREEDY)
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(prompt="The quick brown fox", max_tokens=40, stop=[stop, "@@@@"],
                                            stream=True, **GREEDY))
    deltas = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(deltas) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # chat, streamed
    msgs = [{"role": "user", "content": "The quick brown fox"}]
    cbase = client.chat.completions.create(messages=msgs, max_tokens=40, **GREEDY).choices[0].message.content
    cstop = cbase[10:12]
    chunks = list(client.chat.completions.create(messages=msgs, max_tokens=40, stop=cstop, stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cbase[: cbase.find(cstop)]


def test_n_greater_than_one(client):
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=12, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    texts = {c.index: c.text for c in full.choices}
    assert len(set(texts.values())) > 1  # different samples
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.text
    assert streamed == texts  # seeded: the same samples


def test_n_streamed_logprobs_equal_non_streamed(client):
    """Streams carry each choice's tokens once, in order: the engine reports deltas and the async
    front end rebuilds running totals per choice (n > 1 and logprobs included)."""
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=10, temperature=1.0, seed=11, n=2, logprobs=2,
              extra_body={"ignore_eos": True})
    full = {c.index: c for c in client.completions.create(**kw).choices}
    tokens: dict[int, list] = {0: [], 1: []}
    lps: dict[int, list] = {0: [], 1: []}
    text: dict[int, str] = {0: "", 1: ""}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            text[c.index] += c.text
            if c.logprobs is not None:
                tokens[c.index] += c.logprobs.tokens
                lps[c.index] += c.logprobs.token_logprobs
    for i in (0, 1):
        assert text[i] == full[i].text
        assert tokens[i] == full[i].logprobs.tokens and len(tokens[i]) == 10
        assert lps[i] == pytest.approx(full[i].logprobs.token_logprobs)


def test_sampling_fields_and_logprobs(client):
    a = client.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=0.8, top_p=0.9, seed=3,
                                  extra_body={"top_k": 20, "ignore_eos": True}, logprobs=2)
    b = client.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=0.8, top_p=0.9, seed=3,
                                  extra_body={"top_k": 20, "ignore_eos": True}, logprobs=2)
    assert a.choices[0].text == b.choices[0].text
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    # the 2 most likely and always the sampled token (OpenAI's up to logprobs + 1 entries)
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    assert all(t[tok] == pytest.approx(v) for t, tok, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    assert all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "x"}], max_tokens=5, logprobs=True,
                                          top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)
    # greedy: the sampled token is the top-1
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_logit_bias_and_penalties(client):
    """OpenAI's logit_bias (token ids as strings) and penalties, plus min_p / min_tokens /
    repetition_penalty through extra_body."""
    forced = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0,
                                       logit_bias={"7": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text and forced.usage.completion_tokens == 4
    ids = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=1,
                                    logit_bias={"7": 100}, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(set(ids.tokens)) == 1  # the same (biased) token every step
    pen = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0.7, seed=2,
                                    presence_penalty=1.0, frequency_penalty=0.5,
                                    extra_body={"min_p": 0.05, "min_tokens": 3, "repetition_penalty": 1.3})
    assert pen.usage.completion_tokens >= 3


BAD_COMPLETIONS = [
    ({"model": MODEL, "prompt": "a" * (MAX_MODEL_LEN + 10)}, "prompt"),
    ({"model": MODEL, "prompt": "a", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "a", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "a", "top_k": -5}, "top_k"),
    ({"model": MODEL, "prompt": "a", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "stop": 5}, "stop"),
    ({"model": MODEL, "prompt": "a", "logprobs": 99}, "logprobs"),
    ({"model": MODEL, "prompt": "a", "seed": "x"}, "seed"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": [100000]}, "prompt"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": "a", "presence_penalty": 5}, "presence_penalty"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"model": MODEL, "prompt": "a", "logit_bias": {"100000": 5}}, "logit_bias"),
    ({"model": MODEL, "prompt": "a", "min_p": 2}, "min_p"),
]


def test_bad_requests_get_400(served):
    url = served.base_url
    for body, param in BAD_COMPLETIONS:
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"], (body, err)
    for body in [{"model": MODEL}, {"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"content": "x"}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": "x" * 400}]}]:
        r = httpx.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # an unknown model is 404 model_not_found everywhere, as OpenAI answers it
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as ei:
        c.completions.create(model="other", prompt="a")
    assert ei.value.code == "model_not_found"
    # and the server is fine afterwards
    assert httpx.get(url + "/health").status_code == 200
    ok = c.completions.create(model=MODEL, prompt="ok", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3
    assert _no_leaks(served)


def test_metrics_prometheus_text(served, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(prompt="metrics", max_tokens=4, **GREEDY)
    text = httpx.get(served.base_url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ["hybrid_num_requests_running", "hybrid_num_requests_waiting", "hybrid_state_slots_in_use",
                 "hybrid_kv_pages_in_use", "hybrid_generation_tokens", "hybrid_time_to_first_token_seconds",
                 "hybrid_time_per_output_token_seconds"]:
        assert name in fams, name
    gen = [s.value for s in fams["hybrid_generation_tokens"].samples if s.name.endswith("_total")]
    assert gen and gen[0] >= 4
    ttft_count = [s.value for s in fams["hybrid_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft_count[0] >= 1
    tpot_count = [s.value for s in fams["hybrid_time_per_output_token_seconds"].samples if s.name.endswith("_count")]
    assert tpot_count[0] >= 3
    # vLLM's names carry the same figures (dashboards built for vLLM read them)
    def value(family: str, suffix: str = "") -> float:
        return next(s.value for s in fams[family].samples if s.name == family + suffix)

    assert value("vllm:generation_tokens", "_total") == value("hybrid_generation_tokens", "_total")
    assert value("vllm:prompt_tokens", "_total") == value("hybrid_prompt_tokens", "_total") > 0
    assert value("vllm:time_to_first_token_seconds", "_count") == ttft_count[0]
    assert value("vllm:inter_token_latency_seconds", "_count") == tpot_count[0]
    assert value("vllm:num_requests_running") == value("hybrid_num_requests_running")
    assert 0.0 <= value("vllm:kv_cache_usage_perc") <= 1.0
    assert sum(s.value for s in fams["vllm:request_success"].samples if s.name.endswith("_total")) >= 1


def test_disconnect_frees_slot_and_pages(served, client):
    ref = client.completions.create(prompt="Steady request", max_tokens=60, **GREEDY).choices[0].text

    other: dict = {}

    def run_other():
        other["text"] = "".join(c.choices[0].text for c in client.completions.create(
            prompt="Steady request", max_tokens=60, stream=True, **GREEDY) if c.choices)

    t = threading.Thread(target=run_other)
    t.start()
    body = {"model": MODEL, "prompt": "This one goes away", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events = 0
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", served.base_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events >= 5:
                        break
    # the client is gone: its slot and pages are released promptly, while the other stream goes on
    llm = served.llm
    t.join(timeout=60)
    assert not t.is_alive()
    assert other["text"] == ref
    assert _no_leaks(served)
    assert wait_until(lambda: llm.engine.requests == {})


def _metric(served, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(served.base_url + "/metrics").text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    return 0.0


def test_disconnect_aborts_mid_stream(served):
    """A stream cancelled mid-way is aborted (not run to its end) and frees its slot and pages."""
    aborted0 = _metric(served, "hybrid_request_aborted_total")
    tokens0 = _metric(served, "hybrid_generation_tokens_total")
    body = {"model": MODEL, "prompt": "Long running", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", served.base_url + "/v1/completions", json=body) as r:
            for i, line in enumerate(r.iter_lines()):
                if i >= 6:
                    break
    assert _no_leaks(served)
    assert _metric(served, "hybrid_request_aborted_total") == aborted0 + 1
    assert _metric(served, "hybrid_generation_tokens_total") - tokens0 < 240


def test_disconnect_non_streamed_request_aborts(served):
    aborted0 = _metric(served, "hybrid_request_aborted_total")
    body = {"model": MODEL, "prompt": "Impatient", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.05))
    assert wait_until(lambda: _metric(served, "hybrid_request_aborted_total") == aborted0 + 1)
    assert _no_leaks(served)


def test_queue_limit_answers_429(chat_ckpt):
    from hybrid import LLM
    from hybrid.server import build_app

    llm = LLM(str(chat_ckpt), max_num_seqs=1, max_model_len=MAX_MODEL_LEN)
    app = build_app(llm, served_model_name="small", max_queued_requests=1)
    body = {"model": "small", "prompt": "busy", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with ServerThread(app) as srv, httpx.Client(timeout=30) as h:
        streams = []
        try:
            for _ in range(2):  # one running, one queued
                cm = h.stream("POST", srv.base_url + "/v1/completions", json=body)
                r = cm.__enter__()
                assert r.status_code == 200
                streams.append(cm)
            assert wait_until(lambda: app.state.async_engine.num_inflight == 2)
            r = h.post(srv.base_url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1"
        finally:
            for cm in streams:
                cm.__exit__(None, None, None)
        assert wait_until(lambda: app.state.async_engine.num_inflight == 0)
        r = h.post(srv.base_url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert r.status_code == 200 and json.loads(r.text)["usage"]["completion_tokens"] == 2
        assert wait_until(lambda: llm.state_pool.num_free == 1)


def test_text_deltas_hold_back_stop_prefixes_and_partial_chars():
    from hybrid.output_processor import TextDeltas

    d = TextDeltas(["STOP", "\n\n"])
    assert d.update("ab", False) == "ab"
    assert d.update("abS", False) == ""  # could become "STOP"
    assert d.update("abST", False) == ""
    assert d.update("abSTx", False) == "STx"  # it did not
    assert d.update("abSTx\n", False) == ""
    assert d.update("abSTx\ncaf\ufffd", False) == "\ncaf"  # "\n" is no longer a stop prefix; U+FFFD held
    assert d.sent == "abSTx\ncaf"
    assert d.update("abSTx\ncafé", False) == "é"
    assert d.update("abSTx\ncafé", True) == ""  # the engine cut the stop string: nothing leaks
    assert d.sent == "abSTx\ncafé"
