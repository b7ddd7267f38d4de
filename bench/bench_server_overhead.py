"""The server's host cost per generated token, without a model: `hybrid serve`'s app (build_app over
the bundled default model's LLM, its tokenizer detokenizing every token) with the model runner
replaced by a fake device that returns fixed logits, streamed /v1/completions at a fixed
concurrency, next to the same requests through offline LLM.generate on the same fake device.

    python bench/bench_server_overhead.py                          # concurrency 64, free device
    python bench/bench_server_overhead.py --device-ms 6.5          # a 6.5 ms device step (async scheduling)
    python bench/bench_server_overhead.py --client openai          # the openai client (as bench_serving.py)
    python bench/bench_server_overhead.py --profile /tmp/prof      # cProfile of the engine thread and the loop

The server runs in a child process (uvicorn, as `hybrid serve` runs it: the event loop on the
main thread, the engine on its worker thread); the client in this one, so that the client's own
parsing does not compete for the server's GIL. The fake device (--device-ms D): each launched
step occupies the device for D ms after the previous one, and reading a step's tokens back sleeps
(GIL released, as a CUDA event wait does) until its device time is over; async scheduling is on,
as on CUDA, so the host schedules step N+1 while step N "runs". D = 0: the device is free, so the
figures are the host's alone.

Reported per level: output tokens/s of the server and offline (same fake device, the engine's
admission cap = concurrency), and the server's CPU time per generated token split by thread (the
event loop: HTTP, SSE, the per-request streams; the engine thread: schedule, batch, sample,
detokenize, deliver), with the engine step's wall time split into its own CPU, the fake device's
wait and the rest (waiting for the GIL).

Clients: --client raw (default): a minimal HTTP/1.1 client on asyncio streams that only counts the
SSE events, so that one client process can keep up with ~10,000 events/s on a small machine;
--client openai: bench/bench_serving.py's client (AsyncOpenAI, stream=True) from --client-procs
processes; its parsing of every chunk (SSE, a pydantic model) costs ~0.1-0.2 ms of client CPU, so
one process cannot read 64 streams at a 6.5 ms step.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SERVED_NAME = "bench"
FIRST_ID = 4


# ------------------------------------------------------------------------------ the fake device
class FakeDevice:
    """Stands in for the model runner: rotating fixed logits rows (so the tokens, and the text the
    tokenizer makes of them, vary), and a device queue that each launched step occupies for
    `device_ms` after the previous step. read_back (wrapped by install) sleeps until the step's
    device time is over."""

    ctx = None  # no attention backend (so no workspace regions for the sanitizer)

    def __init__(self, vocab: int, device_ms: float, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(4096 + 9000, vocab, generator=g)
        self.logits[:, :FIRST_ID] = -1e4  # never the special tokens
        self.device_s = device_ms / 1e3
        self.busy_until = 0.0
        self.ends: collections.deque = collections.deque()
        self.offset = 0
        self.device_wait = 0.0

    def execute(self, batch):
        self.ran = batch
        rows = batch.logits_indices.shape[0]
        now = time.perf_counter()
        start = max(now, self.busy_until)
        self.busy_until = start + self.device_s
        self.ends.append(self.busy_until)
        self.offset = (self.offset + 7) % 4096
        return self.logits[self.offset: self.offset + rows]

    def inputs_that_ran(self):
        return self.ran

    def install(self, engine) -> None:
        engine.runner = self
        launcher = engine.launcher
        read_back = launcher.read_back

        def timed_read_back(step):
            end = self.ends.popleft() if self.ends else 0.0
            wait = end - time.perf_counter()
            if wait > 0:
                t = time.perf_counter()
                time.sleep(wait)
                self.device_wait += time.perf_counter() - t
            return read_back(step)

        launcher.read_back = timed_read_back


def build_llm(args, max_num_seqs: int):
    import torch

    from hybrid import LLM
    from hybrid.model_source import DEFAULT_MODEL_DIR

    torch.set_num_threads(1)
    llm = LLM(DEFAULT_MODEL_DIR, max_num_seqs=max_num_seqs, max_model_len=args.input_len + args.output_len + 16,
              max_num_batched_tokens=args.max_num_batched_tokens, async_scheduling=True, seed=0)
    dev = FakeDevice(llm.engine.vocab_size, args.device_ms)
    dev.install(llm.engine)
    return llm, dev


def requests_of(args, n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(args.input_len)] for _ in range(n)]


# ------------------------------------------------------------------------------ the server child
class StepStats:
    """Engine.step wrapped: calls, wall time, the engine thread's CPU time inside it."""

    def __init__(self, engine, device: FakeDevice) -> None:
        self.engine, self.device = engine, device
        self.reset()
        step = engine.step
        self.profile_on = False
        self.profiler = None

        def timed_step(*a, **kw):
            self._profile_switch()
            t, c = time.perf_counter(), time.thread_time()
            try:
                return step(*a, **kw)
            finally:
                self.wall += time.perf_counter() - t
                self.cpu += time.thread_time() - c
                self.steps += 1

        engine.step = timed_step

    def _profile_switch(self) -> None:  # on the engine thread (cProfile hooks the thread that enables it)
        if self.profile_on and self.profiler is None:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()
        elif not self.profile_on and self.profiler is not None:
            self.profiler.disable()
            self.done_profiler, self.profiler = self.profiler, None

    def reset(self) -> None:
        self.steps, self.wall, self.cpu = 0, 0.0, 0.0
        self.device_wait0 = getattr(self, "device", None) and self.device.device_wait or 0.0


