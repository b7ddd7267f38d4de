"""The driver side: spawns the N - 1 workers, joins the group as rank 0, and wraps the model runner
so that every step goes to the workers before rank 0 runs it.

Failure handling: a worker that raises reports its traceback and exits; one that dies just exits.
Either way the driver's collective fails (gloo sees the socket close; for NCCL a watchdog thread
aborts the group when a worker process is gone) and the step raises WorkerFailedError, an
EngineDeadError: the engine stops with the worker's error, it does not hang. Any other error in a
tensor-parallel step is fatal too: the ranks may no longer be in step."""
from __future__ import annotations

import logging
import threading
import time
import weakref

from typing import TYPE_CHECKING

import torch
import torch.multiprocessing as mp

from hybrid.errors import EngineDeadError
from hybrid.parallel import protocol
from hybrid.parallel.group import TPGroup, collective_timeout, make_store
from hybrid.parallel.shard_model import ShardPlan
from hybrid.parallel.sharding import check_shapes

if TYPE_CHECKING:
    from hybrid.config import ModelConfig
    from hybrid.engine_config import EngineConfig

logger = logging.getLogger("hybrid")

STARTUP_TIMEOUT_S = 600.0  # loading a large shard takes a while; a dead worker is seen at once anyway


class WorkerFailedError(EngineDeadError):
    """A tensor-parallel worker died or raised: the engine cannot go on."""


