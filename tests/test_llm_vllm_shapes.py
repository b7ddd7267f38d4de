"""LLM.generate's inputs and outputs in the shapes code written against vLLM uses: prompt dicts
({"prompt"} / {"prompt_token_ids"}), Logprob entries (.logprob, .rank) and cumulative_logprob."""
from __future__ import annotations

import math

import pytest
import torch

from hybrid import LLM, SamplingParams
from hybrid.errors import InvalidRequestError
from hybrid.outputs import Logprob

torch.set_num_threads(1)
PROMPT = "And the LORD said unto Moses,"


@pytest.fixture(scope="module")
def llm():
    return LLM(None, max_num_seqs=4)


def test_prompt_dicts(llm):
    sp = SamplingParams(max_tokens=8, temperature=0)
    ids = llm.tokenizer.encode(PROMPT)
    ref = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    text, tokens, both = llm.generate([{"prompt": PROMPT}, {"prompt_token_ids": ids},
                                       {"prompt": PROMPT, "prompt_token_ids": ids}], sp, use_tqdm=False)
    for out in (text, tokens, both):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.prompt_token_ids == ids
    assert text.prompt == PROMPT and tokens.prompt is None and both.prompt == PROMPT
    one = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)  # a single dict is one prompt
    assert len(one) == 1 and one[0].outputs[0].token_ids == ref.outputs[0].token_ids
    for bad, match in (({"text": PROMPT}, "not supported"), ({"prompt": 5}, "needs 'prompt'"),
                       ({"prompt_token_ids": "1 2"}, "list of token ids"), ({}, "needs 'prompt'")):
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate([bad], sp, use_tqdm=False)


def test_lora_request_none_is_accepted(llm):
    """Code written for vLLM passes lora_request=None to generate and chat: accepted; an adapter is refused."""
    sp = SamplingParams(max_tokens=4, temperature=0)
    ref = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate([PROMPT], sp, use_tqdm=False, lora_request=None)[0].outputs[0].token_ids == ref
    chat = [{"role": "user", "content": "hi"}]
    assert llm.chat(chat, sp, use_tqdm=False, lora_request=None)[0].finished
    for call in (lambda: llm.generate([PROMPT], sp, lora_request=object()),
                 lambda: llm.chat(chat, sp, lora_request=object())):
        with pytest.raises(InvalidRequestError, match="LoRA adapters are not supported"):
            call()


def test_logprob_entries_and_cumulative_logprob(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    total = 0.0
    for tid, entries in zip(out.token_ids, out.logprobs):
        lp = entries[tid]
        assert isinstance(lp, Logprob) and isinstance(lp, float) and lp.logprob == float(lp) <= 0.0
        # the top 3 ranked 1..3, and the sampled token with its own rank (outside them: > 3, less likely)
        assert isinstance(lp.rank, int) and lp.rank >= 1
        top = sorted((e for t, e in entries.items() if t != tid or lp.rank <= 3), key=lambda e: e.rank)
        assert [e.rank for e in top] == [1, 2, 3] and top[0].logprob >= top[1].logprob >= top[2].logprob
        assert entries[tid] is top[lp.rank - 1] if lp.rank <= 3 else lp.logprob <= top[2].logprob
        total += lp.logprob
        # each entry names its token's text, as vLLM's decoded_token
        assert all(e.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False) for t, e in entries.items())
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-9)
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_vllm_keyword_spellings():
    """LLM(...) as model cards write it for vLLM: trust_remote_code, mamba_ssm_cache_dtype, block_size,
    enable_chunked_prefill, disable_log_stats; quantization must agree with the checkpoint."""
    from hybrid.errors import ConfigurationError

    llm = LLM(None, max_num_seqs=2, trust_remote_code=True, mamba_ssm_cache_dtype="bfloat16", block_size=32,
              enable_chunked_prefill=True, disable_log_stats=True)
    assert llm.ssm_dtype == torch.bfloat16 and llm.kv_cache.page_size == 32
    assert LLM(None, max_num_seqs=2, mamba_ssm_cache_dtype="auto").ssm_dtype == torch.float32
    with pytest.raises(ConfigurationError, match="name one setting"):
        LLM(None, mamba_ssm_dtype="float16", mamba_ssm_cache_dtype="bfloat16")
    with pytest.raises(ConfigurationError, match="name one setting"):
        LLM(None, page_size=8, block_size=32)
    with pytest.raises(ConfigurationError, match="not quantized .*names a checkpoint format"):
        LLM(None, quantization="modelopt")
    with pytest.raises(TypeError):
        LLM(None, no_such_argument=1)


