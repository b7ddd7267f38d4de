"""The SamplingParams fields vLLM users pass out of habit: skip_special_tokens,
spaces_between_special_tokens, include_stop_str_in_output, allowed_token_ids, bad_words and
truncate_prompt_tokens, end to end on the bundled default model (its byte-level BPE tokenizer has
one special token, <|endoftext|> = 0, its EOS): through LLM.generate, under async scheduling and
speculative decoding, through the OpenAI server (streamed and not), and their errors."""
from __future__ import annotations

import pytest
import torch

from hybrid import LLM, SamplingParams
from hybrid.output_processor import TextDeltas
from hybrid.errors import InvalidRequestError
from hybrid.logits_processing import process_logits

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower

PROMPT = "And the LORD said unto Moses,"
EOS = 0
EOS_TEXT = "<|endoftext|>"


@pytest.fixture(scope="module")
def llm():
    return LLM(None, max_num_seqs=4)


def _one(llm, prompt=PROMPT, **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 24)
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


@pytest.fixture(scope="module")
def plain(llm):
    """The unconstrained greedy continuation, with the model's full distribution at every step."""
    out = _one(llm, logprobs=llm.engine.vocab_size)
    return out.outputs[0]


# ---------------------------------------------------------------------------------- allowed_token_ids
def test_allowed_token_ids_greedy_takes_the_best_allowed_token(llm, plain):
    allowed = sorted(set(plain.token_ids[::3]) | {12, 269, 2000})
    assert set(plain.token_ids) - set(allowed)  # the plain run leaves the set: the mask must act
    c = _one(llm, allowed_token_ids=allowed, logprobs=llm.engine.vocab_size).outputs[0]
    assert set(c.token_ids) <= set(allowed)
    # every step's token is the allowed one with the largest logprob of the model's own distribution
    for tok, lps in zip(c.token_ids, c.logprobs):
        assert tok == max(allowed, key=lambda t: lps[t])
    # the first step has the plain run's distribution: its best allowed token
    assert c.token_ids[0] == max(allowed, key=lambda t: plain.logprobs[0][t])


def test_allowed_token_ids_sampled_and_forked_rows(llm):
    allowed = [12, 259, 303, 341, 392, 712]
    out = _one(llm, n=3, temperature=1.0, seed=7, allowed_token_ids=allowed)
    for c in out.outputs:  # branch 0 samples in the batch, the others at the fork (the host path)
        assert len(c.token_ids) == 24 and set(c.token_ids) <= set(allowed)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


# ---------------------------------------------------------------------------------- bad_words
def test_bad_words_one_token(llm, plain):
    tok = llm.tokenizer
    assert "LORD" in plain.text
    lord = tok.encode(" LORD", add_special_tokens=False)
    assert len(lord) == 1 and lord[0] in plain.token_ids
    c = _one(llm, bad_words=["LORD"]).outputs[0]
    assert "LORD" not in c.text and lord[0] not in c.token_ids
    at = plain.token_ids.index(lord[0])
    assert c.token_ids[:at] == plain.token_ids[:at] and c.token_ids[at] != lord[0]


def test_bad_words_several_tokens_mask_the_last_after_the_rest(llm, plain):
    tok = llm.tokenizer
    word = tok.encode(" thy God", add_special_tokens=False)
    assert len(word) == 2 and "thy God" in plain.text
    at = next(i for i in range(len(plain.token_ids)) if plain.token_ids[i:i + 2] == word) + 1
    c = _one(llm, bad_words=["thy God"], logprobs=llm.engine.vocab_size).outputs[0]
    assert "thy God" not in c.text
    assert all(c.token_ids[i:i + 2] != word for i in range(len(c.token_ids)))
    # the same until "God" would follow "thy"; there the best other token
    assert c.token_ids[:at] == plain.token_ids[:at]
    lps = c.logprobs[at]
    assert c.token_ids[at] == max((t for t in lps if t != word[1]), key=lambda t: lps[t])
    # " God" is masked only right after " thy" (of the output: the prompt's tokens do not count, as in vLLM)
    free = _one(llm, prompt=PROMPT + " thy", bad_words=["thy God"], max_tokens=12, ignore_eos=True,
                allowed_token_ids=word).outputs[0].token_ids
    assert free[0] == word[1] and all(free[i:i + 2] != word for i in range(len(free)))


