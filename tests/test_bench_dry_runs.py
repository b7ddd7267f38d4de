"""The MoE benchmark's CPU dry run (bench/bench_moe.py --dry-run): the full-size configs parse and
build on the meta device, and a shrunken copy of each target shape runs the whole per-shape benchmark
through LLM startup with the random-weight stand-in for the loader. It catches the benchmark drifting
from the runtime it measures (a loader signature change broke every device benchmark once)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_moe_dry_run():
    proc = subprocess.run([sys.executable, "bench/bench_moe.py", "--dry-run", "--shapes", "nemotron-nano",
                           "granite-tiny", "--no-peer"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dry run OK" in proc.stdout
    assert "nemotron-nano" in proc.stdout and "granite-tiny" in proc.stdout


def test_bench_moe_dry_run_with_fp8_experts():
    # --fp8-experts: the routed experts in FP8 (bench_moe.to_fp8_experts) through the same shrunken run
    proc = subprocess.run([sys.executable, "bench/bench_moe.py", "--dry-run", "--shapes", "granite-tiny", "--no-peer",
                           "--fp8-experts"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dry run OK" in proc.stdout
    assert "routed experts in FP8 (per-row scales)" in proc.stdout
