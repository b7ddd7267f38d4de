"""The benchmark tools (bench/bench_throughput.py, bench/bench_serving.py) on a tiny checkpoint, on
CPU, for a few requests: they run end to end and write JSON with the fields the device runs read."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import bench_serving, bench_throughput  # noqa: E402

RUN_FIELDS = {"num_requests", "prompt_tokens", "output_tokens", "elapsed_s", "requests_per_s",
              "total_tokens_per_s", "output_tokens_per_s", "split"}
SPLIT_FIELDS = {"prefill_s", "decode_s", "host_s", "prefill_steps", "decode_steps", "mixed_steps"}


def test_throughput_json(tiny_ckpt, tmp_path):
    out = tmp_path / "tp.json"
    bench_throughput.main(["--model", tiny_ckpt("nemotron_h"), "--device", "cpu", "--num-prompts", "4",
                           "--input-len", "12", "--output-len", "6", "--max-num-seqs", "2",
                           "--max-num-batched-tokens", "32", "--repeat", "2", "--json", str(out)])
    r = json.loads(out.read_text())
    assert {"startup_s", "runs", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
            "first_over_second_elapsed"} <= set(r)
    assert len(r["runs"]) == 2
    for run in r["runs"]:
        assert RUN_FIELDS <= set(run) and SPLIT_FIELDS <= set(run["split"])
        assert run["output_tokens"] == 4 * 6 and run["prompt_tokens"] == 4 * 12  # ignore_eos: exact lengths
        assert run["split"]["prefill_steps"] >= 1 and run["split"]["decode_steps"] >= 5


def test_throughput_sampled_ab(tiny_ckpt, tmp_path):
    """--sampled-ab runs the greedy batch, then the same batch once per sampler setting, each with its
    decode rate against greedy's and exact lengths."""
    out = tmp_path / "tp.json"
    bench_throughput.main(["--model", tiny_ckpt("nemotron_h"), "--device", "cpu", "--num-prompts", "3",
                           "--input-len", "10", "--output-len", "5", "--max-num-seqs", "3",
                           "--sampled-ab", "--json", str(out)])
    r = json.loads(out.read_text())
    assert len(r["runs"]) == 1 and set(r["sampled"]) == set(bench_throughput.SAMPLED_SETTINGS)
    for name, run in r["sampled"].items():
        assert RUN_FIELDS <= set(run) and run["output_tokens"] == 3 * 5
        assert run["sampling"]["temperature"] == 0.8 and run["sampling"]["per_request_seeds"]
        assert run["decode_rate_vs_greedy"] > 0 and run["output_rate_vs_greedy"] > 0
    with pytest.raises(SystemExit):
        bench_throughput.main(["--model", tiny_ckpt("nemotron_h"), "--device", "cpu", "--repeat", "0", "--sampled-ab"])


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="--cold-load evicts pages with posix_fadvise (Linux)")
def test_throughput_cold_load_and_compile_counts(tiny_ckpt, tmp_path):
    """--cold-load reads the weight files once from a dropped page cache (the disk's speed) before the
    start, and reports the load phase against it; every run lists its Triton compiles (none on CPU)."""
    path = tiny_ckpt("granite_moe")
    out = tmp_path / "tp.json"
    bench_throughput.main(["--model", path, "--device", "cpu", "--num-prompts", "2", "--input-len", "8",
                           "--output-len", "3", "--max-num-seqs", "2", "--cold-load", "--json", str(out)])
    r = json.loads(out.read_text())
    weights = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    assert r["disk"]["bytes"] == weights and r["disk"]["read_gb_s"] > 0 and r["disk"]["cold_load_gb_s"] > 0
    assert r["runs"][0]["triton_compiles"] == {"count": 0, "seconds": 0, "kernels": []}


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="--cold-load evicts pages with posix_fadvise (Linux)")
def test_load_only_cold(tiny_ckpt, tmp_path):
    """--load-only --cold-load: the disk's speed, then the load alone from a dropped page cache."""
    out = tmp_path / "load.json"
    bench_throughput.main(["--model", tiny_ckpt("nemotron_h"), "--device", "cpu", "--load-only", "--cold-load",
                           "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["benchmark"] == "load" and r["bytes"] == r["disk"]["bytes"] and r["load_gb_s"] > 0


def test_throughput_shape_saved_with_transformers(tmp_path):
    """--shape: a released shape (cut down by --shape-override) saved with save_pretrained, then loaded."""
    pytest.importorskip("transformers")
    tiny = {"hidden_size": 64, "num_hidden_layers": 3, "hybrid_override_pattern": "M*-", "intermediate_size": 64,
            "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300}
    out = tmp_path / "tp.json"
    args = ["--shape", "nemotron-nano-9b-v2", "--shape-dir", str(tmp_path / "shapes"), "--shape-override",
            json.dumps(tiny), "--device", "cpu", "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
            "--max-num-batched-tokens", "32", "--json", str(out)]
    bench_throughput.main(args)
    ckpt = tmp_path / "shapes" / "nemotron-nano-9b-v2"
    assert (ckpt / "tokenizer.json").is_file() and (ckpt / ".complete").is_file()
    assert json.loads((ckpt / "config.json").read_text())["hybrid_override_pattern"] == "M*-"
    assert json.loads(out.read_text())["runs"][0]["output_tokens"] == 8
    bench_throughput.main(args)  # the second run reuses the saved checkpoint
    assert json.loads(out.read_text())["checkpoint_build_s"] == 0.0


def test_serving_json(tiny_ckpt, tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    r = bench_serving.main(["--model", tiny_ckpt("nemotron_h"), "--device", "cpu", "--concurrency", "1", "2",
                            "--num-prompts", "2", "--input-len", "12", "--output-len", "6", "--warmup", "1",
                            "--max-num-batched-tokens", "32", "--cpu-threads", "1", "--out-dir", str(tmp_path),
                            "--startup-timeout", "120", "--offline-timeout", "120"])
    saved = json.loads((tmp_path / "serving.json").read_text())
    assert saved["levels"] == json.loads(json.dumps(r["levels"]))
    assert [row["concurrency"] for row in saved["levels"]] == [1, 2]
    for row in saved["levels"]:
        s = row["server"]
        assert s["completed"] == 2 and s["failed"] == 0 and s["output_tokens"] == 2 * 6
        for k in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert set(s[k]) == {"mean", "p50", "p99"} and s[k]["p50"] > 0
        assert row["offline"]["output_tokens"] == 2 * 6 and row["server_over_offline"] > 0
    assert saved["server_startup_s"] > 0 and saved["offline_error"] is None
    if saved["plot"] is not None:
        assert os.path.getsize(saved["plot"]) > 0


@pytest.mark.parametrize("scheme", ["pcpt", "static"])
def test_bench_decode_fp8_projections(tiny_ckpt, scheme):
    """bench_decode.py --fp8: every projection but the LM head becomes an Fp8Linear of that scheme, and
    the model still computes (per-channel + dynamic: nearly what it did; the static scheme's input
    scale is not calibrated, so only finite)."""
    from bench.bench_decode import quantize_projections
    from hybrid import LLM, SamplingParams
    from hybrid.fp8_linear import Fp8Linear
    from hybrid.layers import Linear

    sp = SamplingParams(max_tokens=1, logprobs=5, temperature=0.0)
    llm = LLM(tiny_ckpt("nemotron_h"), device="cpu", max_num_seqs=2)
    before = llm.generate([[5, 6, 7, 8, 9]], sp, use_tqdm=False)[0].outputs[0].logprobs[0]
    linears = sum(isinstance(m, Linear) for m in llm.model.modules())
    n = quantize_projections(llm.model, scheme)
    fp8 = [m for m in llm.model.modules() if isinstance(m, Fp8Linear)]
    assert n == len(fp8) == linears - 1 and isinstance(llm.model.lm_head, Linear)  # all but the LM head
    assert all((m.input_scale is None) == (scheme == "pcpt") for m in fp8)
    after = llm.generate([[5, 6, 7, 8, 9]], sp, use_tqdm=False)[0].outputs[0].logprobs[0]
    assert all(v == v and abs(v) < float("inf") for v in after.values())
    if scheme == "pcpt":
        top = max(before, key=before.get)
        assert top in after and abs(after[top] - before[top]) < 0.5


def test_marginal_times_add_up_to_each_steps_span():
    """bench_decode.marginal_times: under PDL a kernel's span overlaps its predecessor's; each kernel is
    charged only what it adds past the latest end before it, so the charges sum to the steps' spans
    (host gaps between steps excluded) and a kernel hidden under another's span costs nothing."""
    from bench.bench_decode import marginal_times

    # one step: a [0, 10], b starts early and waits [2, 14], c hidden under b [3, 12], d [13, 20]
    step = [("a", 0.0, 10.0), ("b", 2.0, 14.0), ("c", 3.0, 12.0), ("d", 13.0, 20.0)]
    second = [(n, s + 100.0, e + 100.0) for n, s, e in step]  # the next step after a host gap
    got = marginal_times(step + second, steps=2)
    assert got == {"a": [10.0, 1], "b": [4.0, 1], "c": [0.0, 1], "d": [6.0, 1]}
    assert sum(v[0] for v in got.values()) == 20.0  # the step's span, not the 38 us of summed spans