def test_bad_words_under_async_scheduling_and_speculation(llm):
    """The newest output token is still on the device when the next step's mask is made (async), and
    verify rows are processed position by position on the host (speculation): the same tokens."""
    prompts = [PROMPT, "And God said,", "Then David went up to"]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, bad_words=["thy God", "the land"]),
              SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, bad_words=["the LORD"],
                             allowed_token_ids=list(range(2, 1500))),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, bad_words=["of the", "unto"])]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    async_llm = LLM(None, max_num_seqs=4, async_scheduling=True)
    assert [o.outputs[0].token_ids for o in async_llm.generate(prompts, params, use_tqdm=False)] == ref
    assert async_llm.engine.stats["overlapped_steps"] > 0
    spec = LLM(None, max_num_seqs=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == ref
    assert spec.engine.stats["spec_verify_rows"] > 0


def test_process_logits_bad_words_with_a_pending_token():
    """The bad-word prefix ends with the token still on the device: decided there, without a sync."""
    V = 20
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(bad_words=["x"])  # (the words themselves are not read here: their token ids are)
    words = [[4], [7, 8, 9], [5, 6]]
    histories = [([1], [3, 7]), ([1], [2, 7]), ([1], [7])]
    pending = ([0, 1, 2], torch.tensor([8, 8, 5]))  # rows 0, 1: ... 7, 8 -> mask 9; row 2: 5 -> mask 6
    got = process_logits(logits, [0, 1, 2], [p] * 3, [3, 3, 2], histories, [[], [], []], pending, [words] * 3)
    masked = {r: {t for t in range(V) if got[r, t] == float("-inf")} for r in range(3)}
    assert masked == {0: {4, 9}, 1: {4, 9}, 2: {4, 6}}
    # the same histories with every token on the host
    host = [(h[0], h[1] + [int(pending[1][j])]) for j, h in enumerate(histories)]
    again = process_logits(logits, [0, 1, 2], [p] * 3, [3, 3, 2], host, [[], [], []], None, [words] * 3)
    assert torch.equal(got, again)


# ---------------------------------------------------------------------------------- special tokens and stops
def test_skip_special_tokens(llm):
    forced = dict(ignore_eos=True, logit_bias={EOS: 100.0}, max_tokens=3)
    assert _one(llm, **forced).outputs[0].text == ""
    kept = _one(llm, skip_special_tokens=False, **forced).outputs[0]
    assert kept.token_ids == [EOS] * 3 and kept.text == EOS_TEXT * 3
    # stop strings are matched on the text as returned: the special token's text is in it
    stopped = _one(llm, skip_special_tokens=False, stop=["|><|"], **forced).outputs[0]
    assert stopped.finish_reason == "stop" and stopped.text == "<|endoftext"
    # EOS ending the output: its text only with include_stop_str_in_output (as vLLM)
    eos_end = dict(logit_bias={EOS: 100.0}, max_tokens=3)
    assert _one(llm, skip_special_tokens=False, **eos_end).outputs[0].text == ""
    both = _one(llm, skip_special_tokens=False, include_stop_str_in_output=True, **eos_end).outputs[0]
    assert both.finish_reason == "stop" and both.text == EOS_TEXT
    # accepted, no effect of its own with the `tokenizers` library
    assert _one(llm, spaces_between_special_tokens=False, skip_special_tokens=False, **forced).outputs[0].text \
        == EOS_TEXT * 3


def test_include_stop_str_in_output(llm, plain):
    stop = "thy God"
    cut = plain.text[:plain.text.find(stop)]
    without = _one(llm, stop=[stop]).outputs[0]
    with_stop = _one(llm, stop=[stop], include_stop_str_in_output=True).outputs[0]
    assert without.text == cut and with_stop.text == cut + stop
    assert with_stop.finish_reason == "stop" and with_stop.stop_reason == stop


def test_min_tokens_holds_back_stop_strings(llm, plain):
    """As vLLM: no stop string ends an output within its first min_tokens tokens; one whose text lies wholly in
    those tokens' text is not looked for later; one that starts in it and ends after it stops the output."""
    tok = llm.tokenizer
    ids = plain.token_ids
    text_of = [tok.decode(ids[:n]) for n in range(len(ids) + 1)]
    stop = text_of[3][-2:]  # (ends in the third token's text)
    assert text_of[2].find(stop) == -1
    early = _one(llm, stop=[stop]).outputs[0]
    assert early.text == text_of[3][:-2] and early.stop_reason == stop
    later = _one(llm, stop=[stop], min_tokens=3).outputs[0]
    rest = plain.text.find(stop, len(text_of[3]) - len(stop) + 1)
    assert later.text == (plain.text if rest == -1 else plain.text[:rest])
    assert len(later.token_ids) > 3
    # across the boundary: from the third token's text into the fourth's
    span = text_of[4][len(text_of[3]) - 1:len(text_of[3]) + 1]
    assert text_of[3].find(span) == -1
    across = _one(llm, stop=[span], min_tokens=3).outputs[0]
    assert across.text == text_of[4][:len(text_of[3]) - 1] and across.stop_reason == span


def test_text_deltas_with_included_stops():
    texts = ["I will", "I will bring th", "I will bring the LO", "I will bring the LORD"]
    for include in (False, True):
        d = TextDeltas(["the LORD"], include_stops=include)
        sent = [d.update(t, False) for t in texts[:-1]] + [d.update(texts[-1], True)]
        assert "".join(sent) == texts[-1]
        # without it the possible beginnings of the stop string wait ("th", "the LO"); with it nothing waits
        assert sent == (["I will", " bring th", "e LO", "RD"] if include else ["I will", " bring ", "", "the LORD"])


# ---------------------------------------------------------------------------------- truncate_prompt_tokens
def test_truncate_prompt_tokens(llm):
    ids = llm.tokenizer.encode(PROMPT)
    out = _one(llm, truncate_prompt_tokens=3)
    assert out.prompt_token_ids == ids[-3:] and out.prompt == PROMPT
    same = llm.generate([ids[-3:]], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    assert _one(llm, truncate_prompt_tokens=100).prompt_token_ids == ids  # shorter prompts are kept whole


def test_truncate_prompt_tokens_to_the_context():
    short = LLM(None, max_num_seqs=2, max_model_len=16)
    ids = short.tokenizer.encode(PROMPT * 3)
    assert len(ids) > 16
    with pytest.raises(InvalidRequestError, match="longer than the context"):
        short.generate([ids], SamplingParams(max_tokens=4), use_tqdm=False)
    out = short.generate([ids], SamplingParams(max_tokens=4, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-15:] and len(out.outputs[0].token_ids) == 1  # room for one token


# ---------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs, name", [
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [1, 2.0]}, "allowed_token_ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"), ({"bad_words": "LORD"}, "bad_words"),
    ({"bad_words": ["ok", " "]}, "bad_words"), ({"bad_words": [3]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
])
def test_bad_values_are_named(kwargs, name):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**kwargs)


