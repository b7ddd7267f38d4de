"""Tool calling on /v1/chat/completions (vLLM's --enable-auto-tool-choice --tool-call-parser NAME):
the parsers on text samples of each format, then a real server (the tiny random checkpoint, its
output forced to a known text with the structured-outputs `choice` constraint) queried with the
openai client: message.tool_calls, streamed tool-call deltas, tool_choice none / auto / required /
a named function, the request checks, and assistant tool_calls / tool messages reaching the chat
template with their arguments as objects."""
from __future__ import annotations

import json
import random
import shutil

import pytest

from hybrid.server.tool_parsers import (TOOL_PARSERS, GraniteToolParser, HermesToolParser, NemotronJsonToolParser,
                                        Qwen3CoderToolParser, ToolCallStream, check_tool_options, parse_tool_calls,
                                        tool_parser_class)
from hybrid.server.tool_tags import MarkedText, MarkerTokens

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, TIME]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(parser, text, seed):
    """The text fed in random pieces: (content or None if there are calls, calls)."""
    rng, stream, events, i = random.Random(seed), ToolCallStream(parser), [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        events += stream.feed(text[i:i + k])
        i += k
    events += stream.feed("", final=True)
    calls = [v for kind, v in events if kind == "call"]
    content = "".join(v for kind, v in events if kind == "content")
    return (content or None) if calls else content, calls


# ---------------------------------------------------------------------------------- the parsers
HERMES_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
SAMPLES = [
    # (parser, text, content, calls)
    (HermesToolParser, HERMES_ONE, None, [("get_weather", {"city": "Paris", "days": 2})]),
    # NaN / Infinity are read by Python's json but are not JSON: such a call stays content
    (HermesToolParser, '<tool_call>\n{"name": "get_weather", "arguments": {"days": NaN}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"days": NaN}}\n</tool_call>', []),
    (HermesToolParser, '<tool_call>\n{"name": "get_weather", "arguments": "{\\"days\\": -Infinity}"}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": "{\\"days\\": -Infinity}"}\n</tool_call>', []),
    (HermesToolParser, 'Let me look.\n\n' + HERMES_ONE + '\n<tool_call>\n{"name": "get_time", "arguments": '
     '"{\\"zone\\": \\"UTC\\"}"}\n</tool_call>\n', "Let me look.",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})]),
    (HermesToolParser, 'Before ' + HERMES_ONE + ' after.', "Before after.",
     [("get_weather", {"city": "Paris", "days": 2})]),
    (HermesToolParser, '<tool_call>{"name": "ping"}</tool_call>', None, [("ping", {})]),
    (HermesToolParser, '<tool_call>{"name": "ping", "arguments": {}}', None, [("ping", {})]),  # unclosed at the end
    (HermesToolParser, '<tool_call>{"name": "ping", "arguments": {"s": "a </tool_call> b"}}</tool_call>', None, None),
    (HermesToolParser, 'x <tool_call>{not json}</tool_call> y', 'x <tool_call>{not json}</tool_call> y', []),
    (HermesToolParser, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (HermesToolParser, '<tool_call>["get_weather"]</tool_call>', '<tool_call>["get_weather"]</tool_call>', []),
    (HermesToolParser, 'a <tool_call>{"name": "x", "arguments": [1]}</tool_call>',
     'a <tool_call>{"name": "x", "arguments": [1]}</tool_call>', []),
    (HermesToolParser, 'plain text, a < b, <tool no call\n', 'plain text, a < b, <tool no call\n', []),
    (GraniteToolParser, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}}]', None,
     [("get_weather", {"city": "Rome", "days": 1}), ("get_time", {"zone": "CET"})]),
    (GraniteToolParser, 'Sure: <tool_call>[{"name": "ping", "arguments": {"q": "]}"}}]</tool_call> done', "Sure: done",
     [("ping", {"q": "]}"})]),
    (GraniteToolParser, '<|tool_call|>{"name": "ping", "arguments": {}}', None, [("ping", {})]),
    (GraniteToolParser, '<|tool_call|>[{"name": "ping", "arguments": {}}',  # unclosed list: not a call
     '<|tool_call|>[{"name": "ping", "arguments": {}}', []),
    (GraniteToolParser, 'no <|tool_call|> here', 'no <|tool_call|> here', []),
    (NemotronJsonToolParser, 'OK.\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
     '{"name": "ping", "arguments": {}}]</TOOLCALL>', "OK.",
     [("get_weather", {"city": "Paris", "days": 3}), ("ping", {})]),
    (NemotronJsonToolParser, '<TOOLCALL>[{"name": "ping", "arguments": {}}]</TOOLCALL><TOOLCALL>[{"name": "get_time", '
     '"arguments": {"zone": "UTC"}}]</TOOLCALL>', None, [("ping", {}), ("get_time", {"zone": "UTC"})]),
    (NemotronJsonToolParser, '<TOOLCALL>[{"name": "ping", "arguments": }]</TOOLCALL> x',
     '<TOOLCALL>[{"name": "ping", "arguments": }]</TOOLCALL> x', []),
    (NemotronJsonToolParser, '<TOOLCALL>[]</TOOLCALL>', '<TOOLCALL>[]</TOOLCALL>', []),
    (Qwen3CoderToolParser, 'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
     '<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n'
     '<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>', "Checking.",
     [("get_weather", {"city": "Paris", "days": 4}), ("get_time", {"zone": "UTC"})]),
    (Qwen3CoderToolParser, '<tool_call>\n{"name": "ping"}\n</tool_call>', '<tool_call>\n{"name": "ping"}\n</tool_call>',
     []),
]


