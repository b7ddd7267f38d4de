"""Request fields and conventions of vLLM's OpenAI server that client programs written for it rely on: a
request's own chat_template (only with --trust-request-chat-template), `documents` for the template,
`add_special_tokens` on chat, the client's request id (X-Request-Id or request_id) naming the response,
OpenAI's deprecated "function" messages, `max_tokens: null` on completions, and `echo` streamed."""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from server_utils import ServerThread, shared_tiny_chat_checkpoint  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]


def _llm(tmp_path_factory):
    import torch

    from hybrid import LLM

    torch.set_num_threads(1)
    return LLM(str(shared_tiny_chat_checkpoint(tmp_path_factory)), device="cpu", max_num_seqs=4, max_model_len=128,
               max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def trusting(tmp_path_factory):
    from hybrid.server import build_app

    llm = _llm(tmp_path_factory)
    with ServerThread(build_app(llm, trust_request_chat_template=True)) as srv:
        yield llm, srv


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    from hybrid.server import build_app

    llm = _llm(tmp_path_factory)
    with ServerThread(build_app(llm)) as srv:
        yield llm, srv


def _post(srv, path, **body):
    return httpx.post(srv.base_url + path, timeout=60, json={"temperature": 0, **body})


def test_request_chat_template_needs_the_flag(plain):
    llm, srv = plain
    r = _post(srv, "/v1/chat/completions", messages=MESSAGES, max_tokens=2, chat_template="{{ messages[0].content }}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    r = _post(srv, "/tokenize", messages=MESSAGES, chat_template="{{ messages[0].content }}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert _post(srv, "/v1/chat/completions", messages=MESSAGES, max_tokens=2).status_code == 200


def test_request_chat_template_renders_the_prompt(trusting):
    llm, srv = trusting
    template = "{% for m in messages %}<{{ m.content }}>{% endfor %}|"
    want = llm.tokenizer.encode("<hi>|", add_special_tokens=False)
    r = _post(srv, "/tokenize", messages=MESSAGES, chat_template=template)
    assert r.status_code == 200 and r.json()["tokens"] == want
    r = _post(srv, "/v1/chat/completions", messages=MESSAGES, max_tokens=2, chat_template=template)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)
    # the checkpoint's template still serves requests without one of their own
    default = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    r = _post(srv, "/tokenize", messages=MESSAGES)
    assert r.json()["tokens"] == llm.tokenizer.encode(default, add_special_tokens=False) != want
    for bad in ("{% for %}", "", 3):
        r = _post(srv, "/v1/chat/completions", messages=MESSAGES, max_tokens=2, chat_template=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", bad


def test_documents_reach_the_template(trusting):
    llm, srv = trusting
    template = "{% for d in documents %}[{{ d.title }}]{% endfor %}{{ messages[-1].content }}"
    docs = [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}]
    r = _post(srv, "/tokenize", messages=MESSAGES, chat_template=template, documents=docs)
    assert r.json()["tokens"] == llm.tokenizer.encode("[a][b]hi", add_special_tokens=False)
    r = _post(srv, "/v1/chat/completions", messages=MESSAGES, max_tokens=2, documents="not a list")
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


def test_add_special_tokens_on_chat(plain):
    llm, srv = plain
    text = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    for flag in (False, True):
        r = _post(srv, "/v1/chat/completions", messages=MESSAGES, max_tokens=1, add_special_tokens=flag)
        assert r.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode(text, add_special_tokens=flag))


def test_client_request_id_names_the_response(plain):
    llm, srv = plain
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, headers={"X-Request-Id": "trace-7"},
                   json={"messages": MESSAGES, "max_tokens": 2, "request_id": "body-id"})
    assert r.json()["id"] == "chatcmpl-trace-7"  # the header wins, as in vLLM
    assert _post(srv, "/v1/completions", prompt="hi", max_tokens=2, request_id="body-id").json()["id"] == "cmpl-body-id"
    assert _post(srv, "/v1/completions", prompt="hi", max_tokens=2).json()["id"].startswith("cmpl-")
    r = _post(srv, "/v1/completions", prompt="hi", max_tokens=2, request_id="x" * 300)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"

    # two clients sending the same id at once each get their own output (the engine's ids stay unique)
    async def both():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
            bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0, "request_id": "same"} for p in ("ab", "cd")]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    got = [r.json()["choices"][0]["text"] for r in asyncio.run(both())]
    want = [_post(srv, "/v1/completions", prompt=p, max_tokens=12).json()["choices"][0]["text"] for p in ("ab", "cd")]
    assert got == want