def test_vllm_spellings(llm):
    """vLLM's spellings: top_k=0 is off (as -1), max_tokens=None runs to the end of the context, clone()
    is a deep copy; n must be an int, not a bool."""
    assert SamplingParams(top_k=0).top_k == -1
    ids = [5, 6, 7]
    short = LLM(None, max_num_seqs=2, max_model_len=40)
    whole = short.generate([ids], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True),
                           use_tqdm=False)[0]
    assert whole.outputs[0].finish_reason == "length"
    assert len(ids) + len(whole.outputs[0].token_ids) == 40
    sp = SamplingParams(stop=["a"], logit_bias={3: 1.0})
    twin = sp.clone()
    assert twin == sp and twin is not sp and twin.stop is not sp.stop and twin.logit_bias is not sp.logit_bias
    with pytest.raises(InvalidRequestError, match="n=True"):
        SamplingParams(n=True)
    # detokenize=False: the same tokens, no text; stop strings need the text
    kw = dict(max_tokens=6, temperature=0, ignore_eos=True)
    [text_out, ids_out] = [llm.generate([ids], SamplingParams(**kw, detokenize=d), use_tqdm=False)[0].outputs[0]
                           for d in (True, False)]
    assert ids_out.token_ids == text_out.token_ids and text_out.text and ids_out.text == ""
    with pytest.raises(InvalidRequestError, match="need detokenize=True"):
        SamplingParams(stop=["a"], detokenize=False)


