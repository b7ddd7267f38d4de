"""Command line: `hybrid generate ...` and `hybrid serve ...` (also `python -m hybrid`)."""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys

logger = logging.getLogger("hybrid")

MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")

# an option name as written on a command line: `--name` (letters, digits, `-`, `_`)
_OPTION_NAME = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")


# the JSON-valued flags vLLM also takes one key at a time (`--compilation-config.cudagraph_mode=PIECEWISE`,
# `-O.level 3`), with their short spellings
JSON_FLAGS = {"--compilation-config": "--compilation-config", "-O": "--compilation-config",
              "-cc": "--compilation-config", "--speculative-config": "--speculative-config",
              "--override-generation-config": "--override-generation-config", "--hf-overrides": "--hf-overrides"}
_LEVEL = re.compile(r"-O[0-9]+")
_DOTTED = re.compile(r"(--[A-Za-z0-9][A-Za-z0-9_-]*|-O|-cc)\.([A-Za-z0-9_.]+)")


def normalize_flag_names(argv: list[str]) -> list[str]:
    """`--x_y` spelled `--x-y`, as vLLM accepts both spellings of every flag (model cards write
    `--mamba_ssm_cache_dtype`). Only option names change: `--x_y=a_b` becomes `--x-y=a_b`; values,
    positional arguments and everything after a bare `--` stay as written. A JSON flag given one key at a time
    (vLLM's dotted form, fold_dotted_json_flags) becomes one JSON object."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return fold_dotted_json_flags(out) + list(argv[i:])
        # vLLM's optimization level, -O2 or -O 2 (-O with a JSON object is the compilation config, as before)
        if _LEVEL.fullmatch(arg):
            out += ["--optimization-level", arg[2:]]
            continue
        if arg.isdigit() and out and out[-1] == "-O":
            out[-1] = "--optimization-level"
        name, eq, value = arg.partition("=")
        # a token with a space is a value to argparse even if it starts with `--` (a prompt): the name
        # pattern leaves it alone
        if "_" in name and _OPTION_NAME.fullmatch(name):
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return fold_dotted_json_flags(out)


def _json_value(text: str):
    """A dotted key's value: JSON where it parses (numbers, lists, true/false), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _dotted_flag(arg: str) -> tuple[str, str] | None:
    """(the JSON flag, its key path) of a dotted argument (`--compilation-config.a.b[=v]`), or None."""
    m = _DOTTED.fullmatch(arg.partition("=")[0])
    flag = JSON_FLAGS.get(m.group(1).replace("_", "-")) if m else None
    return None if flag is None else (flag, m.group(2))