def thread_cpu(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def serve_child(args) -> None:
    import uvicorn

    from hybrid.server import build_app

    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval / 1e3)
    llm, dev = build_llm(args, max(args.concurrency))
    app = build_app(llm, served_model_name=SERVED_NAME, max_queued_requests=4 * max(args.concurrency))
    stats = StepStats(llm.engine, dev)
    aeng = app.state.async_engine
    loop_ident = threading.get_ident()
    mark = {}
    loop_prof = {}

    def snapshot() -> dict:
        eng_ident = aeng._thread.ident if aeng._thread is not None else None
        return {"t": time.perf_counter(), "loop_cpu": thread_cpu(loop_ident),
                "engine_cpu": thread_cpu(eng_ident) if eng_ident else 0.0,
                "process_cpu": time.process_time(), "tokens": llm.engine.stats["generated_tokens"]}

    async def bench_start(request):
        from starlette.responses import JSONResponse

        mark.update(snapshot())
        stats.reset()
        if request.query_params.get("profile"):
            import cProfile

            loop_prof["p"] = cProfile.Profile()
            loop_prof["p"].enable()
            stats.profile_on = True
        return JSONResponse({"ok": True})

    async def bench_stop(request):
        from starlette.responses import JSONResponse

        now = snapshot()
        d = {k: now[k] - mark[k] for k in now}
        d.update(steps=stats.steps, step_wall=stats.wall, step_cpu=stats.cpu,
                 device_wait=dev.device_wait - stats.device_wait0)
        return JSONResponse(d)

    async def bench_dump(request):
        from starlette.responses import JSONResponse

        prof_dir = request.query_params["dir"]
        os.makedirs(prof_dir, exist_ok=True)
        out = {}
        if "p" in loop_prof:
            loop_prof["p"].disable()
            loop_prof.pop("p").dump_stats(os.path.join(prof_dir, "loop.pstats"))
            out["loop"] = os.path.join(prof_dir, "loop.pstats")
        stats.profile_on = False
        # the engine thread's profiler: snapshotted from here (the thread is idle between levels)
        prof = stats.profiler or getattr(stats, "done_profiler", None)
        if prof is not None:
            prof.dump_stats(os.path.join(prof_dir, "engine.pstats"))
            out["engine"] = os.path.join(prof_dir, "engine.pstats")
        return JSONResponse(out)

    app.add_route("/_bench/start", bench_start, methods=["POST"])
    app.add_route("/_bench/stop", bench_stop, methods=["POST"])
    app.add_route("/_bench/dump", bench_dump, methods=["POST"])
    # as hybrid.server.run_server runs it
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


# ------------------------------------------------------------------------------ the loop alone
class _NullTransport:
    """What uvicorn's H11Protocol writes to, in place of a socket: counts the bytes (and keeps them
    when asked), never blocks."""

    def __init__(self, keep: bool = False) -> None:
        self.nbytes, self.writes, self.closed = 0, 0, False
        self.data = [] if keep else None

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data) -> None:
        self.nbytes += len(data)
        self.writes += 1
        if self.data is not None:
            self.data.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol) -> None:
        pass


