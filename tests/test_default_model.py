"""The bundled default checkpoint (hybrid/default_model/).

It is a real Hugging Face GraniteMoeHybrid checkpoint (a tiny Granite 4.0-H: dense, tied
embeddings, NoPE, Mamba2 layers around one attention layer), trained on the King James Bible
by hybrid/tools/train_default_model.py.  transformers (eager attention, fp32) is the oracle:
the runtime's `LLM()` with no model argument must load this checkpoint and reproduce the
transformers greedy continuations token for token.
"""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hybrid", "default_model")
N_TOKENS = 24
# In-domain prompts (King James Bible).  Their greedy continuations do not reach eos within
# N_TOKENS, so the runtime's natural stop and transformers' agree without ignore_eos too.
PROMPTS = [
    "And the LORD said unto Moses,",
    "And God said,",
    "Then David went up to",
    "Hear, O Israel:",
    "And Jesus answered and said unto them,",
]
COMMON_WORDS = {"the", "and", "of", "unto", "to", "that", "he", "in", "shall", "his", "i", "a", "is",
                "lord", "be", "for", "not", "they", "them", "him", "with", "all", "thou", "thy", "god"}


def _read_json(name: str) -> dict:
    with open(os.path.join(MODEL_DIR, name)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def llm():
    from hybrid import LLM

    return LLM()  # no model argument: the bundled default


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], n: int = N_TOKENS) -> list[int]:
    """transformers greedy continuation of exactly n tokens (eos does not stop it).

    Also checks that no step is a near-tie (top-2 log-prob gap), so that an fp32 rounding
    difference between two correct implementations cannot flip a greedy choice.
    """
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n,
        eos_token_id=None, pad_token_id=0, use_cache=True, num_beams=1,
        temperature=None, top_p=None, top_k=None, repetition_penalty=None,
        output_logits=True, return_dict_in_generate=True,
    )
    for step, logits in enumerate(out.logits):
        top2 = torch.topk(torch.log_softmax(logits[0].float(), -1), 2).values
        assert float(top2[0] - top2[1]) > 1e-3, f"near-tie at step {step}: pick another prompt"
    return out.sequences[0, ids.shape[1]:].tolist()


# ---- the files ----------------------------------------------------------------------------------

def test_checkpoint_files_present_and_small():
    names = set(os.listdir(MODEL_DIR))
    for required in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json"):
        assert required in names, f"missing {required}"
    total = sum(os.path.getsize(os.path.join(MODEL_DIR, n)) for n in names)
    assert total <= 10 * 1024 * 1024, f"default checkpoint is {total} bytes; keep it under 10 MiB"


def test_config_is_dense_granite_hybrid():
    from transformers import AutoConfig, GraniteMoeHybridConfig

    raw = _read_json("config.json")
    assert raw["model_type"] == "granitemoehybrid"
    assert raw["architectures"] == ["GraniteMoeHybridForCausalLM"]
    assert raw["num_local_experts"] == 0
    assert raw["tie_word_embeddings"] is True
    assert raw["position_embedding_type"] == "nope"
    types = raw["layer_types"]
    assert len(types) == raw["num_hidden_layers"]
    attn = [i for i, t in enumerate(types) if t in ("attention", "full_attention")]
    mamba = [i for i, t in enumerate(types) if t in ("mamba", "linear_attention")]
    assert len(attn) == 1 and len(mamba) == len(types) - 1 and 0 < attn[0] < len(types) - 1
    # a prompt longer than one Mamba chunk exercises the chunked scan
    assert raw["mamba_chunk_size"] <= 64

    cfg = AutoConfig.from_pretrained(MODEL_DIR)
    assert isinstance(cfg, GraniteMoeHybridConfig)

    gen = _read_json("generation_config.json")
    assert gen["eos_token_id"] == raw["eos_token_id"]


def test_transformers_loads_every_tensor(hf_model):
    from safetensors import safe_open
    from transformers import GraniteMoeHybridForCausalLM

    assert isinstance(hf_model, GraniteMoeHybridForCausalLM)
    with safe_open(os.path.join(MODEL_DIR, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.float32 for k in keys)
    assert "lm_head.weight" not in keys  # tied
    assert any(".mamba.in_proj.weight" in k for k in keys)
    assert any(".self_attn.q_proj.weight" in k for k in keys)
    state = hf_model.state_dict()
    for k in keys:
        assert k in state, f"{k} on disk but not in the transformers model"
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()


# ---- the tokenizer ------------------------------------------------------------------------------

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "And Jesus answered and said unto them,\nVerily I say unto you.",
    "Zerubbabel, café, naïve, 1234 — ✓ emoji 🙂 and\ttabs  double  spaces",
    "",
]