def fold_dotted_json_flags(argv: list[str]) -> list[str]:
    """vLLM's dotted form of a JSON flag, `--compilation-config.cudagraph_mode PIECEWISE` or
    `-O.max_cudagraph_capture_size=64` (nested keys a.b.c), merged over that flag's whole-JSON form if that is also
    given, into one `--flag JSON` at the end of argv. Without a dotted JSON flag, argv is returned as it is."""
    flags = {d[0] for arg in argv if (d := _dotted_flag(arg)) is not None}
    if not flags:
        return list(argv)
    keys: dict[str, dict] = {flag: {} for flag in flags}
    whole: dict[str, dict] = {}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        dotted = _dotted_flag(arg)
        flag = dotted[0] if dotted else JSON_FLAGS.get(name.replace("_", "-") if name.startswith("--") else name)
        if flag not in flags:
            out.append(arg)
            i += 1
            continue
        if not eq:  # the value is the next argument
            if i + 1 >= len(argv):
                raise SystemExit(f"hybrid: error: {name} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if dotted is None:  # the whole-JSON form beside dotted keys: its object first, the keys over it
            obj = _json_value(value)
            if not isinstance(obj, dict):
                raise SystemExit(f"hybrid: error: {name}: a JSON object is needed beside its dotted keys, "
                                 f"got {value!r}")
            whole[flag] = obj
            continue
        node = keys[flag]
        *parents, leaf = dotted[1].split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise SystemExit(f"hybrid: error: {name}: {key} is given a value and keys")
        node[leaf] = _json_value(value)
    for flag in sorted(flags):
        out += [flag, json.dumps(_deep_merge(whole.get(flag, {}), keys[flag]))]
    return out


def _deep_merge(base: dict, over: dict) -> dict:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(
            merged.get(key), dict) else value
    return merged


def _json_object(text: str) -> dict:
    """argparse type of --speculative-config: a JSON object (ArgumentTypeError: argparse's
    `error: argument --speculative-config: ...`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object such as '{{\"method\": \"ngram\", \"num_speculative_tokens\": 3}}', got {text!r}")
    return value


def _only(allowed: tuple, why: str):
    """argparse type of a vLLM flag whose other values this runtime cannot honour: the value if it is one of
    `allowed` (compared as text), else argparse's `error: argument --flag: ...` naming why."""
    def parse(text: str):
        if text not in tuple(str(a) for a in allowed):
            raise argparse.ArgumentTypeError(f"{text!r} is not supported: {why}")
        return text
    return parse


class _Unsupported(argparse.Action):
    """A vLLM flag of a feature this runtime does not have: argparse's error naming it, so that a vLLM command
    fails at once instead of serving without what it asked for."""

    def __init__(self, option_strings, dest, why: str, nargs=None, **kw) -> None:
        super().__init__(option_strings, dest, nargs=nargs, default=None, **kw)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string}: {self.why}")