def loop_only(args) -> dict:
    """The event loop's cost per streamed token, alone: the real app behind uvicorn's H11Protocol on
    null transports (no sockets, no client), the real AsyncEngine.generate, and in place of the
    engine thread a driver on the loop that hands `concurrency` requests one token each per "step"
    as the worker does (one batch into their queues), then lets the loop run until every stream has
    written its event. CPU seconds of the loop / tokens."""
    import torch

    from hybrid import LLM
    from hybrid.async_engine import _put_all  # noqa: F401 - the worker's delivery (checked below)
    from hybrid.model_source import DEFAULT_MODEL_DIR
    from hybrid.outputs import CompletionOutput, RequestOutput
    from hybrid.server import build_app
    from uvicorn.config import Config
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.server import ServerState

    torch.set_num_threads(1)
    c = args.concurrency[0]
    llm = LLM(DEFAULT_MODEL_DIR, max_num_seqs=c, max_model_len=args.input_len + args.output_len + 16,
              max_num_batched_tokens=args.max_num_batched_tokens)
    app = build_app(llm, served_model_name=SERVED_NAME, max_queued_requests=4 * c)
    ae = app.state.async_engine
    config = Config(app, log_level="warning", lifespan="off")
    config.load()
    state = ServerState()
    vocab = llm.engine.vocab_size
    rng = random.Random(0)
    words = [llm.tokenizer.decode([t]) for t in range(FIRST_ID, vocab)]

    async def main() -> dict:
        loop = asyncio.get_running_loop()
        transports = []
        body = {"model": SERVED_NAME, "max_tokens": args.output_len, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        for i in range(c):
            b = json.dumps({**body, "prompt": [rng.randrange(FIRST_ID, vocab) for _ in range(args.input_len)]})
            t = _NullTransport()
            proto = H11Protocol(config=config, server_state=state, app_state={}, _loop=loop)
            proto.connection_made(t)
            proto.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Content-Length: %d\r\n\r\n" % len(b) + b.encode())
            transports.append(t)
        active = {}  # rid -> [tracked, text, tokens]
        while len(active) < c:  # the handlers' adds
            await asyncio.sleep(0)
            while not ae._commands.empty():
                cmd = ae._commands.get_nowait()
                if cmd[0] == "add":
                    active[cmd[1].request_id] = [cmd[1], "", 0]
        cpu0, t0, tokens, steps = time.process_time(), time.perf_counter(), 0, 0
        while active:
            items = []
            for rid, st in list(active.items()):
                tr = st[0]
                tid = rng.randrange(FIRST_ID, vocab)
                st[1] += words[tid - FIRST_ID]
                st[2] += 1
                done = st[2] >= args.output_len
                out = RequestOutput(rid, None, [], [CompletionOutput(0, st[1], [tid], "length" if done else None)],
                                    finished=done)
                items.append((tr.queue, out))
                if done:
                    del active[rid]
            tokens += len(items)
            steps += 1
            loop.call_soon(_put_all, items)  # (the worker: call_soon_threadsafe, once a step)
            for _ in range(50):  # until every stream has written its event
                await asyncio.sleep(0)
                if all(q.empty() for q, _ in items):
                    break
            for _ in range(5):
                await asyncio.sleep(0)
        for _ in range(200):
            await asyncio.sleep(0)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        return {"tokens": tokens, "steps": steps, "cpu_s": cpu, "wall_s": wall,
                "writes": sum(t.writes for t in transports), "bytes": sum(t.nbytes for t in transports)}

    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    r = asyncio.run(main())
    if prof is not None:
        prof.disable()
        os.makedirs(args.profile, exist_ok=True)
        prof.dump_stats(os.path.join(args.profile, "loop_only.pstats"))
    print(f"loop only, concurrency {c}: {r['tokens']} tokens in {r['steps']} steps, loop CPU "
          f"{r['cpu_s'] / r['tokens'] * 1e6:.1f} us a token ({r['cpu_s'] / r['steps'] * 1e3:.2f} ms a step), "
          f"{r['writes'] / r['tokens']:.2f} transport writes a token, {r['bytes'] / r['tokens']:.0f} bytes a token")
    return r


def engine_only(args) -> dict:
    """The engine thread's cost per generated token with the server's bookkeeping (delta outputs,
    metrics, delivery to the loop) and nothing else: the real AsyncEngine worker on the fake device,
    `concurrency` requests consumed on the loop by bare `async for` over generate(). CPU seconds of
    the worker thread / tokens (its figure inside Engine.step too), and the same requests through
    offline LLM.generate (output_kind "final") in this thread."""
    from hybrid import SamplingParams
    from hybrid.async_engine import AsyncEngine
    from hybrid.metrics import ServerMetrics

    c = args.concurrency[0]
    llm, dev = build_llm(args, c)
    stats = StepStats(llm.engine, dev)
    prompts = requests_of(args, c, llm.engine.vocab_size, seed=5)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    ae = AsyncEngine(llm.engine, metrics=ServerMetrics("bench"))
    ae.start()

    async def one(ids):
        async for _ in ae.generate(ids, params):
            pass

    async def main():
        await asyncio.gather(*(one(p) for p in prompts[:4]))  # warm-up
        ident = ae._thread.ident
        stats.reset()
        cpu0, tok0 = thread_cpu(ident), llm.engine.stats["generated_tokens"]
        await asyncio.gather(*(one(p) for p in prompts))
        return thread_cpu(ident) - cpu0, llm.engine.stats["generated_tokens"] - tok0

    cpu, tokens = asyncio.run(main())
    step_cpu = stats.cpu
    ae.shutdown()
    t = time.thread_time()
    g0 = llm.engine.stats["generated_tokens"]
    llm.generate(prompts, params, use_tqdm=False)
    off = (time.thread_time() - t) / (llm.engine.stats["generated_tokens"] - g0)
    print(f"engine only, concurrency {c}: worker CPU {cpu / tokens * 1e6:.1f} us a token (in Engine.step "
          f"{step_cpu / tokens * 1e6:.1f} us); offline LLM.generate {off * 1e6:.1f} us a token")
    return {"cpu_s": cpu, "tokens": tokens, "step_cpu_s": step_cpu, "offline_us": off * 1e6}


# ------------------------------------------------------------------------------ clients
def _stats(xs: list[float]) -> dict:
    """mean / p50 / p99 in ms, as bench_serving reports them."""
    from bench.bench_serving import _stats as serving_stats

    return serving_stats(xs)


async def raw_request(port: int, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion over a bare HTTP/1.1 connection: events counted as they arrive (the
    chunked framing is not parsed: an event is a b'data: ' in the body), the usage from the last chunk."""
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    tail = b""
    events, first, last, itl = 0, None, None, []
    while True:
        data = await reader.read(65536)
        if not data:
            break
        now = time.perf_counter()
        k = data.count(b"data: ")
        if k:
            events += k
            if first is None:
                first = now
            else:
                itl.append(now - last)
                itl.extend([0.0] * (k - 1))
            last = now
        tail = (tail + data)[-4096:]
        if b"data: [DONE]" in tail:
            break
    writer.close()
    usage = tail.rfind(b'"completion_tokens": ')
    tokens = int(tail[usage + 21:].split(b",")[0]) if usage >= 0 else 0
    return {"ok": first is not None and tokens > 0, "tokens": tokens, "ttft": (first or now) - t0,
            "latency": time.perf_counter() - t0, "itl": itl, "events": events}


def drive(args, port: int, prompts: list[list[int]], concurrency: int) -> dict:
    if args.client == "openai":  # bench_serving.py's client, from --client-procs processes
        from bench import bench_serving
        from bench.bench_throughput import Request

        reqs = [Request(p, len(p), args.output_len) for p in prompts]
        r = bench_serving.drive(f"http://127.0.0.1:{port}", reqs, concurrency, 600, 600,
                                bench_serving.client_procs_for(args.client_procs, concurrency))
        r["wall_s"], r["events"] = r["elapsed_s"], None
        r["client_cpu_s"] = r["client_cpu_per_proc"] * r["client_procs"] * r["elapsed_s"]
        return r
    return asyncio.run(_drive_raw(args, port, prompts, concurrency))


async def _drive_raw(args, port: int, prompts: list[list[int]], concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)

    async def one(p):
        async with sem:
            return await raw_request(port, p, args.output_len)

    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    return {"completed": len(ok), "failed": len(results) - len(ok), "wall_s": wall, "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall, "events": sum(r["events"] for r in ok),
            "client_cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
            "ttft_ms": _stats([r["ttft"] for r in ok]), "tpot_ms": _stats(tpot),
            "itl_ms": _stats([x for r in ok for x in r["itl"]])}


# ------------------------------------------------------------------------------ the parent
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def run_server_levels(args) -> dict:
    port = free_port()
    cmd = [sys.executable, os.path.abspath(__file__), "--serve-child", "--port", str(port)] + args.passthrough
    proc = subprocess.Popen(cmd, cwd=ROOT)
    out = {}
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        vocab = 2048
        drive(args, port, requests_of(args, 8, vocab, seed=99), 8)  # warm-up
        for c in args.concurrency:
            prompts = requests_of(args, args.num_prompts or 2 * c, vocab, seed=c)
            post(port, "/_bench/start" + ("?profile=1" if args.profile else ""))
            r = drive(args, port, prompts, c)
            s = post(port, "/_bench/stop")
            if args.profile:
                d = os.path.join(args.profile, f"c{c}")
                r["profiles"] = post(port, f"/_bench/dump?dir={d}")
            r["server"] = s
            out[c] = r
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def run_offline(args) -> dict:
    from hybrid import SamplingParams

    llm, dev = build_llm(args, max(args.concurrency))
    vocab = llm.engine.vocab_size
    out = {}
    for c in args.concurrency:
        llm.engine.max_num_seqs = c
        prompts = requests_of(args, args.num_prompts or 2 * c, vocab, seed=c)
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        steps0, dw0 = llm.engine.stats["steps"], dev.device_wait
        t, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        out[c] = {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
                  "cpu_s": time.process_time() - cpu, "steps": llm.engine.stats["steps"] - steps0,
                  "device_wait": dev.device_wait - dw0}
    return out


def report(args, server: dict, offline: dict) -> None:
    print(f"\nfake device step {args.device_ms} ms, {args.input_len} prompt / {args.output_len} output tokens, "
          f"client {args.client}")
    for c, r in server.items():
        s = r["server"]
        tok = max(1, s["tokens"])
        off = offline.get(c)
        steps = max(1, s["steps"])
        line = (f"c={c:4d} server {r['output_tokens_per_s']:8.0f} tok/s"
                + (f"  offline {off['output_tokens_per_s']:8.0f} tok/s  ratio "
                   f"{r['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}" if off else ""))
        print(line)

        def ms(d):
            return "-" if d["p50"] is None else f"{d['p50']:.1f}/{d['p99']:.1f}"

        print(f"        TTFT p50/p99 {ms(r['ttft_ms'])} ms  TPOT {ms(r['tpot_ms'])} ms  ITL {ms(r['itl_ms'])} ms; "
              f"{r['events'] or '-'} events, client CPU {r['client_cpu_s'] / r['wall_s'] * 100:.0f}% of wall"
              + (f" ({r['client_procs']} processes)" if r.get("client_procs", 1) > 1 else ""))
        print(f"        server CPU per generated token: loop {s['loop_cpu'] / tok * 1e6:.1f} us, engine thread "
              f"{s['engine_cpu'] / tok * 1e6:.1f} us, process {s['process_cpu'] / tok * 1e6:.1f} us "
              f"(loop busy {s['loop_cpu'] / s['t'] * 100:.0f}%, engine thread busy {s['engine_cpu'] / s['t'] * 100:.0f}%)")
        other = s["step_wall"] - s["step_cpu"] - s["device_wait"]
        print(f"        engine step: {s['steps']} steps, {s['step_wall'] / steps * 1e3:.2f} ms wall = "
              f"{s['step_cpu'] / steps * 1e3:.2f} ms CPU + {s['device_wait'] / steps * 1e3:.2f} ms device wait + "
              f"{other / steps * 1e3:.2f} ms other (GIL); {s['tokens'] / steps:.1f} tokens a step"
              + (f"; offline {off['wall_s'] / max(1, off['steps']) * 1e3:.2f} ms a step, CPU "
                 f"{off['cpu_s'] / max(1, off['output_tokens']) * 1e6:.1f} us a token" if off else ""))
        if "profiles" in r:
            print(f"        profiles: {r['profiles']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64])
    ap.add_argument("--num-prompts", type=int, default=None, help="per level (default 2 x concurrency)")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--device-ms", type=float, default=0.0, help="the fake device step (0: free)")
    ap.add_argument("--client", choices=["raw", "openai"], default="raw")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="--client openai: client processes (0: bench_serving.py's default)")
    ap.add_argument("--profile", default=None, help="dir: cProfile the server's loop and engine thread per level")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval in the server (ms)")
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--loop-only", action="store_true",
                    help="the event loop's cost alone: no engine thread, no sockets (see loop_only)")
    ap.add_argument("--engine-only", action="store_true",
                    help="the engine thread's cost alone: no HTTP, bare consumers (see engine_only)")
    ap.add_argument("--repeat", type=int, default=1, help="--loop-only / --engine-only: runs (the best is the figure)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_child:
        serve_child(args)
        return
    if args.engine_only:
        best = min((engine_only(args) for _ in range(args.repeat)), key=lambda r: r["cpu_s"] / r["tokens"])
        print(f"best of {args.repeat}: {best['cpu_s'] / best['tokens'] * 1e6:.1f} us a token")
        return
    if args.loop_only:
        best = min((loop_only(args) for _ in range(args.repeat)), key=lambda r: r["cpu_s"])
        print(f"best of {args.repeat}: {best['cpu_s'] / best['tokens'] * 1e6:.1f} us a token")
        return
    args.passthrough = [a for a in sys.argv[1:]]
    server = run_server_levels(args)
    offline = {} if args.no_offline else run_offline(args)
    report(args, server, offline)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "passthrough"}, "server": server,
                       "offline": offline}, f, indent=1)


if __name__ == "__main__":
    main()
