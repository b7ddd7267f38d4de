"""The server's model name and chat rendering (issue 14 follow-ups): a model named by its hub repo id
is served under that id (as vLLM serves it); chats are rendered by hybrid.chat_template.render_chat
with the template hybrid.tokenizer.Tokenizer picked (a list of named templates included), and a
template that refuses the conversation is a 400 naming `messages`."""
from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from server_utils import CHAT_TEMPLATE, ServerThread, shared_tiny_chat_checkpoint  # noqa: E402

# refuses a system message (as some checkpoints' templates do), else renders like CHAT_TEMPLATE
STRICT = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" \
         + CHAT_TEMPLATE


def _llm(path):
    import torch

    from hybrid import LLM

    torch.set_num_threads(1)
    return LLM(str(path), device="cpu", max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def listed_template_ckpt(tmp_path_factory):
    """The tiny chat checkpoint with its template given as a list of named templates."""
    dst = tmp_path_factory.mktemp("listed") / "tiny-listed"
    shutil.copytree(shared_tiny_chat_checkpoint(tmp_path_factory), dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "{{ 'tools!' }}"}, {"name": "default", "template": STRICT}]
    cfg_path.write_text(json.dumps(cfg))
    return dst


def _chat(srv, model, messages, **kw):
    return httpx.post(srv.base_url + "/v1/chat/completions", timeout=60,
                      json={"model": model, "messages": messages, "max_tokens": 2, "temperature": 0, **kw})


def test_chat_uses_the_default_of_a_template_list_and_render_chat(listed_template_ckpt):
    from hybrid.chat_template import render_chat
    from hybrid.server import build_app

    llm = _llm(listed_template_ckpt)
    with ServerThread(build_app(llm)) as srv:
        # text parts joined by newlines, as vLLM joins them (a plain string, Responses' input_text: text too)
        msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, "there", {"type": "input_text", "text": "you"}]}]
        r = _chat(srv, "tiny-listed", msgs)
        assert r.status_code == 200, r.text
        want = render_chat(STRICT, [{"role": "user", "content": "Hi\nthere\nyou"}], llm.tokenizer.config)
        assert want == "<user>Hi\nthere\nyou\n<assistant>"
        assert r.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode(want, add_special_tokens=False))
        # the template refuses the conversation: 400 naming messages, streamed or not, before any 200
        system = [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]
        for stream in (False, True):
            r = _chat(srv, "tiny-listed", system, stream=stream)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "messages" and err["code"] == "invalid_value", err
            assert "chat template could not be rendered" in err["message"] and "System role" in err["message"]
        # malformed messages (hybrid.chat_template.normalize_messages) name the message
        r = _chat(srv, "tiny-listed", [{"role": "user", "content": [{"type": "image_url"}]}])
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]", r.text
        assert "not 'image_url'" in r.json()["error"]["message"]
        r = _chat(srv, "tiny-listed", ["hello"])
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0]", r.text
        assert httpx.get(srv.base_url + "/health").json() == {"status": "ok"}


def test_a_hub_model_is_served_under_its_repo_id(tmp_path, monkeypatch, tmp_path_factory):
    from test_hf_cache import add_snapshot

    from hybrid.server import build_app

    repo, commit = "test-owner/tiny-chat-hub", "89abcdef0123456789abcdef0123456789abcdef"
    cache = tmp_path / "hub"
    add_snapshot(cache, repo, commit, str(shared_tiny_chat_checkpoint(tmp_path_factory)))
    for var in ("HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = _llm(repo)
    assert llm.hf_repo_id == repo
    with ServerThread(build_app(llm)) as srv:
        assert [m["id"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]] == [repo]
        r = _chat(srv, repo, [{"role": "user", "content": "Hi"}])
        assert r.status_code == 200 and r.json()["model"] == repo, r.text
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": commit, "prompt": "a", "max_tokens": 1})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # --served-model-name (build_app's served_model_name) still wins
    app = build_app(llm, served_model_name="mine")
    assert app.state.served_model_name == "mine"
