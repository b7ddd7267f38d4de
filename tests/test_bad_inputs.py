"""Bad checkpoints raise CheckpointError naming the problem; bad requests raise
InvalidRequestError naming the field, and never harm the engine or other requests."""
from __future__ import annotations

import json
import os
import re

import pytest

from hf_oracle import describe_divergence, oracle_run, random_prompt, select_prompts
from tiny_checkpoints import copy_checkpoint

MAX_NEW = 12


def _greedy(max_tokens=MAX_NEW, **kw):
    from hybrid import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _edit_tensors(path, fn, filename="model.safetensors"):
    """Rewrite one safetensors file after fn(dict name -> tensor) edits it in place."""
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, filename)
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def _load_error(path, **kw):
    from hybrid import LLM
    from hybrid.errors import CheckpointError

    with pytest.raises(CheckpointError) as ei:
        LLM(str(path), **kw)
    assert isinstance(ei.value, ValueError)
    return str(ei.value)


def _shape_re(shape):
    # "[48, 64]", "(48, 64)", "torch.Size([48, 64])", "48x64" ...
    return r"\b" + r"\s*[,x×]\s*".join(str(s) for s in shape) + r"\b"


# ---------------------------------------------------------------------------------------------
# bad checkpoints
# ---------------------------------------------------------------------------------------------


