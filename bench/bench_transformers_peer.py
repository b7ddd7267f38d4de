"""The peer: transformers' own generate() on the same Nemotron-H-8B-shaped model (random bf16 weights)
at batch 1, on the GPU. Reports ms per decode step and tokens/s, to set next to bench_decode.py.

transformers' plain-torch Mamba path cannot prefill long prompts on this model (its chunked scan
materialises [b, chunks, L, L, heads] tensors: out of memory at 512 tokens on an H200), so the peer
decodes after a short prompt; the per-step cost of its decode path hardly depends on the context.
Usage: python bench/bench_transformers_peer.py [--prompt 16] [--new 64]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_decode import CONFIG  # noqa: E402  (the same model shape)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = NemotronHConfig(**cfg)
    t = time.perf_counter()
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = NemotronHForCausalLM(config).eval()
        torch.set_default_dtype(torch.float32)
    print(f"built {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters in {time.perf_counter() - t:.0f} s")
    ids = torch.randint(4, 100000, (1, args.prompt), device="cuda")
    gen = dict(do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **gen)  # warm-up
        times = {}
        for n in (1, args.new + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
            torch.cuda.synchronize()
            times[n] = time.perf_counter() - t
    step = (times[args.new + 1] - times[1]) / args.new  # generate(1) is the prefill alone
    result = {"peer": "transformers generate", "batch": 1, "prompt": args.prompt,
              "decode_ms_per_step": step * 1e3, "decode_tok_s": 1 / step, "prefill_ms": times[1] * 1e3}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