class TensorParallel:
    """The driver's handle on the workers of one LLM (rank 0 is the driver itself)."""

    def __init__(self, config: EngineConfig, model_dir: str, cfg: ModelConfig) -> None:
        """Check the shapes divide, spawn the workers (they start loading their shards) and join the
        group as rank 0. WorkerFailedError if a worker fails or dies while starting."""
        tp = config.tensor_parallel_size
        check_shapes(cfg, tp)  # before anything is spawned
        self.world_size = tp
        device = config.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        spec = protocol.WorkerSpec(model_dir=model_dir, device_type=device.type,
                                   first_device_index=device.index or 0, dtype=config.dtype,
                                   check_weights=config.check_weights, fused_ops=config.fused_ops,
                                   mamba_decode_kernels=config.mamba_decode_kernels,
                                   num_threads=torch.get_num_threads())
        store = make_store(tp, 0)
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        from hybrid.parallel.worker import worker_main

        for rank in range(1, tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(rank, tp, store.port, child, spec), daemon=True,
                            name=f"hybrid-tp-worker-{rank}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._groups: list[TPGroup] = []  # (filled once joined: the finalizer tears it down on CUDA)
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, self._groups)
        self.failed: str | None = None
        try:
            self._wait_all("hello", STARTUP_TIMEOUT_S)
            self.group = TPGroup(store, 0, tp, device)
            self._groups.append(self.group)
        except BaseException:
            self.shutdown()
            raise
        self.store = store
        self.plan = ShardPlan(cfg, self.group)
        self.local_cfg = self.plan.local_cfg
        self._log: list = []
        self._watchdog = threading.Thread(target=_watch, args=(weakref.ref(self),), daemon=True,
                                          name="hybrid-tp-watchdog")
        self._watchdog.start()

    # ------------------------------------------------------------------ startup
    def load_model(self, load, *args, **kwargs):
        """Rank 0's shard, via hybrid.loader.load_model (`load`), then the workers' load is awaited."""
        try:
            model = load(*args, shard=self.plan, **kwargs)
            self._wait_all("loaded", STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        return model

    def broadcast(self, msg) -> None:
        self.check()
        data = protocol.dumps(msg)
        try:
            for c in self.conns:
                c.send_bytes(data)
        except (BrokenPipeError, ConnectionError, EOFError, OSError) as e:
            raise self.failure(e) from e

    def instrument(self, state_pool, kv_cache) -> None:
        """Make the driver's pool and KV cache log their writes outside the forward (protocol.py)."""
        state_pool.__class__ = protocol.RecordingStatePool
        kv_cache.__class__ = protocol.RecordingKVCache
        state_pool.tp_log = kv_cache.tp_log = self._log  # one log: their order is kept
        self._pool = state_pool

    def setup_workers(self, setup: protocol.SetupSpec) -> None:
        self.broadcast(("setup", setup))

    def wait_ready(self) -> None:
        try:
            self._wait_all("ready", STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def wrap_runner(self, runner) -> "ParallelRunner":
        return ParallelRunner(runner, self)

    # ------------------------------------------------------------------ steps
    def send_step(self, batch) -> None:
        ops, self._log[:] = list(self._log), []
        self.broadcast(("step", ops, protocol.encode_batch(batch)))

    def check(self) -> None:
        """WorkerFailedError if a worker has reported an error or is no longer running."""
        for rank, c in enumerate(self.conns, start=1):  # a worker's own report first: it says the most
            try:
                while c.poll():
                    msg = protocol.loads(c.recv_bytes())
                    if msg[0] == "error":
                        self._fail(f"tensor-parallel worker rank {msg[1]} failed:\n{msg[2]}")
            except (EOFError, OSError):
                pass  # its process state says the rest
        if self.failed is not None:
            raise WorkerFailedError(self.failed)
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                self._fail(f"tensor-parallel worker rank {rank} (pid {p.pid}) died (exit code {p.exitcode})")

    def failure(self, error: BaseException, grace_s: float = 5.0) -> WorkerFailedError:
        """The WorkerFailedError for a step that raised `error`: a worker's own error if one shows
        within `grace_s` (its report may trail the socket closing), else the driver's."""
        deadline = time.monotonic() + grace_s
        while True:
            try:
                self.check()
            except WorkerFailedError as e:
                self.shutdown()
                return e
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        msg = (f"a tensor-parallel step failed on rank 0 (the driver): {type(error).__name__}: {error}; "
               "the ranks can no longer be kept in step")
        self.failed = msg
        self.shutdown()
        return WorkerFailedError(msg)

    def _fail(self, msg: str) -> None:
        self.failed = msg
        logger.error("%s", msg)
        raise WorkerFailedError(msg)

    def slots_with_nan_per_rank(self) -> list[list[bool]]:
        """For every rank (0 first): which state slots hold NaN there. The sanitizer poisons freed
        slots on rank 0 and the log replays that on the workers: the lists must be equal."""
        ops, self._log[:] = list(self._log), []  # the writes since the last step first (frees, poison)
        self.broadcast(("probe", ops))
        replies = self._wait_all("probe", 30.0)
        return [protocol.slots_with_nan(self._pool)] + [r[2] for r in replies]

    def _wait_all(self, kind: str, timeout_s: float) -> list:
        """Wait for message `kind` from every worker (returned in rank order); WorkerFailedError if
        one fails or dies first."""
        replies: dict[int, tuple] = {}
        pending = set(range(len(self.conns)))
        deadline = time.monotonic() + timeout_s
        while pending:
            for i in list(pending):
                c, p = self.conns[i], self.procs[i]
                if c.poll(0.05):
                    try:
                        msg = protocol.loads(c.recv_bytes())
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None and msg[0] == "error":
                        self._fail(f"tensor-parallel worker rank {msg[1]} failed:\n{msg[2]}")
                    if msg is not None and msg[0] == kind:
                        pending.discard(i)
                        replies[i] = msg
                        continue
                if not p.is_alive() and not c.poll():
                    self._fail(f"tensor-parallel worker rank {i + 1} (pid {p.pid}) died during startup "
                               f"(exit code {p.exitcode})")
            if time.monotonic() > deadline:
                self._fail(f"tensor-parallel workers {sorted(i + 1 for i in pending)} did not report '{kind}' "
                           f"within {timeout_s:.0f} s")
        return [replies[i] for i in sorted(replies)]

    def shutdown(self) -> None:
        """Stop the workers (they are daemons: they also end with this process)."""
        self._finalizer()


def _shutdown(procs, conns, groups) -> None:
    data = protocol.dumps(("stop",))
    for c in conns:
        try:
            c.send_bytes(data)
        except Exception:
            pass
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(1.0)
    for c in conns:
        c.close()
    for g in groups:  # NCCL: abort, not destroy (destroying a communicator used in captured graphs can hang)
        if g.device.type == "cuda":
            g.abort()


def _watch(ref) -> None:
    """A worker process that disappears marks the group failed and, on CUDA, aborts the NCCL
    communicator: an NCCL collective does not block the host, the driver would hang later, in the
    device sync that reads the step's tokens back, until the collective timeout. (gloo blocks in
    the collective itself and fails there as soon as the dead peer's socket closes.)"""
    while True:
        tp = ref()
        if tp is None or not tp._finalizer.alive:
            return
        dead = [rank for rank, p in enumerate(tp.procs, start=1) if not p.is_alive()]
        if dead:  # (the next step's check() raises WorkerFailedError with the worker's own report)
            if tp.device.type == "cuda":
                logger.error("tensor-parallel worker rank %d is gone: aborting the NCCL communicator", dead[0])
                tp.group.abort()
            return
        del tp
        time.sleep(0.2)


class ParallelRunner:
    """The driver's model runner: each step goes to the workers, then rank 0 runs it; everything
    else (padded_batch, bucket, stats, ...) is the wrapped runner's."""

    def __init__(self, runner, tp: TensorParallel) -> None:
        self._runner, self._tp = runner, tp

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def execute(self, batch) -> torch.Tensor:
        tp = self._tp
        tp.send_step(batch)
        try:
            return self._runner.execute(batch)
        except Exception as e:
            raise tp.failure(e) from e


__all__ = ["TensorParallel", "ParallelRunner", "WorkerFailedError", "collective_timeout"]