def _add_vllm_engine_flags(p: argparse.ArgumentParser) -> None:
    """vLLM engine flags that vLLM commands carry: the ones with an effect here map to LLM keywords (engine_kwargs),
    the others are accepted with no effect, or refused where ignoring them would serve something else."""
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule step N+1 while step N runs (the default on CUDA; see --no-async-scheduling)")
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes captured as CUDA graphs (default 1, 2, 4, 8, 16, ... max-num-seqs)")
    p.add_argument("--optimization-level", type=int, choices=range(4), default=None, metavar="{0,1,2,3}",
                   help="vLLM's -O0..-O3: the CUDA graphs each implies (0: none, 1: piecewise only, 2 and 3: whole-step "
                        "decode graphs and piecewise graphs, the default); cudagraph_mode in -cc takes precedence")
    p.add_argument("--compilation-config", "-cc", "-O", type=_json_object, default=None, metavar="JSON",
                   help="vLLM's: its cudagraph_capture_sizes (as --cuda-graph-sizes), cudagraph_mode and "
                        "max_cudagraph_capture_size have an effect here; also given one key at a time "
                        "(-cc.cudagraph_mode=PIECEWISE)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="no effect: long prompts are always prefilled in chunks of --max-num-batched-tokens")
    p.add_argument("--tokenizer", default=None,
                   help="the checkpoint's own tokenizer only (model cards repeat the model's name here)")
    p.add_argument("--swap-space", type=float, default=None,
                   help="no effect: a preempted request is recomputed, never swapped to the host")
    p.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                   help="sampling defaults over generation_config.json's, e.g. '{\"temperature\": 0.6}' "
                        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)")
    p.add_argument("--revision", default=None,
                   help="the revision of a hub repo id in the local cache (as MODEL@REVISION)")
    p.add_argument("--download-dir", default=None,
                   help="a Hugging Face hub cache to find a repo id's snapshot in (before the default cache)")
    # (these five are checked by hybrid.llm.vllm_engine_settings, as LLM's keywords of the same names)
    p.add_argument("--load-format", default="auto", help="auto or safetensors")
    p.add_argument("--tokenizer-mode", default="auto", help="auto, hf or slow")
    p.add_argument("--logprobs-mode", default="raw_logprobs",
                   type=_only(("raw_logprobs",), "logprobs are the model's own, before any sampling setting"))
    for flag, what in (("--data-parallel-size", "data parallelism"), ("--pipeline-parallel-size", "pipeline "
                       "parallelism (--tensor-parallel-size shards the model)"), ("--api-server-count", "several "
                       "API server processes")):
        p.add_argument(flag, default="1", type=_only((1,), f"{what} is not implemented"), help="1 only")
    p.add_argument("--cpu-offload-gb", type=float, default=0, help="0 only")
    p.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON", help="{} only")
    p.add_argument("--enable-lora", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--lora-modules", "--max-loras", "--max-lora-rank"):
        p.add_argument(flag, action=_Unsupported, nargs="+", why="LoRA adapters are not supported",
                       help=argparse.SUPPRESS)
    p.add_argument("--kv-cache-memory-bytes", action=_Unsupported, nargs=1, help=argparse.SUPPRESS,
                   why="not supported: size the KV cache with --gpu-memory-utilization")
    noop = p.add_argument_group("more vLLM engine flags accepted with no effect")
    for flag in ("--max-seq-len-to-capture", "--distributed-executor-backend", "--max-parallel-loading-workers",
                 "--prefix-caching-hash-algo", "--long-prefill-token-threshold", "--max-num-partial-prefills",
                 "--max-long-partial-prefills", "--model-impl", "--limit-mm-per-prompt", "--mm-processor-kwargs",
                 "--allowed-local-media-path", "--max-logprobs"):
        noop.add_argument(flag, default=None, help="no effect")
    noop.add_argument("--hf-token", nargs="?", const=True, default=None,
                      help="no effect: a repo id is read from the local Hugging Face cache, nothing is downloaded")
    for flag in ("--calculate-kv-scales", "--disable-cascade-attn", "--enable-expert-parallel",
                 "--disable-custom-all-reduce", "--disable-sliding-window"):
        noop.add_argument(flag, action="store_true", help="no effect")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from hybrid.quantization import QUANTIZATION_NAMES
    from hybrid.engine_config import (CPU_MAX_NUM_BATCHED_TOKENS, CPU_MAX_NUM_SEQS, CUDA_MAX_NUM_BATCHED_TOKENS,
                                      CUDA_MAX_NUM_SEQS)

    p.add_argument("--config", default=None, metavar="FILE",
                   help="vLLM's: a YAML file of flags (names as keys, e.g. 'max-num-seqs: 64'); flags given on the "
                        "command line take precedence")
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
    p.add_argument("--page-size", "--block-size", dest="page_size", type=int, default=16,
                   help="tokens per KV-cache page (--block-size: vLLM's name for it; default 16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="cuda: share of the GPU's memory for weights, activations, Mamba state and KV cache "
                        "(default 0.9)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="reuse the KV and Mamba state of prompt prefixes seen before (default off)")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step before scheduling the next (default on CUDA: overlap them)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over this many processes (one GPU each on cuda; default 1)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the startup warm-up requests (default on cuda: they compile the kernels the first "
                        "batch would)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache storage: auto (the model's dtype) or fp8 (e4m3: twice the tokens)")
    p.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=MAMBA_SSM_CACHE_DTYPES,
                   help="dtype of the Mamba SSM state (default auto: float32, this runtime's default)")
    p.add_argument("--mamba-block-size", type=int, default=None, metavar="N",
                   help="with --enable-prefix-caching, also cache a prompt's Mamba state (and KV) every N tokens, "
                        "so that a later prompt sharing only part of it resumes from there (default: only at the "
                        "end of each prompt)")
    p.add_argument("--mamba-cache-dtype", default="auto", choices=MAMBA_SSM_CACHE_DTYPES,
                   help="vLLM's dtype of the whole Mamba cache: here the SSM state's where --mamba-ssm-cache-dtype "
                        "is auto (the conv state keeps the model's dtype)")
    p.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
                        "(also prompt_lookup_max / prompt_lookup_min; default off)")
    p.add_argument("--quantization", "-q", default=None, metavar="NAME",
                   help="the checkpoint's quantization, in vLLM's names: " + ", ".join(QUANTIZATION_NAMES)
                        + "; must agree with the checkpoint's own quantization config (fp8: either format), as "
                          "nothing is quantized at load")
    p.add_argument("--generation-config", default=None, metavar="auto|vllm|FOLDER",
                   help="default sampling for requests that leave fields unset: auto (default: the checkpoint's "
                        "generation_config.json), vllm (none), or a folder holding a generation_config.json")
    p.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"],
                   help="fcfs (default): requests run in arrival order; priority: by each request's 'priority' "
                        "(lower first, ties by arrival), the lowest preempted first")
    noop = p.add_argument_group("vLLM engine flags accepted with no effect")
    noop.add_argument("--trust-remote-code", action="store_true",
                      help="no code from a checkpoint is ever run: the architectures are implemented here")
    noop.add_argument("--disable-log-stats", action="store_true", help="no effect")
    _add_vllm_engine_flags(p)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM's keyword arguments from the engine flags; what is not given is left to LLM's defaults
    (device and dtype "auto", the device-suited sizes), resolved by engine_config as LLM does."""
    kw = dict(model=args.model, device=args.device or "auto", dtype=args.dtype or "auto",
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size, seed=args.seed,
              enforce_eager=args.enforce_eager, async_scheduling=_async_scheduling(args),
              enable_prefix_caching=args.enable_prefix_caching, tensor_parallel_size=args.tensor_parallel_size,
              kv_cache_dtype=args.kv_cache_dtype, warmup=False if args.no_warmup else None)
    # the vLLM-named flags: passed only when given, so LLM's signature stays the one home of their defaults
    if args.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.mamba_ssm_cache_dtype != "auto":  # auto: LLM's default (float32)
        kw["mamba_ssm_dtype"] = args.mamba_ssm_cache_dtype
    elif args.mamba_cache_dtype != "auto":  # (vLLM's: the whole cache's; the SSM state's here)
        kw["mamba_ssm_dtype"] = args.mamba_cache_dtype
    if args.mamba_block_size is not None:  # (vLLM's grid of cached Mamba states: the prefix cache's interval)
        kw["prefix_cache_interval"] = args.mamba_block_size
    if args.speculative_config is not None:
        kw["speculative_config"] = args.speculative_config
    if args.generation_config is not None:
        kw["generation_config"] = args.generation_config
    if args.scheduling_policy is not None:
        kw["scheduling_policy"] = args.scheduling_policy
    from hybrid.llm import vllm_engine_settings

    kw["model"], sizes = vllm_engine_settings(
        args.model, args.cuda_graph_sizes, revision=args.revision, compilation_config=args.compilation_config,
        load_format=args.load_format, tokenizer_mode=args.tokenizer_mode, cpu_offload_gb=args.cpu_offload_gb,
        hf_overrides=args.hf_overrides, enable_lora=args.enable_lora, download_dir=args.download_dir)
    if sizes is not None:
        kw["cuda_graph_sizes"] = sizes
    for flag in ("tokenizer", "swap_space", "enable_chunked_prefill"):
        if getattr(args, flag) is not None:
            kw[flag] = getattr(args, flag)
    return kw


def _async_scheduling(args: argparse.Namespace) -> bool | None:
    from hybrid.errors import ConfigurationError

    if args.async_scheduling and args.no_async_scheduling:
        raise ConfigurationError("--async-scheduling and --no-async-scheduling contradict each other")
    return True if args.async_scheduling else False if args.no_async_scheduling else None


def check_quantization(name: str, model: str | None) -> str:
    """`--quantization NAME` against the checkpoint of `model` (hybrid.quantization.check_quantization_name),
    read from config.json before any weight is loaded, so a wrong flag fails at once."""
    from hybrid.config_parse import load_config
    from hybrid.model_source import resolve_model
    from hybrid.quantization import check_quantization_name

    model_dir = resolve_model(model).path
    return check_quantization_name(name, model_dir, load_config(model_dir).raw)


def build_llm(args: argparse.Namespace):
    """The LLM of the engine flags, through the EngineConfig LLM(...) builds (engine_config)."""
    from hybrid.engine_config import engine_config, with_compilation_config
    from hybrid.llm import LLM

    # the flags' values checked before anything is read
    config = with_compilation_config(engine_config(**engine_kwargs(args)), args.compilation_config,
                                     args.optimization_level)
    overrides = None
    if args.override_generation_config is not None:
        from hybrid.sampling import generation_overrides

        overrides = generation_overrides(args.override_generation_config, "--override-generation-config")
    if args.trust_remote_code:
        logger.info("--trust-remote-code has no effect: the model architectures are implemented in this runtime, "
                    "which never runs code from a checkpoint")
    if args.quantization is not None:
        found = check_quantization(args.quantization, args.model)
        logger.info("--quantization %s: the checkpoint is %s", args.quantization, found)
    llm = LLM.from_engine_config(config, quantization=args.quantization)
    if overrides:  # over the checkpoint's generation_config.json: the defaults of LLM.generate and the server
        llm.default_sampling.update(overrides)
        logger.info("--override-generation-config: sampling defaults now %s", llm.default_sampling)
    return llm


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


def build_parser() -> argparse.ArgumentParser:
    """The `hybrid` command's parser: `generate` and `serve` (argv goes through normalize_flag_names first)."""
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
    return parser


