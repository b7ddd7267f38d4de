"""Bounded load test: 64 concurrent streamed requests of mixed lengths against a real server on a
tiny checkpoint. All complete, greedy outputs equal the same prompts run alone, no slot or page
leaks afterwards. Prints the throughput and latency it measured."""
from __future__ import annotations

import asyncio
import statistics
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from server_utils import ServerThread, build_tiny_chat_checkpoint, wait_until  # noqa: E402

NUM_REQUESTS = 64
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then", "runs", "home"]


def _workload():
    reqs = []
    for i in range(NUM_REQUESTS):
        n_words = 1 + (i * 7) % 12
        prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n_words)) + f" {i}"
        max_tokens = 4 + (i * 11) % 37  # 4 .. 40
        reqs.append((prompt, max_tokens))
    return reqs


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def test_64_concurrent_streams(tmp_path_factory):
    import torch

    from hybrid import LLM, SamplingParams
    from hybrid.server import build_app

    torch.set_num_threads(1)
    ckpt = build_tiny_chat_checkpoint(tmp_path_factory.mktemp("load_ckpt") / "tiny-chat")
    kw = dict(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=128)
    work = _workload()

    # reference: every prompt alone (batch of one), greedy
    ref_llm = LLM(str(ckpt), **kw)
    expected = []
    for prompt, max_tokens in work:
        out = ref_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                               use_tqdm=False)[0]
        expected.append(out.outputs[0].text)
    del ref_llm

    llm = LLM(str(ckpt), **kw)
    initial = (llm.state_pool.num_free, llm.kv_cache.allocator.num_free)
    app = build_app(llm, max_queued_requests=NUM_REQUESTS)

    async def one(client, prompt, max_tokens):
        t0 = time.perf_counter()
        ttft = None
        parts, n_events, finish = [], 0, None
        stream = await client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for ch in stream:
            if not ch.choices:
                continue
            c = ch.choices[0]
            if c.text and ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(c.text)
            n_events += 1
            finish = c.finish_reason or finish
        return "".join(parts), time.perf_counter() - t0, ttft, finish

    async def run_all(base_url):
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            t0 = time.perf_counter()
            results = await asyncio.wait_for(
                asyncio.gather(*(one(client, p, m) for p, m in work)), timeout=120)
            return results, time.perf_counter() - t0
        finally:
            await client.close()

    with ServerThread(app) as srv:
        results, wall = asyncio.run(run_all(srv.base_url))
        assert wait_until(lambda: (llm.state_pool.num_free, llm.kv_cache.allocator.num_free) == initial)
        assert llm.engine.requests == {} and not llm.engine.has_unfinished_requests()
        assert app.state.async_engine.num_inflight == 0

    texts = [r[0] for r in results]
    mismatches = [i for i, (got, exp) in enumerate(zip(texts, expected)) if got != exp]
    assert not mismatches, f"{len(mismatches)} outputs differ from the same prompt run alone: {mismatches[:5]}"
    assert all(r[3] == "length" for r in results)

    total_tokens = sum(m for _, m in work)
    lat = [r[1] for r in results]
    ttfts = [r[2] for r in results if r[2] is not None]
    print(f"\n[load] {NUM_REQUESTS} concurrent streamed requests, {total_tokens} generated tokens in {wall:.2f} s: "
          f"{total_tokens / wall:.0f} tok/s, {NUM_REQUESTS / wall:.1f} req/s; "
          f"latency p50 {statistics.median(lat):.2f} s p95 {_pct(lat, 0.95):.2f} s; "
          f"TTFT p50 {statistics.median(ttfts):.2f} s p95 {_pct(ttfts, 0.95):.2f} s")