def test_unknown_model_type(tiny_ckpt, tmp_path):
    p = copy_checkpoint(tiny_ckpt("granite_dense"), tmp_path)
    cfg = json.loads((p / "config.json").read_text())
    cfg["model_type"] = "frobnicator_lm"
    cfg["architectures"] = ["FrobnicatorForCausalLM"]
    (p / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(p)
    assert "frobnicator_lm" in msg


def test_missing_config(tiny_ckpt, tmp_path):
    p = copy_checkpoint(tiny_ckpt("granite_dense"), tmp_path)
    os.remove(p / "config.json")
    assert "config.json" in _load_error(p)


def test_invalid_config_json(tiny_ckpt, tmp_path):
    p = copy_checkpoint(tiny_ckpt("granite_dense"), tmp_path)
    (p / "config.json").write_text('{"model_type": "granitemoehybrid", ')
    assert "config.json" in _load_error(p)


def test_missing_checkpoint_dir(tmp_path):
    assert "does_not_exist" in _load_error(tmp_path / "does_not_exist")


def test_missing_weights_file(tiny_ckpt, tmp_path):
    p = copy_checkpoint(tiny_ckpt("granite_dense"), tmp_path)
    os.remove(p / "model.safetensors")
    assert "safetensors" in _load_error(p)


def test_missing_shard_file(tiny_ckpt, tmp_path):
    p = copy_checkpoint(tiny_ckpt("nemotron_h_sharded"), tmp_path)
    index = json.loads((p / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    os.remove(p / shard)
    assert shard in _load_error(p)


@pytest.mark.parametrize("name,tensor", [
    ("granite_dense", "model.layers.0.mamba.dt_bias"),
    ("granite_dense", "model.layers.1.self_attn.k_proj.weight"),
    ("granite_moe", "model.layers.2.block_sparse_moe.router.layer.weight"),
    ("nemotron_h", "backbone.layers.4.mixer.experts.2.up_proj.weight"),
    ("nemotron_h", "backbone.layers.4.mixer.gate.e_score_correction_bias"),
    ("bamba", "lm_head.weight"),
])
def test_missing_tensor(name, tensor, tiny_ckpt, tmp_path):
    p = copy_checkpoint(tiny_ckpt(name), tmp_path)
    _edit_tensors(p, lambda t: t.pop(tensor))
    msg = _load_error(p)
    assert tensor in msg and "missing" in msg.lower(), msg


def test_tensor_missing_from_its_shard(tiny_ckpt, tmp_path):
    """The index lists the tensor but its shard does not hold it."""
    p = copy_checkpoint(tiny_ckpt("nemotron_h_sharded"), tmp_path)
    index = json.loads((p / "model.safetensors.index.json").read_text())
    tensor = "backbone.layers.2.mixer.A_log"
    _edit_tensors(p, lambda t: t.pop(tensor), filename=index["weight_map"][tensor])
    assert tensor in _load_error(p)


@pytest.mark.parametrize("name,tensor", [
    ("granite_dense", "model.layers.0.mamba.extra_scale"),
    ("nemotron_h", "backbone.layers.4.mixer.experts.4.up_proj.weight"),  # a 5th expert of 4
])
def test_unexpected_tensor(name, tensor, tiny_ckpt, tmp_path):
    import torch

    p = copy_checkpoint(tiny_ckpt(name), tmp_path)
    _edit_tensors(p, lambda t: t.__setitem__(tensor, torch.zeros(32, 64)))
    msg = _load_error(p)
    assert tensor in msg and "unexpected" in msg.lower(), msg


@pytest.mark.parametrize("name,tensor,new_shape", [
    ("granite_dense", "model.layers.1.self_attn.q_proj.weight", (48, 64)),
    ("granite_dense", "model.layers.0.mamba.conv1d.weight", (160, 1, 3)),
    ("nemotron_h", "backbone.layers.4.mixer.experts.1.down_proj.weight", (64, 31)),
    ("bamba", "model.embed_tokens.weight", (225, 64)),
])
def test_shape_mismatch(name, tensor, new_shape, tiny_ckpt, tmp_path):
    import torch

    p = copy_checkpoint(tiny_ckpt(name), tmp_path)
    old = {}

    def edit(t):
        old["shape"] = tuple(t[tensor].shape)
        t[tensor] = torch.zeros(new_shape)

    _edit_tensors(p, edit)
    msg = _load_error(p)
    assert tensor in msg, msg
    assert re.search(_shape_re(old["shape"]), msg), f"expected shape {old['shape']} not in: {msg}"
    assert re.search(_shape_re(new_shape), msg), f"found shape {new_shape} not in: {msg}"


@pytest.mark.parametrize("encoding", ["literal", "tagged"])
def test_infinity_encodings(encoding, tiny_ckpt, tmp_path, make_llm):
    """time_step_limit's infinity as the bare `Infinity` literal (hub files) or as
    {"__float__": "Infinity"} (transformers 5.x saves): both load and generate like HF."""
    src = tiny_ckpt("granite_dense")
    p = copy_checkpoint(src, tmp_path)
    text = (p / "config.json").read_text()
    if encoding == "literal":
        text = re.sub(r'\{\s*"__float__":\s*"Infinity"\s*\}', "Infinity", text)
        assert "Infinity" in text and "__float__" not in text
    else:
        assert '"__float__": "Infinity"' in text
    (p / "config.json").write_text(text)
    prompt = select_prompts(src, lengths=(9,), max_new_tokens=MAX_NEW)[9]
    out = make_llm(p).generate([prompt], _greedy(), use_tqdm=False)[0]
    d = describe_divergence(oracle_run(src, prompt, MAX_NEW), out.outputs[0].token_ids)
    assert d is None, d


# ---------------------------------------------------------------------------------------------
# bad requests
# ---------------------------------------------------------------------------------------------

MAX_LEN = 64


@pytest.fixture(scope="module")
def good_prompts(tiny_ckpt):
    p = select_prompts(tiny_ckpt("nemotron_h"), lengths=(7, 19), max_new_tokens=MAX_NEW)
    return [p[7], p[19]]


@pytest.fixture(scope="module")
def served(tiny_ckpt):
    """A long-lived LLM that receives every bad request of this module, and its reference."""
    from hybrid import LLM

    path = tiny_ckpt("nemotron_h")  # has a tokenizer: text prompts work
    return LLM(path, max_model_len=MAX_LEN)


def _check_good(path, llm, prompts):
    """The LLM still serves good requests exactly like HF, and holds nothing over."""
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    bad = [d for p, o in zip(prompts, outs) if (d := describe_divergence(oracle_run(path, p, MAX_NEW), o.outputs[0].token_ids))]
    assert not bad, "\n".join(bad)
    assert not llm.engine.has_unfinished_requests()


def _bad_param_cases():
    return [
        ("temperature", dict(temperature=-0.1)),
        ("temperature", dict(temperature=-1)),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=-0.5)),
        ("top_p", dict(top_p=1.01)),
        ("top_k", dict(top_k=-5)),
        ("top_k", dict(top_k=-2)),
        ("max_tokens", dict(max_tokens=0)),
        ("max_tokens", dict(max_tokens=-3)),
        ("n", dict(n=0)),
        ("n", dict(n=-1)),
    ]


@pytest.mark.parametrize("field,kwargs", _bad_param_cases(),
                         ids=[f"{f}={list(k.values())[0]}" for f, k in _bad_param_cases()])
def test_invalid_sampling_params(field, kwargs, served, good_prompts):
    from hybrid import SamplingParams
    from hybrid.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as ei:
        # whether SamplingParams(...) itself or generate() raises, it is InvalidRequestError
        served.generate([good_prompts[0]], SamplingParams(**kwargs), use_tqdm=False)
    assert isinstance(ei.value, ValueError)
    assert field in str(ei.value), str(ei.value)
    assert not served.engine.has_unfinished_requests()


@pytest.mark.parametrize("what", ["empty_ids", "empty_text", "too_long", "much_too_long",
                                  "too_long_text", "negative_id", "id_out_of_vocab", "float_id", "bool_id",
                                  "numpy_id"])
def test_invalid_prompts(what, served):
    from hybrid.errors import InvalidRequestError

    prompt = {
        "empty_ids": [],
        "empty_text": "",
        "too_long": random_prompt(160, MAX_LEN + 1, seed=3),
        "much_too_long": random_prompt(160, 4 * MAX_LEN, seed=3),
        "too_long_text": "abcdefghij" * 20,  # 200 single-character tokens at most
        "negative_id": [5, 6, -1, 7],
        "id_out_of_vocab": [5, 6, 160, 7],
        "float_id": [5, 6.0, 7],
        "bool_id": [5, True, 7],
        "numpy_id": [5, __import__("numpy").int64(6), 7],
    }[what]
    with pytest.raises(InvalidRequestError) as ei:
        served.generate([prompt], _greedy(), use_tqdm=False)
    assert isinstance(ei.value, ValueError)
    if what.startswith("empty"):
        assert "empty" in str(ei.value).lower()
    if "too_long" in what:
        assert str(MAX_LEN) in str(ei.value) or "max_model_len" in str(ei.value)
    if what in ("float_id", "bool_id", "numpy_id"):  # the type is named, not a vocabulary it is inside of
        assert "must be Python ints: position 1" in str(ei.value), str(ei.value)
    assert not served.engine.has_unfinished_requests()


def test_good_request_after_bad_ones(served, tiny_ckpt, make_llm, good_prompts):
    """Runs after the bad-request tests above on the same LLM: output equals a fresh LLM's."""
    from hybrid import SamplingParams
    from hybrid.errors import InvalidRequestError

    path = tiny_ckpt("nemotron_h")
    # one more round of bad requests right here, so the test also stands alone
    for bad in (dict(temperature=-1.0), dict(top_k=-2), dict(max_tokens=0)):
        with pytest.raises(InvalidRequestError):
            served.generate([good_prompts[0]], SamplingParams(**bad), use_tqdm=False)
    with pytest.raises(InvalidRequestError):
        served.generate([[]], _greedy(), use_tqdm=False)
    _check_good(path, served, good_prompts)
    fresh = make_llm(path, max_model_len=MAX_LEN)
    prompts = good_prompts
    a = [o.outputs[0].token_ids for o in served.generate(prompts, _greedy(), use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in fresh.generate(prompts, _greedy(), use_tqdm=False)]
    assert a == b


def test_bad_request_in_a_batch_queues_nothing(tiny_ckpt, make_llm, good_prompts):
    """generate([good, bad, good]) raises, and leaves no half-submitted batch behind."""
    from hybrid.errors import InvalidRequestError

    path = tiny_ckpt("nemotron_h")
    llm = make_llm(path, max_model_len=MAX_LEN)
    good = good_prompts
    with pytest.raises(InvalidRequestError):
        llm.generate([good[0], random_prompt(160, MAX_LEN + 5, seed=4), good[1]], _greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    from hybrid import SamplingParams

    with pytest.raises(InvalidRequestError):
        llm.generate(good, [_greedy(), SamplingParams(top_p=2.0)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    _check_good(path, llm, good)


def test_bad_request_while_others_decode(tiny_ckpt, make_llm, good_prompts):
    """engine.add_request of a bad request mid-decode raises and does not disturb the others."""
    from hybrid import SamplingParams
    from hybrid.errors import InvalidRequestError

    path = tiny_ckpt("nemotron_h")
    llm = make_llm(path, max_model_len=MAX_LEN)
    eng = llm.engine
    good = good_prompts
    eng.add_request("a", good[0], _greedy())
    eng.add_request("b", good[1], _greedy())
    outs = {}
    for _ in range(4):
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    for rid, ids, params in [
        ("c", [], _greedy()),
        ("d", random_prompt(160, MAX_LEN + 1, seed=9), _greedy()),
        ("e", [1, 2, 10_000], _greedy()),
        ("a", good[0], _greedy()),  # duplicate id of a running request
    ]:
        with pytest.raises(InvalidRequestError):
            eng.add_request(rid, ids, params)
    with pytest.raises(InvalidRequestError):
        eng.add_request("f", good[0], SamplingParams(top_k=-2))
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert set(outs) == {"a", "b"}, sorted(outs)
    for rid, p in zip("ab", good):
        d = describe_divergence(oracle_run(path, p, MAX_NEW), outs[rid].outputs[0].token_ids)
        assert d is None, d