@pytest.mark.parametrize("cls, text, content, calls", SAMPLES)
def test_parsers_on_samples(cls, text, content, calls):
    parser = cls(TOOLS)
    got_content, got = parse_tool_calls(parser, text)
    if calls is None:  # a closing tag inside a string: not a call we need to get right, only no crash
        return
    assert (got_content, _calls(got)) == (content, calls), (got_content, got)
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got)
    assert len({c.id for c in got}) == len(got)
    for seed in range(12):  # the same split, fed in pieces as a stream
        s_content, s_calls = _streamed(parser, text, seed)
        assert (s_content, _calls(s_calls)) == (content, calls), seed


def test_stream_gives_plain_text_out_as_it_comes():
    stream = ToolCallStream(HermesToolParser())
    assert stream.feed("Hello") == [("content", "Hello")]
    assert stream.feed(" wor") == [("content", " wor")]
    assert stream.feed("ld <") == [("content", "ld")]  # " <" could start a call
    assert stream.feed("b") == [("content", " <b")]
    assert stream.feed(" <tool_call>{\"name\": \"ping\"") == []  # the call is held until complete
    out = stream.feed("}</tool_call>")
    assert [k for k, _ in out] == ["call"] and out[0][1].name == "ping"
    assert stream.feed(" bye", final=True) == [("content", " bye")]


def test_qwen3_coder_values_typed_by_schema():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
        "a": {"type": "array"}, "s": {"type": "string"}, "u": {"type": ["integer", "null"]}}}}}]
    text = ("<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n<parameter=x>\n2.5\n</parameter>\n"
            "<parameter=b>\nTrue\n</parameter>\n<parameter=o>\n{\"k\": [1]}\n</parameter>\n<parameter=a>\n[1, 2]\n"
            "</parameter>\n<parameter=s>\n12\n</parameter>\n<parameter=u>\nnull\n</parameter>\n<parameter=extra>\n"
            "3\n</parameter>\n<parameter=n2>\nmulti\nline\n</parameter>\n</function>\n</tool_call>")
    content, calls = parse_tool_calls(Qwen3CoderToolParser(tools), text)
    assert content is None
    assert _calls(calls) == [("f", {"n": 7, "x": 2.5, "b": True, "o": {"k": [1]}, "a": [1, 2], "s": "12", "u": None,
                                    "extra": "3", "n2": "multi\nline"})]
    # a value that is not of its type stays text
    _, calls = parse_tool_calls(Qwen3CoderToolParser(tools), "<tool_call><function=f><parameter=n>seven</parameter>"
                                                              "</function></tool_call>")
    assert _calls(calls) == [("f", {"n": "seven"})]


