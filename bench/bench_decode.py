"""Decode / prefill throughput of a Nemotron-H-8B-shaped model with random bf16 weights.

The model is built in memory on the GPU (no checkpoint on disk): `hybrid.llm.load_config` and
`load_model` are swapped for a config dict and random weights, then the normal LLM startup runs
(Mamba kernels, memory planning, CUDA-graph capture). Decode is timed on synthetic decode steps
through `runner.execute` (the engine's one call) at a ~2K-token context with random KV / state,
graphs on (replay) and off (eager); prefill is one 8K prompt through `LLM.generate` (max_tokens=1).
Usage: python bench/bench_decode.py [--batches 1 8 64 256] [--ctx 2048] [--prompt 8192] [--ssm-dtype ...]
(bench/run_benchmark.py runs it for both SSM-state dtypes plus the transformers peer, in one command.)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
CONFIG = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072,
    "hidden_size": 4096, "hybrid_override_pattern": PATTERN, "num_hidden_layers": len(PATTERN),
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504,
    "mlp_hidden_act": "relu2", "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
    "conv_kernel": 4, "expand": 2, "chunk_size": 128, "mamba_hidden_act": "silu", "use_conv_bias": True,
    "use_bias": False, "mamba_proj_bias": False, "layer_norm_epsilon": 1e-5, "max_position_embeddings": 16384,
    "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0,
    "time_step_limit": [0.0, float("inf")], "residual_in_fp32": False, "rescale_prenorm_residual": True,
    "attention_bias": False, "torch_dtype": "bfloat16",
}


def random_model(cfg, device, dtype, progress=False):
    from hybrid.model import HybridModel

    model = HybridModel(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in list(model.named_parameters()):
        shape = p.shape
        if name.endswith("A_log"):
            t = torch.log(torch.rand(shape, generator=g, device=device) * 15 + 1)
        elif name.endswith("dt_bias"):
            t = torch.log(torch.expm1(torch.rand(shape, generator=g, device=device) * 0.09 + 0.01))
        elif "norm" in name.split(".")[-1] or name.endswith(".D") or name.endswith("norm.weight"):
            t = torch.ones(shape, device=device)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            t = torch.randn(shape, generator=g, device=device, dtype=dtype) / math.sqrt(fan_in)
        mod_path, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_path) if mod_path else model
        setattr(mod, attr, torch.nn.Parameter(t.to(dtype), requires_grad=False))
    for m in model.modules():
        for b, buf in list(m._buffers.items()):
            if buf is not None:
                m._buffers[b] = buf.to(device)
    return model


def quantize_projections(model, scheme: str) -> int:
    """Every projection (Mamba in/out, attention qkv/o, MLP; not the LM head) as an Fp8Linear, in place,
    as an FP8 checkpoint of that scheme would load: "pcpt" per-channel weights with dynamic per-token
    activations (ModelOpt's FP8_PER_CHANNEL_PER_TOKEN, compressed-tensors' FP8_DYNAMIC), "static"
    per-tensor weights with a static input scale (ModelOpt's FP8 default; not calibrated here: fixed at
    32/448, so that no activation of these random weights saturates; the speed does not depend on it).
    The number replaced."""
    from hybrid.fp8_linear import Fp8Linear
    from hybrid.layers import Linear
    from hybrid.quantization import FP8_DTYPE, STATIC

    if scheme == "pcpt":  # the runtime's own FP8 at load (quantization="fp8" on a 16-bit checkpoint)
        from hybrid.online_fp8 import quantize_model_fp8

        return quantize_model_fp8(model, model.embed.device, model.embed.dtype)[0]
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or name == "lm_head" or name.endswith(".lm_head"):
            continue
        w = module.weight.data.float()
        scale = (w.abs().amax() / 448).clamp_min(1e-12)
        q = (w / scale).clamp(-448, 448).to(FP8_DTYPE)
        del w
        input_scale = torch.tensor(32 / 448, device=q.device)
        fp8 = Fp8Linear(q, scale.float(), input_scale, STATIC, module.bias.data if module.bias is not None else None)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, fp8)
        count += 1
    return count


def make_llm(args, enforce_eager, **llm_kwargs):
    import hybrid.llm as L
    from hybrid.config_parse import parse_config

    cfg = parse_config(CONFIG)
    L.load_config = lambda d: cfg

    def load(d, c, device, dtype, **_):
        model = random_model(c, device, dtype)
        if getattr(args, "fp8", "none") != "none":
            print(f"FP8 ({args.fp8}): {quantize_projections(model, args.fp8)} projections", flush=True)
            torch.cuda.empty_cache()
        return model

    L.load_model = load
    # the in-memory model has no checkpoint to read K/V scales from: an FP8 cache takes scales 1.0
    L.kv_cache_dtype_note = lambda model, model_dir, c, kv_dtype: "" if str(kv_dtype) == "auto" else \
        f"KV cache {kv_dtype} with K/V scales 1.0 (random in-memory model)"
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        llm_kwargs.setdefault("kv_cache_dtype", args.kv_cache_dtype)
    return L.LLM("/nonexistent-random-model", device="cuda", dtype="bfloat16", max_num_seqs=max(args.batches),
                 max_model_len=max(args.prompt, args.ctx) + 64, max_num_batched_tokens=args.prompt,
                 enforce_eager=enforce_eager, cuda_graph_sizes=sorted(set(args.batches)),
                 gpu_memory_utilization=args.util, mamba_ssm_dtype=args.ssm_dtype,
                 mamba_decode_kernels=args.decode_kernels, fused_ops=not args.no_fused_ops, **llm_kwargs)


def decode_batch(llm, n, ctx):
    from hybrid.batch import StepBatch

    ps = llm.kv_cache.page_size
    width = llm.engine.max_pages_per_seq
    per = -(-(ctx + 1) // ps)
    dev = llm.device
    table = torch.zeros(n, width, dtype=torch.int32)
    for i in range(n):
        table[i, :per] = torch.arange(1 + i * per, 1 + (i + 1) * per, dtype=torch.int32)
    loc = table[:, ctx // ps].long() * ps + ctx % ps
    return StepBatch(
        input_ids=torch.randint(0, 1000, (n,), device=dev), positions=torch.full((n,), ctx, device=dev),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((n,), ctx + 1, dtype=torch.int32, device=dev), page_table=table.to(dev),
        kv_write_loc=loc.to(dev), state_slot=torch.arange(n, device=dev),
        has_initial_state=torch.ones(n, dtype=torch.bool, device=dev), logits_indices=torch.arange(n, device=dev),
        num_decodes=n, num_prefills=0, query_lens_cpu=[1] * n, seq_lens_cpu=[ctx + 1] * n,
        state_slot_cpu=list(range(n)), has_initial_state_cpu=[True] * n,
    )


def copy_bandwidth(dev):
    a = torch.empty(4 * 2**30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    bw = 2 * a.numel() * 10 / (time.perf_counter() - t)
    del a, b
    torch.cuda.empty_cache()
    return bw


def step_greedy(logits: torch.Tensor) -> torch.Tensor:
    """A step's greedy tokens as the engine takes them (hybrid.sampling.greedy_tokens), so that the timed
    step includes what LLM.generate's greedy decode pays after the model."""
    from hybrid.sampling import greedy_tokens

    return greedy_tokens(logits)[0]


