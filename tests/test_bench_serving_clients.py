"""bench/bench_serving.py's client over several processes (--client-procs): one openai client
process cannot read 64 streams' chunks (~0.1-0.2 ms of CPU each), so the levels past that spread
the streams over processes that start together; the level's figures merge theirs."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import bench_serving  # noqa: E402


def test_client_procs_for(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert [bench_serving.client_procs_for(0, c) for c in (1, 8, 16, 17, 64, 256)] == [1, 1, 1, 2, 4, 14]
    assert bench_serving.client_procs_for(3, 64) == 3 and bench_serving.client_procs_for(8, 2) == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert bench_serving.client_procs_for(0, 256) == 1  # no core left beyond the server's: this process


def test_serving_with_two_client_processes(tiny_ckpt, tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    r = bench_serving.main(["--model", tiny_ckpt("nemotron_h"), "--device", "cpu", "--concurrency", "3",
                            "--num-prompts", "5", "--input-len", "12", "--output-len", "6", "--warmup", "1",
                            "--max-num-batched-tokens", "32", "--cpu-threads", "1", "--out-dir", str(tmp_path),
                            "--startup-timeout", "120", "--no-offline", "--client-procs", "2"])
    (row,) = json.loads((tmp_path / "serving.json").read_text())["levels"]
    assert row == json.loads(json.dumps(r["levels"][0]))
    s = row["server"]
    assert s["client_procs"] == 2 and 0 < s["client_cpu_per_proc"]
    assert s["completed"] == 5 and s["failed"] == 0 and s["output_tokens"] == 5 * 6
    assert s["elapsed_s"] > 0 and s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["p50"] > 0