def test_function_message_is_a_tool_reply(plain):
    llm, srv = plain
    legacy = [{"role": "user", "content": "hi"}, {"role": "function", "name": "f", "content": "42"}]
    as_tool = [{"role": "user", "content": "hi"}, {"role": "tool", "name": "f", "content": "42"}]
    a = _post(srv, "/tokenize", messages=legacy)
    assert a.status_code == 200 and a.json()["tokens"] == _post(srv, "/tokenize", messages=as_tool).json()["tokens"]
    assert _post(srv, "/v1/chat/completions", messages=legacy, max_tokens=2).status_code == 200


def test_completion_max_tokens_null_is_the_rest_of_the_context(plain):
    llm, srv = plain
    assert _post(srv, "/v1/completions", prompt="hi", ignore_eos=True).json()["usage"]["completion_tokens"] == 16
    r = _post(srv, "/v1/completions", prompt="hi", ignore_eos=True, max_tokens=None).json()
    assert r["usage"]["completion_tokens"] == 128 - r["usage"]["prompt_tokens"]


def test_echo_streamed(plain):
    llm, srv = plain
    whole = _post(srv, "/v1/completions", prompt=["hi", "yo"], max_tokens=5, echo=True, n=2).json()
    with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=60,
                      json={"prompt": ["hi", "yo"], "max_tokens": 5, "echo": True, "n": 2, "temperature": 0,
                            "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c["choices"]:
            texts.setdefault(ch["index"], "")
            texts[ch["index"]] += ch["text"]
    assert [texts[c["index"]] for c in whole["choices"]] == [c["text"] for c in whole["choices"]]
    assert whole["choices"][0]["text"].startswith("hi") and whole["choices"][2]["text"].startswith("yo")
    first = [ch for c in chunks[:4] for ch in c["choices"]]  # each choice opens with its prompt
    assert sorted((ch["index"], ch["text"]) for ch in first) == [(0, "hi"), (1, "hi"), (2, "yo"), (3, "yo")]


def _stream_chunks(srv, path, body):
    with httpx.stream("POST", srv.base_url + path, timeout=60, json={"temperature": 0, "stream": True, **body}) as s:
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def test_return_token_ids(plain):
    """vLLM's return_token_ids: every choice's token ids (they decode to its text) and the prompt's ids (on each
    completion choice, on the chat response); streamed, each chunk's new tokens (joined: the whole choice's),
    the prompt's ids once (on each completion choice's first chunk, on the chat stream's first chunk)."""
    llm, srv = plain
    tok = llm.tokenizer
    whole = _post(srv, "/v1/completions", prompt=["hi", "And yo"], max_tokens=6, n=2, return_token_ids=True,
                  temperature=1.0, seed=5).json()
    for c in whole["choices"]:
        assert c["prompt_token_ids"] == tok.encode(["hi", "And yo"][c["index"] // 2], add_special_tokens=False)
        assert tok.decode(c["token_ids"]) == c["text"] and len(c["token_ids"]) == 6
    chunks = _stream_chunks(srv, "/v1/completions", {"prompt": ["hi", "And yo"], "max_tokens": 6, "n": 2,
                                                     "return_token_ids": True, "temperature": 1.0, "seed": 5})
    ids: dict[int, list[int]] = {}
    for c in chunks:
        for ch in c["choices"]:
            if ch["index"] not in ids:  # the choice's first chunk
                assert ch["prompt_token_ids"] == whole["choices"][ch["index"]]["prompt_token_ids"]
            else:
                assert "prompt_token_ids" not in ch
            ids.setdefault(ch["index"], []).extend(ch["token_ids"])
    assert ids == {c["index"]: c["token_ids"] for c in whole["choices"]}
    # chat
    body = {"messages": MESSAGES, "max_tokens": 5, "return_token_ids": True}
    r = _post(srv, "/v1/chat/completions", **body).json()
    assert tok.decode(r["choices"][0]["token_ids"]) == r["choices"][0]["message"]["content"]
    assert len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"]
    chunks = _stream_chunks(srv, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == r["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == r["choices"][0]["token_ids"]
    # without it: none of these fields
    plain_r = _post(srv, "/v1/chat/completions", messages=MESSAGES, max_tokens=5).json()
    assert "prompt_token_ids" not in plain_r and "token_ids" not in plain_r["choices"][0]


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    import torch

    from hybrid import LLM
    from hybrid.server import build_app

    torch.set_num_threads(1)
    llm = LLM(str(shared_tiny_chat_checkpoint(tmp_path_factory)), device="cpu", max_num_seqs=4, max_model_len=256,
              max_num_batched_tokens=64, enable_prefix_caching=True, page_size=16)
    with ServerThread(build_app(llm, enable_prompt_tokens_details=True)) as srv:
        yield llm, srv


def test_cache_salt_keeps_tenants_apart(cached):
    """vLLM's cache_salt: a request reuses cached prefixes only of requests with the same salt."""
    llm, srv = cached
    prompt = "the same long system prompt that every tenant sends before its question, " * 2

    def hit(path, salt, **body):
        if salt is not None:
            body["cache_salt"] = salt
        r = _post(srv, path, max_tokens=2, **body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert hit("/v1/completions", "a", prompt=prompt) == 0
    assert hit("/v1/completions", "a", prompt=prompt) > 0
    assert hit("/v1/completions", "b", prompt=prompt) == 0
    assert hit("/v1/completions", None, prompt=prompt) == 0
    messages = [{"role": "user", "content": prompt}]
    assert hit("/v1/chat/completions", "c", messages=messages) == 0
    assert hit("/v1/chat/completions", "c", messages=messages) > 0
    assert hit("/v1/chat/completions", "d", messages=messages) == 0
    for path, body in (("/v1/completions", {"prompt": prompt}), ("/v1/chat/completions", {"messages": messages})):
        r = _post(srv, path, max_tokens=2, cache_salt="", **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_use_beam_search_answers_with_the_beams(plain, tmp_path_factory):
    """vLLM's use_beam_search: the n choices are LLM.beam_search's n beams, best first (streamed: each beam
    whole once the search is done); what the beams would silently drop is a 400."""
    from hybrid import BeamSearchParams

    llm, srv = plain
    ref = _llm(tmp_path_factory)  # (the served LLM's engine belongs to the server's thread)
    ids = ref.tokenizer.encode("hello", add_special_tokens=True)
    for width, penalty in ((3, 1.0), (2, 0.5)):
        want = ref.beam_search([ids], BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=penalty))[0]
        texts = [ref.tokenizer.decode(b.tokens[len(ids):]) for b in want.sequences]
        r = _post(srv, "/v1/completions", prompt="hello", max_tokens=6, n=width, use_beam_search=True,
                  length_penalty=penalty)
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == texts
        assert [c["index"] for c in r.json()["choices"]] == list(range(width))
        with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=60,
                          json={"prompt": "hello", "max_tokens": 6, "n": width, "use_beam_search": True,
                                "length_penalty": penalty, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        streamed = [""] * width
        for c in chunks:
            for ch in c["choices"]:
                streamed[ch["index"]] += ch["text"]
        assert streamed == texts
    text = ref.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    chat_ids = ref.tokenizer.encode(text, add_special_tokens=False)
    want = ref.beam_search([chat_ids], BeamSearchParams(beam_width=2, max_tokens=5))[0]
    r = _post(srv, "/v1/chat/completions", messages=MESSAGES, max_tokens=5, n=2, use_beam_search=True)
    assert [c["message"]["content"] for c in r.json()["choices"]] == \
        [ref.tokenizer.decode(b.tokens[len(chat_ids):]) for b in want.sequences]
    for extra, param in (({"stop": ["a"]}, "use_beam_search"), ({"response_format": {"type": "json_object"}},
                         "use_beam_search"), ({"prompt_logprobs": 2}, "use_beam_search"),
                         ({"echo": True, "logprobs": 1}, "use_beam_search"), ({"length_penalty": 1e308},
                         "length_penalty"), ({"length_penalty": "long"}, "length_penalty")):
        for stream in (False, True):
            r = _post(srv, "/v1/completions", prompt="hello", max_tokens=4, n=2, use_beam_search=True, stream=stream,
                      **extra)
            # (prompt_logprobs and echo with logprobs are refused with stream anyway, naming themselves)
            assert r.status_code == 400 and r.json()["error"]["param"] in (param, *extra), (extra, stream)
    assert not llm.engine.has_unfinished_requests()
