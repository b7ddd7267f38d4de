"""Quality cost of FP8 on the trained default model (issue 17 item 5), on CPU.

The bundled default model (a small GraniteMoeHybrid trained on the King James Bible) is quantized with
`hybrid.tools.quantize_fp8` into the two checkpoint formats (ModelOpt per-tensor with static
activation scales calibrated on our runtime; compressed-tensors per-channel with dynamic per-token
activations), each also run with the FP8 KV cache (its calibrated K/V scales). Against the fp32
model, for each variant:
- greedy agreement over long generations: for 4 prompts, the tokens generated before the first
  difference and the share of positions that agree;
- perplexity of two texts (a KJV passage, which may be in the training text, and a modern English
  paragraph, which is not), from the prompt logprobs of every token.
The CPU path is the numerics' reference (the CUDA FP8 GEMMs match it up to accumulation order:
tests/gpu/test_fp8_gpu.py). Usage: python bench/bench_fp8_quality.py [--tokens 256] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROMPTS = ["And the LORD said unto Moses,", "In the beginning", "Hear, O Israel:", "And it came to pass"]
TEXTS = {
    "kjv": ("To every thing there is a season, and a time to every purpose under the heaven: a time to be "
            "born, and a time to die; a time to plant, and a time to pluck up that which is planted; a time "
            "to kill, and a time to heal; a time to break down, and a time to build up."),
    "modern": ("The committee met on Tuesday to review the budget for the coming year. After a long "
               "discussion about rising costs, the members agreed to postpone the decision until the "
               "engineers had finished their report on the new building."),
}


def run(path: str, tokens: int, **llm_kw) -> dict:
    from hybrid import LLM, SamplingParams

    llm = LLM(path, device="cpu", max_num_seqs=len(PROMPTS), max_model_len=tokens + 256, **llm_kw)
    greedy = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)]
    ppl = {}
    for name, text in TEXTS.items():
        ids = llm.tokenizer.encode(text)
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0), use_tqdm=False)[0]
        lps = [d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:])]
        ppl[name] = math.exp(-sum(lps) / len(lps))
    return {"greedy": greedy, "ppl": ppl}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    from hybrid import LLM, SamplingParams
    from hybrid.model_source import DEFAULT_MODEL_DIR
    from hybrid.tools.quantize_fp8 import quantize_checkpoint

    tmp = tempfile.mkdtemp()
    variants = {"fp32": (DEFAULT_MODEL_DIR, {})}
    for name, fmt, per_channel, dynamic in (("modelopt per-tensor static", "modelopt", False, False),
                                            ("compressed-tensors per-channel dynamic", "compressed-tensors", True, True)):
        path = quantize_checkpoint(DEFAULT_MODEL_DIR, os.path.join(tmp, fmt), fmt, per_channel=per_channel,
                                   dynamic=dynamic, kv_cache_scales=True)
        variants[f"FP8 {name}"] = (path, {})
        variants[f"FP8 {name} + FP8 KV cache"] = (path, {"kv_cache_dtype": "fp8"})
    variants["fp32 weights + FP8 KV cache (scales 1.0)"] = (DEFAULT_MODEL_DIR, {"kv_cache_dtype": "fp8"})
    results = {name: run(path, args.tokens, **kw) for name, (path, kw) in variants.items()}
    ref = results["fp32"]
    reference = LLM(DEFAULT_MODEL_DIR, device="cpu", max_num_seqs=len(PROMPTS), max_model_len=args.tokens + 256)
    prompt_ids = [reference.tokenizer.encode(p) for p in PROMPTS]
    rows = []
    print(f"| variant | first divergence per prompt ({args.tokens} greedy tokens) | agreement | "
          f"fp32's choice after the same prefix (max regret, nats) | perplexity KJV passage | perplexity modern text |")
    print("|---|---|---:|---:|---:|---:|")
    for name, r in results.items():
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ref["greedy"], r["greedy"])]
        agree = sum(x == y for a, b in zip(ref["greedy"], r["greedy"]) for x, y in zip(a, b)) / sum(map(len, ref["greedy"]))
        # teacher-forced: is each of the variant's tokens the fp32 model's greedy choice after the variant's
        # own prefix (a divergence at a near-tie then costs one token, not the rest of the generation)
        outs = reference.generate([p + g for p, g in zip(prompt_ids, r["greedy"])],
                                  SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0), use_tqdm=False)
        hits = total = 0
        regret = 0.0
        for p, g, o in zip(prompt_ids, r["greedy"], outs):
            for j, tok in enumerate(g):
                d = o.prompt_logprobs[len(p) + j]
                hits += tok == max(d, key=d.get)
                regret = max(regret, max(d.values()) - d[tok])
                total += 1
        forced = hits / total
        rows.append(dict(variant=name, first_divergence=first, agreement=agree, teacher_forced=forced,
                         max_regret=regret, **{f"ppl_{k}": v for k, v in r["ppl"].items()}))
        print(f"| {name} | {', '.join(map(str, first))} | {agree:.1%} | {forced:.1%} ({regret:.2f}) | "
              f"{r['ppl']['kjv']:.3f} | {r['ppl']['modern']:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
