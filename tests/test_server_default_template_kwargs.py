"""vLLM's --default-chat-template-kwargs: template variables every chat request renders with (enable_thinking
off for a thinking model), under each request's own chat_template_kwargs; checked at startup."""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_utils import ServerThread, build_thinking_checkpoint  # noqa: E402

USER = [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    import torch

    from hybrid import LLM

    torch.set_num_threads(1)
    ckpt = build_thinking_checkpoint(tmp_path_factory.mktemp("template_kwargs") / "tiny-thinker")
    return LLM(str(ckpt), device="cpu", max_num_seqs=2, max_model_len=512, max_num_batched_tokens=128)


def _prompt_ids(base_url: str, **body) -> list[int]:
    return httpx.post(base_url + "/tokenize", json={"messages": USER, **body}).json()["tokens"]


def test_defaults_render_under_the_requests_own(llm):
    from hybrid.server import build_app

    with ServerThread(build_app(llm, default_chat_template_kwargs={"enable_thinking": False})) as srv:
        # the default: the template writes an empty thought (<think></think>, ids 192 193) after <assistant>
        assert _prompt_ids(srv.base_url)[-2:] == [192, 193]
        # a request's own variable wins over the default
        own = _prompt_ids(srv.base_url, chat_template_kwargs={"enable_thinking": True})
        assert own[-1] != 193 and 192 in own[-3:]
        r = httpx.post(srv.base_url + "/v1/chat/completions",
                       json={"model": "tiny-thinker", "messages": USER, "max_tokens": 3, "temperature": 0,
                             "logprobs": True})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(_prompt_ids(srv.base_url))


@pytest.mark.parametrize("bad, message", [(["enable_thinking"], "object of template variables"),
                                          ({"messages": []}, "messages cannot be set there")])
def test_bad_defaults_are_refused_at_startup(llm, bad, message):
    from hybrid.server import build_app

    with pytest.raises(ValueError, match=message):
        build_app(llm, default_chat_template_kwargs=bad)


def test_the_serve_flag():
    from hybrid.cli import parse_args
    from hybrid.server import serve_options

    args = parse_args(["serve", "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert serve_options(args, environ={})["default_chat_template_kwargs"] == {"enable_thinking": False}
    assert "default_chat_template_kwargs" not in serve_options(parse_args(["serve"]), environ={})
    for bad in ("[1]", "{not json", '{"add_generation_prompt": true}'):
        with pytest.raises(SystemExit):
            parse_args(["serve", "--default-chat-template-kwargs", bad])