def test_registry_and_options():
    assert {"hermes", "granite", "nemotron_json", "qwen3_coder"} <= set(TOOL_PARSERS)
    assert tool_parser_class("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'.*granite, hermes, nemotron_json"):
        tool_parser_class("nope")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        check_tool_options(True, None)
    assert check_tool_options(False, None) is None


def test_special_token_tags_are_kept_for_parsing():
    """Where the tokenizer has the tags as special tokens, decoding drops them from the engine's text:
    the text parsed is rebuilt from the token ids with them kept (and cut at the stop string)."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split

    words = ["<unk>", "</s>", "ok", " ", '{"name": "ping"}', "STOP", "x"]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Split(" ", "isolated")
    tok.add_special_tokens(["<TOOLCALL>", "</TOOLCALL>", "</s>"])
    tok.decoder = decoders.Fuse()

    class Tok:  # hybrid.tokenizer.Tokenizer's surface
        def token_to_id(self, t):
            return tok.token_to_id(t)

        def decode(self, ids, skip_special_tokens=True):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    markers = MarkerTokens(Tok(), NemotronJsonToolParser.tags)
    _chat_format_keeps_special_tags(markers, Tok(), tok)
    start, end, eos = tok.token_to_id("<TOOLCALL>"), tok.token_to_id("</TOOLCALL>"), tok.token_to_id("</s>")
    assert set(markers.ids) == {start, end}
    ids = [2, 3, start, 4, end, 3, 2, eos]
    engine_text = Tok().decode(ids)
    assert engine_text == 'ok {"name": "ping"} ok'  # the tags are gone
    marked = MarkedText(markers)
    assert marked.text(ids[:2], "ok ", None, False) == "ok "  # no tag yet: the engine's text
    assert marked.text(ids, engine_text, None, True) == 'ok <TOOLCALL>{"name": "ping"}</TOOLCALL> ok'
    content, calls = parse_tool_calls(NemotronJsonToolParser(), marked.text(ids, engine_text, None, True))
    assert content == "ok ok" and _calls(calls) == [("ping", {})]
    assert MarkedText(markers).text(ids + [5, 6], "", "STOP", True).endswith("ok")
    assert MarkerTokens(Tok(), HermesToolParser.tags).ids == {}  # plain-text tags: nothing to do


def _chat_format_keeps_special_tags(markers, hybrid_tok, tok):
    """ChatFormat (the server's chat writer) over outputs whose tags are special tokens: the streamed
    deltas and the whole message both see the call."""
    from hybrid.output_processor import TextDeltas
    from hybrid.outputs import CompletionOutput
    from hybrid.server.streaming import ChatFormat, ChoiceUpdate
    from hybrid.server.tool_calls import ToolMode

    ids = [2, 3, tok.token_to_id("<TOOLCALL>"), 4, tok.token_to_id("</TOOLCALL>"), tok.token_to_id("</s>")]
    mode = ToolMode("auto", [], NemotronJsonToolParser)
    fmt = ChatFormat(1, None, str, mode, markers)
    deltas, chunks = TextDeltas(None), []
    for k in range(1, len(ids) + 1):
        done = k == len(ids)
        c = CompletionOutput(0, hybrid_tok.decode(ids[:k]), ids[:k], "stop" if done else None)
        delta = deltas.update(fmt.text((0, 0), c), done)
        chunks += fmt.deltas(ChoiceUpdate(0, 0, delta, None, 0, c.finish_reason, k), 0, None)
    sent = [ch[0]["delta"] for ch in chunks]
    assert sent[0] == {"content": "ok"}
    assert sent[1]["tool_calls"][0]["function"] == {"name": "ping", "arguments": "{}"}
    assert chunks[-1][0]["finish_reason"] == "tool_calls"
    whole = ChatFormat(1, None, str, mode, markers)
    choice = whole.choice(0, whole.text((0, 0), c), None, "stop")
    assert choice["message"]["content"] == "ok" and choice["finish_reason"] == "tool_calls"
    assert [t["function"]["name"] for t in choice["message"]["tool_calls"]] == ["ping"]


# ---------------------------------------------------------------------------------- the server
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from server_utils import ServerThread, shared_tiny_chat_checkpoint  # noqa: E402

MODEL = "tiny-tools"
# renders the tools' names, an assistant's calls (their arguments as objects: `.city` reads one) and
# a tool message's tool_call_id
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% for tc in m.tool_calls or [] %}<call {{ tc.function.name }} {{ tc.function.arguments.city }}>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    dst = tmp_path_factory.mktemp("tools") / MODEL
    shutil.copytree(shared_tiny_chat_checkpoint(tmp_path_factory), dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TOOLS_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return dst


def _new_llm(ckpt):
    import torch

    from hybrid import LLM

    torch.set_num_threads(1)
    return LLM(str(ckpt), device="cpu", max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def llm(ckpt):
    return _new_llm(ckpt)


@pytest.fixture(scope="module")
def served(llm):
    from hybrid.server import build_app

    with ServerThread(build_app(llm, enable_auto_tool_choice=True, tool_call_parser="hermes")) as srv:
        srv.llm = llm
        yield srv


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _forced(text: str) -> dict:
    """extra_body that makes the model write exactly `text` (then stop)."""
    return {"structured_outputs": {"choice": [text]}}


def _stream(client, **kw):
    """A streamed chat's content, its tool calls accumulated per index as the openai SDK's clients
    do, the finish reason, and its content deltas."""
    content, deltas, calls, finish = "", [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            d = c.delta
            if d.content:
                content += d.content
                deltas.append(d.content)
            for tc in d.tool_calls or []:
                acc = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert acc["id"] is None  # sent once, on the call's first delta
                    acc["id"] = tc.id
                    assert tc.type == "function"
                if tc.function is not None:
                    acc["name"] += tc.function.name or ""
                    acc["arguments"] += tc.function.arguments or ""
            if c.finish_reason is not None:
                finish = c.finish_reason
    return content, [calls[i] for i in sorted(calls)], finish, deltas


TWO_CALLS = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def test_auto_tool_calls_non_streamed_and_streamed(client):
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=300, temperature=0, extra_body=_forced(TWO_CALLS))
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content == "I will check."
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("function", "get_weather", {"city": "Paris", "days": 2}), ("function", "get_time", {"zone": "CET"})]
    assert all(c.id.startswith("call_") for c in msg.tool_calls) and msg.tool_calls[0].id != msg.tool_calls[1].id
    assert r.usage.completion_tokens > 0
    # streamed: the content as deltas, each call in one delta (id, name, arguments), then "tool_calls"
    content, calls, finish, _ = _stream(client, **kw)
    assert content == "I will check." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]
    assert all(c["id"].startswith("call_") for c in calls)
    # parallel_tool_calls false: the first call only
    r = client.chat.completions.create(parallel_tool_calls=False, **kw)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    _, calls, _, _ = _stream(client, parallel_tool_calls=False, **kw)
    assert [c["name"] for c in calls] == ["get_weather"]


def test_a_cut_output_with_calls_finishes_with_length(client, served):
    """An output cut by max_tokens after its first call, inside its second: finish_reason "length" (not
    "tool_calls"), streamed and not, so that an agent loop learns the output is incomplete; the complete call is
    still read."""
    tok = served.llm.tokenizer
    cut = len(tok.encode(TWO_CALLS[:TWO_CALLS.index("</tool_call>\n<tool_call>") + 40], add_special_tokens=False))
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=cut, temperature=0, extra_body=_forced(TWO_CALLS))
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == cut
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    _, calls, finish, _ = _stream(client, **kw)
    assert finish == "length" and [c["name"] for c in calls] == ["get_weather"]


def test_only_a_call_has_null_content_and_the_raw_json_is_right(served):
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "max_tokens": 300, "temperature": 0,
            **_forced('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')}
    r = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["role"] == "assistant"
    (call,) = choice["message"]["tool_calls"]
    assert set(call) == {"id", "type", "function"} and call["type"] == "function"
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}


def test_plain_text_streams_token_by_token_and_malformed_calls_stay_content(client):
    text = "Hello there, my friend. It is sunny today in the city."
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=300, temperature=0, extra_body=_forced(text))
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    content, calls, finish, deltas = _stream(client, **kw)
    assert content == text and calls == [] and finish == "stop"
    assert len(deltas) >= 10  # incremental, not one blob at the end
    bad = 'Oops <tool_call>{"name": get_weather}</tool_call> and <tool_call>["x"]</tool_call>'
    kw["extra_body"] = _forced(bad)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    content, calls, finish, _ = _stream(client, **kw)
    assert (content, calls, finish) == (bad, [], "stop")


def test_logprobs_with_tool_calls(client):
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=300, temperature=0, logprobs=True,
              extra_body=_forced('Hi <tool_call>{"name": "ping", "arguments": {}}</tool_call>'))
    r = client.chat.completions.create(**kw)
    n = r.usage.completion_tokens
    assert len(r.choices[0].logprobs.content) == n
    rows = [row for chunk in client.chat.completions.create(stream=True, **kw) for c in chunk.choices
            if c.logprobs is not None for row in c.logprobs.content]
    assert len(rows) == n  # every token's row, once, even those of the held call


def test_tool_choice_none_does_not_parse(client, served, llm):
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=300, temperature=0,
              extra_body=_forced(TWO_CALLS))
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == TWO_CALLS and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    # the tools are still rendered (vLLM's default)
    rendered = "<tools>get_weather;get_time;\n<user>Weather in Paris?\n<assistant>"
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode(rendered, add_special_tokens=False))
    content, calls, finish, _ = _stream(client, **kw)
    assert (content, calls, finish) == (TWO_CALLS, [], "stop")


def test_named_tool_choice_is_constrained_to_its_schema(client):
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=300, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # as vLLM and OpenAI answer a forced function
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # streamed: the id and name first, then the arguments as generated (greedy: the same ones)
    content, calls, finish, _ = _stream(client, **kw)
    assert content == "" and finish == "stop"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    # a function without parameters: an object
    r = client.chat.completions.create(**{**kw, "tools": [NOARGS], "tool_choice": {"type": "function",
                                                                                     "function": {"name": "ping"}}})
    assert isinstance(json.loads(r.choices[0].message.tool_calls[0].function.arguments), dict)


def test_required_tool_choice(client):
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=400, temperature=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    content, calls, finish, _ = _stream(client, **kw)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    r = client.chat.completions.create(parallel_tool_calls=False, **kw)  # constrained to one call
    assert len(r.choices[0].message.tool_calls) == 1
    # n > 1, sampled: every choice is a list of valid calls
    r = client.chat.completions.create(**{**kw, "temperature": 1.0, "seed": 5, "n": 2})
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls


def test_tool_messages_reach_the_template_with_arguments_as_objects(client, llm):
    from hybrid.chat_template import render_chat
    from hybrid.server.protocol import parse_chat

    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2}
    req = parse_chat(body, 512)
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome", "days": 1}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome", "days": 1}'  # not mutated
    want = ("<tools>get_weather;get_time;\n<user>Weather in Paris?\n<assistant><call get_weather Rome>\n"
            "<tool>sunny[call_1]\n<assistant>")
    assert render_chat(TOOLS_TEMPLATE, req.messages, None, True, {"tools": req.tools}) == want
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2,
                                       temperature=0)
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode(want, add_special_tokens=False))
    # the openai SDK's own message objects, sent back as the next turn
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=300, temperature=0,
                                           extra_body=_forced(HERMES_ONE))
    followup = USER + [first.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "9C"}]
    r = client.chat.completions.create(model=MODEL, messages=followup, tools=TOOLS, max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason in ("length", "stop")


BAD = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": ["get_weather"]}, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": 3}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools"),  # a schema the grammar engine refuses
    ({"functions": [{"name": "x"}]}, "functions"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": {"name": "x"}}]}, "messages[1].tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": USER + [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages[1].tool_call_id"),
]


@pytest.mark.parametrize("extra, param", BAD)
def test_bad_tool_fields_are_400(served, extra, param):
    for stream in (False, True):
        body = {"model": MODEL, "messages": USER, "max_tokens": 2, "stream": stream, **extra}
        r = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert httpx.get(served.base_url + "/health").json() == {"status": "ok"}


def test_auto_without_the_server_flag_is_a_clear_400(ckpt):
    from hybrid.server import build_app

    # (its own LLM: one engine serves one app at a time)
    with ServerThread(build_app(_new_llm(ckpt), served_model_name=MODEL)) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for choice in ({}, {"tool_choice": "auto"}):  # "auto" is the default when tools are given
            with pytest.raises(openai.BadRequestError) as ei:
                c.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=2, **choice)
            err = ei.value.body
            assert err["param"] == "tool_choice"
            assert "--enable-auto-tool-choice and --tool-call-parser" in err["message"]
        # none, named and required need no parser
        r = c.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=300,
                                      temperature=0, extra_body=_forced(HERMES_ONE))
        assert r.choices[0].message.content == HERMES_ONE and not r.choices[0].message.tool_calls
        r = c.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=300, temperature=0,
                                      tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert r.choices[0].message.tool_calls[0].function.name == "get_time"
        # without tools nothing changes
        r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length"


def test_other_parsers_and_exclude_tools_through_the_server(ckpt):
    from hybrid.server import build_app

    text = ('Fine.\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Rome", "days": 5}}, '
            '{"name": "get_time", "arguments": {"zone": "UTC"}}]</TOOLCALL>')
    llm = _new_llm(ckpt)
    with ServerThread(build_app(llm, served_model_name=MODEL, enable_auto_tool_choice=True,
                                tool_call_parser="nemotron_json", exclude_tools_when_tool_choice_none=True)) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=300, temperature=0, extra_body=_forced(text))
        msg = c.chat.completions.create(**kw).choices[0].message
        assert msg.content == "Fine."
        assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
            ("get_weather", {"city": "Rome", "days": 5}), ("get_time", {"zone": "UTC"})]
        content, calls, finish, _ = _stream(c, **kw)
        assert content == "Fine." and [x["name"] for x in calls] == ["get_weather", "get_time"]
        assert finish == "tool_calls"
        # --exclude-tools-when-tool-choice-none: no tools in the prompt then (still with "auto")
        r = c.chat.completions.create(**{**kw, "tool_choice": "none"})
        assert r.choices[0].message.content == text
        assert r.usage.prompt_tokens == len(llm.tokenizer.encode("<user>Weather in Paris?\n<assistant>",
                                                                 add_special_tokens=False))
        r = c.chat.completions.create(**kw)
        assert r.usage.prompt_tokens == len(llm.tokenizer.encode(
            "<tools>get_weather;get_time;\n<user>Weather in Paris?\n<assistant>", add_special_tokens=False))


def test_build_app_and_cli_refuse_an_unknown_parser(llm, capsys):
    import argparse

    from hybrid.cli import _add_engine_args, main
    from hybrid.server import add_serve_parser, build_app, serve_options

    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        build_app(llm, enable_auto_tool_choice=True, tool_call_parser="nope")
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        build_app(llm, enable_auto_tool_choice=True)
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(), _add_engine_args)
    opts = serve_options(parser.parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "granite",
                                            "--exclude-tools-when-tool-choice-none"]), {})
    assert (opts["enable_auto_tool_choice"], opts["tool_call_parser"], opts["exclude_tools_when_tool_choice_none"]) \
        == (True, "granite", True)
    # at startup, before the model is loaded
    assert main(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown tool call parser 'nope'" in err and "hermes" in err and "nemotron_json" in err


def test_required_tool_choice_with_pydantic_defs(client):
    """tool_choice "required" over tools whose parameters use `$defs` / `$ref` (pydantic's schemas): the
    definitions move to the top of the calls' schema, where the references resolve, and the calls validate
    against each tool's own schema; two tools defining one name differently are a 400 naming `tools`."""
    address = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    params = {"$defs": {"Address": address}, "type": "object",
              "properties": {"address": {"$ref": "#/$defs/Address"}}, "required": ["address"]}
    tool = {"type": "function", "function": {"name": "add_user", "parameters": params}}
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[tool], tool_choice="required",
                                       max_tokens=400, temperature=0, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), params)
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "$defs": {"Address": {"type": "string"}}, "type": "object",
        "properties": {"a": {"$ref": "#/$defs/Address"}}}}}
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, tools=[tool, other], tool_choice="required",
                                       max_tokens=20)
    assert e.value.body["param"] == "tools" and "Address" in e.value.body["message"]
