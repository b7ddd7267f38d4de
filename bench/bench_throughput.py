"""Offline throughput: N requests through one `LLM.generate` call, shaped like vLLM's
`benchmarks/benchmark_throughput.py`.

    python bench/bench_throughput.py --model DIR --num-prompts 256 --input-len 1024 --output-len 256
    python bench/bench_throughput.py --shape nemotron-h-8b --num-prompts 64 --input-len 1024 --output-len 257 \\
        --max-num-seqs 256 --max-num-batched-tokens 8192 --mamba-ssm-dtype bfloat16 --repeat 2 --json out.json

`--model DIR` loads a checkpoint directory; `--shape NAME` first saves a random-weight model of a
released shape with transformers' `save_pretrained` (sharded, bf16, built on the GPU when there is
one) into `--shape-dir` (reused when it is already there), so the run loads from disk exactly as
a user's checkpoint does. Shapes: `nemotron-h-8b` (bench/bench_decode.py's CONFIG) and every entry
of tests/data/released_configs.json (`nemotron-nano-9b-v2`, ...). The saved shape gets a word-level
tokenizer covering the whole vocabulary, so that `hybrid serve` streams one text delta per token.

Prompts are random token ids (`--input-len`, `--output-len`, `--range-ratio` for lengths drawn
uniformly in [len*(1-r), len*(1+r)]) or a JSONL file (`--dataset`: one object a line with
"prompt" (text or token ids) and optionally "output_len"). Every request has ignore_eos, so it
generates exactly its output length; greedy unless `--temperature` is given.

Reported per run (`--repeat 2` runs the same batch twice: the first batch after startup pays any
compilation the startup missed, the second shows the steady state): requests/s, total (prompt +
output) tokens/s, output tokens/s, and the wall time split into
- prefill: device time of the steps that hold prefill rows (mixed prefill+decode steps included,
  counted separately as `mixed_steps`),
- decode: device time of the decode-only steps,
- host: the rest of the wall time, i.e. the host work (scheduling, batch building, outputs) that did
  not hide behind the device, plus any device idle time.
The engine has no per-step timing hook, so the benchmark wraps `llm.runner.execute` (step start)
and `llm.engine._launch` (step end: forward, sampling and the token copy queued) on the instance.
`--split events` (default) records CUDA events there: no synchronisation is added, async
scheduling keeps overlapping, but an event interval also counts device idle gaps inside a step
(an eager prefill whose kernel launches outrun the GPU). `--split sync` synchronises the device
around each step instead (strict device time, but it serialises host and device: the wall time
then includes what async scheduling normally hides); `--split off` installs nothing. Compilation
inside a step (Triton / FlashInfer JIT in a first batch) counts in that step's interval; each run
also lists the Triton compiles that happened in it (kernel, seconds, argument classes), which the
startup warm-up should leave at none.
Startup (LLM construction: load, kernels, memory planning, graph capture) is timed separately.
`--sampled-ab` then runs the same batch sampled (temperature 0.8, request i seeded with seed + i) with
top-p 0.95, top-k 50, min-p 0.05 and the three together, each reported with its decode step rate
against the last greedy run's (the same steps, so that ratio is the ratio of decode tokens/s).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RELEASED_CONFIGS = os.path.join(ROOT, "tests", "data", "released_configs.json")
FIRST_NORMAL_ID = 4  # ids 0..3 are pad / bos / eos / unk in the shapes' tokenizer: prompts avoid them


# ------------------------------------------------------------------------------ shapes on disk
def shape_config(name: str) -> dict:
    """config.json of a released shape (full size, hub spelling)."""
    if name == "nemotron-h-8b":
        from bench.bench_decode import CONFIG

        return dict(CONFIG)
    with open(RELEASED_CONFIGS) as f:
        table = json.load(f)  # Python's json reads the `Infinity` literal hub files use
    for e in table["entries"]:
        if e["name"] == name:
            return dict(e["config"])
    raise SystemExit(f"unknown shape '{name}'; choose one of {shape_names()}")


def shape_names() -> list[str]:
    with open(RELEASED_CONFIGS) as f:
        names = [e["name"] for e in json.load(f)["entries"]]
    return ["nemotron-h-8b"] + [n for n in names if n != "nemotron-h-8b"]


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    """bench_decode.random_model's draw (known to keep the 8B shape's activations finite in bf16)
    instead of transformers' init: A_log / dt_bias in their usual ranges, norms and D at one, every
    other weight N(0, 1/fan_in)."""
    for name, p in model.named_parameters():
        g = torch.Generator(device=p.device).manual_seed(seed * 1000003 + zlib.crc32(name.encode()))
        module, _, leaf = name.rpartition(".")
        if leaf == "A_log":
            t = torch.log(torch.rand(p.shape, generator=g, device=p.device) * 15 + 1)
        elif leaf == "dt_bias":
            t = torch.log(torch.expm1(torch.rand(p.shape, generator=g, device=p.device) * 0.09 + 0.01))
        elif "norm" in module.rpartition(".")[2] or leaf == "D":
            t = torch.ones(p.shape, device=p.device)
        else:
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            t = torch.randn(p.shape, generator=g, device=p.device) / math.sqrt(fan_in)
        p.copy_(t.to(p.dtype))


def write_wordlevel_tokenizer(path: str, vocab_size: int) -> None:
    """A tokenizer.json with one word per id ("w123"), so random ids decode to text and every
    streamed token is a non-empty delta (the server sends no event for a token without text)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "unk_token": "<unk>"}, f)


