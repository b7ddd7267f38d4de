"""Bounded soak test (issue 12, "How it is proven"): a fixed count of mixed requests against one
server with prefix caching on: valid ones (completions and chat, streamed or not, n = 1 or 2),
invalid ones, cancelled ones (streams cut mid-way, non-streamed answers not waited for) and
oversized ones (bodies over the limit, prompts over the context). Afterwards /health is ok,
nothing holds a slot or a page but the prefix cache, and every valid greedy output equals the
same prompt run alone."""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from server_utils import ServerThread, metric, shared_tiny_chat_checkpoint, wait_until  # noqa: E402

MODEL = "tiny-chat"
NUM_REQUESTS = 240
CONCURRENCY = 6  # x n <= 2: never more than max_num_seqs + max_queued_requests, so no 429 is expected
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 16 * 1024
PROMPTS = ["In the beginning", "And the earth was without form", "a b c d e f g h i j k l m n o p q r s",
           "The quick brown fox jumps over the lazy dog, then runs home to sleep", "Hi", "0123456789" * 3]

INVALID = [  # (path, body, expected status)
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"99999": 5}, "stream": True}, 400),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10 ** 6, "stream": True}, 400),
    ("/v1/completions", {"prompt": "a", "model": "other"}, 404),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 6]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}], "stream": True}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/completions", {"prompt": "a", "n": 50}, 400),  # can never fit: 400, not 429
]


def _kind(i: int) -> str:
    return ["complete", "complete_stream", "chat", "chat_stream", "complete_n2", "invalid", "cancel_stream",
            "cancel_wait", "oversized_body", "too_long_prompt", "surrogate", "complete_stream"][i % 12]


def _case(i: int):
    prompt = PROMPTS[i % len(PROMPTS)]
    max_tokens = 4 + (i * 7) % 21
    return prompt, max_tokens


