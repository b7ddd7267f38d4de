"""Command line: `hybrid generate ...` and `hybrid serve ...` (also `python -m hybrid`)."""
from __future__ import annotations

import argparse
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from hybrid.engine_config import (CPU_MAX_NUM_BATCHED_TOKENS, CPU_MAX_NUM_SEQS, CUDA_MAX_NUM_BATCHED_TOKENS,
                                      CUDA_MAX_NUM_SEQS)

    p.add_argument("--model", default=None,
                   help="a checkpoint directory, or a Hugging Face repo id owner/name[@rev] already in the local "
                        "Hugging Face cache (nothing is downloaded; default: the bundled model)")
    p.add_argument("--device", default=None, help="auto | cpu | cuda[:N] (default auto: cuda if available)")
    p.add_argument("--dtype", default=None,
                   help="auto | float32 | bfloat16 | float16 (default auto: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"sequences running at once (default: {CUDA_MAX_NUM_SEQS} on cuda, fewer if memory is "
                        f"short; {CPU_MAX_NUM_SEQS} on cpu)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"tokens per engine step (default: {CUDA_MAX_NUM_BATCHED_TOKENS} on cuda, fewer if memory "
                        f"is short; {CPU_MAX_NUM_BATCHED_TOKENS} on cpu)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the KV and Mamba state of prompt prefixes seen before")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step before scheduling the next (default on CUDA: overlap them)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many processes (one GPU each on cuda; default 1)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the startup warm-up requests (default on cuda: they compile the kernels the first "
                        "batch would)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache storage: auto (the model's dtype) or fp8 (e4m3: twice the tokens)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM's keyword arguments from the engine flags; what is not given is left to LLM's defaults
    (device and dtype "auto", the device-suited sizes), resolved by engine_config as LLM does."""
    return dict(model=args.model, device=args.device or "auto", dtype=args.dtype or "auto",
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size, seed=args.seed,
                enforce_eager=args.enforce_eager, async_scheduling=False if args.no_async_scheduling else None,
                enable_prefix_caching=args.enable_prefix_caching, tensor_parallel_size=args.tensor_parallel_size,
                kv_cache_dtype=args.kv_cache_dtype, warmup=False if args.no_warmup else None)


def build_llm(args: argparse.Namespace):
    """The LLM of the engine flags, through the EngineConfig LLM(...) builds (engine_config)."""
    from hybrid.engine_config import engine_config
    from hybrid.llm import LLM

    return LLM.from_engine_config(engine_config(**engine_kwargs(args)))


def _generate(args: argparse.Namespace) -> int:
    from hybrid.errors import HybridError
    from hybrid.sampling import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sampling_seed, n=args.n, ignore_eos=args.ignore_eos)
        llm = build_llm(args)
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    except HybridError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outs):
        for completion in out.outputs:
            if len(args.prompt) > 1 or len(out.outputs) > 1:
                print(f"--- prompt {prompt!r} [{completion.index}] ({completion.finish_reason})")
            print(prompt + completion.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    from hybrid import __version__

    parser = argparse.ArgumentParser(prog="hybrid", description="Serve hybrid Mamba2/attention language models.")
    parser.add_argument("--version", action="version", version=f"hybrid {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=_generate)

    try:
        from hybrid.server import add_serve_parser  # needs the [serve] extra
    except ImportError as e:
        # `serve` is still a command: it says what is missing instead of "invalid choice"
        missing = getattr(e, "name", None) or str(e)
        serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (needs the [serve] extra)")
        serve.add_argument("rest", nargs=argparse.REMAINDER)
        serve.set_defaults(func=lambda args: _serve_unavailable(missing))
    else:
        serve = add_serve_parser(sub, _add_engine_args)
        serve.set_defaults(func=_serve)
        # `hybrid serve MODEL`, as `vllm serve MODEL` (or --model MODEL)
        serve.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                           help="checkpoint directory or cached hub repo id owner/name[@rev] (same as --model)")

    args = parser.parse_args(argv)
    if getattr(args, "model_path", None) is not None:
        if args.model is not None and args.model != args.model_path:
            parser.error(f"two models given: {args.model_path!r} and --model {args.model!r}")
        args.model = args.model_path
    return args.func(args)


def _serve(args: argparse.Namespace) -> int:
    import logging

    from hybrid.errors import HybridError
    from hybrid.server import run_server, serve_options

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = serve_options(args)
        llm = build_llm(args)
    except (ValueError, HybridError) as e:  # ConfigurationError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_server(llm, args, options)
    return 0


def _serve_unavailable(missing: str) -> int:
    print(f"error: `hybrid serve` needs the HTTP server packages ({missing} is not importable): "
          "pip install 'hybrid[serve]' (FastAPI, uvicorn, prometheus-client)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
