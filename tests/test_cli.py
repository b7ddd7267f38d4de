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

    import hybrid.server

    seen = []
    monkeypatch.setattr(hybrid.server, "_serve", lambda args: seen.append(args.model) or 0)
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
