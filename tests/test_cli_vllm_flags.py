"""`hybrid generate` / `hybrid serve` take the flags of vLLM commands as model cards print them:
`--x_y` spellings, --gpu-memory-utilization, --mamba-ssm-cache-dtype, --block-size,
--speculative-config, --quantization, --generation-config, --chat-template, --uvicorn-log-level,
--trust-remote-code and the flags accepted with no effect. Mostly the flag -> LLM keyword mapping
(no model loaded); one generate and one serve run of the bundled tiny model."""
from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import pytest

from hybrid.cli import build_parser, engine_kwargs, main, normalize_flag_names
from hybrid.model_source import DEFAULT_MODEL_DIR


def _parse(*argv: str):
    return build_parser().parse_args(normalize_flag_names(["generate", "--prompt", "x", *argv]))


def _option_strings(command: str) -> list[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")  # the subcommands' action
    return [s for action in sub.choices[command]._actions for s in action.option_strings if s.startswith("--")]


# ------------------------------------------------------------------------------------------ underscores
def test_every_flag_takes_its_underscore_spelling():
    commands = ["generate"] + (["serve"] if _has_serve() else [])
    for command in commands:
        names = [s for s in _option_strings(command) if "-" in s[2:]]
        assert names, command
        for name in names:
            assert normalize_flag_names(["--" + name[2:].replace("-", "_")]) == [name]
            assert normalize_flag_names(["--" + name[2:].replace("-", "_") + "=a_b"]) == [name + "=a_b"]


def test_only_option_names_are_rewritten():
    argv = ["generate", "--prompt", "snake_case", "--prompt=--x_y", "--max_tokens=3", "--prompt", "--a_b c",
            "-q", "compressed_tensors", "--", "--z_w"]
    assert normalize_flag_names(argv) == ["generate", "--prompt", "snake_case", "--prompt=--x_y", "--max-tokens=3",
                                          "--prompt", "--a_b c", "-q", "compressed_tensors", "--", "--z_w"]


def test_underscored_flags_parse_as_dashed_ones():
    a = _parse("--max_num_seqs", "3", "--mamba_ssm_cache_dtype", "float32", "--gpu_memory_utilization=0.5",
               "--trust_remote_code", "--block_size", "32", "--max_tokens", "7")
    assert (a.max_num_seqs, a.mamba_ssm_cache_dtype, a.gpu_memory_utilization, a.trust_remote_code, a.page_size,
            a.max_tokens) == (3, "float32", 0.5, True, 32, 7)


# ------------------------------------------------------------------------------- flags -> LLM keywords
def test_vllm_flags_map_to_llm_keywords():
    from hybrid.engine_config import engine_config

    kw = engine_kwargs(_parse("--gpu-memory-utilization", "0.55", "--mamba-ssm-cache-dtype", "bfloat16",
                              "--block-size", "32", "--generation-config", "vllm", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}'))
    assert kw["gpu_memory_utilization"] == 0.55 and kw["mamba_ssm_dtype"] == "bfloat16" and kw["page_size"] == 32
    assert kw["generation_config"] == "vllm"
    assert kw["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    import torch

    cfg = engine_config(**{**kw, "device": "cpu"})  # LLM's own validation accepts them (nothing loaded)
    assert cfg.cache.gpu_memory_utilization == 0.55 and cfg.cache.mamba_ssm_dtype == torch.bfloat16
    assert cfg.cache.page_size == 32 and cfg.generation_config == "vllm"
    assert (cfg.speculative.num_speculative_tokens, cfg.speculative.prompt_lookup_max) == (2, 4)


def test_unset_vllm_flags_leave_llm_its_defaults():
    from hybrid.llm import LLM

    kw = engine_kwargs(_parse())
    for key in ("gpu_memory_utilization", "mamba_ssm_dtype", "speculative_config", "generation_config"):
        assert key not in kw
    assert engine_kwargs(_parse("--mamba-ssm-cache-dtype", "auto")) == kw
    # the help says "auto: float32": LLM's default
    assert inspect.signature(LLM).parameters["mamba_ssm_dtype"].default == "float32"
    assert _parse("--page-size", "8").page_size == 8 and _parse().page_size == 16


def test_bad_values_are_clear_errors(capsys):
    for argv, wanted in ((["--speculative-config", "{bad"], "argument --speculative-config: not valid JSON"),
                         (["--speculative_config", "[3]"], "argument --speculative-config: must be a JSON object"),
                         (["--mamba-ssm-cache-dtype", "int8"], "argument --mamba-ssm-cache-dtype: invalid choice"),
                         (["--gpu_memory_utilization", "most"], "argument --gpu-memory-utilization: invalid float")):
        with pytest.raises(SystemExit) as e:
            _parse(*argv)
        assert e.value.code == 2 and wanted in capsys.readouterr().err, argv
    # values the engine refuses: `error: ...` before anything is loaded
    for argv, wanted in ((["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
                         (["--speculative-config", '{"model": "x"}'], "unknown speculative_config keys ['model']"),
                         (["--generation-config", "/no/such/folder"], "generation_config must be")):
        assert main(["generate", "--prompt", "x", "--device", "cpu", *argv]) == 2, argv
        assert wanted in capsys.readouterr().err, argv


# ------------------------------------------------------------------------------------------ quantization
def _checkpoint_config(tmp_path, quantization_config=None, name="ckpt"):
    """The bundled model's config.json (no weights: --quantization is checked from the config alone)."""
    d = tmp_path / name
    d.mkdir()
    cfg = json.loads((Path(DEFAULT_MODEL_DIR) / "config.json").read_text())
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


MODELOPT = {"quant_method": "modelopt", "quant_algo": "FP8"}
COMPRESSED = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"],
                                            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                            "input_activations": {"num_bits": 8, "type": "float",
                                                                  "strategy": "token", "dynamic": True}}}}


def test_quantization_must_agree_with_the_checkpoint(tmp_path):
    from hybrid.cli import check_quantization
    from hybrid.errors import ConfigurationError

    modelopt = _checkpoint_config(tmp_path, MODELOPT, "modelopt")
    compressed = _checkpoint_config(tmp_path, COMPRESSED, "compressed")
    assert check_quantization("modelopt", modelopt) == "modelopt FP8"
    assert check_quantization("fp8", modelopt) == "modelopt FP8"
    assert check_quantization("compressed-tensors", compressed) == "compressed-tensors float-quantized"
    assert check_quantization("compressed_tensors", compressed) == check_quantization("fp8", compressed)
    with pytest.raises(ConfigurationError, match=r"the checkpoint is modelopt FP8 .*pass --quantization modelopt"):
        check_quantization("compressed-tensors", modelopt)
    with pytest.raises(ConfigurationError, match="awq: not supported"):
        check_quantization("awq", modelopt)
    # a checkpoint that is not quantized: fp8 quantizes it at load; a format's name is an error
    assert check_quantization("fp8", _checkpoint_config(tmp_path, None, "plain-fp8")).startswith(
        "not quantized: its projections and routed experts are quantized to FP8 at load")
    for name in ("modelopt", "compressed-tensors"):
        with pytest.raises(ConfigurationError, match="not quantized .*names a checkpoint format.*--quantization "
                                                     "fp8.*python -m hybrid.tools.quantize_fp8"):
            check_quantization(name, _checkpoint_config(tmp_path, None, f"plain-{name}"))


def test_quantization_on_a_bf16_checkpoint_fails_before_loading(capsys, monkeypatch):
    import hybrid.llm

    monkeypatch.setattr(hybrid.llm.LLM, "from_engine_config", lambda config, **kw: pytest.fail("loaded"))
    assert main(["generate", "--prompt", "x", "--device", "cpu", "--quantization", "modelopt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --quantization modelopt: the checkpoint") and "hybrid.tools.quantize_fp8" in err


# --------------------------------------------------------------------------- generate, end to end (tiny)
def test_generate_runs_a_model_card_command(capsys, caplog):
    """A vLLM-style command line (underscores, no-op flags) generates what the plain one does, and
    --trust-remote-code says in one info line that it changes nothing."""
    plain = ["generate", "--prompt", "And the LORD said", "--max-tokens", "5", "--device", "cpu"]
    assert main(plain) == 0
    expected = capsys.readouterr().out
    caplog.set_level(logging.INFO, logger="hybrid")
    assert main(plain + ["--trust_remote_code", "--mamba_ssm_cache_dtype", "float32", "--gpu-memory-utilization",
                         "0.8", "--block_size", "16", "--disable_log_stats", "--generation_config", "auto"]) == 0
    assert capsys.readouterr().out == expected
    notes = [r.getMessage() for r in caplog.records if "--trust-remote-code" in r.getMessage()]
    assert len(notes) == 1 and "no effect" in notes[0]


# ---------------------------------------------------------------------------------------------- serve
def _has_serve() -> bool:
    try:
        import hybrid.server  # noqa: F401
    except ImportError:
        return False
    return True


needs_serve = pytest.mark.skipif(not _has_serve(), reason="needs the [serve] extra")


@needs_serve
def test_serve_help_lists_the_flags_accepted_with_no_effect(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "vLLM server flags accepted with no effect" in out and "vLLM engine flags accepted with no effect" in out
    for flag in ("--disable-log-requests", "--enable-log-requests", "--disable-frontend-multiprocessing",
                 "--disable-log-stats", "--trust-remote-code", "--uvicorn-log-level", "--chat-template",
                 "--block-size", "--quantization", "--generation-config", "--speculative-config",
                 "--gpu-memory-utilization", "--mamba-ssm-cache-dtype"):
        assert flag in out, flag


@needs_serve
def test_chat_template_flag_reads_a_file_or_takes_the_text(tmp_path):
    from hybrid.server.options import read_chat_template

    text = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(text)
    assert read_chat_template(str(path)) == text
    assert read_chat_template(text) == text
    # serve_options hands the text to build_app(chat_template=...); without the flag, no such key
    import argparse

    from hybrid.server.options import add_serve_parser, serve_options

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(), lambda p: None)
    assert serve_options(parser.parse_args(["serve", "--chat-template", str(path)]))["chat_template"] == text
    assert "chat_template" not in serve_options(parser.parse_args(["serve"]))
    assert serve_options(parser.parse_args(["serve", "--return-tokens-as-token-ids"]))["return_tokens_as_token_ids"]
    assert "return_tokens_as_token_ids" not in serve_options(parser.parse_args(["serve"]))
    assert serve_options(parser.parse_args(["serve", "--enable-prompt-tokens-details"]))["enable_prompt_tokens_details"]
    with pytest.raises(ValueError, match=r"--chat-template .*nowhere\.jinja: no such file"):
        read_chat_template(str(tmp_path / "nowhere.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=r"bad\.jinja: the chat template does not compile"):
        read_chat_template(str(bad))


@needs_serve
def test_bad_chat_template_is_an_error_before_the_model_loads(capsys, monkeypatch, tmp_path):
    import hybrid.cli

    monkeypatch.setattr(hybrid.cli, "build_llm", lambda args: pytest.fail("loaded"))
    assert main(["serve", "--chat_template", str(tmp_path / "missing.jinja"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --chat-template ") and "missing.jinja: no such file" in err
    assert main(["serve", "--chat-template", "{% if %}", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --chat-template (text): the chat template does not compile"), err


@needs_serve
def test_serve_runs_a_model_card_command(monkeypatch, tmp_path, caplog):
    """`hybrid serve` with vLLM's flags, up to uvicorn.run (replaced): the LLM gets the engine
    flags, uvicorn the --uvicorn-log-level, and the app serves chats with the --chat-template file."""
    import httpx
    import uvicorn

    import hybrid.cli
    from server_utils import ServerThread

    built, runs = [], []
    build = hybrid.cli.build_llm
    monkeypatch.setattr(hybrid.cli, "build_llm", lambda args: built.append(build(args)) or built[-1])
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append((app, kw)))
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    caplog.set_level(logging.INFO, logger="hybrid")
    argv = ["serve", "--device", "cpu", "--max_num_seqs", "2", "--trust-remote-code", "--gpu_memory_utilization",
            "0.7", "--mamba_ssm_cache_dtype", "float32", "--block_size", "16", "--generation_config", "vllm",
            "--chat_template", str(template), "--uvicorn_log_level", "warning", "--disable_log_requests",
            "--enable-log-requests", "--disable-frontend-multiprocessing", "--disable-log-stats",
            "--port", "0", "--disable-uvicorn-access-log"]
    assert main(argv) == 0
    [llm], [(app, kw)] = built, runs
    assert kw["log_level"] == "warning" and kw["access_log"] is False
    cfg = llm.engine_config
    assert (cfg.cache.gpu_memory_utilization, cfg.cache.page_size, cfg.generation_config) == (0.7, 16, "vllm")
    assert sum("--trust-remote-code" in r.getMessage() for r in caplog.records) == 1
    with ServerThread(app) as srv:
        body = {"model": app.state.served_model_name, "messages": [{"role": "user", "content": "Hear"}],
                "max_tokens": 2, "temperature": 0}
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json=body)
    assert r.status_code == 200, r.text
    rendered = "[user] Hear\n"
    assert r.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode(rendered, add_special_tokens=False))


@needs_serve
def test_uvicorn_log_level_defaults_to_log_level(monkeypatch):
    import types

    import uvicorn

    import hybrid.cli
    from hybrid.server import options

    parsed, runs = [], []
    monkeypatch.setattr(hybrid.cli, "_serve", lambda args: parsed.append(args) or 0)
    assert main(["serve", "--log-level", "debug"]) == 0
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append(kw))
    monkeypatch.setattr(options, "build_app", lambda llm, **kw: types.SimpleNamespace(
        state=types.SimpleNamespace(served_model_name="m")))
    options.run_server(None, parsed[0], {"api_key": None})
    assert runs[0]["log_level"] == "debug"


# ------------------------------------------------------------------------------------------ more vLLM flags
def test_more_vllm_engine_flags_map_to_llm_keywords():
    kw = engine_kwargs(_parse("--cuda-graph-sizes", "1", "2", "8", "--tokenizer", "m", "--swap-space", "4",
                              "--enable-chunked-prefill", "--async-scheduling", "--no-enable-prefix-caching"))
    assert kw["cuda_graph_sizes"] == [1, 2, 8] and kw["tokenizer"] == "m" and kw["swap_space"] == 4.0
    assert kw["enable_chunked_prefill"] is True and kw["async_scheduling"] is True
    assert kw["enable_prefix_caching"] is False
    assert engine_kwargs(_parse("--enable-prefix-caching"))["enable_prefix_caching"] is True
    assert engine_kwargs(_parse("--no-async-scheduling"))["async_scheduling"] is False
    assert engine_kwargs(_parse())["async_scheduling"] is None
    # vLLM's -O / --compilation-config: its capture sizes are --cuda-graph-sizes
    assert engine_kwargs(_parse("-O", '{"cudagraph_capture_sizes": [1, 4], "level": 3}'))["cuda_graph_sizes"] == [1, 4]
    assert "cuda_graph_sizes" not in engine_kwargs(_parse("--compilation-config", '{"level": 3}'))
    # --revision: a hub repo id's revision, as MODEL@REVISION; a directory is itself
    assert engine_kwargs(_parse("--model", "owner/name", "--revision", "abc"))["model"] == "owner/name@abc"
    assert engine_kwargs(_parse("--model", DEFAULT_MODEL_DIR, "--revision", "abc"))["model"] == DEFAULT_MODEL_DIR
    # accepted, no effect (a vLLM command runs as written)
    for argv in (["--max-seq-len-to-capture", "8192"], ["--distributed-executor-backend", "mp"], ["--load-format",
                 "safetensors"], ["--data-parallel-size", "1"], ["--cpu-offload-gb", "0"], ["--hf-overrides", "{}"],
                 ["--calculate-kv-scales"], ["--enable-expert-parallel"], ["--tokenizer-mode", "auto"],
                 ["--logprobs-mode", "raw_logprobs"], ["--max-logprobs", "20"]):
        assert engine_kwargs(_parse(*argv)) == engine_kwargs(_parse()), argv


def test_vllm_flags_this_runtime_cannot_honour_are_refused(capsys):
    for argv, wanted in ((["--lora-modules", "a=b"], "--lora-modules: LoRA adapters are not supported"),
                         (["--data-parallel-size", "2"], "data parallelism is not implemented"),
                         (["--pipeline-parallel-size", "2"], "pipeline parallelism"),
                         (["--kv-cache-memory-bytes", "1000"], "--gpu-memory-utilization"),
                         (["--logprobs-mode", "processed_logprobs"], "the model's own")):
        with pytest.raises(SystemExit) as e:
            _parse(*argv)
        assert e.value.code == 2 and wanted in capsys.readouterr().err, argv
    # the settings LLM takes under the same names: its checks, an `error:` before anything loads
    for argv, wanted in ((["--enable-lora"], "LoRA adapters are not supported"),
                         (["--load-format", "pt"], "weights load from safetensors"),
                         (["--tokenizer-mode", "mistral"], "tokenizers"),
                         (["--hf-overrides", '{"num_hidden_layers": 2}'], "config.json is read as it is"),
                         (["--cpu-offload-gb", "4"], "weights stay on the device")):
        assert main(["generate", "--prompt", "x", "--device", "cpu", *argv]) == 2, argv
        assert wanted in capsys.readouterr().err, argv
    assert main(["generate", "--prompt", "x", "--device", "cpu", "--async-scheduling", "--no-async-scheduling"]) == 2
    assert "contradict" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--device", "cpu", "--override-generation-config",
                 '{"temperature": 0.5, "do_sample": true}']) == 2
    assert "do_sample not among the sampling defaults" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--device", "cpu", "--override-generation-config",
                 '{"top_p": 7}']) == 2
    assert "--override-generation-config" in capsys.readouterr().err


def test_override_generation_config_sets_the_sampling_defaults(monkeypatch):
    import hybrid.cli

    built = []
    build = hybrid.cli.build_llm
    monkeypatch.setattr(hybrid.cli, "build_llm", lambda args: built.append(build(args)) or built[-1])
    assert main(["generate", "--prompt", "In the", "--device", "cpu", "--max-tokens", "2",
                 "--override-generation-config", '{"temperature": 0.25, "max_new_tokens": 7, "top_k": 0}']) == 0
    llm = built[0]
    assert llm.default_sampling["temperature"] == 0.25 and llm.default_sampling["max_tokens"] == 7
    assert llm.default_sampling["top_k"] == -1  # (generation_config's 0: off)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.25, 7)


@needs_serve
def test_more_vllm_server_flags(monkeypatch, capsys):
    """--served-model-name with several names, --enable-force-include-usage, --enable-request-id-headers,
    --disable-fastapi-docs, and the TLS / root-path flags passed to uvicorn."""
    import httpx
    import uvicorn

    from server_utils import ServerThread

    runs = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append((app, kw)))
    argv = ["serve", "--device", "cpu", "--max-num-seqs", "2", "--served-model-name", "first", "second",
            "--enable-force-include-usage", "--enable-request-id-headers", "--disable-fastapi-docs",
            "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--root-path", "/api", "--max-log-len", "10",
            "--guided-decoding-backend", "xgrammar", "--chat-template-content-format", "string",
            "--enable-log-outputs", "--response-role", "assistant"]
    assert main(argv) == 0
    [(app, kw)] = runs
    assert (kw["ssl_keyfile"], kw["ssl_certfile"], kw["root_path"]) == ("k.pem", "c.pem", "/api")
    with ServerThread(app) as srv:
        models = httpx.get(srv.base_url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["first", "second"]
        body = {"model": "second", "prompt": "In the", "max_tokens": 2, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60,
                          headers={"X-Request-Id": "abc"}) as s:
            assert s.headers["x-request-id"] == "abc"
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert chunks[0]["model"] == "first" and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
        r = httpx.post(srv.base_url + "/v1/completions", json={**body, "model": "third", "stream": False})
        assert r.status_code == 404 and len(r.headers["x-request-id"]) == 32  # a new id, on refusals too
        assert httpx.get(srv.base_url + "/docs").status_code == 404
        assert httpx.get(srv.base_url + "/openapi.json").status_code == 404
    with pytest.raises(SystemExit):
        main(["serve", "--response-role", "user"])
    assert "--response-role 'user' is not supported" in capsys.readouterr().err