def _config_file(argv: list[str]) -> str | None:
    """The path of `--config FILE` / `--config=FILE` in argv (normalized), or None."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return None
        if arg == "--config":
            return argv[i + 1] if i + 1 < len(argv) else None
        if arg.startswith("--config="):
            return arg.partition("=")[2]
    return None


def config_file_tokens(data: dict, options: dict) -> list[str]:
    """vLLM's --config YAML (flag names as keys, with - or _) as command-line tokens: `key: value` is `--key value`,
    true a bare `--key`, false `--no-key` where the flag has one (else nothing), a list its items, an object its
    JSON, null nothing."""
    tokens: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None:
            continue
        if value is True:
            tokens.append(flag)
        elif value is False:
            if "--no-" + flag[2:] in options:
                tokens.append("--no-" + flag[2:])
        elif isinstance(value, list):
            tokens += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif isinstance(value, dict):
            tokens += [flag, json.dumps(value)]
        else:
            tokens += [flag, str(value)]
    return tokens


def _apply_config_file(parser: argparse.ArgumentParser, argv: list[str], path: str) -> None:
    """vLLM's `--config FILE`: the YAML file's flags become the subcommand's defaults, so that flags given on the
    command line take precedence; a key that is no flag of the subcommand is argparse's error naming it."""
    import yaml

    command = next((a for a in argv if not a.startswith("-")), None)
    sub = next(a for a in parser._actions if a.dest == "command").choices.get(command)
    if sub is None:
        return  # (argparse names the bad command)
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        sub.error(f"--config {path}: {e}")
    if data is None:
        return
    if not isinstance(data, dict):
        sub.error(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    tokens = normalize_flag_names(config_file_tokens(data, sub._option_string_actions))
    required = [a for a in sub._actions if a.required]
    for action in required:  # (a required flag may still come from the command line)
        action.required = False
    try:
        given, defaults = sub.parse_args(tokens), sub.parse_args([])
    finally:
        for action in required:
            action.required = True
    sub.set_defaults(**{dest: value for dest, value in vars(given).items() if getattr(defaults, dest) != value})


def parse_args(argv: list[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The `hybrid` command's arguments: argv normalized (normalize_flag_names), a --config file's flags as the
    subcommand's defaults, then parsed (by `parser`, build_parser()'s by default)."""
    parser = parser or build_parser()
    argv = normalize_flag_names(list(argv))
    path = _config_file(argv)
    if path is not None:
        _apply_config_file(parser, argv, path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(sys.argv[1:] if argv is None else list(argv), parser)
    if getattr(args, "model_path", None) is not None:
        if args.model is not None and args.model != args.model_path:
            parser.error(f"two models given: {args.model_path!r} and --model {args.model!r}")
        args.model = args.model_path
    return args.func(args)


def _serve(args: argparse.Namespace) -> int:
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