def test_chat_renders_tools(tmp_path):
    """LLM.chat(tools=...) gives the template its tools, as vLLM's LLM.chat."""
    import json
    import shutil

    from hybrid.model_source import DEFAULT_MODEL_DIR

    p = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, p)
    cfg = json.loads((p / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                            "{% for m in messages %}{{ m.content }}\n{% endfor %}")
    (p / "tokenizer_config.json").write_text(json.dumps(cfg))
    llm = LLM(str(p), max_num_seqs=2)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), tools=tools, use_tqdm=False)[0]
    assert out.prompt == "[get_weather]Hi\n"
    assert llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt == "Hi\n"
    with pytest.raises(InvalidRequestError, match="tools must be"):
        llm.chat([{"role": "user", "content": "Hi"}], tools="get_weather", use_tqdm=False)


def test_pooling_methods_say_they_are_not_served(llm):
    for name in ("encode", "embed", "classify", "score", "reward"):
        with pytest.raises(InvalidRequestError, match=f"LLM.{name}\\(\\) needs a pooling"):
            getattr(llm, name)(["a"])


def test_reset_prefix_cache(tmp_path):
    """reset_prefix_cache drops every cached prefix and gives back its slot and pages: the next run of the
    same prompt finds nothing cached, and its tokens are the same."""
    llm = LLM(None, max_num_seqs=2, enable_prefix_caching=True)
    ids = list(range(5, 5 + 40))
    greedy = SamplingParams(max_tokens=3, temperature=0)
    first = llm.generate([ids], greedy, use_tqdm=False)[0]
    hit = llm.generate([ids], greedy, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0 and len(llm.engine.prefix_cache) > 0
    free_slots = llm.state_pool.num_free
    assert llm.reset_prefix_cache() is True
    assert len(llm.engine.prefix_cache) == 0 and llm.state_pool.num_free > free_slots
    again = llm.generate([ids], greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert first.outputs[0].token_ids == hit.outputs[0].token_ids == again.outputs[0].token_ids
    llm.engine.add_request("busy", ids, greedy)  # refused while a request is in the engine
    assert llm.reset_prefix_cache() is False
    llm.engine.abort_request("busy")


def test_vllm_construction_spellings(caplog):
    """dtype "half" / "float", seed=None (a random engine seed), and a max_model_len past the checkpoint's
    max_position_embeddings is served with a warning."""
    import logging

    assert LLM(None, max_num_seqs=2, dtype="float").dtype == torch.float32
    assert LLM(None, max_num_seqs=2, dtype="half").dtype == torch.float16
    a, b = (LLM(None, max_num_seqs=2, seed=None) for _ in range(2))
    sp = SamplingParams(max_tokens=8, temperature=1.0)
    assert a.engine.seed != b.engine.seed
    assert len(a.generate(["In the"], sp, use_tqdm=False)[0].outputs[0].token_ids) == 8
    limit = a.config.max_position_embeddings
    with caplog.at_level(logging.WARNING, logger="hybrid"):
        longer = LLM(None, max_num_seqs=1, max_model_len=limit + 64)
    assert longer.max_model_len == limit + 64
    assert any("longer than the checkpoint's max_position_embeddings" in r.getMessage() for r in caplog.records)


def test_empty_multimodal_keys_in_prompt_dicts(llm):
    greedy = SamplingParams(max_tokens=3, temperature=0)
    plain = llm.generate([{"prompt": "In the"}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    same = llm.generate([{"prompt": "In the", "multi_modal_data": None, "mm_processor_kwargs": {}}], greedy,
                        use_tqdm=False)[0].outputs[0].token_ids
    assert same == plain
    with pytest.raises(InvalidRequestError, match="'multi_modal_data' is not supported"):
        llm.generate([{"prompt": "In the", "multi_modal_data": {"image": object()}}], greedy, use_tqdm=False)


def test_tokenizer_and_swap_space_keywords():
    from hybrid import ConfigurationError
    from hybrid.model_source import DEFAULT_MODEL_DIR

    path = str(DEFAULT_MODEL_DIR)
    llm = LLM(path, max_num_seqs=1, tokenizer=path, swap_space=4)
    assert llm.generate(["In the"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    with pytest.raises(ConfigurationError, match="only the checkpoint's own tokenizer"):
        LLM(path, max_num_seqs=1, tokenizer="/somewhere/else")


def test_more_vllm_engine_keywords():
    """vLLM's LLM keywords: override_generation_config sets the sampling defaults, compilation_config's capture
    sizes are cuda_graph_sizes, the ones with no effect are accepted, and the values this runtime cannot honour
    are a ConfigurationError before anything loads."""
    from hybrid import ConfigurationError

    llm = LLM(None, max_num_seqs=1, override_generation_config={"temperature": 0.3, "max_new_tokens": 5},
              compilation_config={"cudagraph_capture_sizes": [1, 2], "level": 3}, max_logprobs=20,
              disable_custom_all_reduce=True, max_seq_len_to_capture=8192, tokenizer_mode="auto",
              load_format="safetensors", hf_overrides={}, enable_lora=False, cpu_offload_gb=0)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.3, 5)
    assert llm.engine_config.cuda_graph_sizes == (1, 2)
    assert len(llm.generate(["In the"], use_tqdm=False)[0].outputs[0].token_ids) == 5  # the defaults apply
    for kw, wanted in (({"enable_lora": True}, "LoRA"), ({"load_format": "pt"}, "safetensors"),
                       ({"hf_overrides": {"num_hidden_layers": 1}}, "config.json"),
                       ({"cpu_offload_gb": 4}, "on the device"), ({"tokenizer_mode": "mistral"}, "tokenizers"),
                       ({"override_generation_config": {"do_sample": True}}, "do_sample"),
                       ({"override_generation_config": {"top_p": 3}}, "top_p"),
                       ({"compilation_config": "fast"}, "compilation_config")):
        with pytest.raises(ConfigurationError, match=wanted):
            LLM(None, max_num_seqs=1, **kw)


def test_vllm_engine_loop(llm):
    """Code that drives vLLM's LLMEngine through llm.llm_engine: add_request with a string, a TextPrompt or a
    TokensPrompt, step() until done, abort_request with a list, get_num_unfinished_requests, get_tokenizer."""
    from hybrid import TextPrompt, TokensPrompt

    engine = llm.llm_engine
    assert engine is llm.engine and engine.get_tokenizer() is llm.get_tokenizer()
    sp = SamplingParams(max_tokens=5, temperature=0)
    ids = llm.tokenizer.encode(PROMPT)
    ref = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    engine.add_request("text", PROMPT, sp)
    engine.add_request("dict", TextPrompt(prompt=PROMPT), sp)
    engine.add_request("tokens", TokensPrompt(prompt_token_ids=ids), sp)
    engine.add_request("gone-1", PROMPT, sp)
    engine.add_request("gone-2", ids, sp)
    assert engine.get_num_unfinished_requests() == 5
    engine.abort_request(["gone-1", "gone-2", "unknown"])
    assert engine.get_num_unfinished_requests() == 3
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert sorted(finals) == ["dict", "text", "tokens"]
    for rid, out in finals.items():
        assert out.outputs[0].token_ids == ref.token_ids and out.outputs[0].text == ref.text
        assert out.prompt_token_ids == ids and out.prompt == (None if rid == "tokens" else PROMPT)
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        engine.add_request("empty", "", sp)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("stop", [None, [" unto"]])
def test_request_output_kinds(llm, stop):
    """SamplingParams.output_kind (vLLM's RequestOutputKind) through the engine loop: DELTA outputs carry the
    tokens and the text new since the last (stop strings' possible beginnings held back), which join into the
    CUMULATIVE result; FINAL_ONLY gives one output. LLM.generate returns finished requests whatever it says."""
    from hybrid import RequestOutputKind

    engine = llm.llm_engine
    outs: dict[RequestOutputKind, list] = {}
    for kind in RequestOutputKind:
        sp = SamplingParams(max_tokens=12, temperature=1.0, seed=4, stop=stop, output_kind=kind)
        engine.add_request(f"kind-{kind.name}", PROMPT, sp)
        got = outs[kind] = []
        while engine.has_unfinished_requests():
            got += engine.step()
    final = outs[RequestOutputKind.CUMULATIVE][-1].outputs[0]
    assert len(outs[RequestOutputKind.FINAL_ONLY]) == 1
    assert outs[RequestOutputKind.FINAL_ONLY][0].outputs[0].text == final.text
    deltas = [o.outputs[0] for o in outs[RequestOutputKind.DELTA]]
    assert len(deltas) > 1 and "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=4, stop=stop, output_kind=RequestOutputKind.DELTA)
    assert llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].text == final.text


def test_vllm_output_fields_and_params_helpers(llm):
    from hybrid import RequestOutputKind
    from hybrid.sampling_params import SamplingParams as SP2

    assert SP2 is SamplingParams
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.outputs[0].finished() is True  # a method, as vLLM's
    assert out.metrics is None and out.encoder_prompt is None and out.encoder_prompt_token_ids is None
    assert out.lora_request is None and out.outputs[0].lora_request is None and out.multi_modal_placeholders == {}
    sp = SamplingParams.from_optional(temperature=None, top_p=None, max_tokens=3, seed=None)
    assert sp == SamplingParams(max_tokens=3)
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams(extra_args={"x": 1}).extra_args == {"x": 1}
    with pytest.raises(InvalidRequestError, match="output_kind"):
        SamplingParams(output_kind=7)
    # stop and stop_token_ids are lists, as vLLM's (code extends them)
    sp = SamplingParams()
    assert sp.stop == [] and sp.stop_token_ids == []
    sp.stop_token_ids.append(0)
    assert SamplingParams().stop_token_ids == [] and SamplingParams(stop="x").stop == ["x"]


def test_more_vllm_engine_keywords():
    """LLM keywords of vLLM's engine: accepted where they change nothing here (task / runner "generate",
    pipeline_parallel_size 1, distributed_executor_backend, limit_mm_per_prompt), a ConfigurationError naming
    the setting where they would (another task, pipeline parallelism, a KV cache in bytes)."""
    from hybrid.errors import ConfigurationError

    llm = LLM(None, device="cpu", task="generate", runner="auto", pipeline_parallel_size=1,
              distributed_executor_backend="mp", limit_mm_per_prompt={})
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    for kw, says in (({"task": "embed"}, "task='embed'"), ({"runner": "pooling"}, "runner='pooling'"),
                     ({"pipeline_parallel_size": 2}, "pipeline parallelism"),
                     ({"kv_cache_memory_bytes": 10**9}, "gpu_memory_utilization")):
        with pytest.raises(ConfigurationError, match=says):
            LLM(None, device="cpu", **kw)


def test_chat_and_beam_search_take_vllms_keywords(llm):
    from hybrid import BeamSearchParams

    chat = [{"role": "user", "content": "hi"}]
    sp = SamplingParams(max_tokens=3, temperature=0)
    ref = llm.chat(chat, sp, use_tqdm=False)[0].outputs[0].token_ids
    got = llm.chat(chat, sp, use_tqdm=False, chat_template_content_format="string", mm_processor_kwargs=None)
    assert got[0].outputs[0].token_ids == ref
    for kw, says in (({"chat_template_content_format": "openai"}, "chat_template_content_format"),
                     ({"mm_processor_kwargs": {"x": 1}}, "text only")):
        with pytest.raises(InvalidRequestError, match=says):
            llm.chat(chat, sp, use_tqdm=False, **kw)
    bp = BeamSearchParams(beam_width=2, max_tokens=3)
    want = llm.beam_search([PROMPT], bp)[0].sequences[0].tokens
    assert llm.beam_search([PROMPT], bp, lora_request=None, use_tqdm=True, concurrency_limit=1)[0] \
        .sequences[0].tokens == want


def test_logprobs_minus_one_is_the_whole_vocabulary(llm):
    """vLLM's logprobs=-1 / prompt_logprobs=-1: every token's logprob (the distributions sum to 1); the caller's
    params are left as given."""
    sp = SamplingParams(max_tokens=3, temperature=1.0, seed=2, logprobs=-1, prompt_logprobs=-1)
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    vocab = llm.engine.vocab_size
    for entries in out.outputs[0].logprobs + out.prompt_logprobs[1:]:
        assert len(entries) == vocab
        assert math.isclose(sum(math.exp(v) for v in entries.values()), 1.0, rel_tol=1e-3)
    assert out.prompt_logprobs[0] is None and sp.logprobs == -1 and sp.prompt_logprobs == -1
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(logprobs=-2)