def test_vocabulary_checks(llm):
    with pytest.raises(InvalidRequestError, match="allowed_token_ids.*2048 is outside the vocabulary"):
        _one(llm, allowed_token_ids=[5, 2048])
    nvocab = LLM(None, max_num_seqs=2)
    nvocab.engine.tokenizer = None  # as a checkpoint without tokenizer.json
    with pytest.raises(InvalidRequestError, match="bad_words.*no tokenizer"):
        nvocab.generate([[5, 6]], SamplingParams(bad_words=["LORD"]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="stop.*tokenizer.*use stop_token_ids"):  # (no text to match)
        nvocab.generate([[5, 6]], SamplingParams(stop=["x"]), use_tqdm=False)
    assert nvocab.generate([[5, 6]], SamplingParams(max_tokens=2, stop_token_ids=[7]), use_tqdm=False)[0].finished


# ---------------------------------------------------------------------------------- the OpenAI server
@pytest.fixture(scope="module")
def served():
    """A server with an LLM of its own: the references are computed on `llm` while the server's
    engine thread may still be finishing a step, so the two never share an engine."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    from server_utils import ServerThread

    from hybrid.server import build_app

    with ServerThread(build_app(LLM(None, max_num_seqs=4), max_queued_requests=16)) as srv:
        import httpx

        srv.model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
        yield srv


def _stream_text(srv, path: str, body: dict) -> tuple[str, str]:
    """(the concatenated text deltas, the finish reason) of a streamed request."""
    import json

    import httpx

    text, reason = "", None
    with httpx.stream("POST", srv.base_url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[len("data: "):])["choices"]:
                text += ch["text"] if "text" in ch else (ch["delta"].get("content") or "")
                reason = ch["finish_reason"] or reason
    return text, reason


def test_server_fields_streamed_and_not(served, llm, plain):
    import httpx

    base = {"model": served.model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    cases = [({"stop": ["thy God"]}, plain.text[:plain.text.find("thy God")]),
             ({"stop": ["thy God"], "include_stop_str_in_output": True}, plain.text[:plain.text.find("thy God") + 7]),
             ({"bad_words": ["LORD"]}, _one(llm, bad_words=["LORD"]).outputs[0].text),
             ({"allowed_token_ids": [12, 259, 303, 392, 712]},
              _one(llm, allowed_token_ids=[12, 259, 303, 392, 712]).outputs[0].text),
             ({"ignore_eos": True, "logit_bias": {str(EOS): 100}, "max_tokens": 2, "skip_special_tokens": False,
               "spaces_between_special_tokens": False}, EOS_TEXT * 2),
             ({"truncate_prompt_tokens": 3}, _one(llm, truncate_prompt_tokens=3).outputs[0].text)]
    for extra, want in cases:
        body = {**base, **extra}
        r = httpx.post(served.base_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want, extra
        assert _stream_text(served, "/v1/completions", body)[0] == want, extra
    # chat: the stop string kept, streamed as not
    chat = {"model": served.model, "messages": [{"role": "user", "content": "Who was Moses?"}], "max_tokens": 24,
            "temperature": 0, "ignore_eos": True}
    full = httpx.post(served.base_url + "/v1/chat/completions", json=chat, timeout=60).json()
    content = full["choices"][0]["message"]["content"]
    stop = content[5:8]
    body = {**chat, "stop": [stop], "include_stop_str_in_output": True}
    got = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert got["choices"][0]["message"]["content"] == content[:content.find(stop) + len(stop)]
    assert _stream_text(served, "/v1/chat/completions", body) == (content[:content.find(stop) + len(stop)], "stop")


@pytest.mark.parametrize("extra, param", [
    ({"allowed_token_ids": [1, 99999]}, "allowed_token_ids"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": ["1"]}, "allowed_token_ids"), ({"bad_words": "LORD"}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"), ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ({"spaces_between_special_tokens": 1}, "spaces_between_special_tokens"),
    ({"include_stop_str_in_output": "true"}, "include_stop_str_in_output"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 3, "echo": True}, "truncate_prompt_tokens"),
])
def test_server_bad_values_get_400(served, extra, param):
    import httpx

    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        if "echo" in extra and path != "/v1/completions":
            continue
        for stream in (False,) if "echo" in extra else (False, True):  # (echo with stream is refused for itself)
            r = httpx.post(served.base_url + path, json={"model": served.model, "max_tokens": 4, **body, **extra,
                                                         "stream": stream}, timeout=60)
            assert r.status_code == 400, (path, extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param and param in err["message"], (path, extra, err)


def test_server_truncates_before_the_context_check(served, llm):
    """A prompt longer than the context is truncated first (as vLLM does), so it is served, and the
    usage counts the tokens that ran; max_tokens is fitted to the truncated prompt."""
    import httpx

    ids = llm.tokenizer.encode(PROMPT)
    reps = llm.engine.max_model_len // len(ids) + 2
    long_prompt = PROMPT * reps
    assert len(llm.tokenizer.encode(long_prompt)) > llm.engine.max_model_len
    body = {"model": served.model, "prompt": long_prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(served.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(served.base_url + "/v1/completions", json={**body, "truncate_prompt_tokens": 5}, timeout=60)
    assert r.status_code == 200, r.text
    tail = llm.tokenizer.encode(long_prompt)[-5:]
    assert r.json()["usage"]["prompt_tokens"] == 5
    assert r.json()["choices"][0]["text"] == _one(llm, prompt=tail, max_tokens=4).outputs[0].text
    chat = {"model": served.model, "messages": [{"role": "user", "content": long_prompt}], "temperature": 0,
            "truncate_prompt_tokens": 7}
    r = httpx.post(served.base_url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 7 and usage["completion_tokens"] >= 1


def test_allowed_tokens_that_min_tokens_all_masks_are_refused(llm):
    """Only end tokens allowed, and min_tokens forbids ending: nothing could be sampled (a clear
    error up front, not a row of -inf logits failing the request later)."""
    with pytest.raises(InvalidRequestError, match="allowed_token_ids.*min_tokens"):
        _one(llm, allowed_token_ids=[EOS], min_tokens=2)
    ids = _one(llm, allowed_token_ids=[EOS, 5], min_tokens=2, max_tokens=3).outputs[0].token_ids
    assert ids[:2] == [5, 5] and set(ids) <= {EOS, 5}  # one non-end token allowed: it fills min_tokens
    out = _one(llm, allowed_token_ids=[EOS], min_tokens=2, ignore_eos=True, max_tokens=2)  # EOS is not an end then
    assert out.outputs[0].token_ids == [EOS, EOS]
