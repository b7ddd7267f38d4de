"""Online serving benchmark: `hybrid serve` on loopback, streamed completions at fixed concurrencies,
next to the offline `LLM.generate` figure for the same requests (the server's own cost).

    python bench/bench_serving.py --model DIR [--concurrency 1 8 64 256] [--num-prompts N]
    python bench/bench_serving.py --shape nemotron-h-8b --input-len 1024 --output-len 256 \\
        --mamba-ssm-dtype bfloat16 --out-dir /tmp/out

What it does:
1. (`--shape`) saves the random-weight checkpoint first, in a subprocess (bench_throughput.py
   --build-only), so that this process never holds GPU memory.
2. Starts the server as a subprocess on 127.0.0.1 and a free port: `hybrid.cli.main(["serve", ...])`,
   i.e. `hybrid serve`, with `--max-num-seqs` = the largest concurrency; LLM options the CLI has no
   flag for (--mamba-ssm-dtype, --gpu-memory-utilization) are merged into its engine kwargs by a
   two-line shim. Waits for GET /health (bounded by --startup-timeout); its log goes to
   <out-dir>/server.log. The server is always terminated (SIGTERM, then SIGKILL), also when this
   process gets SIGTERM, and it gets SIGTERM itself if this process dies (PR_SET_PDEATHSIG).
3. Warm-up requests (--warmup, untimed), then per concurrency level C: N requests (default
   max(8, 2C)) of random token ids (sent as token-id lists in `prompt`, which the server accepts),
   at most C in flight, each `/v1/completions` with stream=True, ignore_eos, greedy, and
   stream_options.include_usage (the exact completion token count), from --client-procs processes
   (default one per 16 streams: one openai client process saturates at ~5,000-10,000 chunks/s, and
   a saturated client reads its streams in bursts). Per level: output tokens/s and
   requests/s over the level's wall time, TTFT (request sent -> first text delta), TPOT ((latency -
   TTFT) / (output tokens - 1), per request) and ITL (gaps between successive text deltas; a delta
   may carry more than one token when the detokenizer holds back an incomplete character), each
   mean / p50 / p99 in ms.
4. Unless --no-offline: after the server is gone (its GPU memory free), a separate process builds
   one LLM with the same options and runs the same warm-up and the same requests per level through
   one `LLM.generate` each, with the engine's admission cap (`engine.max_num_seqs`, the only runtime
   use of max_num_seqs) set to C: the scheduler then keeps C requests in flight as the server does,
   with the memory plan and captured CUDA graphs of the server (one startup instead of four).
5. Writes <out-dir>/serving.json (or --json) and, if matplotlib imports, a PNG of output tokens/s
   against concurrency, server and offline (<out-dir>/serving_throughput.png).

Client: the official `openai` Python client (AsyncOpenAI, stream=True), not guidellm: it is what
users call the server with, it is already a test dependency (tests/test_server_load.py), and it
parses the real server-sent-event stream, so the figures include the SSE path; guidellm is not in
the project's dependencies (nor on the device image). On the device, openai / fastapi / uvicorn
come as wheels (bench/run_device.sh, target `serving`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_throughput import add_llm_args, random_requests, vocab_size_of  # noqa: E402

SERVED_NAME = "bench"
# `hybrid serve` with LLM kwargs the CLI has no flag for (JSON in HYBRID_BENCH_LLM_KWARGS) merged in
SERVE_SHIM = ("import json, os, sys; import hybrid.cli as c; f = c.engine_kwargs; "
              "extra = json.loads(os.environ.get('HYBRID_BENCH_LLM_KWARGS') or '{}'); "
              "c.engine_kwargs = lambda a: {**f(a), **extra}; sys.exit(c.main(sys.argv[1:]))")


def _die_with_parent() -> None:
    """preexec_fn: the server gets SIGTERM if this process dies (Linux), so it never outlives us."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the finally blocks still terminate it
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def levels_of(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(concurrency, number of requests) per level."""
    return [(c, args.num_prompts or max(8, 2 * c)) for c in args.concurrency]


def level_requests(args: argparse.Namespace, vocab: int, c: int, n: int) -> list:
    # the seed depends on the level only: the server run and the offline run get the same prompts
    return random_requests(n, args.input_len, args.output_len, vocab, seed=args.seed + 1000 + c,
                           range_ratio=args.range_ratio)


def warmup_requests(args: argparse.Namespace, vocab: int) -> list:
    return random_requests(args.warmup, args.input_len, 16, vocab, seed=args.seed + 7)


def llm_extra(args: argparse.Namespace) -> dict:
    """LLM kwargs `hybrid serve` has no flag for."""
    extra = {"mamba_ssm_dtype": args.mamba_ssm_dtype}
    if args.gpu_memory_utilization is not None:
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    return extra


def child_env(args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if args.cpu_threads:
        env["OMP_NUM_THREADS"] = str(args.cpu_threads)
    return env


# ------------------------------------------------------------------------------ the server
class Server:
    """`hybrid serve` as a subprocess on 127.0.0.1:port; a context manager that always stops it."""

    def __init__(self, args: argparse.Namespace, model_dir: str, max_len: int, log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-c", SERVE_SHIM, "serve", "--model", model_dir, "--host", "127.0.0.1",
               "--port", str(self.port), "--served-model-name", SERVED_NAME,
               "--max-num-seqs", str(max(args.concurrency)), "--max-num-batched-tokens",
               str(args.max_num_batched_tokens), "--max-model-len", str(max_len), "--seed", str(args.seed),
               "--log-level", "info", "--disable-uvicorn-access-log"]  # the startup phases in the log, no line a request
        if args.device:
            cmd += ["--device", args.device]
        if args.dtype != "auto":
            cmd += ["--dtype", args.dtype]
        for flag in ("enforce_eager", "enable_prefix_caching", "no_async_scheduling"):
            if getattr(args, flag):
                cmd.append("--" + flag.replace("_", "-"))
        cmd += args.serve_arg
        env = dict(child_env(args), HYBRID_BENCH_LLM_KWARGS=json.dumps(llm_extra(args)))
        self.cmd, self.log_path = cmd, log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     preexec_fn=_die_with_parent if os.name == "posix" else None)

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until GET /health answered 200; raises if the server exits or times out."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} during startup:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server did not answer /health within {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------ the client
@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None


async def one_request(client, req, timeout: float) -> RequestResult:
    t0 = time.perf_counter()
    res = RequestResult(ok=False, prompt_tokens=req.prompt_len)
    last = None
    chunks = 0
    try:
        stream = await client.completions.create(
            model=SERVED_NAME, prompt=req.prompt, max_tokens=req.output_len, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, timeout=timeout)
        async for ch in stream:
            now = time.perf_counter()
            if ch.choices and ch.choices[0].text:
                chunks += 1
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
            if ch.usage is not None:
                res.output_tokens = ch.usage.completion_tokens
        res.latency = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.ok = res.ttft is not None
        if not res.ok:
            res.error = "no text in the stream"
    except Exception as e:  # noqa: BLE001 - counted and reported per level
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(xs: list[float]) -> dict:
    """mean / p50 / p99 in ms (nearest-rank percentiles)."""
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    s = sorted(xs)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))]

    return {"mean": statistics.fmean(s) * 1e3, "p50": pct(50) * 1e3, "p99": pct(99) * 1e3}


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    out = sum(r.output_tokens for r in ok)
    inp = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    return {"completed": len(ok), "failed": len(results) - len(ok), "errors": errors[:5], "elapsed_s": wall,
            "prompt_tokens": inp, "output_tokens": out, "output_tokens_per_s": out / wall,
            "total_tokens_per_s": (inp + out) / wall, "requests_per_s": len(ok) / wall,
            "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
            "itl_ms": _stats([x for r in ok for x in r.itl]), "e2e_ms": _stats([r.latency for r in ok])}


async def _run_requests(url: str, reqs: list, concurrency: int, request_timeout: float,
                        level_timeout: float) -> tuple[list, float, float, bool, float]:
    """Send reqs with at most `concurrency` in flight from this process: (results, start, end on
    time.monotonic(), whether the level's time limit cut it short, this process's CPU seconds)."""
    import openai

    # the server asks for a key only if HYBRID_API_KEY is set (it inherits this environment)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=os.environ.get("HYBRID_API_KEY") or "unused",
                                max_retries=0, timeout=request_timeout)
    sem = asyncio.Semaphore(concurrency)

    async def limited(req):
        async with sem:
            return await one_request(client, req, request_timeout)

    cpu0 = time.process_time()
    t0 = time.monotonic()
    tasks = [asyncio.create_task(limited(r)) for r in reqs]
    try:
        done, pending = await asyncio.wait(tasks, timeout=level_timeout)
        for t in pending:  # past the level's time limit: cancelled (the server aborts them) and counted as failed
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await client.close()
    t1 = time.monotonic()
    results = [t.result() for t in tasks if t in done]
    results += [RequestResult(ok=False, prompt_tokens=0, error=f"not done within --level-timeout {level_timeout:.0f} s")
                for t in tasks if t not in done]
    return results, t0, t1, bool(pending), time.process_time() - cpu0


def client_procs_for(requested: int, concurrency: int) -> int:
    """Client processes for a level: `requested` (0: auto). The openai client spends ~0.1-0.2 ms of
    CPU on each streamed chunk (SSE parsing, a pydantic model per chunk), so one asyncio process
    tops out at ~5,000-10,000 chunks/s, about what 64 streams at a 6-7 ms decode step make: past
    that the client, not the server, sets the figures (chunks read in bursts, ITL p50 ~0.1 ms).
    Auto: one process per 16 streams, at most the cores left after the server's two."""
    if requested > 0:
        return max(1, min(requested, concurrency))
    return max(1, min(-(-concurrency // 16), (os.cpu_count() or 1) - 2, concurrency))


def _client_child(url, reqs, concurrency, request_timeout, level_timeout, q, go, i) -> None:
    """One client process of a level: ready, wait for the common start, run its share, report."""
    import importlib

    importlib.import_module("openai")  # before the common start, not inside the timed part
    q.put(("ready", i))
    go.wait()
    try:
        q.put(("done", i, asyncio.run(_run_requests(url, reqs, concurrency, request_timeout, level_timeout))))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which counts the share as failed
        q.put(("error", i, f"{type(e).__name__}: {e}"))


def _drive_procs(url: str, reqs: list, concurrency: int, request_timeout: float, level_timeout: float,
                 procs: int) -> tuple[list, float, float, bool, float]:
    """_run_requests over `procs` processes: request k goes to process k % procs, the concurrency is
    split as evenly as it goes; they start together and the level runs from the first start to the
    last end."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")  # (a fork would copy whatever this process holds)
    q, go = ctx.Queue(), ctx.Event()
    procs = max(1, min(procs, len(reqs), concurrency))  # (no process without requests)
    shares = [reqs[i::procs] for i in range(procs)]
    conc = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    children = [ctx.Process(target=_client_child, args=(url, shares[i], conc[i], request_timeout, level_timeout,
                                                        q, go, i), daemon=True) for i in range(procs)]
    for ch in children:
        ch.start()
    got: dict[int, tuple] = {}
    try:
        ready, ready_by = 0, time.monotonic() + 120
        while ready < procs:  # (a child that dies before it is ready is an error now, not a 2-minute wait)
            try:
                msg = q.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [i for i, ch in enumerate(children) if ch.exitcode is not None]
                if dead or time.monotonic() > ready_by:
                    raise RuntimeError(f"client processes {dead or 'all'} did not start "
                                       f"(exit codes {[children[i].exitcode for i in dead]})") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"client process {msg[1]} failed before the start: {msg[2]}")
            ready += msg[0] == "ready"
        go.set()
        deadline = time.monotonic() + level_timeout + 60
        while len(got) < procs:
            try:
                msg = q.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue_mod.Empty:
                break
            if msg[0] == "done":
                got[msg[1]] = msg[2]
            elif msg[0] == "error":
                got[msg[1]] = ([RequestResult(ok=False, prompt_tokens=0, error=msg[2]) for _ in shares[msg[1]]],
                               None, None, False, 0.0)
    finally:
        if go.is_set():  # one shared deadline for all, then whatever is left is killed
            stop_by = time.monotonic() + 10
            for ch in children:
                ch.join(timeout=max(0.0, stop_by - time.monotonic()))
        for ch in children:  # (never started: killed at once, no request sent)
            if ch.is_alive():
                ch.kill()
            ch.join(timeout=5)
    results, starts, ends, cut, cpu = [], [], [], False, 0.0
    for i in range(procs):
        r = got.get(i) or ([RequestResult(ok=False, prompt_tokens=0, error="the client process did not report")
                            for _ in shares[i]], None, None, True, 0.0)
        results += r[0]
        starts += [r[1]] if r[1] is not None else []
        ends += [r[2]] if r[2] is not None else []
        cut, cpu = cut or r[3], cpu + r[4]
    t0 = min(starts) if starts else 0.0
    return results, t0, max(ends) if ends else t0, cut, cpu


def drive(url: str, reqs: list, concurrency: int, request_timeout: float, level_timeout: float,
          client_procs: int = 1) -> dict:
    """Send reqs with at most `concurrency` in flight, from `client_procs` processes (1: this one);
    summary of the level."""
    if client_procs > 1:
        results, t0, t1, cut, cpu = _drive_procs(url, reqs, concurrency, request_timeout, level_timeout,
                                                 client_procs)
    else:
        results, t0, t1, cut, cpu = asyncio.run(_run_requests(url, reqs, concurrency, request_timeout, level_timeout))
    wall = max(t1 - t0, 1e-9)
    out = summarize(results, wall)
    out["timed_out"] = cut
    out["client_procs"] = client_procs
    out["client_cpu_per_proc"] = cpu / wall / client_procs  # 1.0: the client processes were saturated
    return out


def run_server(args: argparse.Namespace, model_dir: str, max_len: int, vocab: int) -> dict:
    log_path = os.path.join(args.out_dir, "server.log")
    with Server(args, model_dir, max_len, log_path) as srv:
        print(f"[server] starting: {' '.join(srv.cmd[:2])} <shim> {' '.join(srv.cmd[3:])}", flush=True)
        startup = srv.wait_healthy(args.startup_timeout)
        print(f"[server] healthy after {startup:.1f} s on {srv.url}", flush=True)
        out = {"startup_s": startup, "levels": {}}
        if args.warmup:
            w = drive(srv.url, warmup_requests(args, vocab), max(args.concurrency), args.request_timeout,
                      args.level_timeout)
            out["warmup"] = w
            print(f"[server] warm-up: {w['completed']} requests in {w['elapsed_s']:.2f} s", flush=True)
        for c, n in levels_of(args):
            r = drive(srv.url, level_requests(args, vocab, c, n), c, args.request_timeout, args.level_timeout,
                      client_procs_for(args.client_procs, c))
            out["levels"][c] = r
            print(f"[server] concurrency {c:4d}: {describe(r)}", flush=True)
            if r["failed"]:
                print(f"[server]   {r['failed']} failed: {r['errors']}\n{srv.tail(10)}", flush=True)
            if srv.proc.poll() is not None:
                raise RuntimeError(f"the server died:\n{srv.tail()}")
    return out


def describe(r: dict) -> str:
    def ms(d):
        return "-" if d["p50"] is None else f"{d['p50']:.1f}/{d['p99']:.1f}"

    return (f"{r['output_tokens_per_s']:9.1f} out tok/s {r['requests_per_s']:7.2f} req/s  TTFT p50/p99 "
            f"{ms(r['ttft_ms'])} ms  TPOT {ms(r['tpot_ms'])} ms  ITL {ms(r['itl_ms'])} ms  "
            f"(client: {r.get('client_procs', 1)} process(es), CPU {r.get('client_cpu_per_proc', 0) * 100:.0f}% each)")


# ------------------------------------------------------------------------------ offline, in a child
def offline_child(spec_path: str, out_path: str) -> None:
    """Run in a separate process: one LLM, the same warm-up and per-level requests through
    LLM.generate with engine.max_num_seqs = C."""
    import torch

    from bench.bench_throughput import StepTimer, llm_kwargs, run_once
    from hybrid import LLM

    with open(spec_path) as f:
        spec = json.load(f)
    args = argparse.Namespace(**spec["args"])
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.temperature, args.top_p = 0.0, 1.0
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs(args, spec["model_dir"], spec["max_len"]))
    out = {"startup_s": time.perf_counter() - t0, "levels": {}}
    timer = StepTimer(llm, "events")
    timer.install()
    vocab = spec["vocab"]
    if args.warmup:
        llm.engine.max_num_seqs = max(args.concurrency)
        out["warmup"] = run_once(llm, warmup_requests(args, vocab), args, timer)
    for c, n in levels_of(args):
        llm.engine.max_num_seqs = c  # the admission cap: C requests in flight, like the server's clients
        r = run_once(llm, level_requests(args, vocab, c, n), args, timer)
        out["levels"][c] = r
        print(f"[offline] concurrency {c:4d}: {r['output_tokens_per_s']:9.1f} out tok/s "
              f"{r['requests_per_s']:7.2f} req/s in {r['elapsed_s']:.2f} s", flush=True)
        with open(out_path, "w") as f:  # after each level: a timeout still leaves the finished ones
            json.dump(out, f)


def run_offline(args: argparse.Namespace, model_dir: str, max_len: int, vocab: int) -> dict:
    spec = {"args": vars(args), "model_dir": model_dir, "max_len": max_len, "vocab": vocab}
    spec_path = os.path.join(args.out_dir, "offline_spec.json")
    out_path = os.path.join(args.out_dir, "offline.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    if os.path.exists(out_path):
        os.remove(out_path)
    cmd = [sys.executable, os.path.abspath(__file__), "--offline-child", spec_path, out_path]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(args),
                            preexec_fn=_die_with_parent if os.name == "posix" else None)
    try:
        rc = proc.wait(timeout=args.offline_timeout)
    except subprocess.TimeoutExpired:
        rc = None
        print(f"[offline] timed out after {args.offline_timeout:.0f} s", flush=True)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    if not os.path.exists(out_path):
        return {"error": f"the offline process ended with {rc} before finishing a level", "levels": {}}
    with open(out_path) as f:
        out = json.load(f)
    out["levels"] = {int(k): v for k, v in out["levels"].items()}
    if rc != 0:
        out["error"] = f"the offline process ended with {rc}"
    return out


# ------------------------------------------------------------------------------ report
def plot(levels: list[dict], path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[plot] matplotlib is not installed: no plot", flush=True)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    cs = [row["concurrency"] for row in levels]
    ax.plot(cs, [row["server"]["output_tokens_per_s"] for row in levels], "o-", label="hybrid serve (streamed)")
    off = [(row["concurrency"], row["offline"]["output_tokens_per_s"]) for row in levels if row.get("offline")]
    if off:
        ax.plot(*zip(*off), "s--", label="offline LLM.generate")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"[plot] wrote {path}", flush=True)
    return path


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--offline-child"]:
        offline_child(argv[1], argv[2])
        return None
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_llm_args(ap)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per level (default max(8, 2C))")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=16, help="untimed requests (16 output tokens) before the levels")
    ap.add_argument("--no-offline", action="store_true", help="skip the offline LLM.generate figures")
    ap.add_argument("--client-procs", type=int, default=0,
                    help="client processes per level (default 0: one per 16 streams, at most the cores but two; "
                         "one openai client process cannot read much more than 64 streams' chunks)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `hybrid serve` flag (repeatable)")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--level-timeout", type=float, default=600)
    ap.add_argument("--offline-timeout", type=float, default=900)
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the whole run: the offline process gets what is left of it (minus 15 s)")
    ap.add_argument("--out-dir", default=None, help="logs, JSON and plot (default: a new temp dir)")
    ap.add_argument("--json", default=None, help="default <out-dir>/serving.json")
    ap.add_argument("--plot", default=None, help="default <out-dir>/serving_throughput.png")
    args = ap.parse_args(argv)
    if args.model and args.shape:
        raise SystemExit("--model or --shape, not both")
    t_start = time.perf_counter()
    args.max_num_seqs = max(args.concurrency)  # --max-num-seqs is the largest concurrency, for both runs
    args.out_dir = args.out_dir or tempfile.mkdtemp(prefix="bench_serving_")
    os.makedirs(args.out_dir, exist_ok=True)

    model_dir, build_s = args.model, 0.0
    if args.shape:  # in a subprocess: this process never touches the GPU
        cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_throughput.py"), "--build-only", "--shape",
               args.shape, "--shape-dir", args.shape_dir, "--seed", str(args.seed)]
        cmd += ["--device", args.device] if args.device else []
        cmd += ["--shape-override", args.shape_override] if args.shape_override else []
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT, env=child_env(args), timeout=args.startup_timeout)
        build_s = time.perf_counter() - t0
        model_dir = os.path.join(args.shape_dir, args.shape)
    if model_dir is None:
        from hybrid.llm import DEFAULT_MODEL_DIR

        model_dir = DEFAULT_MODEL_DIR
    vocab = vocab_size_of(model_dir)
    max_len = args.max_model_len or int(args.input_len * (1 + args.range_ratio)) \
        + int(args.output_len * (1 + args.range_ratio)) + 2

    server = run_server(args, model_dir, max_len, vocab)
    with open(os.path.join(args.out_dir, "server.json"), "w") as fh:  # kept if the offline part is cut short
        json.dump(server, fh, indent=1)
    if args.time_budget:
        left = args.time_budget - (time.perf_counter() - t_start) - 15
        args.offline_timeout = max(30.0, min(args.offline_timeout, left))
    offline = None if args.no_offline else run_offline(args, model_dir, max_len, vocab)
    levels = []
    for c, n in levels_of(args):
        row = {"concurrency": c, "num_requests": n, "server": server["levels"][c]}
        off = (offline or {}).get("levels", {}).get(c)
        if off:
            row["offline"] = off
            row["server_over_offline"] = row["server"]["output_tokens_per_s"] / off["output_tokens_per_s"]
        levels.append(row)
    result = {
        "benchmark": "serving", "client": "openai.AsyncOpenAI completions, stream=True (per level: client_procs "
                                          "processes)", "model": model_dir,
        "shape": args.shape, "input_len": args.input_len, "output_len": args.output_len,
        "options": {k: v for k, v in vars(args).items() if k not in ("json", "plot", "out_dir")},
        "checkpoint_build_s": build_s, "server_startup_s": server["startup_s"],
        "offline_startup_s": (offline or {}).get("startup_s"), "offline_error": (offline or {}).get("error"),
        "levels": levels,
    }
    print("\nconcurrency | server out tok/s | offline out tok/s | server/offline | TTFT p50/p99 ms | "
          "TPOT p50/p99 ms | ITL p50/p99 ms")
    for row in levels:
        s, o = row["server"], row.get("offline")

        def f(d):
            return "-" if d["p50"] is None else f"{d['p50']:.1f} / {d['p99']:.1f}"

        print(f"{row['concurrency']:11d} | {s['output_tokens_per_s']:16.1f} | "
              f"{(o['output_tokens_per_s'] if o else float('nan')):17.1f} | "
              f"{row.get('server_over_offline', float('nan')):14.3f} | {f(s['ttft_ms'])} | {f(s['tpot_ms'])} | "
              f"{f(s['itl_ms'])}")
    title = f"{args.shape or os.path.basename(model_dir.rstrip('/'))}: {args.input_len} in / {args.output_len} out"
    result["plot"] = plot(levels, args.plot or os.path.join(args.out_dir, "serving_throughput.png"), title)
    json_path = args.json or os.path.join(args.out_dir, "serving.json")
    with open(json_path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {json_path}", flush=True)
    return result


if __name__ == "__main__":
    # SIGTERM (e.g. from `timeout`) must run the finally blocks that stop the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