def test_soak(tmp_path_factory):
    import torch

    from hybrid import LLM, SamplingParams
    from hybrid.server import build_app

    torch.set_num_threads(1)
    ckpt = shared_tiny_chat_checkpoint(tmp_path_factory)
    kw = dict(max_num_seqs=4, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64)

    # reference: each valid request's prompt alone (batch of one, no prefix cache), greedy
    ref = LLM(str(ckpt), **kw)
    tok = ref.tokenizer
    expected: dict[tuple, str] = {}

    def solo(ids: list[int], max_tokens: int) -> str:
        key = (tuple(ids), max_tokens)
        if key not in expected:
            out = ref.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                               use_tqdm=False)
            expected[key] = out[0].outputs[0].text
        return expected[key]

    def chat_ids(prompt: str) -> list[int]:  # server_utils.CHAT_TEMPLATE rendered for one user message
        return tok.encode(f"<user>{prompt}\n<assistant>", add_special_tokens=False)

    llm = LLM(str(ckpt), enable_prefix_caching=True, **kw)
    app = build_app(llm, max_queued_requests=8, max_request_bytes=MAX_REQUEST_BYTES)
    initial = (llm.state_pool.num_free, llm.kv_cache.allocator.num_free)

    async def one(client, i):
        kind = _kind(i)
        prompt, max_tokens = _case(i)
        greedy = {"model": MODEL, "temperature": 0, "ignore_eos": True, "max_tokens": max_tokens}
        chat_body = {**greedy, "messages": [{"role": "user", "content": prompt}]}
        if kind in ("complete", "complete_n2"):
            n = 2 if kind == "complete_n2" else 1
            r = await client.post("/v1/completions", json={**greedy, "prompt": prompt, "n": n})
            assert r.status_code == 200, r.text
            want = solo(tok.encode(prompt), max_tokens)
            return kind, [c["text"] == want for c in r.json()["choices"]] == [True] * n
        if kind in ("complete_stream", "chat_stream"):
            path, body = (("/v1/completions", {**greedy, "prompt": prompt}) if kind == "complete_stream"
                          else ("/v1/chat/completions", chat_body))
            text = ""
            async with client.stream("POST", path, json={**body, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ev = json.loads(line[6:])
                        assert "error" not in ev, ev
                        for c in ev["choices"]:
                            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
            ids = tok.encode(prompt) if kind == "complete_stream" else chat_ids(prompt)
            return kind, text == solo(ids, max_tokens)
        if kind == "chat":
            r = await client.post("/v1/chat/completions", json=chat_body)
            assert r.status_code == 200, r.text
            return kind, r.json()["choices"][0]["message"]["content"] == solo(chat_ids(prompt), max_tokens)
        if kind == "invalid":
            path, body, status = INVALID[(i // 12) % len(INVALID)]
            r = await client.post(path, json={"model": MODEL, **body})
            return kind, r.status_code == status and r.headers["content-type"] == "application/json"
        if kind == "cancel_stream":
            async with client.stream("POST", "/v1/completions",
                                     json={**greedy, "prompt": prompt, "max_tokens": 200, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                for _ in range(3 + i % 5):
                    await lines.__anext__()
            return kind, True  # leaving the block closes the connection mid-stream
        if kind == "cancel_wait":
            try:
                await client.post("/v1/completions", json={**greedy, "prompt": prompt, "max_tokens": 200},
                                  timeout=httpx.Timeout(5.0, read=0.02 + 0.01 * (i % 4)))
            except httpx.ReadTimeout:
                pass
            return kind, True
        if kind == "oversized_body":
            r = await client.post("/v1/completions", json={**greedy, "prompt": "x" * (MAX_REQUEST_BYTES + i)})
            return kind, r.status_code == 413
        if kind == "too_long_prompt":
            r = await client.post("/v1/chat/completions" if i % 2 else "/v1/completions",
                                  json={**greedy, "prompt": "y" * 2000, "messages": [{"role": "user",
                                                                                      "content": "y" * 2000}]})
            return kind, r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        if kind == "surrogate":
            r = await client.post("/v1/completions", content=('{"model": "tiny-chat", "prompt": "ab\\ud800"}').encode(),
                                  headers={"content-type": "application/json"})
            return kind, r.status_code == 400
        raise AssertionError(kind)

    async def main(base_url):
        sem = asyncio.Semaphore(CONCURRENCY)

        async def bounded(client, i):
            async with sem:
                return await one(client, i)

        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(bounded(client, i) for i in range(NUM_REQUESTS))), 120)

    with ServerThread(app) as srv:
        results = asyncio.run(main(srv.base_url))
        bad = [(i, kind) for i, (kind, ok) in enumerate(results) if not ok]
        assert not bad, bad
        assert httpx.get(srv.base_url + "/health").json() == {"status": "ok"}
        eng = llm.engine
        assert wait_until(lambda: eng.requests == {} and not eng.has_unfinished_requests()
                          and app.state.server.reserved_seqs == 0 and app.state.server.admitted_requests == 0)
        # nothing is held but the cached prefixes: by the metrics, and by the pools themselves
        cache = eng.prefix_cache
        cached_slots = {e.slot for e in cache.entries.values()}
        cached_pages = {p for e in cache.entries.values() for p in e.pages}
        assert len(cache) >= 1
        assert wait_until(lambda: (llm.state_pool.num_free, llm.kv_cache.allocator.num_free)
                          == (initial[0] - len(cached_slots), initial[1] - len(cached_pages)))
        m = lambda name: metric(srv.base_url, name)  # noqa: E731
        assert wait_until(lambda: m("hybrid_state_slots_in_use") == m("hybrid_state_slots_prefix_cache")
                          == len(cached_slots))
        assert m("hybrid_state_slots_requests") == 0
        assert m("hybrid_kv_pages_in_use") == m("hybrid_kv_pages_prefix_cache") == len(cached_pages)
        assert m("hybrid_num_requests_inflight") == 0 and m("hybrid_num_sequences_admitted") == 0
        assert m("hybrid_request_aborted_total") >= NUM_REQUESTS // 12  # the cancels were aborted
        # every rejection was a 4xx: no 500, no 503, and no 429 (the concurrency stays within the limit)
        rejected = _samples(srv.base_url, "hybrid_request_rejected_total")
        assert rejected and all(status.startswith("4") and status != "429" for status in rejected), rejected
        assert sum(rejected.values()) == NUM_REQUESTS // 12 * 4  # invalid, oversized, too long, surrogate


def _samples(base_url: str, name: str) -> dict[str, float]:
    """status label -> value of every sample of `name`."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for s in fam.samples:
            if s.name == name:
                out[s.labels.get("status", "")] = s.value
    return out
