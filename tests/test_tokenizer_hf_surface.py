"""hybrid.tokenizer.Tokenizer (what LLM.get_tokenizer() returns) answers the Hugging Face
PreTrainedTokenizer calls vLLM users write (eos_token_id, len(), tokenizer(text),
convert_*, batch_decode, apply_chat_template returning ids by default ...) as transformers does,
checked against transformers' own tokenizer loaded from the same files."""
from __future__ import annotations

import json

import pytest

from hybrid.model_source import DEFAULT_MODEL_DIR
from hybrid.tokenizer import Tokenizer
from tiny_checkpoints import write_char_bpe_tokenizer

# renders tools and documents when given, and a template variable of the caller's
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% if documents %}<docs>{% for d in documents %}{{ d.title }};{% endfor %}\n{% endif %}"
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CONV = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "ab zzz"},
        {"role": "user", "content": "more"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
DOCS = [{"title": "Genesis", "text": "In the beginning"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The char BPE tokenizer plus an added special token (<think>), an added normal token (zzz),
    a post-processor that adds <s> (so add_special_tokens matters) and a chat template."""
    from tokenizers import Tokenizer as RawTokenizer, processors

    p = tmp_path_factory.mktemp("tok")
    write_char_bpe_tokenizer(p, 192)
    raw = RawTokenizer.from_file(str(p / "tokenizer.json"))
    raw.add_special_tokens(["<think>"])
    raw.add_tokens(["zzz"])
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    raw.save(str(p / "tokenizer.json"))
    cfg = json.loads((p / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=True, additional_special_tokens=["<think>"], chat_template=TEMPLATE)
    (p / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(p)


@pytest.fixture(scope="module", params=["tiny", "default"])
def pair(request, tiny_dir):
    """(ours, transformers') for the same tokenizer files."""
    from transformers import AutoTokenizer

    path = tiny_dir if request.param == "tiny" else DEFAULT_MODEL_DIR
    return Tokenizer(path), AutoTokenizer.from_pretrained(path)


def test_special_tokens_and_vocab_as_transformers(pair):
    ours, hf = pair
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id",
                 "eos_token", "bos_token", "pad_token", "unk_token", "all_special_tokens", "all_special_ids"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert len(ours) == len(hf)
    assert ours.get_vocab() == hf.get_vocab()
    assert ours.eos_token_id in ours.eos_token_ids


def test_tiny_special_tokens_are_the_configured_ones(tiny_dir):
    tok = Tokenizer(tiny_dir)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.eos_token == "</s>" and tok.pad_token == "<pad>"
    assert len(tok) == 194  # 192 + <think> + zzz
    assert tok.all_special_ids == [1, 2, 3, 0, 192]


def test_eos_token_id_without_a_configured_eos_token(tmp_path):
    write_char_bpe_tokenizer(tmp_path, 192)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["eos_token"], cfg["pad_token"]
    cfg_path.write_text(json.dumps(cfg))
    # one EOS id from config.json / generation_config.json is the eos token
    tok = Tokenizer(str(tmp_path), eos_token_ids=(2,))
    assert (tok.eos_token_id, tok.eos_token) == (2, "</s>")
    assert tok.pad_token_id is None and tok.pad_token is None
    # several: none is "the" eos token
    assert Tokenizer(str(tmp_path), eos_token_ids=(2, 5)).eos_token_id is None


@pytest.mark.parametrize("text", ["ab zzz", "hello world, said <think> the LORD", ""])
def test_call_as_transformers(pair, text):
    ours, hf = pair
    for add in (True, False):
        enc = ours(text, add_special_tokens=add)
        assert dict(enc) == dict(hf(text, add_special_tokens=add))
        assert enc.input_ids == enc["input_ids"] and enc.attention_mask == [1] * len(enc.input_ids)
    assert ours(text) == dict(hf(text))  # add_special_tokens defaults to True
    batch = [text, "the end", "x"]
    assert dict(ours(batch)) == dict(hf(batch))
    assert dict(ours(batch, add_special_tokens=False)) == dict(hf(batch, add_special_tokens=False))


def test_add_special_tokens_is_honoured(tiny_dir):
    tok = Tokenizer(tiny_dir)
    assert tok("ab")["input_ids"] == [1, 69, 70]
    assert tok("ab", add_special_tokens=False)["input_ids"] == [69, 70]
    assert tok(["ab", "b"]).input_ids == [[1, 69, 70], [1, 70]]


def test_convert_ids_and_tokens_as_transformers(pair):
    ours, hf = pair
    ids = hf("ab zzz <think> the end")["input_ids"] + [0, 1, 2, 3]
    tokens = hf.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids) == tokens
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == hf.convert_ids_to_tokens(
        ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids[1]) == hf.convert_ids_to_tokens(ids[1]) == tokens[1]
    assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens) == ids
    assert ours.convert_tokens_to_ids(tokens[2]) == ids[2]
    # an unknown token: the unk token's id (3 in the tiny tokenizer), or None without one
    assert ours.convert_tokens_to_ids("no-such-token") == hf.convert_tokens_to_ids("no-such-token")
    assert ours.convert_tokens_to_ids(["no-such-token"]) == hf.convert_tokens_to_ids(["no-such-token"])


def test_unknown_token_is_unk(tiny_dir):
    tok = Tokenizer(tiny_dir)
    assert tok.convert_tokens_to_ids("no-such-token") == 3
    assert tok.convert_ids_to_tokens([1, 69, 192, 193], skip_special_tokens=True) == ["a", "zzz"]


def test_batch_decode_as_transformers(pair):
    ours, hf = pair
    seqs = [hf("ab zzz <think> x")["input_ids"] + [2], [0, 1, 70], []]
    assert ours.batch_decode(seqs) == hf.batch_decode(seqs)  # keeps special tokens by default, as HF
    assert ours.batch_decode(seqs, skip_special_tokens=True) == hf.batch_decode(seqs, skip_special_tokens=True)
    assert ours.decode(seqs[0][1]) == hf.decode(seqs[0][1])  # one id


def test_batch_decode_keeps_special_tokens_by_default(tiny_dir):
    tok = Tokenizer(tiny_dir)
    assert tok.batch_decode([[1, 69, 2]]) == ["<s>a</s>"]
    assert tok.batch_decode([[1, 69, 2]], skip_special_tokens=True) == ["a"]


def test_apply_chat_template_tokenizes_by_default(tiny_dir):
    from transformers import AutoTokenizer

    ours, hf = Tokenizer(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    ids = ours.apply_chat_template(CONV, add_generation_prompt=True)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids == hf.apply_chat_template(CONV, add_generation_prompt=True, return_dict=False)
    text = ours.apply_chat_template(CONV, add_generation_prompt=True, tokenize=False)
    assert text == hf.apply_chat_template(CONV, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<s><user>hi there\n") and text.endswith("<assistant>")
    assert ids == ours.encode(text, add_special_tokens=False)  # the template's <s>, no second one
    assert ids[0] == 1 and ids[1] != 1
    for gen in (True, False):
        enc = ours.apply_chat_template(CONV, add_generation_prompt=gen, return_dict=True)
        assert dict(enc) == dict(hf.apply_chat_template(CONV, add_generation_prompt=gen, return_dict=True))
        assert enc.attention_mask == [1] * len(enc.input_ids)


def test_apply_chat_template_options_as_transformers(tiny_dir):
    from transformers import AutoTokenizer

    ours, hf = Tokenizer(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    for kw in [dict(tools=TOOLS), dict(documents=DOCS), dict(tools=TOOLS, documents=DOCS, greeting="Hail"),
               dict(tools=None, documents=None), dict(continue_final_message=True, add_generation_prompt=False),
               dict(chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}")]:
        for tokenize in (False, True):
            want = hf.apply_chat_template(CONV, tokenize=tokenize, return_dict=False,
                                          **{"add_generation_prompt": True, **kw})
            assert ours.apply_chat_template(CONV, tokenize=tokenize, **kw) == want, kw
    text = ours.apply_chat_template(CONV, tokenize=False, tools=TOOLS, documents=DOCS, greeting="Hail")
    assert text.startswith("<s><tools>get_weather;<docs>Genesis;Hail\n<user>")  # trim_blocks eats a newline


def test_apply_chat_template_batch_as_transformers(tiny_dir):
    from transformers import AutoTokenizer

    ours, hf = Tokenizer(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    convs = [CONV, CONV[:1]]
    for tokenize in (False, True):
        want = hf.apply_chat_template(convs, add_generation_prompt=True, tokenize=tokenize, return_dict=False)
        got = ours.apply_chat_template(convs, tokenize=tokenize)
        assert got == want and len(got) == 2
    enc = ours.apply_chat_template(convs, return_dict=True)
    assert dict(enc) == dict(hf.apply_chat_template(convs, add_generation_prompt=True, return_dict=True))


def test_apply_chat_template_options_are_keywords(tiny_dir):
    """HF's second positional parameter is `tools`: a positional option must not be taken for another."""
    with pytest.raises(TypeError):
        Tokenizer(tiny_dir).apply_chat_template(CONV, TOOLS)


def test_default_model_chat_ids_as_transformers():
    from transformers import AutoTokenizer

    ours, hf = Tokenizer(DEFAULT_MODEL_DIR), AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    msgs = [{"role": "user", "content": "Who made the earth?"}]
    ids = ours.apply_chat_template(msgs, add_generation_prompt=True)
    assert ids == hf.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert ours.decode(ids) == "User: Who made the earth?\nAssistant:\n"


@pytest.mark.parametrize("text", ["ab zzz", "hello world, said <think> the LORD", "In the beginning créé", ""])
def test_tokenize_as_transformers(pair, text):
    ours, hf = pair
    assert ours.tokenize(text) == hf.tokenize(text)  # no special tokens by default, as HF
    assert ours.tokenize(text, add_special_tokens=True) == hf.tokenize(text, add_special_tokens=True)
    assert ours.tokenize(text, "the end") == hf.tokenize(text, "the end")
    assert ours.convert_tokens_to_ids(ours.tokenize(text)) == ours.encode(text, add_special_tokens=False)


def test_tokenize_adds_special_tokens_when_asked(tiny_dir):
    tok = Tokenizer(tiny_dir)
    assert tok.tokenize("ab zzz") == ["a", "b", " ", "zzz"]
    assert tok.tokenize("ab", add_special_tokens=True) == ["<s>", "a", "b"]


def test_attributes_as_transformers(pair):
    ours, hf = pair
    for name in ("name_or_path", "model_max_length", "padding_side", "truncation_side"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.max_token_id == len(ours) - 1 == max(hf.get_vocab().values())


def test_attributes_from_tokenizer_config(tmp_path):
    from transformers import AutoTokenizer

    write_char_bpe_tokenizer(tmp_path, 192)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["model_max_length"]
    cfg.update(padding_side="left", truncation_side="left")
    cfg_path.write_text(json.dumps(cfg))
    ours, hf = Tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.model_max_length == hf.model_max_length == int(1e30)  # HF's VERY_LARGE_INTEGER
    assert (ours.padding_side, ours.truncation_side) == (hf.padding_side, hf.truncation_side) == ("left", "left")
    assert ours.name_or_path == str(tmp_path) and ours.max_token_id == 191
    cfg_path.write_text(json.dumps({**cfg, "padding_side": "middle"}))
    with pytest.raises(ValueError, match="padding_side"):
        Tokenizer(str(tmp_path))


def _same_tensor(a, b, kind: str) -> bool:
    import numpy as np
    import torch

    if kind == "pt":
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


@pytest.mark.parametrize("kind", ["pt", "np"])
def test_return_tensors_as_transformers(pair, kind):
    ours, hf = pair
    for text, shape in (("hello world", None), ("", (1, 0))):
        for add in (True, False):
            enc, want = ours(text, add_special_tokens=add, return_tensors=kind), hf(
                text, add_special_tokens=add, return_tensors=kind)
            assert set(enc) == {"input_ids", "attention_mask"}
            for key in enc:
                assert _same_tensor(enc[key], want[key], kind), (text, key)
            assert enc.input_ids.shape[0] == 1 and (shape is None or add or tuple(enc.input_ids.shape) == shape)
            assert _same_tensor(ours.encode(text, add, return_tensors=kind),
                                hf.encode(text, add_special_tokens=add, return_tensors=kind), kind)
    batch = ["a", "b", "c"]  # one length in either tokenizer
    enc, want = ours(batch, return_tensors=kind), hf(batch, return_tensors=kind)
    assert tuple(enc.input_ids.shape) == (3, len(ours.encode("a")))
    assert all(_same_tensor(enc[k], want[k], kind) for k in ("input_ids", "attention_mask"))
    # unequal lengths: ValueError, as transformers' "pt" without padding (its "np" makes a ragged object array)
    for tok in (ours, hf) if kind == "pt" else (ours,):
        with pytest.raises(ValueError):
            tok(["a", "hello world"], return_tensors=kind)
    assert ours(batch) == hf(batch)  # lists without return_tensors, as before
    assert ours.encode("hello") == hf.encode("hello")


def test_return_tensors_refuses_other_types(tiny_dir):
    tok = Tokenizer(tiny_dir)
    for kind in ("tf", "jax", "bogus"):
        for call in (lambda: tok("ab", return_tensors=kind), lambda: tok.encode("ab", return_tensors=kind),
                     lambda: tok.apply_chat_template(CONV, return_tensors=kind),
                     lambda: tok.apply_chat_template(CONV, return_dict=True, return_tensors=kind)):
            with pytest.raises(ValueError, match="return_tensors"):
                call()


def test_return_tensors_accepts_transformers_tensor_type(tiny_dir):
    import torch
    from transformers import TensorType

    tok = Tokenizer(tiny_dir)
    assert torch.equal(tok.encode("ab", return_tensors=TensorType.PYTORCH), torch.tensor([[1, 69, 70]]))


@pytest.mark.parametrize("kind", ["pt", "np"])
def test_apply_chat_template_return_tensors_as_transformers(tiny_dir, kind):
    from transformers import AutoTokenizer

    ours, hf = Tokenizer(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    ids = ours.apply_chat_template(CONV, return_tensors=kind)
    want = hf.apply_chat_template(CONV, add_generation_prompt=True, return_dict=False, return_tensors=kind)
    assert _same_tensor(ids, want, kind) and ids.shape == (1, len(ours.apply_chat_template(CONV)))
    enc = ours.apply_chat_template(CONV, return_dict=True, return_tensors=kind)
    want = hf.apply_chat_template(CONV, add_generation_prompt=True, return_dict=True, return_tensors=kind)
    assert set(enc) == {"input_ids", "attention_mask"}
    assert all(_same_tensor(enc[k], want[k], kind) for k in enc)
    # a batch of conversations of one length: [B, n]; of different lengths: ValueError, as transformers' "pt"
    convs = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    got = ours.apply_chat_template(convs, return_tensors=kind)
    want = hf.apply_chat_template(convs, add_generation_prompt=True, return_dict=False, return_tensors=kind)
    assert _same_tensor(got, want, kind) and got.shape[0] == 2
    for call in (lambda: ours.apply_chat_template([CONV, CONV[:1]], return_tensors=kind),
                 lambda: hf.apply_chat_template([CONV, CONV[:1]], return_dict=False, return_tensors="pt")):
        with pytest.raises(ValueError):
            call()
    # tokenize=False: the text, return_tensors aside (and never a template variable)
    assert ours.apply_chat_template(CONV, tokenize=False, return_tensors=kind) == ours.apply_chat_template(
        CONV, tokenize=False)
    probe = "{% if return_tensors is defined %}leaked{% endif %}ok"
    assert ours.apply_chat_template(CONV, tokenize=False, chat_template=probe, return_tensors=kind) == "ok"


def test_default_model_chat_tensor_as_transformers():
    import torch
    from transformers import AutoTokenizer

    ours, hf = Tokenizer(DEFAULT_MODEL_DIR), AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    msgs = [{"role": "user", "content": "Who made the earth?"}]
    ids = ours.apply_chat_template(msgs, return_tensors="pt")
    assert torch.equal(ids, hf.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False,
                                                   return_tensors="pt"))
    assert ids.shape == (1, len(ours.apply_chat_template(msgs))) and ids.dtype == torch.long