def test_tokenizer_round_trips(hf_tokenizer):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(os.path.join(MODEL_DIR, "tokenizer.json"))
    tc = _read_json("tokenizer_config.json")
    cfg = _read_json("config.json")
    assert 2048 <= raw.get_vocab_size() <= 4096 and raw.get_vocab_size() == cfg["vocab_size"]
    eos_id = raw.token_to_id(tc["eos_token"])
    assert eos_id == cfg["eos_token_id"] == hf_tokenizer.eos_token_id
    assert raw.token_to_id(tc["bos_token"]) == cfg["bos_token_id"]
    for text in TEXTS:
        ids = hf_tokenizer.encode(text)
        assert ids == raw.encode(text).ids
        assert hf_tokenizer.decode(ids) == text
        assert raw.decode(ids) == text
    # byte-level: common words are single tokens, not bytes
    assert len(hf_tokenizer.encode(" the LORD said unto")) <= 5


def test_chat_template_renders(hf_tokenizer):
    tc = _read_json("tokenizer_config.json")
    assert isinstance(tc.get("chat_template"), str) and "messages" in tc["chat_template"]
    text = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who made the earth?"}], tokenize=False, add_generation_prompt=True)
    assert "Who made the earth?" in text and text.rstrip().endswith("Assistant:")


# ---- the model ----------------------------------------------------------------------------------

def test_transformers_greedy_reads_as_text(hf_model, hf_tokenizer):
    for prompt in PROMPTS:
        ids = hf_tokenizer.encode(prompt)
        cont = hf_greedy(hf_model, ids)
        assert hf_tokenizer.eos_token_id not in cont, (prompt, cont)
        text = hf_tokenizer.decode(cont)
        words = re.findall(r"[A-Za-z]+", text.lower())
        assert len(words) >= 12, (prompt, text)
        assert len(set(words)) >= 8, f"degenerate repetition: {text!r}"
        assert sum(w in COMMON_WORDS for w in words) >= len(words) // 4, text


def test_runtime_tokenizer_matches(llm, hf_tokenizer):
    for text in TEXTS[:3]:
        assert llm.tokenizer.encode(text) == hf_tokenizer.encode(text)
        assert llm.tokenizer.decode(hf_tokenizer.encode(text)) == text
    assert hf_tokenizer.eos_token_id in llm.tokenizer.eos_token_ids


def test_runtime_greedy_matches_transformers(llm, hf_model, hf_tokenizer):
    from hybrid import SamplingParams

    prompt = PROMPTS[0]
    expected = hf_greedy(hf_model, hf_tokenizer.encode(prompt))
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=N_TOKENS), use_tqdm=False)
    assert out.prompt == prompt
    assert out.prompt_token_ids == hf_tokenizer.encode(prompt)
    comp = out.outputs[0]
    assert comp.token_ids == expected, (hf_tokenizer.decode(comp.token_ids), hf_tokenizer.decode(expected))
    assert comp.finish_reason == "length"
    assert comp.text == hf_tokenizer.decode(expected)


def test_runtime_batched_greedy_matches_transformers(llm, hf_model, hf_tokenizer):
    """All prompts in one generate() call (batched decode, mixed lengths) and as token ids."""
    from hybrid import SamplingParams

    long_prompt = " ".join(PROMPTS) + " And God said, Let there be light: and there was light. " * 4
    prompts = PROMPTS + [long_prompt]  # the long one spans several Mamba chunks and KV pages
    prompt_ids = [hf_tokenizer.encode(p) for p in prompts]
    assert len(prompt_ids[-1]) > 64
    expected = [hf_greedy(hf_model, ids) for ids in prompt_ids]
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    for outs in (llm.generate(prompts, params, use_tqdm=False), llm.generate(prompt_ids, params, use_tqdm=False)):
        assert len(outs) == len(prompts)
        for out, ids, exp in zip(outs, prompt_ids, expected):
            assert out.prompt_token_ids == ids
            assert out.outputs[0].token_ids == exp, (hf_tokenizer.decode(out.outputs[0].token_ids),
                                                     hf_tokenizer.decode(exp))