def build_shape_checkpoint(name: str, out_dir: str, device: str, seed: int = 0,
                           overrides: dict | None = None) -> tuple[str, float]:
    """Save the shape with random bf16 weights (transformers' own class, save_pretrained, 5 GB
    shards) to out_dir/name unless a complete copy is already there. Returns (path, seconds)."""
    import transformers

    path = os.path.join(out_dir, name)
    done = os.path.join(path, ".complete")
    if os.path.isfile(done):
        print(f"[shape] reusing {path}", flush=True)
        return path, 0.0
    t0 = time.perf_counter()
    cfg = shape_config(name)
    cfg.update(overrides or {})
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    # bf16 directly on the device: the 8B shape is 16 GB (32 GB in fp32), built in seconds on a GPU
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    _redraw(model, seed)
    built = time.perf_counter() - t0
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="5GB")
    del model
    gc.collect()  # module reference cycles: free the 16 GB before the LLM plans its memory
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        saved = json.load(f)
    from tests.released_shapes import hubify  # the hub spelling of layer types, one copy

    hubify(saved)
    with open(cfg_path, "w") as f:
        json.dump(saved, f, indent=2)
    write_wordlevel_tokenizer(path, int(saved["vocab_size"]))
    open(done, "w").close()
    dt = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"[shape] {name}: built in {built:.1f} s, saved {size / 1e9:.2f} GB to {path} in {dt - built:.1f} s",
          flush=True)
    return path, dt


# ------------------------------------------------------------------------------ requests
@dataclass
class Request:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


