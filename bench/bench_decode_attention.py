"""Decode attention alone: one query token a request over a paged bf16 KV cache, at the attention
shapes of the MoE hybrids (Nemotron-3-Nano: 32 q / 2 kv heads x 128; Granite-4.0-H-Tiny: 12 q / 4 kv),
through FlashInfer's trtllm decode entry point (XQA on sm_90) as attention/trtllm.py calls it, for
several `max_seq_len` values (the runner passes the page table's width, i.e. max_model_len, which sets
how many blocks XQA splits a sequence into), next to FlashInfer's split-KV batch decode wrapper.

Each timing is one CUDA graph of `--layers` back-to-back calls over as many distinct KV caches (so the
KV comes from HBM as in a real step, not from L2), divided by the number of calls.

    python3 bench/bench_decode_attention.py [--ctx 2048] [--layers 24]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.cuda_timing import graph_us_per_call  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-lens", type=int, nargs="+", default=None,
                    help="max_seq_len values to time XQA at (default: the context and 8256)")
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--no-wrapper", action="store_true", help="XQA only (no FlashInfer split-KV wrapper rows)")
    args = ap.parse_args()
    max_lens = args.max_lens or [args.ctx, 8256]
    import flashinfer
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    dev = torch.device("cuda")
    results = []
    for name, hq, hkv in (("nemotron-nano", 32, 2), ("granite-tiny", 12, 4)):
        d = 128
        for page in args.pages:
            for batch in args.batches:
                pages_per_seq = -(-args.ctx // page)
                n_pages = batch * pages_per_seq + 1
                caches = [torch.randn(n_pages, 2, hkv, page, d, device=dev, dtype=torch.bfloat16)
                          for _ in range(args.layers)]
                q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
                seq_lens = torch.full((batch,), args.ctx, device=dev, dtype=torch.int32)
                kv_bytes = batch * args.ctx * hkv * d * 2 * 2
                ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
                row = {"shape": name, "page": page, "batch": batch, "ctx": args.ctx, "kv_mb": kv_bytes / 1e6}
                for max_len in max_lens:
                    width = -(-max_len // page)
                    table = torch.zeros(batch, width, device=dev, dtype=torch.int32)
                    table[:, :pages_per_seq] = (1 + torch.arange(batch * pages_per_seq, device=dev,
                                                                 dtype=torch.int32)).view(batch, -1)

                    def xqa(table=table, width=width):
                        for c in caches:
                            trtllm_batch_decode_with_kv_cache(
                                query=q, kv_cache=c, workspace_buffer=ws, block_tables=table,
                                seq_lens=seq_lens, max_seq_len=width * page, bmm1_scale=d ** -0.5,
                                bmm2_scale=1.0, kv_layout="HND")

                    row[f"xqa_max{max_len}_us"] = graph_us_per_call([xqa], iters=20) / len(caches)
                fws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
                indptr = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * pages_per_seq
                indices = 1 + torch.arange(batch * pages_per_seq, device=dev, dtype=torch.int32)
                last = torch.full((batch,), args.ctx - (pages_per_seq - 1) * page, device=dev, dtype=torch.int32)
                for tc in (() if args.no_wrapper else (False, True)):
                    try:
                        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(fws, kv_layout="HND",
                                                                                use_tensor_cores=tc)
                        wrapper.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=torch.bfloat16)

                        def fi(wrapper=wrapper):
                            for c in caches:
                                wrapper.run(q, c)

                        row[f"fi_decode_tc{int(tc)}_us"] = graph_us_per_call([fi], iters=20) / len(caches)
                    except Exception as e:  # noqa: BLE001 - a benchmark row, not a runtime path
                        row[f"fi_decode_tc{int(tc)}_us"] = f"error: {type(e).__name__}: {str(e)[:120]}"
                floor = kv_bytes / 4.3e12 * 1e6
                row["floor_us"] = floor
                print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}),
                      flush=True)
                results.append(row)
                del caches
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
