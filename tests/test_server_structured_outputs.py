"""Structured outputs through the OpenAI-compatible server: OpenAI's `response_format` (json_object,
json_schema) and vLLM's `structured_outputs` / `guided_*` fields, on /v1/chat/completions and
/v1/completions, streamed or not; an invalid constraint is a 400 and harms no other request."""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from server_utils import ServerThread  # noqa: E402

MODEL = "hybrid-default"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "tribe": {"enum": ["Judah", "Levi", "Dan"]}},
    "required": ["name", "age", "tribe"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,7} [0-9]{1,3}:[0-9]{1,2}"
MESSAGES = [{"role": "user", "content": "Who was Moses?"}]


@pytest.fixture(scope="module")
def served():
    import torch

    from hybrid import LLM
    from hybrid.server import build_app

    torch.set_num_threads(1)
    llm = LLM(None, device="cpu", max_num_seqs=4, max_model_len=1024)
    with ServerThread(build_app(llm, served_model_name=MODEL)) as srv:
        srv.llm = llm
        yield srv


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _schema_format(schema=PERSON):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_chat_json_schema_streamed_and_not(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=400, temperature=0, response_format=_schema_format())
    r = client.chat.completions.create(**kw)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == text
    # sampled, n > 1: every choice validates
    r = client.chat.completions.create(**{**kw, "temperature": 1.0, "seed": 3, "n": 2})
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_completions_response_format_and_json_object(client):
    r = client.completions.create(model=MODEL, prompt="And the LORD said unto Moses,", max_tokens=400, temperature=0,
                                  extra_body={"response_format": _schema_format()})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("extra, ok", [
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"structured_outputs": {"choice": ["Moses", "Aaron"]}}, lambda t: t in ("Moses", "Aaron")),
    ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None
     and t == json.dumps(json.loads(t), separators=(",", ":"), ensure_ascii=False)),
    ({"structured_outputs": {"grammar": 'start: "yea" | "nay"'}}, lambda t: t in ("yea", "nay")),
    ({"guided_json": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_choice": ["Moses", "Aaron"]}, lambda t: t in ("Moses", "Aaron")),
])
def test_vllm_extension_fields(client, extra, ok):
    r = client.completions.create(model=MODEL, prompt="Who was Moses?", max_tokens=400, temperature=0,
                                  extra_body=extra)
    assert ok(r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=400, temperature=1.0, seed=1,
                                       extra_body=extra)
    assert ok(r.choices[0].message.content), r.choices[0].message.content


BAD = [
    ({"response_format": _schema_format({"type": "objekt"})}, "objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "unclosed group"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "nowhere"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"structured_outputs": {"jsn": {}}}, "unknown field"),
    ({"structured_outputs": {"choice": []}}, "choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "only one output constraint"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
     "response_format.json_schema.name"),
]


@pytest.mark.parametrize("extra, says", BAD)
def test_invalid_constraint_is_400(served, client, extra, says):
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4})):
        for stream in (False, True):
            r = httpx.post(served.base_url + path, json={**body, **extra, "stream": stream}, timeout=60)
            assert r.status_code == 400, (path, extra, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and says in err["message"] + str(err["param"]), err
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
    ok = client.completions.create(model=MODEL, prompt="ok", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3


def test_compiling_a_grammar_leaves_the_server_responsive(served, monkeypatch):
    """A constrained request's grammar compiles on a worker thread, not on the event loop: while one
    compile is held, the server answers other requests; the held request then completes."""
    import threading

    grammars = served.llm.engine.grammars
    real, entered, release = grammars.matchers, threading.Event(), threading.Event()

    def held_matchers(params, n):
        if n == 0 and params.regex == "held[0-9]":  # the server's validation of the held request
            entered.set()
            assert release.wait(60)
        return real(params, n)

    monkeypatch.setattr(grammars, "matchers", held_matchers)
    result = {}

    def held_request():
        result["r"] = httpx.post(served.base_url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 4, "structured_outputs": {"regex": "held[0-9]"}})

    t = threading.Thread(target=held_request)
    t.start()
    try:
        assert entered.wait(60)
        assert httpx.get(served.base_url + "/health", timeout=10).status_code == 200
        free = httpx.post(served.base_url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "ok", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert free.json()["usage"]["completion_tokens"] == 3
    finally:
        release.set()
        t.join(120)
    assert result["r"].status_code == 200 and re.fullmatch("held[0-9]", result["r"].json()["choices"][0]["text"])


def test_logprob_bytes_join_into_the_text(served):
    """Chat logprobs' `bytes` are each token's own, as OpenAI's: tokens that are parts of one UTF-8 character
    (each alone decodes as U+FFFD) carry their bytes, and the bytes of the content's tokens join into it."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20, "logprobs": True, "top_logprobs": 2,
            "structured_outputs": {"regex": "🙂é🙂"}}
    for stream in (False, True):
        r = httpx.post(served.base_url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            entries = [e for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
                       for e in c["choices"][0]["logprobs"]["content"]]
        else:
            choice = r.json()["choices"][0]
            text, entries = choice["message"]["content"], choice["logprobs"]["content"]
        assert text == "🙂é🙂"
        assert any(e["token"] == "\ufffd" for e in entries)  # (the case: partial characters)
        assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8") == text
        assert all(isinstance(t["bytes"], list) for e in entries for t in e["top_logprobs"])
