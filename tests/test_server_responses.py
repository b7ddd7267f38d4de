"""OpenAI's Responses API (/v1/responses) through the openai client: the same outputs as the chat
endpoint for the same conversation, whole and streamed (the SDK's own stream accumulator reads the
events), with reasoning items, function calls, structured text and input items of every kind."""
from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from server_utils import build_thinking_checkpoint, thinking_server  # noqa: E402

from hybrid.server.responses import input_messages  # noqa: E402

MODEL = "tiny-responder"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
END_FIRST = {"logit_bias": {"193": 100}}  # </think> first: the thought ends at once
TOOLS = [{"type": "function", "name": "capital", "description": "a country's capital",
          "parameters": {"type": "object", "properties": {"country": {"type": "string", "enum": ["France"]}},
                         "required": ["country"], "additionalProperties": False}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with thinking_server(build_thinking_checkpoint(tmp_path_factory.mktemp("responses") / MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _events(client, **kw) -> list:
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    ids = {e.response.id for e in events if hasattr(e, "response")}
    assert len(ids) == 1
    return events


def _items(output) -> list[tuple]:
    """What the output items say, without their ids."""
    out = []
    for item in output:
        if item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        elif item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content or [])))
        else:
            out.append(("function_call", item.name, json.loads(item.arguments)))
    return out


def test_text_equals_the_chat_endpoint_whole_and_streamed(client):
    r = client.responses.create(model=MODEL, input="Capital of France?", max_output_tokens=9, temperature=0,
                                extra_body=NO_THINKING)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}],
                                          max_tokens=9, temperature=0, extra_body=NO_THINKING)
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    events = _events(client, model=MODEL, input="Capital of France?", max_output_tokens=9, temperature=0,
                     extra_body=NO_THINKING)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text
    assert _items(events[-1].response.output) == _items(r.output)
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens


def test_reasoning_item(client):
    """A thought the template opens, never ended: one reasoning item, no message."""
    kw = dict(model=MODEL, input="Capital of France?", max_output_tokens=10, temperature=0,
              extra_body={"logit_bias": {"193": -100}})
    r = client.responses.create(**kw)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}],
                                          max_tokens=10, temperature=0, extra_body={"logit_bias": {"193": -100}})
    thought = chat.choices[0].message.model_extra["reasoning"]
    assert _items(r.output) == [("reasoning", thought)] and r.output_text == ""
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens
    events = _events(client, **kw)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert _items(events[-1].response.output) == _items(r.output)


def test_json_schema_text_format_after_the_thought(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
              "required": ["city"], "additionalProperties": False}
    kw = dict(model=MODEL, input="Capital of France?", max_output_tokens=120, temperature=0, extra_body=END_FIRST,
              text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    r = client.responses.create(**kw)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.usage.output_tokens_details.reasoning_tokens == 0  # the thought ended at its first token
    events = _events(client, **kw)
    assert _items(events[-1].response.output) == _items(r.output)


def test_function_calls_whole_and_streamed(client):
    kw = dict(model=MODEL, input="Capital of France?", tools=TOOLS, tool_choice="required", max_output_tokens=240,
              temperature=0, extra_body=END_FIRST)
    r = client.responses.create(**kw)
    assert _items(r.output) == [("function_call", "capital", {"country": "France"})]
    call = r.output[0]
    assert call.call_id.startswith("call_") and call.status == "completed"
    events = _events(client, **kw)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"country": "France"}
    assert _items(events[-1].response.output) == _items(r.output)
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert _items(final.output) == _items(r.output)
    # a named function
    named = client.responses.create(**{**kw, "tool_choice": {"type": "function", "name": "capital"}})
    assert _items(named.output) == [("function_call", "capital", {"country": "France"})]


def test_input_items_become_the_conversation():
    body = {"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Capital of "}, {"type": "input_text",
                                                                                   "text": "France?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
        {"type": "function_call", "call_id": "call_1", "name": "capital", "arguments": '{"country": "France"}'},
        {"type": "function_call", "call_id": "call_2", "name": "capital", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "Paris"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
    ]}
    assert input_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "", "reasoning_content": "look", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "capital", "arguments": '{"country": "France"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "capital", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Paris"},
        {"role": "assistant", "content": "Paris."},
    ]


