"""LLM.chat / LLM.get_tokenizer / Tokenizer.apply_chat_template (issue 14 item 4): conversations
rendered with the checkpoint's chat template as transformers renders them, batched through
generate; the bundled model's template makes replies start on a new line, not with a space."""
from __future__ import annotations

import json
import shutil

import pytest

from hybrid import LLM, InvalidRequestError, SamplingParams
from hybrid.chat_template import normalize_messages, render_chat
from hybrid.model_source import DEFAULT_MODEL_DIR

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)

CONVERSATIONS = [
    [{"role": "user", "content": "Who made the earth?"}],
    [{"role": "user", "content": "Tell me about Noah."}],
    [{"role": "system", "content": "Answer in the words of the prophets."},
     {"role": "user", "content": "Who was Moses?"},
     {"role": "assistant", "content": "He led Israel out of Egypt."},
     {"role": "user", "content": "And then?"}],
    [{"role": "user", "content": "Blessed are"}],
]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, device="cpu")


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def test_renders_as_transformers(llm, hf_tokenizer):
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer
    for conv in CONVERSATIONS:
        for gen in (True, False):
            want = hf_tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False) == want
            ids = tok.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True)
            assert ids == hf_tokenizer.encode(want, add_special_tokens=False)


def test_bundled_template_ends_the_generation_prompt_with_a_newline(llm):
    text = llm.get_tokenizer().apply_chat_template(CONVERSATIONS[0], tokenize=False)
    assert text == "User: Who made the earth?\nAssistant:\n"
    # a past reply is laid out the same way, closed by EOS
    text = llm.get_tokenizer().apply_chat_template(CONVERSATIONS[2], add_generation_prompt=False, tokenize=False)
    assert "\nAssistant:\nHe led Israel out of Egypt.<|endoftext|>\n" in text


def test_replies_do_not_start_with_a_space(llm):
    outs = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    for out in outs:
        text = out.outputs[0].text
        assert text and not text[0].isspace(), repr(text)
    # at temperature 1 the tokens that start with a space hold ~2% of the first token's mass (a tail
    # of rare tokens): top_p 0.9 leaves them out, so the check holds for any seeds, not just lucky ones
    sampled = [SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=s) for s in range(6)]
    for out in llm.chat([CONVERSATIONS[0]] * 6, sampled, use_tqdm=False):
        assert not out.outputs[0].text.startswith(" "), repr(out.outputs[0].text)


