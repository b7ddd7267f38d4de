"""The command line, as a user runs it: `hybrid generate` (and `python -m hybrid`)."""
from __future__ import annotations

import os
import subprocess
import sys

from hybrid import LLM, SamplingParams
from hybrid.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generate_prints_the_greedy_continuation(capsys):
    prompt = "And the LORD said unto Moses,"
    assert main(["generate", "--prompt", prompt, "--max-tokens", "12", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    expected = LLM(None).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert out.strip() == (prompt + expected[0].outputs[0].text).strip()


def test_several_prompts_and_branches(capsys):
    args = ["generate", "--prompt", "In the beginning", "--prompt", "Hear, O Israel:", "--max-tokens", "6",
            "--temperature", "0.8", "--sampling-seed", "3", "--n", "2", "--device", "cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("--- prompt") == 4 and "'In the beginning' [1]" in out and "'Hear, O Israel:' [0]" in out


def test_bad_arguments_are_clear_errors(capsys, tmp_path):
    assert main(["generate", "--prompt", "x", "--temperature", "-1", "--device", "cpu"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x", "--device", "cpu"]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err


def test_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "hybrid", "generate", "--prompt", "Blessed", "--max-tokens", "4",
                           "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Blessed")


def test_async_scheduling_flag():
    import argparse

    from hybrid.cli import _add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    _add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--device", "cpu"]))["async_scheduling"] is None  # LLM's default
    assert engine_kwargs(p.parse_args(["--device", "cpu", "--no-async-scheduling"]))["async_scheduling"] is False


def test_version(capsys):
    import hybrid
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"hybrid {hybrid.__version__}"


def test_serve_takes_the_model_as_a_positional_argument(monkeypatch, capsys, tmp_path):
    import pytest

    import hybrid.cli

    seen = []
    monkeypatch.setattr(hybrid.cli, "_serve", lambda args: seen.append(args.model) or 0)
    assert main(["serve", str(tmp_path), "--port", "0"]) == 0  # as `vllm serve MODEL`
    assert main(["serve", "--model", str(tmp_path)]) == 0
    assert main(["serve", str(tmp_path), "--model", str(tmp_path)]) == 0
    assert seen == [str(tmp_path)] * 3
    with pytest.raises(SystemExit) as e:
        main(["serve", str(tmp_path), "--model", str(tmp_path / "other")])
    assert e.value.code == 2 and "two models given" in capsys.readouterr().err


def test_serve_without_the_server_packages_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "hybrid.server", None)  # as if FastAPI / uvicorn were missing
    assert main(["serve", "some/model"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'hybrid[serve]'" in err and "invalid choice" not in err


# ------------------------------------------------------------------ issue 14 follow-ups: LLM's defaults apply
def _engine_parser():
    import argparse

    from hybrid.cli import _add_engine_args

    p = argparse.ArgumentParser()
    _add_engine_args(p)
    return p


def test_unset_flags_leave_llm_its_defaults():
    from hybrid.cli import engine_kwargs

    kw = engine_kwargs(_engine_parser().parse_args([]))
    assert kw["device"] == "auto" and kw["dtype"] == "auto"
    assert kw["max_num_seqs"] is None and kw["max_num_batched_tokens"] is None and kw["max_model_len"] is None
    kw = engine_kwargs(_engine_parser().parse_args(["--max-num-seqs", "3", "--max-num-batched-tokens", "64",
                                                    "--device", "cpu", "--dtype", "bfloat16"]))
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["device"], kw["dtype"]) == (3, 64, "cpu", "bfloat16")


def test_the_cli_builds_the_config_llm_builds(monkeypatch):
    """build_llm goes through engine_config, as LLM(...) does: the same EngineConfig."""
    import torch

    from hybrid.cli import build_llm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    llm = build_llm(_engine_parser().parse_args([]))
    assert llm.engine_config == LLM().engine_config
    assert (llm.device.type, llm.dtype, llm.max_num_seqs, llm.max_num_batched_tokens) == ("cpu", torch.float32, 8, 256)


_WITH_LOG = ("import logging, sys; logging.basicConfig(level=logging.INFO); from hybrid.cli import main; "
             "sys.exit(main(sys.argv[1:]))")


def test_generate_without_device_flags_takes_the_device_defaults():
    """No --device / --dtype / --max-num-seqs / --max-num-batched-tokens: device "auto" (here the CPU:
    CUDA hidden) and the CPU's 8 sequences and 256-token steps, as the startup log states."""
    proc = subprocess.run([sys.executable, "-c", _WITH_LOG, "generate", "--prompt", "Blessed", "--max-tokens", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Blessed")
    [line] = [ln for ln in proc.stderr.splitlines() if "max_num_seqs" in ln]
    assert " on cpu; weights float32" in line and "max_num_seqs 8 (" in line and "max_num_batched_tokens 256;" in line
    # explicit values still win
    proc = subprocess.run([sys.executable, "-c", _WITH_LOG, "generate", "--prompt", "Blessed", "--max-tokens", "3",
                           "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--device", "auto"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if "max_num_seqs" in ln]
    assert "max_num_seqs 2 (" in line and "max_num_batched_tokens 32;" in line


def test_help_names_hub_repo_ids():
    for command in (["generate"], ["serve"]):
        proc = subprocess.run([sys.executable, "-m", "hybrid", *command, "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT, COLUMNS="200"))
        assert proc.returncode == 0, proc.stderr
        assert "owner/name[@rev]" in proc.stdout and "Hugging Face cache" in proc.stdout, proc.stdout


def test_bad_device_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "hybrid", "generate", "--prompt", "x", "--device", "tpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2 and "error: unknown device 'tpu'" in proc.stderr, proc.stderr


def test_kv_cache_dtype_flag(capsys):
    import argparse

    import pytest

    from hybrid.cli import _add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    _add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["kv_cache_dtype"] == "auto"
    assert engine_kwargs(p.parse_args(["--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "int8"])
    assert "invalid choice" in capsys.readouterr().err


def test_serve_access_log_flag_reaches_uvicorn(monkeypatch, tmp_path):
    """--disable-uvicorn-access-log (vLLM's flag) turns uvicorn's line per request off; the default keeps it."""
    import types

    import hybrid.cli
    from hybrid.server import options

    parsed = []
    monkeypatch.setattr(hybrid.cli, "_serve", lambda args: parsed.append(args) or 0)
    assert main(["serve", str(tmp_path)]) == 0
    assert main(["serve", str(tmp_path), "--disable-uvicorn-access-log", "--log-level", "info"]) == 0
    runs = []
    monkeypatch.setitem(sys.modules, "uvicorn", types.SimpleNamespace(run=lambda app, **kw: runs.append(kw)))
    monkeypatch.setattr(options, "build_app", lambda llm, **kw: types.SimpleNamespace(
        state=types.SimpleNamespace(served_model_name="m")))
    opts = {"api_key": None, "enable_auto_tool_choice": False}
    for args in parsed:
        options.run_server(None, args, opts)
    assert [kw["access_log"] for kw in runs] == [True, False]
    assert runs[1]["log_level"] == "info"
