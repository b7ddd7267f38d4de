"""Structured outputs (SamplingParams(structured_outputs=StructuredOutputsParams(...)), as vLLM's): a
constrained output matches its JSON schema / JSON object / regex / choice / grammar, greedy and
sampled, with n > 1, under preemption, with prefix caching and with async scheduling; a bad
constraint is an InvalidRequestError at add_request that harms no other request."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from hybrid import InvalidRequestError, SamplingParams, StructuredOutputsParams

torch.set_num_threads(1)  # 2 cores shared by several people

PROMPTS = ["And the LORD said unto Moses,", "Who was Moses?", "In the beginning", "Thou shalt"]

# Bounded schemas: a tiny model follows a grammar, but left free it may run a string or a number on
# until max_tokens; these keep every output short enough to finish.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "alive"],
    "additionalProperties": False,
}
ENUM = {"type": "object", "properties": {"tribe": {"enum": ["Judah", "Levi", "Benjamin", "Dan"]}},
        "required": ["tribe"], "additionalProperties": False}
ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4}
NESTED = {
    "type": "object",
    "properties": {
        "book": {"type": "string", "maxLength": 12},
        "verse": {
            "type": "object",
            "properties": {"chapter": {"type": "integer", "minimum": 1, "maximum": 50},
                           "words": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
            "required": ["chapter", "words"],
            "additionalProperties": False,
        },
    },
    "required": ["book", "verse"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "enum": ENUM, "array": ARRAY, "nested": NESTED}
REGEX = r"[A-Z][a-z]{2,7} [0-9]{1,3}:[0-9]{1,2}"
CHOICE = ["Moses", "Aaron", "Miriam", "Pharaoh"]


def _default_llm(**kwargs):
    """The bundled default model (byte-level BPE tokenizer) on CPU."""
    from hybrid import LLM

    return LLM(None, device="cpu", **kwargs)


@pytest.fixture(scope="module")
def llm():
    return _default_llm(max_num_seqs=8)


def _json(schema, **kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, **kw)


def _check_json(outs, schema) -> None:
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            jsonschema.validate(json.loads(c.text), schema)


# ------------------------------------------------------------------ the parameters
def test_params_take_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="exactly one of json, regex.*got json, regex"):
        StructuredOutputsParams(json=PERSON, regex="a+")
    with pytest.raises(InvalidRequestError, match="not JSON text"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(InvalidRequestError, match="choice must be a non-empty list of strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(InvalidRequestError, match="choice"):
        StructuredOutputsParams(choice=["a", 1])
    with pytest.raises(InvalidRequestError, match="regex must be a string"):
        StructuredOutputsParams(regex=5)
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs={"jsn": {}})
    # a dict is taken as the fields of StructuredOutputsParams
    sp = SamplingParams(structured_outputs={"regex": "a+"})
    assert sp.structured_outputs == StructuredOutputsParams(regex="a+")
    from hybrid.sampling import StructuredOutputsParams as same
    assert same is StructuredOutputsParams


@pytest.mark.parametrize("so, match", [
    (StructuredOutputsParams(json={"type": "objekt"}), "invalid json: .*objekt"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}),
     "invalid json"),
    (StructuredOutputsParams(regex="(unclosed"), "invalid regex: .*unclosed group"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "invalid grammar: .*undefined_rule"),
])
def test_invalid_constraint_is_a_request_error_and_harms_no_one(llm, so, match):
    good = SamplingParams(max_tokens=12, temperature=0.0)
    ref = llm.generate(PROMPTS[:1], good, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(PROMPTS[:2], [good, SamplingParams(max_tokens=12, structured_outputs=so)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing of the batch was queued
    # straight into a running engine: the request is refused, the one already running is untouched
    eng = llm.engine
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    eng.add_request("ok", ids, SamplingParams(max_tokens=12, temperature=0.0), output_kind="final")
    eng.step()
    with pytest.raises(InvalidRequestError, match=match):
        eng.add_request("bad", ids, SamplingParams(max_tokens=12, structured_outputs=so))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs] == ["ok"] and outs[0].outputs[0].token_ids == ref


def test_speculative_decoding_refuses_structured_outputs():
    llm = _default_llm( speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(InvalidRequestError, match="structured outputs with speculative decoding are not supported"):
        llm.generate(["Hi"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")), use_tqdm=False)


# ------------------------------------------------------------------ outputs match
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_greedy_json_validates(llm, name):
    schema = SCHEMAS[name]
    for so in (_json(schema), _json(json.dumps(schema), disable_any_whitespace=True)):
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=400, temperature=0.0, structured_outputs=so),
                            use_tqdm=False)
        _check_json(outs, schema)
    compact = outs[0].outputs[0].text
    assert compact == json.dumps(json.loads(compact), separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_json_validates(llm, seed):
    for schema in (PERSON, NESTED):
        sp = SamplingParams(max_tokens=400, temperature=1.0, seed=seed, structured_outputs=_json(schema))
        _check_json(llm.generate(PROMPTS, sp, use_tqdm=False), schema)


def test_json_object(llm):
    sp = SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=StructuredOutputsParams(json_object=True))
    for o in llm.generate(PROMPTS, sp, use_tqdm=False):
        c = o.outputs[0]
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
    # additionalProperties: false where unset: only the listed keys
    open_schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a"]}
    so = _json(open_schema, disable_additional_properties=True)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=1.0, seed=0, structured_outputs=so),
                        use_tqdm=False)
    for o in outs:
        assert set(json.loads(o.outputs[0].text)) == {"a"}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_choice_match(llm, temperature):
    for so, ok in ((StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
                   (StructuredOutputsParams(choice=CHOICE), lambda t: t in CHOICE),
                   (StructuredOutputsParams(grammar='start: "yea" | "nay" | "amen"'),
                    lambda t: t in ("yea", "nay", "amen"))):
        sp = SamplingParams(n=2, max_tokens=40, temperature=temperature, seed=7, structured_outputs=so)
        for o in llm.generate(PROMPTS, sp, use_tqdm=False):
            for c in o.outputs:
                assert ok(c.text) and c.finish_reason == "stop", (c.text, c.finish_reason)


def test_vllms_older_guided_decoding_names(llm):
    """SamplingParams(guided_decoding=GuidedDecodingParams(..., backend=...)), as code written against older
    vLLM releases says it: the same constraint as structured_outputs; both at once is an error."""
    from hybrid.sampling import GuidedDecodingParams

    sp = SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                        guided_decoding=GuidedDecodingParams(choice=CHOICE, backend="xgrammar"))
    assert sp.structured_outputs == StructuredOutputsParams(choice=CHOICE) and sp.guided_decoding is None
    for o in llm.generate(PROMPTS, sp, use_tqdm=False):
        assert o.outputs[0].text in CHOICE
    with pytest.raises(InvalidRequestError, match="guided_decoding"):
        SamplingParams(guided_decoding=GuidedDecodingParams(choice=CHOICE),
                       structured_outputs=StructuredOutputsParams(regex=REGEX))


def test_grammar_completion_stops_even_with_ignore_eos(llm):
    so = StructuredOutputsParams(choice=CHOICE)
    for ignore_eos in (False, True):
        out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=ignore_eos,
                                                      min_tokens=0, structured_outputs=so), use_tqdm=False)[0]
        c = out.outputs[0]
        assert c.text in CHOICE and c.finish_reason == "stop" and len(c.token_ids) < 10
    # min_tokens cannot hold back the end of a complete grammar
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0, min_tokens=30,
                                                  structured_outputs=so), use_tqdm=False)[0]
    assert out.outputs[0].text in CHOICE and out.error is None


def test_n_branches_each_valid(llm):
    sp = SamplingParams(n=3, max_tokens=400, temperature=1.0, seed=11, structured_outputs=_json(PERSON))
    outs = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    _check_json(outs, PERSON)
    assert all(len(o.outputs) == 3 for o in outs)
    assert len({c.text for c in outs[0].outputs}) > 1  # the branches sample on their own
    assert llm.engine.stats["forks"] > 0


def test_constrained_and_free_requests_share_steps(llm):
    """A batch mixing constrained and free requests: each free one is what it is alone."""
    free = SamplingParams(max_tokens=20, temperature=0.0)
    alone = llm.generate(PROMPTS[1], free, use_tqdm=False)[0].outputs[0].token_ids
    sps = [SamplingParams(max_tokens=400, temperature=0.0, structured_outputs=_json(PERSON)), free,
           SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=REGEX)),
           SamplingParams(max_tokens=20, temperature=0.8, seed=3)]
    outs = llm.generate(PROMPTS, sps, use_tqdm=False)
    jsonschema.validate(json.loads(outs[0].outputs[0].text), PERSON)
    assert outs[1].outputs[0].token_ids == alone
    assert re.fullmatch(REGEX, outs[2].outputs[0].text)


def test_constraint_that_starts_after_a_token(llm):
    """start_after_token_id (a thinking model's end of thought): the output is free until that token,
    then it matches; each branch of n waits on its own, and a branch that never meets the token
    stays free."""
    tok = llm.get_tokenizer()
    gate = tok.encode(" Moses")[0]
    assert len(tok.encode(" Moses")) == 1
    so = StructuredOutputsParams(choice=["yea", "nay"], start_after_token_id=gate)
    # the bias makes the gate token the first choice of every free position; inside the constraint
    # the mask wins over it
    sp = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=4, structured_outputs=so, logit_bias={gate: 100})
    for o in llm.generate(PROMPTS[:2], sp, use_tqdm=False):
        for c in o.outputs:
            assert c.token_ids[0] == gate and c.finish_reason == "stop", (c.text, c.token_ids)
            assert tok.decode(c.token_ids[1:]) in ("yea", "nay")
    # no gate token ever: nothing is constrained (the free output is the unconstrained one)
    free = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={gate: -100})
    waiting = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={gate: -100}, structured_outputs=so)
    a, b = llm.generate([PROMPTS[0]] * 2, [free, waiting], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and b.outputs[0].text not in ("yea", "nay")
    with pytest.raises(InvalidRequestError, match="start_after_token_id"):
        StructuredOutputsParams(choice=["a"], start_after_token_id=-1)


# ------------------------------------------------------------------ with the engine's machinery
def _mixed_params():
    return [SamplingParams(max_tokens=400, temperature=0.0, structured_outputs=_json(NESTED)),
            SamplingParams(n=2, max_tokens=400, temperature=1.0, seed=5, structured_outputs=_json(PERSON)),
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=0.9, seed=2, structured_outputs=StructuredOutputsParams(regex=REGEX))]


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _check_mixed(outs):
    jsonschema.validate(json.loads(outs[0].outputs[0].text), NESTED)
    for c in outs[1].outputs:
        jsonschema.validate(json.loads(c.text), PERSON)
    assert re.fullmatch(REGEX, outs[3].outputs[0].text)


@pytest.fixture(scope="module")
def mixed_ref(llm):
    outs = llm.generate(PROMPTS, _mixed_params(), use_tqdm=False)
    _check_mixed(outs)
    return _tokens(outs)


def test_under_preemption(mixed_ref):
    # 20 pages of 16 tokens (+ the dummy): one sequence of max_model_len, while the 5 sequences grow
    # to 60-300 tokens each: they preempt
    llm = _default_llm(max_num_seqs=5, max_model_len=320, num_kv_pages=21, check_state=True)
    outs = llm.generate(PROMPTS, _mixed_params(), use_tqdm=False)
    assert llm.engine.stats["preemptions"] > 0
    _check_mixed(outs)
    assert _tokens(outs) == mixed_ref  # the matchers were not advanced twice by the replays
    assert llm.state_pool.num_free == 5 and llm.kv_cache.allocator.num_free == 20


def test_with_prefix_caching(llm):
    """Prompts that share a long prefix: the later ones resume from the cache; the matcher state is
    the request's own, whatever prefix it resumed from."""
    shared = "And it came to pass, when Moses had made an end of writing the words of this law in a book, "
    prompts = [shared + p for p in PROMPTS]
    ref = _tokens(llm.generate(prompts, _mixed_params(), use_tqdm=False))
    cached = _default_llm(enable_prefix_caching=True, check_state=True)
    for _ in range(2):
        outs = cached.generate(prompts, _mixed_params(), use_tqdm=False)
        _check_mixed(outs)
        assert _tokens(outs) == ref
    assert cached.engine.stats["prefix_cache_hits"] >= 4


def test_with_async_scheduling(mixed_ref):
    llm = _default_llm(async_scheduling=True, check_state=True)
    outs = llm.generate(PROMPTS, _mixed_params(), use_tqdm=False)
    _check_mixed(outs)
    assert _tokens(outs) == mixed_ref
    # free requests alone still overlap their steps; constrained ones run synchronously
    llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert llm.engine.stats["overlapped_steps"] > 5


def test_tiny_checkpoint_tokenizer(tiny_ckpt, make_llm):
    """A char-BPE tokenizer whose decoder (Fuse) llguidance does not read: built from each token's text."""
    llm = make_llm(tiny_ckpt("nemotron_h"))
    sps = [SamplingParams(n=2, max_tokens=400, temperature=t, seed=4, structured_outputs=_json(PERSON))
           for t in (0.0, 1.0)]
    _check_json(llm.generate(["the cat", "in the"], sps, use_tqdm=False), PERSON)
    sp = SamplingParams(max_tokens=30, temperature=1.0, seed=1, structured_outputs=StructuredOutputsParams(regex=REGEX))
    for o in llm.generate(["the cat", "in the"], sp, use_tqdm=False):
        assert re.fullmatch(REGEX, o.outputs[0].text)


def test_engine_without_tokenizer_refuses(llm):
    grammars = llm.engine.grammars
    saved = grammars.tokenizer
    try:
        grammars.tokenizer = None
        with pytest.raises(InvalidRequestError, match="need the checkpoint's tokenizer"):
            grammars.matchers(StructuredOutputsParams(regex="x"), 1)
    finally:
        grammars.tokenizer = saved


def test_apply_token_bitmask():
    from hybrid.structured_outputs import apply_token_bitmask

    logits = torch.randn(3, 70)
    masks = torch.zeros(2, 3, dtype=torch.int32)
    masks[0, 0] = 0b1010  # tokens 1 and 3
    masks[1, 2] = -2**31  # bit 31 of word 2: token 95, beyond the vocabulary; and token 64:
    masks[1, 2] |= 1
    out = apply_token_bitmask(logits, [2, 0], masks)
    assert torch.equal(out[1], logits[1])  # a row without a mask is untouched
    assert torch.isfinite(out[2]).tolist() == [i in (1, 3) for i in range(70)]
    assert torch.isfinite(out[0]).tolist() == [i == 64 for i in range(70)]
    assert out[2, 3] == logits[2, 3]


def test_a_grammar_the_matcher_cannot_follow_fails_its_request_only(llm):
    """a{1000000} compiles but exceeds what the matcher can lex at its first token: the request fails naming
    the grammar (a client error), never stopping as if its output were complete; a request beside it is served."""
    from hybrid.errors import RequestFailedError

    huge = SamplingParams(max_tokens=4, seed=1, structured_outputs=StructuredOutputsParams(regex="a{1000000}"))
    free = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(RequestFailedError) as e:
        llm.generate(["Hi", "In the"], [huge, free], use_tqdm=False)
    assert list(e.value.failed) == [0] and "InvalidRequestError: structured outputs: the grammar failed" in \
        e.value.failed[0]
    assert e.value.outputs[1].outputs[0].finish_reason == "length"
    assert not llm.engine.has_unfinished_requests()


def test_a_choice_of_thousands(llm):
    """3,000 choices: one terminal of the grammar, walked by the lexer. (As alternatives of the start rule they
    made one Earley row over the matcher's 2,000-item limit, and every such request failed after its first
    token.)"""
    choices = [f"verse {i}" for i in range(3000)]
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=3,
                        structured_outputs=StructuredOutputsParams(choice=choices))
    for o in llm.generate(PROMPTS[:2], sp, use_tqdm=False):
        assert o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop", o.outputs[0]