def test_a_conversation_with_calls_runs(client, served):
    r = client.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=4, temperature=0,
                                tools=TOOLS, extra_body=NO_THINKING, input=[
                                    {"role": "user", "content": "Capital of France?"},
                                    {"type": "function_call", "call_id": "call_1", "name": "capital",
                                     "arguments": '{"country": "France"}'},
                                    {"type": "function_call_output", "call_id": "call_1", "output": "Paris"}])
    assert r.status in ("completed", "incomplete") and r.instructions == "Be brief."
    assert [t.name for t in r.tools] == ["capital"]


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": "hi", "tools": [{"type": "function", "name": ""}]}, "tools[0].name"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "guided_regex": "(["}, "guided_regex"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "boolean"}}}}, "text.format.name"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    # an output answers a call of the conversation (OpenAI's check)
    ({"input": [{"type": "function_call_output", "call_id": "call_zzz", "output": "x"}]}, "input[0].call_id"),
])
def test_bad_requests_are_400_naming_the_field(served, body, param):
    r = httpx.post(served.base_url + "/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    if r.json()["error"]["message"].startswith("'"):  # a message that names the field names this one
        assert r.json()["error"]["message"].startswith(f"'{param}'"), r.json()
    assert httpx.post(served.base_url + "/v1/responses", json={"model": "other", "input": "hi"}).status_code == 404


def test_a_cut_output_item_is_incomplete(client):
    """An output cut by max_output_tokens: the response is "incomplete" and so is its message item, as OpenAI
    marks it, whole and streamed (the output_item.done event's item too)."""
    kw = dict(model=MODEL, input="Tell a long story.", max_output_tokens=4, temperature=0, extra_body=NO_THINKING)
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.output[-1].type == "message" and r.output[-1].status == "incomplete"
    done = [e for e in client.responses.create(stream=True, **kw) if e.type == "response.output_item.done"]
    assert done[-1].item.status == "incomplete"
    r = client.responses.create(**{**kw, "max_output_tokens": 200, "extra_body": {
        **NO_THINKING, "structured_outputs": {"choice": ["Amen."]}}})
    assert r.status == "completed" and r.output[-1].status == "completed"


def test_sdk_parse_helpers(client):
    """The SDK's structured-output helpers over both endpoints: responses.parse / responses.stream
    with text_format, chat.completions.parse with response_format (a pydantic model, strict schema)."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=8)
        people: int

    kw = dict(model=MODEL, input="Capital of France?", text_format=City, max_output_tokens=200, temperature=0,
              extra_body=NO_THINKING)
    parsed = client.responses.parse(**kw).output_parsed
    assert isinstance(parsed, City)
    with client.responses.stream(**kw) as stream:
        assert stream.get_final_response().output_parsed == parsed
    chat = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}],
                                         response_format=City, max_tokens=200, temperature=0, extra_body=NO_THINKING)
    assert chat.choices[0].message.parsed == parsed


def test_vllm_constraint_fields_and_the_sampling_used(served):
    """vLLM's guided_* fields constrain a Responses output as they do a chat one, and the response reports
    the temperature and top_p it ran with (the model's defaults where the request gives none)."""
    r = httpx.post(served.base_url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": "Say yes or no", "guided_choice": ["yes", "no"], "max_output_tokens": 20,
        **NO_THINKING}).json()
    assert r["output"][-1]["content"][0]["text"] in ("yes", "no"), r
    assert isinstance(r["temperature"], float) and isinstance(r["top_p"], float)
    r = httpx.post(served.base_url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": "hi", "guided_regex": "[ab]{3}", "max_output_tokens": 20, "temperature": 0.5,
        **NO_THINKING}).json()
    assert re.fullmatch("[ab]{3}", r["output"][-1]["content"][0]["text"]) and r["temperature"] == 0.5, r