def _lengths(n: int, mean: int, ratio: float, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(n: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0,
                    range_ratio: float = 0.0) -> list[Request]:
    """n prompts of random token ids in [FIRST_NORMAL_ID, vocab_size)."""
    rng = random.Random(seed)
    ins, outs = _lengths(n, input_len, range_ratio, rng), _lengths(n, output_len, range_ratio, rng)
    hi = max(FIRST_NORMAL_ID + 1, vocab_size) - 1
    return [Request([rng.randint(FIRST_NORMAL_ID, hi) for _ in range(i)], i, o) for i, o in zip(ins, outs)]


def dataset_requests(path: str, n: int, output_len: int, tokenizer) -> list[Request]:
    """The first n lines of a JSONL file: {"prompt": text or token ids, "output_len": int (optional)}."""
    reqs = []
    with open(path) as f:
        for line in f:
            if len(reqs) >= n:
                break
            if not line.strip():
                continue
            d = json.loads(line)
            prompt = d["prompt"]
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise SystemExit(f"{path}: text prompts need a checkpoint with a tokenizer")
                plen = len(tokenizer.encode(prompt))
            else:
                plen = len(prompt)
            reqs.append(Request(prompt, plen, int(d.get("output_len", output_len))))
    if not reqs:
        raise SystemExit(f"{path}: no prompts")
    return reqs


def vocab_size_of(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


# ------------------------------------------------------------------------------ step timing
@dataclass
class StepRecord:
    prefill: bool  # the step holds prefill (or replay) rows, possibly with decode rows too
    mixed: bool  # prefill rows and decode rows in one step
    tokens: int
    start: object  # torch.cuda.Event, or a perf_counter float
    end: object = None


@dataclass
class StepTimer:
    """Times each engine step from `runner.execute` (its forward starts) to the end of
    `engine._launch` (sampling and the token copy queued), per instance (module doc)."""
    llm: object
    mode: str = "events"  # events | sync | off
    records: list[StepRecord] = field(default_factory=list)

    def install(self) -> None:
        if self.mode == "off":
            return
        runner, engine = self.llm.runner, self.llm.engine
        cuda = self.llm.device.type == "cuda"
        execute, launch = runner.execute, engine._launch
        pending: list[StepRecord] = []

        def mark():
            if cuda and self.mode == "sync":
                torch.cuda.synchronize()
            if cuda and self.mode == "events":
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                return ev
            return time.perf_counter()

        def timed_execute(batch, *a, **k):
            prefill = batch.num_prefills > 0 or getattr(batch, "num_replay", 0) > 0
            pending.append(StepRecord(prefill, prefill and batch.num_decodes > 0, batch.num_tokens, mark()))
            return execute(batch, *a, **k)

        def timed_launch(chunks, *a, **k):
            out = launch(chunks, *a, **k)
            if pending:
                rec = pending.pop()
                pending.clear()
                rec.end = mark()
                self.records.append(rec)
            return out

        runner.execute, engine._launch = timed_execute, timed_launch

    def reset(self) -> None:
        self.records.clear()

    def summary(self) -> dict:
        if self.mode == "off" or not self.records:
            return {}
        if self.llm.device.type == "cuda":
            torch.cuda.synchronize()
        out = {"prefill_s": 0.0, "decode_s": 0.0, "prefill_steps": 0, "decode_steps": 0, "mixed_steps": 0,
               "prefill_step_tokens": 0}
        for r in self.records:
            dt = r.start.elapsed_time(r.end) / 1e3 if isinstance(r.start, torch.cuda.Event) else r.end - r.start
            kind = "prefill" if r.prefill else "decode"
            out[f"{kind}_s"] += dt
            out[f"{kind}_steps"] += 1
            out["mixed_steps"] += r.mixed
            out["prefill_step_tokens"] += r.tokens if r.prefill else 0
        out["decode_ms_per_step"] = out["decode_s"] / out["decode_steps"] * 1e3 if out["decode_steps"] else None
        return out


# ------------------------------------------------------------------------------ the run
def llm_kwargs(args: argparse.Namespace, model_dir: str, max_len: int) -> dict:
    kw = dict(model=model_dir, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, mamba_ssm_dtype=args.mamba_ssm_dtype,
              enforce_eager=args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching,
              max_model_len=args.max_model_len or max_len, seed=args.seed,
              tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype)
    if args.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.no_async_scheduling:
        kw["async_scheduling"] = False
    return kw


def _weight_files(model_dir: str) -> list[str]:
    return sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors"))


def evict_from_page_cache(paths: list[str]) -> None:
    """Ask the kernel to drop the files' cached pages (flushed first: dirty pages are not dropped)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_disk(model_dir: str, chunk: int = 64 << 20) -> dict:
    """The disk's sequential read speed over the checkpoint's weight files, from a dropped page
    cache, then the cache dropped again for the load that follows. A speed far above a disk's (tens
    of GB/s) means the kernel kept the pages (posix_fadvise is advice), and the cold load is not."""
    paths = _weight_files(model_dir)
    if not paths:
        raise SystemExit(f"--cold-load: no .safetensors files in {model_dir}")
    if not hasattr(os, "posix_fadvise"):
        raise SystemExit("--cold-load needs os.posix_fadvise (Linux)")
    evict_from_page_cache(paths)
    buf = bytearray(chunk)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    seconds = time.perf_counter() - t0
    evict_from_page_cache(paths)
    out = {"bytes": total, "read_s": seconds, "read_gb_s": total / seconds / 1e9}
    print(f"disk: {total / 1e9:.2f} GB of weight files read in {seconds:.2f} s from a dropped page cache "
          f"({out['read_gb_s']:.2f} GB/s); dropped again for the load", flush=True)
    return out


# --sampled-ab: after the greedy runs, the same batch once per sampler setting (temperature 0.8, a seed
# per request), to set sampled decode against greedy in one process (issue 15: >= 90% at batch 256)
SAMPLED_SETTINGS = {
    "top_p": dict(top_p=0.95),
    "top_k": dict(top_k=50),
    "min_p": dict(min_p=0.05),
    "top_k_top_p_min_p": dict(top_k=50, top_p=0.95, min_p=0.05),
}


def run_once(llm, reqs: list[Request], args: argparse.Namespace, timer: StepTimer,
             sampling: dict | None = None) -> dict:
    """One llm.generate of the whole batch: greedy (or --temperature / --top-p), or with `sampling`
    (SamplingParams fields) at temperature 0.8 and request i seeded with args.seed + i."""
    from hybrid import SamplingParams

    if sampling is None:
        params = [SamplingParams(max_tokens=r.output_len, temperature=args.temperature, top_p=args.top_p,
                                 ignore_eos=True) for r in reqs]
    else:
        params = [SamplingParams(max_tokens=r.output_len, temperature=0.8, seed=args.seed + i, ignore_eos=True,
                                 **sampling) for i, r in enumerate(reqs)]
    prompts = [r.prompt for r in reqs]
    from hybrid.ops import compile_watch

    compiles_before = len(compile_watch.events())
    timer.reset()
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    in_tokens = sum(r.prompt_len for r in reqs)
    row = {"num_requests": len(reqs), "prompt_tokens": in_tokens, "output_tokens": out_tokens,
           "elapsed_s": elapsed, "requests_per_s": len(reqs) / elapsed,
           "total_tokens_per_s": (in_tokens + out_tokens) / elapsed, "output_tokens_per_s": out_tokens / elapsed}
    split = timer.summary()
    if split:
        split["host_s"] = max(0.0, elapsed - split["prefill_s"] - split["decode_s"])
        row["split"] = split
    # Triton compiles inside the run (hybrid/ops/compile_watch.py): what the startup warm-up left
    compiled = compile_watch.events()[compiles_before:]
    row["triton_compiles"] = {"count": len(compiled), "seconds": sum(e.seconds for e in compiled),
                              "kernels": [f"{e.kernel} ({e.seconds:.2f} s): {e.signature}" for e in compiled]}
    return row


def describe(i: int, row: dict) -> str:
    s = (f"run {i}: {row['num_requests']} requests, {row['prompt_tokens']} prompt + {row['output_tokens']} output "
         f"tokens in {row['elapsed_s']:.3f} s: {row['requests_per_s']:.2f} req/s, "
         f"{row['total_tokens_per_s']:.0f} total tok/s, {row['output_tokens_per_s']:.0f} output tok/s")
    sp = row.get("split")
    if sp:
        per = f", {sp['decode_ms_per_step']:.2f} ms/decode step" if sp["decode_ms_per_step"] else ""
        s += (f"\n       prefill {sp['prefill_s']:.3f} s ({sp['prefill_steps']} steps, {sp['mixed_steps']} mixed), "
              f"decode {sp['decode_s']:.3f} s ({sp['decode_steps']} steps{per}), host/other {sp['host_s']:.3f} s")
    tc = row.get("triton_compiles")
    if tc and tc["count"]:
        s += f"\n       {tc['count']} Triton compiles in the run ({tc['seconds']:.2f} s): " + \
            ", ".join(sorted({k.split(' (')[0] for k in tc["kernels"]}))
    return s


def add_llm_args(ap: argparse.ArgumentParser) -> None:
    """The LLM options both benchmarks pass through."""
    ap.add_argument("--model", default=None, help="checkpoint directory")
    ap.add_argument("--shape", default=None, help="save a random-weight model of this shape first: "
                    "nemotron-h-8b or a name in tests/data/released_configs.json")
    ap.add_argument("--shape-dir", default=os.path.join(tempfile.gettempdir(), "hybrid-bench-shapes"),
                    help="where --shape checkpoints are saved (and reused)")
    ap.add_argument("--shape-override", default=None,
                    help='JSON object merged into the shape\'s config (e.g. \'{"num_hidden_layers": 4, '
                         '"hybrid_override_pattern": "M-M*"}\' for a quick check)')
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the longest request")
    ap.add_argument("--mamba-ssm-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--enable-prefix-caching", action="store_true")
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="shard the model over this many GPUs")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="torch CPU threads (also OMP_NUM_THREADS of the benchmark's subprocesses); on a "
                         "shared CPU machine 1 avoids oversubscription, which slows a tiny model 10x")


def resolve_model(args: argparse.Namespace) -> tuple[str | None, float]:
    """The checkpoint directory (saving the shape first if asked) and the seconds that took."""
    if args.shape:
        overrides = json.loads(args.shape_override) if args.shape_override else None
        return build_shape_checkpoint(args.shape, args.shape_dir, args.device, args.seed, overrides)
    return args.model, 0.0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_llm_args(ap)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    ap.add_argument("--dataset", default=None, help="JSONL of prompts instead of random tokens")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=1, help="run the same batch this many times (2: first vs second)")
    ap.add_argument("--sampled-ab", action="store_true",
                    help="then the same batch sampled (temperature 0.8, per-request seeds) with top-p 0.95, top-k 50, "
                         "min-p 0.05 and all three: each run's decode step time against the last greedy run's")
    ap.add_argument("--split", default="events", choices=["events", "sync", "off"])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--build-only", action="store_true", help="only save the --shape checkpoint (print its path)")
    ap.add_argument("--load-only", action="store_true",
                    help="only time loading the weights (hybrid.loader.load_model, bf16) onto the device; with "
                         "--cold-load from a dropped page cache, against the disk's speed")
    ap.add_argument("--cold-load", action="store_true",
                    help="evict the checkpoint's files from the page cache, time a plain sequential read of them "
                         "(the disk's speed), evict them again, then start: the load phase reads from the disk")
    args = ap.parse_args(argv)
    if args.sampled_ab and args.repeat < 1:
        ap.error("--sampled-ab compares with the last greedy run: it needs --repeat >= 1")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.model and args.shape:
        raise SystemExit("--model or --shape, not both")
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)

    from hybrid import LLM
    from hybrid.llm import DEFAULT_MODEL_DIR

    model_dir, build_s = resolve_model(args)
    model_dir = model_dir or DEFAULT_MODEL_DIR
    if args.build_only:
        print(f"checkpoint: {model_dir}")
        return {"model": model_dir, "checkpoint_build_s": build_s}
    tokenizer = None
    if args.dataset:  # tokenized for counting before the LLM exists: the LLM's own tokenizer class
        from hybrid.tokenizer import Tokenizer

        tokenizer = Tokenizer(model_dir) if os.path.isfile(os.path.join(model_dir, "tokenizer.json")) else None
        reqs = dataset_requests(args.dataset, args.num_prompts, args.output_len, tokenizer)
    else:
        reqs = random_requests(args.num_prompts, args.input_len, args.output_len, vocab_size_of(model_dir),
                               args.seed, args.range_ratio)
    max_len = max(r.prompt_len + r.output_len for r in reqs) + 1
    disk = measure_disk(model_dir) if args.cold_load else None
    if args.load_only:  # the load alone (hybrid.loader.load_model), no LLM: no kernels, no JIT
        from hybrid.config_parse import load_config
        from hybrid.loader import load_model

        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        context_s = 0.0
        if device.type == "cuda":  # (the CUDA context first, timed apart: the disk's figure has none)
            t0 = time.perf_counter()
            torch.zeros(1, device=device)
            torch.cuda.synchronize()
            context_s = time.perf_counter() - t0
            print(f"CUDA context: {context_s:.2f} s (before the load, not in its time)", flush=True)
        logging.getLogger("hybrid").setLevel(logging.INFO)  # (the prefetch thread's own read rate)
        logging.basicConfig(format="%(message)s")
        t0 = time.perf_counter()
        load_model(model_dir, load_config(model_dir), device, torch.bfloat16)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        size = sum(os.path.getsize(p) for p in _weight_files(model_dir))
        result = {"benchmark": "load", "model": model_dir, "bytes": size, "load_s": seconds, "context_s": context_s,
                  "load_gb_s": size / seconds / 1e9, "disk": disk}
        print(f"load alone{' (cold)' if disk else ''}: {size / 1e9:.2f} GB in {seconds:.2f} s ({size / seconds / 1e9:.2f} GB/s"
              + (f" against the disk's {disk['read_gb_s']:.2f} GB/s)" if disk else ")"), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return result
    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs(args, model_dir, max_len))
    startup = time.perf_counter() - t0
    phases = getattr(llm, "startup_phases", {})
    print(f"startup (LLM construction) {startup:.1f} s ("
          + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()) + f"); model {model_dir}", flush=True)
    if disk is not None and phases.get("load weights"):
        disk["cold_load_s"] = phases["load weights"]
        disk["cold_load_gb_s"] = disk["bytes"] / phases["load weights"] / 1e9
        print(f"cold load: {disk['cold_load_gb_s']:.2f} GB/s against the disk's {disk['read_gb_s']:.2f} GB/s", flush=True)
    timer = StepTimer(llm, args.split)
    timer.install()
    runs: list[dict] = []
    result: dict = {}
    plan = [None] * args.repeat + (list(SAMPLED_SETTINGS) if args.sampled_ab else [])
    sampled: dict[str, dict] = {}
    for i, setting in enumerate(plan):
        row = run_once(llm, reqs, args, timer, SAMPLED_SETTINGS[setting] if setting else None)
        if setting is None:
            runs.append(row)
            print(describe(i + 1, row), flush=True)
        else:
            row["sampling"] = {"temperature": 0.8, "per_request_seeds": True, **SAMPLED_SETTINGS[setting]}
            greedy = runs[-1].get("split", {}).get("decode_ms_per_step")
            mine = row.get("split", {}).get("decode_ms_per_step")
            if greedy and mine:  # the same steps, so the ratio of step times is the ratio of decode tok/s
                row["decode_rate_vs_greedy"] = greedy / mine
            row["output_rate_vs_greedy"] = row["output_tokens_per_s"] / runs[-1]["output_tokens_per_s"]
            sampled[setting] = row
            ratio = f", decode {row['decode_rate_vs_greedy']:.1%} of greedy's rate" if "decode_rate_vs_greedy" in row else ""
            print(describe(i + 1, row).replace(f"run {i + 1}:", f"sampled ({setting}):", 1) + ratio, flush=True)
        result = {
            "benchmark": "throughput", "model": model_dir, "shape": args.shape, "device": str(llm.device),
            "device_name": torch.cuda.get_device_name(0) if llm.device.type == "cuda" else "cpu",
            "num_prompts": len(reqs), "input_len": args.input_len, "output_len": args.output_len,
            "dataset": args.dataset, "temperature": args.temperature, "top_p": args.top_p, "split_mode": args.split,
            "llm_kwargs": {k: v for k, v in llm_kwargs(args, model_dir, max_len).items() if k != "model"},
            "checkpoint_build_s": build_s, "startup_s": startup, "startup_phases_s": phases, "disk": disk,
            "runs": runs, "sampled": sampled,
            # the headline figures: the last run (steady state when --repeat > 1)
            **{k: runs[-1][k] for k in ("requests_per_s", "total_tokens_per_s", "output_tokens_per_s", "elapsed_s")},
        }
        if len(runs) > 1:
            result["first_over_second_elapsed"] = runs[0]["elapsed_s"] / runs[1]["elapsed_s"]
        if args.json:  # after every run: a time limit that cuts the next one keeps this one
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if args.json:
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
