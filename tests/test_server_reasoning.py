"""Reasoning outputs (`hybrid serve --reasoning-parser`), chat_template_kwargs and
continue_final_message on the chat endpoint, and vLLM's /tokenize, /detokenize, /version and /ping."""
from __future__ import annotations

import json
import random
import shutil

import pytest

from hybrid.server.reasoning import (REASONING_PARSERS, ReasoningMode, ReasoningStream, check_reasoning_parser,
                                     prompt_opens_reasoning)

# (starts inside a thought, output) -> (reasoning, content)
SPLITS = [
    (True, "Let me see.\n</think>\n\nParis.", ("Let me see.", "Paris.")),
    (True, "\nstep 1\n\nstep 2  \n</think>Paris", ("step 1\n\nstep 2", "Paris")),
    (True, "cut off before the end", ("cut off before the end", None)),
    (True, "</think>only the answer", (None, "only the answer")),
    (True, "</think>", (None, None)),
    (True, "a < b and </thin is not the tag</think> ok", ("a < b and </thin is not the tag", "ok")),
    (True, "<think>\nopened again</think>ok", ("opened again", "ok")),  # a model that writes the tag anyway
    (True, "<thin", ("<thin", None)),
    (False, "  plain answer\n", (None, "  plain answer\n")),  # an answer from the start stays as generated
    (False, "<think>hmm</think>\n\nyes", ("hmm", "yes")),
    (False, "\n<think>\nhmm", ("hmm", None)),
    (False, "<thinking is a word", (None, "<thinking is a word")),
    (False, "<thi", (None, "<thi")),
    (False, "", (None, None)),
]


@pytest.mark.parametrize("in_reasoning,text,expected", SPLITS)
def test_split(in_reasoning, text, expected):
    assert ReasoningMode(in_reasoning).split(text) == expected


@pytest.mark.parametrize("in_reasoning,text,expected", SPLITS)
def test_streamed_pieces_join_to_the_whole_split(in_reasoning, text, expected):
    """Fed in pieces of any size, the stream gives the same reasoning and content as the whole text,
    and never gives out part of a tag."""
    rng = random.Random(hash(text) & 0xFFFF)
    for _ in range(30):
        stream, cuts = ReasoningStream(in_reasoning), sorted(rng.sample(range(len(text) + 1), min(len(text), 4)))
        parts, at = [], 0
        for cut in cuts + [len(text)]:
            parts.append(text[at:cut])
            at = cut
        pieces = []
        for i, part in enumerate(parts):
            pieces += stream.feed(part, final=i == len(parts) - 1)
        reasoning = "".join(p for k, p in pieces if k == "reasoning") or None
        content = "".join(p for k, p in pieces if k == "content") or None
        assert (reasoning, content) == expected, parts
        assert all("</think>" not in p and "<think>" not in p for _, p in pieces)


def test_the_prompt_says_where_the_output_starts():
    assert prompt_opens_reasoning("<user>hi\n<assistant><think>\n")
    assert not prompt_opens_reasoning("<user>hi\n<assistant><think></think>")
    assert not prompt_opens_reasoning("<user>hi\n<assistant>")
    # an earlier turn's closed thought does not count; the last one is open
    assert prompt_opens_reasoning("<assistant><think>a</think>b\n<user>q\n<assistant><think>")
    check_reasoning_parser(None)
    for name in REASONING_PARSERS:
        check_reasoning_parser(name)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        check_reasoning_parser("nonesuch")


