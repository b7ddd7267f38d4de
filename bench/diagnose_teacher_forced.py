"""Teacher-forced gaps at a released shape on the GPU: tests/gpu/test_released_shapes.py's graphs test
(prompts of 1/7/40/75 tokens, 32-token chunks, CUDA graphs, 16 greedy tokens) against an eager engine
that prefills whole prompts, in bf16 and in fp32, printing every token's gap (nats below the
reference's greedy choice), largest first. bf16 gaps that vanish in fp32 are rounding; gaps that
stay point at a path computing something else.

    python bench/diagnose_teacher_forced.py zamba2-1.2b [--dtypes bfloat16,float32]
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

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import released_shapes  # noqa: E402

from hybrid import LLM, SamplingParams  # noqa: E402


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, released_shapes.GPU_VOCAB, (n,), generator=g).tolist()


def gaps(path: str, dtype: str) -> list[tuple[float, int, int, int]]:
    prompts = [random_prompt(n, 100 + n) for n in (1, 7, 40, 75)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm = LLM(path, device="cuda", dtype=dtype, max_num_seqs=8, page_size=16, max_model_len=256,
              max_num_batched_tokens=32, cuda_graph_sizes=[1, 2, 4, 8], gpu_memory_utilization=0.3)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, **greedy),
                                                        use_tqdm=False)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    ref = LLM(path, device="cuda", dtype=dtype, enforce_eager=True, async_scheduling=False, max_num_seqs=8,
              page_size=16, max_model_len=256, max_num_batched_tokens=2048, gpu_memory_utilization=0.3)
    where = [(i, j) for i, o in enumerate(got) for j in range(len(o))]
    res = ref.generate([prompts[i] + got[i][:j] for i, j in where],
                       SamplingParams(max_tokens=1, logprobs=5, **greedy), use_tqdm=False)
    out = []
    for (i, j), r in zip(where, res):
        lp, choice = r.outputs[0].logprobs[0], r.outputs[0].token_ids[0]
        out.append((lp[choice] - lp.get(got[i][j], -99.0), i, j, got[i][j]))
    del ref
    gc.collect()
    torch.cuda.empty_cache()
    return sorted(out, reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    e = released_shapes.entry(args.name)
    path = tempfile.mkdtemp(prefix=args.name.replace(".", "_"))
    released_shapes.build_checkpoint(e, path, device="cuda", seed=zlib.crc32(args.name.encode()) % 2**31)
    report = {}
    for dtype in args.dtypes.split(","):
        g = gaps(path, dtype)
        report[dtype] = g
        print(f"[{args.name} {dtype}] largest gaps (nats, prompt, step, token): "
              f"{[(round(x[0], 3),) + x[1:] for x in g[:6]]}; exact {sum(x[0] == 0 for x in g)}/{len(g)}", flush=True)
    with open(os.path.join(args.out, f"teacher_forced_{args.name}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