def test_choice_terminal_keeps_every_string_exact(llm):
    """Quotes, backslashes, newlines, non-ASCII and the empty string are choices like any other."""
    choices = ['say "yea"', "a\\b", "line\nbreak", "é😀", ""]
    for seed in range(3):
        sp = SamplingParams(max_tokens=24, temperature=1.0, seed=seed,
                            structured_outputs=StructuredOutputsParams(choice=choices))
        out = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0]
        assert out.text in choices and out.finish_reason == "stop", out


def test_first_mask_is_computed_while_validating(llm, monkeypatch):
    """The compiled template computes its first mask when the request is validated (where the server runs it
    on a worker thread), so the lexer states it builds, for some regexes a second's work, are not built in a
    step that other requests share: every copy starts from them."""
    import llguidance

    real = llguidance.LLMatcher
    calls = []

    class Recording:  # the template, recording its calls; its copies are real matchers
        def __init__(self, *args, **kwargs):
            self._m = real(*args, **kwargs)

        def __getattr__(self, name):
            calls.append(name)
            return getattr(self._m, name)

    monkeypatch.setattr(llguidance, "LLMatcher", Recording)
    for name in ("validate_grammar", "grammar_from_lark", "grammar_from_regex", "grammar_from_json_schema"):
        monkeypatch.setattr(Recording, name, staticmethod(getattr(real, name)), raising=False)
    so = StructuredOutputsParams(regex="[a-z]{3} recorded")
    llm.engine.validate_request([5, 6], SamplingParams(max_tokens=4, structured_outputs=so))
    assert "compute_bitmask" in calls, calls


def test_regex_classes_are_ascii(llm):
    """\\d and \\w in a regex are ASCII classes (as vLLM's default engine and JSON schemas' patterns read them),
    sampled hot so that the model would pick other scripts' digits if they were allowed; a '/' in the regex is
    taken literally."""
    for regex, ok in ((r"\d{4}", r"[0-9]{4}"), (r"\w{3}/\d", r"[0-9A-Za-z_]{3}/[0-9]")):
        for seed in range(4):
            sp = SamplingParams(max_tokens=24, temperature=2.0, seed=seed,
                                structured_outputs=StructuredOutputsParams(regex=regex))
            text = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].text
            assert re.fullmatch(ok, text), (regex, text)
