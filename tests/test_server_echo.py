"""/v1/completions with `echo` (issue 14 item 6): the prompt's text before each choice, and with
`logprobs` the prompt tokens' logprobs too (null for the first), as the OpenAI API and vLLM return
them; `max_tokens: 0` scores a text without generating (what evaluation harnesses send). The
logprobs equal the Python API's SamplingParams(prompt_logprobs=k)."""
from __future__ import annotations

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
        assert len(lp["top_logprobs"][i]) == 2
    assert r.json()["usage"]["completion_tokens"] == 0

    # echo with generation: prompt, then the completion; logprobs cover both, offsets run on
    r = _post(srv, model=model, prompt=text, echo=True, max_tokens=3, logprobs=1)
    choice = r.json()["choices"][0]
    plain = _post(srv, model=model, prompt=text, max_tokens=3).json()["choices"][0]["text"]
    assert choice["text"] == text + plain
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 and lp["text_offset"][len(ids)] == len(text)

    # echo without logprobs: the text only; echo when streaming is refused
    r = _post(srv, model=model, prompt=text, echo=True, max_tokens=2)
    assert r.json()["choices"][0]["text"].startswith(text) and r.json()["choices"][0]["logprobs"] is None
    r = _post(srv, model=model, prompt=text, echo=True, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = _post(srv, model=model, prompt=text, max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