def test_chat_is_generate_on_the_rendered_prompt(llm):
    tok = llm.get_tokenizer()
    batch = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert len(batch) == len(CONVERSATIONS)
    for conv, out in zip(CONVERSATIONS, batch):
        text = tok.apply_chat_template(conv, tokenize=False)
        assert out.prompt == text
        assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
        [ref] = llm.generate([out.prompt_token_ids], GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    # one conversation (not a list of them) gives one output, the same as in the batch
    [single] = llm.chat(CONVERSATIONS[1], GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == batch[1].outputs[0].token_ids


def test_per_conversation_params_and_defaults(llm):
    outs = llm.chat(CONVERSATIONS[:2], [SamplingParams(max_tokens=3, temperature=0.0),
                                        SamplingParams(max_tokens=5, temperature=0.0)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    [out] = llm.chat(CONVERSATIONS[0])  # SamplingParams() by default, as generate
    assert len(out.outputs[0].token_ids) == SamplingParams().max_tokens


def test_chat_options(llm):
    [out] = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert out.prompt == "User: Who made the earth?\n"
    template = "{{ greeting }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{{ eos_token }}"
    [out] = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, chat_template=template,
                     chat_template_kwargs={"greeting": "Hail. "})
    assert out.prompt == "Hail. [user] Who made the earth?\n<|endoftext|>"
    # content given as text parts, as the OpenAI API allows
    # content given as parts, as the OpenAI API allows: joined by newlines, as vLLM joins them; vLLM's other text
    # parts (input_text, output_text, refusal, thinking, a plain string) are text too, a part whose text is null
    # is skipped
    parts = [{"role": "user", "content": [{"type": "text", "text": "Who made"}, {"type": "text", "text": "the earth?"}]}]
    assert llm.get_tokenizer().apply_chat_template(parts, tokenize=False) == "User: Who made\nthe earth?\nAssistant:\n"
    kinds = [{"role": "user", "content": ["a", {"type": "input_text", "text": "b"}, {"type": "output_text", "text": "c"},
                                          {"type": "text", "text": None}, {"type": "refusal", "refusal": "d"},
                                          {"type": "thinking", "thinking": "e"}]}]
    assert llm.get_tokenizer().apply_chat_template(kinds, tokenize=False) == "User: a\nb\nc\nd\ne\nAssistant:\n"


@pytest.mark.parametrize("messages", [[], "hello", [{"content": "no role"}], [{"role": 1, "content": "x"}],
                                      [{"role": "user", "content": 5}], [[]], [{"role": "user"}, "x"],
                                      [{"role": "user", "content": [{"type": "image_url"}]}],
                                      [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                                      [{"role": "user", "content": [7]}]])
def test_malformed_conversations(llm, messages):
    with pytest.raises(InvalidRequestError):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_errors_name_the_conversation_and_queue_nothing(llm):
    with pytest.raises(InvalidRequestError, match="conversation 1"):
        llm.chat([CONVERSATIONS[0], [{"role": "user", "content": "x" * 5000}]], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="2 prompts but 1 sampling params"):
        llm.chat(CONVERSATIONS[:2], [GREEDY], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="could not be rendered: no system role"):
        llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False,
                 chat_template="{% if messages[0]['role'] != 'system' %}{{ raise_exception('no system role') }}"
                               "{% endif %}")
    with pytest.raises(InvalidRequestError, match="could not be rendered"):
        llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, chat_template="{% for %}")
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, chat_template="{# nothing #}")
    assert not llm.engine.has_unfinished_requests()


def test_no_chat_template(tmp_path):
    p = tmp_path / "ckpt"
    shutil.copytree(DEFAULT_MODEL_DIR, p)
    cfg = json.loads((p / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (p / "tokenizer_config.json").write_text(json.dumps(cfg))
    llm = LLM(str(p), device="cpu")
    with pytest.raises(InvalidRequestError, match="no chat template"):
        llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)
    [out] = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, chat_template="{{ messages[0]['content'] }}")
    assert out.prompt == "Who made the earth?"


def test_render_helpers():
    msgs = normalize_messages([{"role": "user", "content": None, "name": "x"}])
    assert msgs == [{"role": "user", "content": "", "name": "x"}]
    cfg = {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    out = render_chat("{{ bos_token }}{{ messages | tojson }}{% if add_generation_prompt %}>{% endif %}{{ eos_token }}",
                      [{"role": "user", "content": "é"}], cfg, add_generation_prompt=True)
    assert out == '<s>[{"role": "user", "content": "é"}]></s>'


def test_chat_template_kwargs_cannot_shadow_arguments(llm):
    with pytest.raises(InvalidRequestError, match="add_generation_prompt"):
        llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(InvalidRequestError, match="must be a dict"):
        llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, chat_template_kwargs=["x"])
    # the tokenizer's special tokens too (the same list as the server's): a clear error, not a TypeError
    for name in ("bos_token", "tools"):
        with pytest.raises(InvalidRequestError, match=name):
            llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, chat_template_kwargs={name: "x"})


def test_continue_final_message_cuts_at_the_message_end(llm):
    """continue_final_message: the prompt ends right after the last message's content, found by rendering
    with a marker after it, not by searching for the content (which can also be inside a later token:
    "text" in <|endoftext|>)."""
    for content in ("text", "of", "Moses was"):
        conversation = [{"role": "user", "content": "Who was Moses?"}, {"role": "assistant", "content": content}]
        [out] = llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False,
                         continue_final_message=True)
        assert out.prompt.endswith("Assistant:\n" + content), out.prompt
    # a template that strips the content: the stripped content is the end
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</s>{% endfor %}"
    assert render_chat(template, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " s "}],
                       add_generation_prompt=False, continue_final_message=True) == "<user>hi</s><assistant>s"
