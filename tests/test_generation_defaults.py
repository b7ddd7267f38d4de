"""The model's recommended sampling (generation_config.json), applied as vLLM applies it: to
LLM.generate / LLM.chat without sampling params and to every server request field left out;
generation_config="vllm" turns it off, a folder takes that folder's file."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybrid import LLM, SamplingParams
from hybrid.errors import ConfigurationError, InvalidRequestError
from hybrid.model_source import DEFAULT_MODEL_DIR
from hybrid.sampling import generation_defaults

torch.set_num_threads(1)
PROMPT = "And the LORD said unto Moses,"
RECOMMENDED = {"do_sample": True, "temperature": 0.0, "top_k": 0, "max_new_tokens": 5, "eos_token_id": 0}


def _ckpt(tmp_path, gen: dict):
    p = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, p)
    (p / "generation_config.json").write_text(json.dumps(gen))
    return p


def test_fields_read_like_vllm():
    assert generation_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 0, "min_p": 0.01,
                                "repetition_penalty": 1.1, "max_new_tokens": 300, "do_sample": True,
                                "eos_token_id": 2}) == \
        {"temperature": 0.6, "top_p": 0.95, "top_k": -1, "min_p": 0.01, "repetition_penalty": 1.1,
         "max_tokens": 300}
    assert generation_defaults({"bos_token_id": 1}) == {} and generation_defaults(None) == {}
    with pytest.raises(InvalidRequestError, match="generation_config.json.*top_p"):
        generation_defaults({"top_p": 2.0})


def test_llm_defaults(tmp_path):
    llm = LLM(str(_ckpt(tmp_path, RECOMMENDED)), max_num_seqs=2)
    assert llm.default_sampling == {"temperature": 0.0, "top_k": -1, "max_tokens": 5}
    out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids and len(out.token_ids) == 5
    # given params win whole (as vLLM: the defaults fill only a request that brings none)
    assert len(llm.generate(PROMPT, SamplingParams(max_tokens=7, temperature=0.0), use_tqdm=False)[0]
               .outputs[0].token_ids) == 7
    off = LLM(str(tmp_path / "model"), max_num_seqs=2, generation_config="vllm")
    assert off.default_sampling == {} and off.get_default_sampling_params().max_tokens == 16
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    assert LLM(None, max_num_seqs=2, generation_config=str(other)).default_sampling == {"max_tokens": 3}


def test_bad_settings_are_clear(tmp_path):
    with pytest.raises(ConfigurationError, match="generation_config must be"):
        LLM(None, generation_config=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigurationError, match="generation_config.json.*temperature"):
        LLM(str(_ckpt(tmp_path, {"temperature": -1.0})), max_num_seqs=2)


def test_server_requests_take_the_defaults_for_fields_they_leave_out(tmp_path):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from server_utils import ServerThread

    from hybrid.server import build_app

    with ServerThread(build_app(LLM(str(_ckpt(tmp_path, RECOMMENDED)), max_num_seqs=2))) as srv:
        def complete(**kw):
            r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": PROMPT, **kw}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]

        plain = complete()
        assert plain[1] == 5 and complete() == plain  # max_tokens 5 and greedy, as recommended
        assert complete(temperature=0.0, max_tokens=5) == plain
        assert complete(max_tokens=8)[1] == 8  # a field the request sets wins
        chat = httpx.post(srv.base_url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "Who was Moses?"}]}, timeout=60).json()
        assert chat["usage"]["completion_tokens"] <= 5