def test_special_token_tags_are_kept_and_streamed_equals_whole():
    """A tokenizer whose <think> / </think> are special tokens (decoding drops them): the chat writer
    rebuilds the text with them kept; streamed deltas and the whole message agree."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split

    from hybrid.output_processor import TextDeltas
    from hybrid.outputs import CompletionOutput
    from hybrid.server.streaming import ChatFormat, ChoiceUpdate
    from hybrid.server.tool_tags import MarkerTokens

    words = ["<unk>", "</s>", "plan", " ", "more", "Paris", "\n"]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Split(" ", "isolated")
    tok.add_special_tokens(["<think>", "</think>", "</s>"])
    tok.decoder = decoders.Fuse()

    class Tok:
        def token_to_id(self, t):
            return tok.token_to_id(t)

        def decode(self, ids, skip_special_tokens=True):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    markers = MarkerTokens(Tok(), ("<think>", "</think>"))
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assert set(markers.ids) == {start, end}
    ids = [start, 2, 3, 4, end, 6, 6, 5, 1]
    assert Tok().decode(ids) == "plan more\n\nParis"  # the engine's text: the tags are gone
    mode = ReasoningMode(in_reasoning=False)
    fmt, deltas, chunks = ChatFormat(1, None, str, None, markers, mode), TextDeltas(None), []
    for k in range(1, len(ids) + 1):
        done = k == len(ids)
        c = CompletionOutput(0, Tok().decode(ids[:k]), ids[:k], "stop" if done else None)
        delta = deltas.update(fmt.text((0, 0), c), done)
        chunks += fmt.deltas(ChoiceUpdate(0, 0, delta, None, 0, c.finish_reason, k), 0, None)
    sent = [ch[0]["delta"] for ch in chunks]
    assert "".join(d.get("reasoning", "") for d in sent) == "plan more"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in sent)
    assert "".join(d.get("content", "") for d in sent) == "Paris"
    assert chunks[-1][0]["finish_reason"] == "stop"
    whole = ChatFormat(1, None, str, None, markers, mode)
    message = whole.choice(0, whole.text((0, 0), c), None, "stop")["message"]
    assert message == {"role": "assistant", "content": "Paris", "reasoning": "plan more",
                       "reasoning_content": "plan more"}


# ---------------------------------------------------------------------------------- the server
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from server_utils import build_thinking_checkpoint, thinking_server  # noqa: E402

MODEL = "tiny-thinker"
USER = [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_thinking_checkpoint(tmp_path_factory.mktemp("reasoning") / MODEL)


@pytest.fixture(scope="module")
def llm(ckpt):
    import torch

    from hybrid import LLM

    torch.set_num_threads(1)
    return LLM(str(ckpt), device="cpu", max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def served(ckpt):
    with thinking_server(ckpt) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


END_FIRST = {"logit_bias": {"193": 100}}  # the thought ends at once (</think> is the argmax)


def _streamed(client, **kw):
    reasoning, reasoning_content, content, finish, calls = "", "", "", None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            reasoning += extra.get("reasoning") or ""
            reasoning_content += extra.get("reasoning_content") or ""
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert reasoning == reasoning_content
    return reasoning or None, content or None, finish, calls


def _complete(served, prompt: str, **params) -> dict:
    """The same prompt through /v1/completions (the engine is the server's: never call the LLM
    object beside it)."""
    r = httpx.post(served.base_url + "/v1/completions", json={"model": MODEL, "prompt": prompt, **params})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_thought_the_template_opens_is_reasoning_until_it_ends(client, served, llm):
    """Free generation inside the opened thought: with no </think> the whole output is reasoning
    (content null), streamed or not, and it is exactly the model's text."""
    kw = dict(model=MODEL, messages=USER, max_tokens=12, temperature=0, extra_body={"logit_bias": {"193": -100}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    extra = msg.model_extra
    assert msg.content is None and extra["reasoning"] == extra["reasoning_content"]
    prompt = llm.get_tokenizer().apply_chat_template(USER, tokenize=False)
    assert prompt.endswith("<think>\n")
    raw = _complete(served, prompt, max_tokens=12, temperature=0, logit_bias={"193": -100})["choices"][0]["text"]
    assert extra["reasoning"] == (raw.strip() or None)
    assert _streamed(client, **kw)[:2] == (extra["reasoning"], None)


def test_structured_output_starts_after_the_thought(client):
    """response_format / structured outputs constrain the answer, not the thought: the first token
    (</think>, pushed by the bias) is free, then the choice holds (the bias cannot beat the mask)."""
    kw = dict(model=MODEL, messages=USER, max_tokens=10, temperature=0, logprobs=True,
              extra_body={**END_FIRST, "structured_outputs": {"choice": ["Paris", "Lyon"]}})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert [t.token for t in c.logprobs.content][0] == "</think>"
    assert c.message.content in ("Paris", "Lyon") and c.message.model_extra["reasoning"] is None
    assert _streamed(client, **kw)[:2] == (None, c.message.content)


def test_enable_thinking_false_reaches_the_template_and_the_output_is_the_answer(client, served, llm):
    """chat_template_kwargs: the template writes an empty thought, so the output is content, and
    a constraint holds from the first token."""
    kw = dict(model=MODEL, messages=USER, max_tokens=10, temperature=0,
              extra_body={"chat_template_kwargs": {"enable_thinking": False},
                          "structured_outputs": {"choice": ["Paris", "Lyon"]}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.content in ("Paris", "Lyon") and msg.model_extra["reasoning"] is None
    assert _streamed(client, **kw)[:2] == (None, msg.content)
    body = {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    tokens = httpx.post(served.base_url + "/tokenize", json=body).json()["tokens"]
    text = httpx.post(served.base_url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert tokens[-2:] == [192, 193]  # the empty thought is two special tokens, which /detokenize keeps (as vLLM)
    assert text.endswith("<assistant>" + llm.tokenizer.decode([192, 193], skip_special_tokens=False))


def test_forced_tool_call_after_the_thought(client):
    """tool_choice "required" is a constraint too: it starts after the thought; the call is read
    from the content."""
    tools = [{"type": "function", "function": {"name": "capital", "parameters": {
        "type": "object", "properties": {"country": {"type": "string", "enum": ["France"]}},
        "required": ["country"], "additionalProperties": False}}}]
    kw = dict(model=MODEL, messages=USER, tools=tools, tool_choice="required", max_tokens=240, temperature=0,
              extra_body=END_FIRST)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.model_extra["reasoning"] is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
        [("capital", {"country": "France"})]
    reasoning, content, finish, calls = _streamed(client, **kw)
    assert (reasoning, content, finish) == (None, None, "tool_calls")
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("capital", {"country": "France"})]


def test_an_earlier_thought_sent_back_reaches_the_template(served):
    for key in ("reasoning", "reasoning_content"):
        messages = USER + [{"role": "assistant", "content": "Paris", key: "easy"},
                           {"role": "user", "content": "And Italy?"}]
        r = httpx.post(served.base_url + "/tokenize", json={"messages": messages, "return_token_strs": True}).json()
        assert "<assistant>[easy]Paris\n" in "".join(r["token_strs"])
    r = httpx.post(served.base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "assistant", "content": "x", "reasoning": 3}], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].reasoning"


def test_continue_final_message(served, client, llm, ckpt):
    messages = USER + [{"role": "assistant", "content": "The capital is"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    tokens = httpx.post(served.base_url + "/tokenize", json=body).json()["tokens"]
    text = llm.get_tokenizer().decode(tokens)
    assert text.endswith("<assistant>The capital is")  # no end of turn, no new turn
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                       extra_body={"continue_final_message": True, "logit_bias": {"193": -100}})
    raw = _complete(served, text, max_tokens=5, temperature=0, logit_bias={"193": -100})
    assert r.usage.prompt_tokens == len(tokens) == raw["usage"]["prompt_tokens"]
    # the prompt continues an answer, so the output is content (no thought was opened)
    assert r.choices[0].message.content == raw["choices"][0]["text"]
    bad = httpx.post(served.base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": USER, "continue_final_message": True, "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"
    # the Python API, as vLLM's LLM.chat (an LLM of its own: the served one belongs to the server)
    import torch

    from hybrid import LLM, SamplingParams
    from hybrid.errors import InvalidRequestError

    torch.set_num_threads(1)
    own = LLM(str(ckpt), device="cpu", max_num_seqs=2, max_model_len=512, max_num_batched_tokens=128)
    out = own.chat(messages, SamplingParams(max_tokens=5, temperature=0, logit_bias={193: -100}),
                   add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    assert out.prompt == text and out.outputs[0].text == raw["choices"][0]["text"]
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        own.chat(messages, continue_final_message=True, use_tqdm=False)  # add_generation_prompt too


@pytest.mark.parametrize("extra,param", [
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"continue_final_message": "yes"}, "continue_final_message"),
])
def test_bad_template_fields_are_400(served, extra, param):
    r = httpx.post(served.base_url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": USER, "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_tokenize_detokenize_version_ping(served, llm):
    url = served.base_url
    tok = llm.get_tokenizer()
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "hello there", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("hello there") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512 and "".join(r["token_strs"]) == "hello there"
    assert httpx.post(url + "/tokenize", json={"prompt": "hi"}).json()["token_strs"] is None
    assert httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "hello there"}
    chat = httpx.post(url + "/tokenize", json={"messages": USER}).json()["tokens"]
    assert chat == tok.encode(tok.apply_chat_template(USER, tokenize=False), add_special_tokens=False)
    for path, body, param in [("/detokenize", {"tokens": [5, 194]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": USER}, "prompt")]:
        bad = httpx.post(url + path, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (path, body)
    wrong = httpx.post(url + "/tokenize", json={"model": "other", "prompt": "a"})
    assert wrong.status_code == 404
    from hybrid import __version__

    assert httpx.get(url + "/version").json() == {"version": __version__}
    assert httpx.get(url + "/ping").status_code == 200 and httpx.post(url + "/ping").status_code == 200
    # the OpenAPI document (client generators read it): every operation id once
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = httpx.get(url + "/openapi.json").json()
    ids = [op["operationId"] for path in spec["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)) and {"ping_get", "ping_post"} <= set(ids)


def test_cli_flag_and_build_app_refuse_an_unknown_parser(llm):
    import argparse

    from hybrid.server import build_app
    from hybrid.server.options import add_serve_parser, serve_options

    with pytest.raises(ValueError, match="unknown reasoning parser"):
        build_app(llm, reasoning_parser="nonesuch")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="cmd"), lambda p: None)
    args = parser.parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert serve_options(args)["reasoning_parser"] == "deepseek_r1"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--reasoning-parser", "nonesuch"])
