"""Diagnose speculative decoding at a released shape on the GPU: the same biased-greedy requests as
tests/gpu/test_released_shapes.py::test_speculative_decoding_teacher_forced, run under several
engine settings (verify graphs on/off, eager, no speculation), each output token flagged when it is
outside the biased set (a token 20 nats under the bias winning means corrupted logits).

    python bench/diagnose_spec_released.py nemotron-3-nano-30b-a3b [--out DIR]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import zlib

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))
import released_shapes  # noqa: E402

from hybrid import LLM, SamplingParams  # noqa: E402

VOCAB = released_shapes.GPU_VOCAB


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (n,), generator=g).tolist()


def periodic_prompt(period: int, reps: int, seed: int) -> list[int]:
    return random_prompt(3, seed + 1) + random_prompt(period, seed) * reps


SETTINGS = {
    "spec, verify graphs": ({}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}),
    "spec, verify graphs off": ({"HYBRID_VERIFY_GRAPHS": "0"},
                                {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}),
    "spec, eager": ({}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
                         "enforce_eager": True}),
    "no spec, graphs": ({}, {}),
    "no spec, eager sync": ({}, {"enforce_eager": True, "async_scheduling": False}),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--settings", default=";".join(SETTINGS), help="labels separated by ;")
    args = ap.parse_args()
    e = released_shapes.entry(args.name)
    path = tempfile.mkdtemp(prefix=args.name.replace(".", "_"))
    released_shapes.build_checkpoint(e, path, device="cuda", seed=zlib.crc32(args.name.encode()) % 2**31)
    allowed = random_prompt(8, 99)
    bias = {t: 20.0 for t in allowed}
    prompts = [periodic_prompt(5, 4, 1) + allowed, periodic_prompt(3, 6, 2) + allowed,
               random_prompt(40, 140) + allowed]
    results = {}
    for label in args.settings.split(";"):
        env, kw = SETTINGS[label]
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            llm = LLM(path, device="cuda", max_num_seqs=4, page_size=16, max_model_len=256,
                      max_num_batched_tokens=32, check_state=True, gpu_memory_utilization=0.3, **kw)
            outs = llm.generate(prompts, SamplingParams(max_tokens=20, logit_bias=bias, temperature=0.0,
                                                        ignore_eos=True), use_tqdm=False)
            got = [o.outputs[0].token_ids for o in outs]
            stats = {k: v for k, v in llm.engine.stats.items() if k.startswith("spec")}
            stats["verify_graph_replays"] = llm.runner.stats.get("verify_graph_replays")
            del llm
        except Exception as exc:  # a diagnosis: report and go on
            got, stats = None, {"error": repr(exc)[:500]}
        finally:
            for k, v in old.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            gc.collect()
            torch.cuda.empty_cache()
        results[label] = {"tokens": got, "stats": stats}
        flagged = None if got is None else [[("*" if t not in bias else "") + str(t) for t in g] for g in got]
        print(f"[{label}] {stats}", flush=True)
        for row in flagged or []:
            print("   ", " ".join(row), flush=True)
    with open(os.path.join(args.out, f"diagnose_spec_{args.name}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