def test_previous_response_id_continues_a_stored_conversation(client, served):
    """OpenAI's store / previous_response_id: a later turn starts from the stored conversation (the earlier
    input and output items) before its own input, exactly as if it had sent them all; streamed turns are stored
    too; GET and DELETE /v1/responses/{id}; store false keeps nothing; an unknown id is a 400 naming it."""
    kw = dict(model=MODEL, max_output_tokens=6, temperature=0, extra_body={**END_FIRST, "ignore_eos": True})
    first = client.responses.create(input="Capital of France?", **kw)
    second = client.responses.create(input="And of Italy?", previous_response_id=first.id, **kw)
    assert second.previous_response_id == first.id
    whole = [{"role": "user", "content": "Capital of France?"}] + [i.model_dump(exclude_none=True)
                                                                   for i in first.output]
    whole.append({"role": "user", "content": "And of Italy?"})
    stateless = client.responses.create(input=whole, **kw)
    assert second.usage.input_tokens == stateless.usage.input_tokens > first.usage.input_tokens
    assert _items(second.output) == _items(stateless.output)
    # a function call answered in the next turn by its call_id alone
    call = client.responses.create(input="Capital of France?", tools=TOOLS, tool_choice="required",
                                   **{**kw, "max_output_tokens": 240})
    (fc,) = call.output[-1:]
    answer = client.responses.create(input=[{"type": "function_call_output", "call_id": fc.call_id,
                                             "output": "Paris"}], previous_response_id=call.id, tools=TOOLS, **kw)
    assert answer.status in ("completed", "incomplete")
    # errors name what the client sent: its own items by their index in its input; a stored item (here a call
    # cut mid-arguments) by previous_response_id
    url = served.base_url + "/v1/responses"
    r = httpx.post(url, json={"model": MODEL, "previous_response_id": call.id,
                              "input": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].role", r.text
    cut = client.responses.create(input="Capital of France?", tools=TOOLS,
                                  tool_choice={"type": "function", "name": "capital"}, **{**kw, "max_output_tokens": 3})
    assert cut.status == "incomplete" and cut.output[-1].type == "function_call"
    r = httpx.post(url, json={"model": MODEL, "previous_response_id": cut.id, "tools": TOOLS, "input": [
        {"type": "function_call_output", "call_id": cut.output[-1].call_id, "output": "Paris"}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "previous_response_id" and "arguments" in err["message"], err
    # streamed turns are stored as well, and can be read back and deleted
    events = _events(client, input="Capital of Spain?", previous_response_id=second.id, **kw)
    streamed = events[-1].response
    assert client.responses.retrieve(streamed.id).output[0].id == streamed.output[0].id
    client.responses.delete(streamed.id)
    for gone in (lambda: client.responses.retrieve(streamed.id), lambda: client.responses.delete(streamed.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    unstored = client.responses.create(input="Hi", store=False, **kw)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input="More", previous_response_id=unstored.id, **kw)
    assert e.value.body["param"] == "previous_response_id"


def test_response_store_is_bounded_in_entries_and_text(monkeypatch):
    """The store keeps the newest responses within both of its bounds, and forgets the oldest first."""
    from hybrid.server.api_errors import APIError
    from hybrid.server.responses import ResponseStore

    monkeypatch.setattr(ResponseStore, "MAX_ENTRIES", 3)
    monkeypatch.setattr(ResponseStore, "MAX_CHARS", 110)  # (every string counts: "user" too, "message")
    store = ResponseStore()
    for i in range(4):
        store.put({"id": f"r{i}", "output": []}, [{"role": "user", "content": "x" * 10}])
    assert store.get("r0") is None and all(store.get(f"r{i}") for i in (1, 2, 3))
    store.put({"id": "big", "output": [{"type": "message", "content": "y" * 80}]}, [])
    # big: 87 characters; with r1-r3's 14 each that is 129: r1 and r2 go, the oldest first
    assert store.get("r1") is None and store.get("r2") is None and store.get("big") is not None
    with pytest.raises(APIError):
        store.conversation("r1")
    assert store.delete("big") and not store.delete("big") and store.get("r3") is not None
