"""Quality cost of a bf16 SSM state: greedy agreement with the fp32-state run over long generations.

Runs on CPU (fp32 weights and activations, only the SSM state dtype changes) on the bundled default
model and on the tiny random checkpoints of the test suite (built with transformers into a temp dir).
For each prompt: the number of greedy tokens generated before the bf16-state run first differs
from the fp32-state run, and the fraction of positions that agree.
Usage: python bench/bench_bf16_state_quality.py [--tokens 256]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def compare(path: str, prompts: list, tokens: int) -> list[tuple[int, float]]:
    from hybrid import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, max_num_seqs=len(prompts), max_model_len=tokens + 128, mamba_ssm_dtype=dtype)
        runs[dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    out = []
    for a, b in zip(runs["float32"], runs["bfloat16"]):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        out.append((first, sum(x == y for x, y in zip(a, b)) / len(a)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import tiny_checkpoints as tc

    g = torch.Generator().manual_seed(0)
    cases = [("default model (KJV)", os.path.join(ROOT, "hybrid", "default_model"),
              ["And the LORD said unto Moses,", "In the beginning", "Hear, O Israel:", "And it came to pass"])]
    tmp = tempfile.mkdtemp()
    for name, build in [("nemotron_h", lambda p: tc.build_nemotron_h(p)),
                        ("granite_moe", lambda p: tc.build_granite_hybrid(p, moe=True)),
                        ("bamba", lambda p: tc.build_bamba(p))]:
        path = str(build(os.path.join(tmp, name)))
        prompts = [torch.randint(4, 150, (n,), generator=g).tolist() for n in (1, 7, 33, 90)]
        cases.append((f"tiny random {name}", path, prompts))
    print("| checkpoint | greedy tokens | first divergence per prompt | agreement per prompt |")
    print("|---|---:|---|---|")
    for name, path, prompts in cases:
        res = compare(path, prompts, args.tokens)
        firsts = ", ".join(str(f) for f, _ in res)
        agree = ", ".join(f"{a:.0%}" for _, a in res)
        print(f"| {name} | {args.tokens} | {firsts} | {agree} |", flush=True)


if __name__ == "__main__":
    main()
