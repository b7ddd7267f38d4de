"""How far the varlen prefill path (HYBRID_VARLEN_PREFILL=1) moves a bf16 engine's next-token
log-probabilities, next to how far the row-by-row path already sits from an fp32 engine (the noise
floor), on the tiny Bamba checkpoint of tests/gpu/test_state_under_graphs.py (bf16 SSM state).

    python3 bench/diag_varlen_noise.py

Prints, per configuration, the largest and mean |logprob - fp32 engine's| over every vocabulary entry
of every prefix, and the largest gap by which its greedy choice falls below the fp32 engine's.
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

PROMPTS = [[7, 19, 33, 41, 5, 60, 12, 88, 9], [4], [100, 3, 57, 22, 61], [45], list(range(20, 60))]


def logprob_rows(llm, prefixes, vocab):
    from hybrid import SamplingParams

    res = llm.generate(prefixes, SamplingParams(max_tokens=1, logprobs=vocab, temperature=0.0), use_tqdm=False)
    rows = torch.full((len(prefixes), vocab), -1e9, dtype=torch.float64)
    for i, r in enumerate(res):
        for t, lp in r.outputs[0].logprobs[0].items():
            rows[i, t] = lp
    return rows


def main() -> None:
    import tiny_checkpoints
    from hybrid import LLM, SamplingParams
    from hybrid.ops import triton_guard

    path = str(tiny_checkpoints.build_bamba(tempfile.mkdtemp(), seed=3))
    truth = LLM(path, device="cuda", dtype="float32", mamba_ssm_dtype="float32", max_num_seqs=4, page_size=16,
                max_model_len=128, gpu_memory_utilization=0.2)
    vocab = truth.config.vocab_size
    outs = truth.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    prefixes = [p + o.outputs[0].token_ids[:j] for p, o in zip(PROMPTS, outs) for j in range(24)]
    ref = logprob_rows(truth, prefixes, vocab)
    del truth
    for seqs in (4, 1):
        llm = LLM(path, device="cuda", dtype="bfloat16", mamba_ssm_dtype="bfloat16", max_num_seqs=seqs, page_size=16,
                  max_model_len=128, gpu_memory_utilization=0.2)
        for varlen in ("0", "1"):
            os.environ["HYBRID_VARLEN_PREFILL"] = varlen
            triton_guard.reset_switches()
            rows = logprob_rows(llm, prefixes, vocab)
            live = ref > -30
            diff = (rows - ref).abs()[live]
            choice = rows.argmax(-1)
            gap = (ref.max(-1).values - ref.gather(1, choice[:, None])[:, 0]).max()
            print({"bf16_max_num_seqs": seqs, "varlen": varlen, "max_abs": round(float(diff.max()), 4),
                   "mean_abs": round(float(diff.mean()), 5), "worst_gap_vs_fp32": round(float(gap), 4),
                   "greedy_agree": float((choice == ref.argmax(-1)).float().mean())}, flush=True)
        del llm


if __name__ == "__main__":
    main()