def time_steps(fn, steps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def marginal_times(kernels: list[tuple[str, float, float]], steps: int) -> dict[str, list[float]]:
    """{name: [marginal us per step, kernels per step]} of `steps` back-to-back steps' kernels (name, start,
    end in us). A kernel's marginal time is how far it moves the step's last end: end - (the latest end of
    the kernels that started before it), at least 0; the first kernel of a step counts its whole span.
    Under programmatic dependent launch a kernel starts while its predecessor runs and its span includes
    that wait, so spans add up to more than the step; marginal times add up to the step's device time
    (without the host gaps between steps) and say which kernels lengthen it."""
    order = sorted(kernels, key=lambda k: k[1])
    per_step = len(order) // steps if steps else 0
    out: dict[str, list[float]] = {}
    for s in range(steps):
        last_end = None
        for name, start, end in order[s * per_step:(s + 1) * per_step]:
            gain = end - start if last_end is None else max(0.0, end - last_end)
            last_end = end if last_end is None else max(last_end, end)
            rec = out.setdefault(name, [0.0, 0])
            rec[0] += gain / steps
            rec[1] += 1 / steps
    return out


def profile_step(fn, label, steps=5):
    """Kernel time per kernel name over `steps` calls (CUPTI sees the kernels inside a CUDA graph), and
    each name's marginal time (marginal_times: what it adds to the step's span)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = {}
    kernels: list[tuple[str, float, float]] = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            rec = per_name.setdefault(ev.name[:90], [0.0, 0])
            rec[0] += ev.device_time / steps
            rec[1] += 1 / steps
            kernels.append((ev.name[:90], ev.time_range.start, ev.time_range.end))
    total = sum(v[0] for v in per_name.values())
    count = sum(v[1] for v in per_name.values())
    print(f"profile {label}: {count:.0f} kernels, {total / 1e3:.3f} ms of kernel time per step")
    for name, (us, k) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"  {us:9.1f} us  {k:5.0f}x  {name}")
    marginal = marginal_times(kernels, steps)
    span = sum(v[0] for v in marginal.values())
    print(f"profile {label}, marginal (what each kernel adds to the step's span): {span / 1e3:.3f} ms per step")
    for name, (us, k) in sorted(marginal.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"  {us:9.1f} us  {k:5.0f}x  {us / max(k, 1):6.2f} us each  {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--util", type=float, default=0.9)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ssm-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--decode-kernels", default="triton", choices=["triton", "library"])
    ap.add_argument("--no-fused-ops", action="store_true",
                    help="LLM(fused_ops=False): norms, residual adds and activations as torch op chains")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager (graphs off) decode timing")
    ap.add_argument("--no-prefill", action="store_true", help="skip the 8K-prompt TTFT measurement")
    ap.add_argument("--greedy", type=int, default=0,
                    help="also generate this many greedy tokens for 4 fixed prompts (bf16- vs fp32-state agreement)")
    ap.add_argument("--fp8", default="none", choices=["none", "pcpt", "static"],
                    help="FP8 projections (the LM head stays bf16): per-channel + dynamic per-token, or "
                         "per-tensor + static input scale")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--profile", action="store_true",
                    help="also print the GPU kernel time per kernel name of one graph replay per batch size")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    t0 = time.perf_counter()
    llm = make_llm(args, enforce_eager=False)
    print(f"startup (random weights, memory plan, graph capture): {time.perf_counter() - t0:.1f} s")
    for s in range(max(args.batches)):
        llm.state_pool.allocate()
    g = torch.Generator(device=dev).manual_seed(0)
    for layer in llm.kv_cache.kv:  # one layer at a time: an FP8 cache is filled through a bf16 draw
        layer.copy_(torch.randn(layer.shape, generator=g, device=dev, dtype=torch.bfloat16))
    llm.state_pool.ssm_state.normal_(generator=g).mul_(0.1)
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    slot_bytes = llm.state_pool.shapes.bytes_per_slot(llm.state_pool.conv_state.dtype, llm.state_pool.ssm_state.dtype)
    cfg = llm.config
    kv_token_bytes = (len(cfg.attention_layers) * 2 * cfg.attention.num_kv_heads * cfg.attention.head_dim
                      * llm.kv_cache.kv.element_size())
    rows = []
    runner = llm.runner
    for n in args.batches:
        batch = decode_batch(llm, n, args.ctx)
        t_graph = time_steps(lambda: step_greedy(runner.execute(batch)), args.steps)
        t_eager = float("nan") if args.no_eager else time_steps(lambda: step_greedy(runner.model(batch, runner.ctx)), args.steps)
        step_bytes = weight_bytes + n * (args.ctx * kv_token_bytes + 2 * slot_bytes)
        floor = step_bytes / bw
        rows.append(dict(batch=n, ctx=args.ctx, graph_ms=t_graph * 1e3, eager_ms=t_eager * 1e3,
                         graph_tok_s=n / t_graph, eager_tok_s=n / t_eager, floor_ms=floor * 1e3,
                         floor_tok_s=n / floor, step_gb=step_bytes / 1e9))
        print(rows[-1], flush=True)
        if args.profile:
            profile_step(lambda: step_greedy(runner.execute(batch)), f"batch {n}, graph replay")
    # the engine runs below (prefill TTFT, greedy tokens): give back the slots the synthetic batches used
    for s in list(llm.state_pool.live_slots):
        llm.state_pool.free(s)
    result = dict(copy_bw_gbs=bw / 1e9, ssm_dtype=args.ssm_dtype, fp8=args.fp8, kv_cache_dtype=args.kv_cache_dtype,
                  decode_kernels=args.decode_kernels,
                  fused_ops=not args.no_fused_ops, weights_gb=weight_bytes / 1e9, slot_mb=slot_bytes / 1e6,
                  memory_plan=llm.memory_plan.summary(max(args.batches), llm.max_model_len, llm.kv_cache.page_size),
                  decode=rows)
    if not args.no_prefill:
        result["prefill"] = prefill_ttft(llm, args, weight_bytes)
    if args.greedy:
        result["greedy"] = greedy_tokens(llm, args.greedy)
    print(json.dumps({k: v for k, v in result.items() if k != "greedy"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


GREEDY_PROMPT_LENS = (16, 100, 500, 2000)


def greedy_tokens(llm, n: int) -> list[list[int]]:
    """Greedy continuations of fixed random prompts through the engine (prefill, then graph decode)."""
    from hybrid.sampling import SamplingParams

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 100000, (k,), generator=g).tolist() for k in GREEDY_PROMPT_LENS]
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def prefill_ttft(llm, args, weight_bytes: int) -> dict:
    """One 8K prompt through generate(max_tokens=1), best of 3 after a warm-up (JIT, autotune); prefill
    runs eagerly with or without graphs."""
    from hybrid.sampling import SamplingParams

    prompt = torch.randint(4, 100000, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], sp, use_tqdm=False)  # warm-up (JIT, autotune)
    ttft = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        torch.cuda.synchronize()
        ttft.append(time.perf_counter() - t)
    best = min(ttft)
    if args.profile:
        profile_step(lambda: llm.generate([prompt], sp, use_tqdm=False), f"{args.prompt}-token prefill", steps=1)
    pre = dict(prompt=args.prompt, ttft_ms=best * 1e3, prefill_tok_s=args.prompt / best,
               flops_tflops=2 * weight_bytes / 2 * args.prompt / best / 1e12)
    print(pre)
    return pre


if __name__ == "__main__":
    main()
