"""Weights read from disk ahead of the loader, on a thread: the disk's reads overlap the copies to the GPU.

Why: the loader opens each file with safetensors on the load device, so each tensor is read from the file
(page faults on the mapping) and then copied to the GPU, one after the other, on one thread. A cold load of the
8B shape read at 77-83% of the disk's speed on an H100 machine (BENCHMARKS.md, issue 15), while on the CPU alone
(no copy to a GPU) the same mapped reads run at the disk's speed.

How: `Prefetcher(files, order)` reads the tensors of `order` (on-disk names, in the order the loader will ask for
them) on a thread: for each, its bytes at the offsets of its file's safetensors header, with large `readinto`
calls (which release the GIL), at most `budget` bytes ahead of the loader. For a GPU target the thread reads
into a ring of page-locked staging buffers, allocated once (page-locking memory for each tensor costs about as
much as reading it), and copies each filled buffer to the tensor's device memory on a stream of its own, so the
copies overlap the next reads; `take(name)` makes the loader's stream wait for the tensor's copies. For the CPU
it reads straight into the tensor. `take` returns None for a name the thread does not read (the loader then reads
it itself): a name outside `order`, a dtype it does not know, a second request for a name.
Any error on the thread is raised again by the `take` that meets it; out of device memory while reading ahead
(or no page-locked memory for the ring) ends the thread, and the loader reads the rest itself. On by default:
measured on an H100 machine, the 8B shape's cold load read at 94-98% of the disk's speed, against 82-84% with the
loader's own reads (BENCHMARKS.md); HYBRID_LOAD_PREFETCH=0 turns it off.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time

import torch

logger = logging.getLogger("hybrid")

# safetensors' dtype names the thread reads (others: the loader reads them through safetensors)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32}
BUDGET = 1 << 30  # bytes read ahead of the loader at most (one tensor larger than this is read alone)
CHUNK = 64 << 20  # bytes a readinto call asks for: one staging buffer
STAGES = 4  # staging buffers in the ring (a buffer is refilled once its copy to the GPU has finished)


def prefetch_enabled() -> bool:
    return os.environ.get("HYBRID_LOAD_PREFETCH", "1") != "0"


def read_header(path: str) -> tuple[int, dict]:
    """(the byte offset of a safetensors file's data, its header: name -> {dtype, shape, data_offsets})."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


class Prefetcher:
    """See the module docstring. Use as a context manager (the thread stops on exit)."""

    def __init__(self, files: dict[str, str], order: list[str], device: torch.device,
                 budget: int = BUDGET) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:  # (the thread sets its device by index: the caller's current one)
            device = torch.device("cuda", torch.cuda.current_device())
        self.files, self.device, self.budget = files, device, budget
        self.headers: dict[str, tuple[int, dict]] = {}
        seen = set()
        self.order = [n for n in order if n in files and not (n in seen or seen.add(n))]
        self.wanted = set(self.order)
        # name -> (the tensor on the device, the event after its copies: None on the CPU)
        self.ready: dict[str, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self.skipped: set[str] = set()  # names of a dtype the thread does not read
        self.ahead = 0  # bytes read and not yet taken
        self.waiting = False  # the loader waits in take()
        self.error: BaseException | None = None
        self.stop = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="hybrid-load-prefetch", daemon=True)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.stages: list[torch.Tensor] = []  # the page-locked ring (GPU targets), made on the thread
        self.stage_done: list[torch.cuda.Event | None] = [None] * STAGES
        self.next_stage = 0
        self.read_s = 0.0  # the thread's time in readinto, for the log line at exit
        self.read_bytes = 0

    def __enter__(self) -> "Prefetcher":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        self.thread.join()
        if self.stream is not None:
            self.stream.synchronize()  # (the staging buffers are not reused by anyone before their copies end)
        self.ready.clear()
        self.stages.clear()
        if self.read_bytes:
            logger.info("load prefetch: %.2f GB read in %.2f s of reads (%.2f GB/s while reading)",
                        self.read_bytes / 1e9, self.read_s, self.read_bytes / max(self.read_s, 1e-9) / 1e9)

    def take(self, name: str) -> torch.Tensor | None:
        """The tensor `name` on the device (its copies ordered before the caller's stream's next work), or None:
        read it yourself."""
        with self.cond:
            if name not in self.wanted:
                return None
            self.wanted.discard(name)
            self.waiting = True  # (the thread may then read past its budget: no wait on each other)
            self.cond.notify_all()
            try:
                while name not in self.ready:
                    if self.error is not None:
                        raise self.error
                    if name in self.skipped or not self.thread.is_alive():
                        return None
                    self.cond.wait(0.1)
            finally:
                self.waiting = False
            tensor, copied = self.ready.pop(name)
            self.ahead -= tensor.numel() * tensor.element_size()
            self.cond.notify_all()
        if copied is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(copied)
            tensor.record_stream(stream)  # (made on the thread's stream: not reused before the caller's work)
        return tensor

    def _run(self) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)
                try:
                    self.stages = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(STAGES)]
                except RuntimeError as e:  # (no page-locked memory to be had: the loader reads it all itself)
                    logger.warning("load prefetch: no page-locked staging buffers (%s); the loader reads the "
                                   "checkpoint itself", e)
                    return
            for name in self.order:
                try:
                    got = self._read(name)
                except torch.OutOfMemoryError:
                    # (the tensors read ahead do not fit beside the model: the loader reads the rest itself,
                    # one at a time, as without the thread; take() answers None once the thread has ended)
                    logger.warning("load prefetch: out of device memory reading ahead at '%s'; the loader reads "
                                   "the rest itself", name)
                    return
                with self.cond:
                    if got is None:  # not ours to read: the loader's take() returns None for it
                        self.skipped.add(name)
                        self.cond.notify_all()
                        continue
                    size = got[0].numel() * got[0].element_size()
                    while self.ahead and self.ahead + size > self.budget and not (self.stop or self.waiting):
                        self.cond.wait()
                    if self.stop:
                        return
                    self.ready[name] = got
                    self.ahead += size
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the loader's next take()
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _read(self, name: str) -> tuple[torch.Tensor, torch.cuda.Event | None] | None:
        path = self.files[name]
        if path not in self.headers:
            self.headers[path] = read_header(path)
        base, header = self.headers[path]
        info = header[name]
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            return None
        start, end = info["data_offsets"]
        copied = None
        with open(path, "rb", buffering=0) as f:
            f.seek(base + start)
            if not self.cuda:
                out = self._allocate(end - start)
                self._read_into(f, out, path, name)
            else:
                with torch.cuda.stream(self.stream):
                    out = self._allocate(end - start)
                    for lo in range(0, end - start, CHUNK):
                        piece = out[lo:lo + CHUNK]
                        stage = self._free_stage()[:piece.numel()]
                        self._read_into(f, stage, path, name)
                        piece.copy_(stage, non_blocking=True)
                        self.stage_done[self.next_stage] = torch.cuda.Event()
                        self.stage_done[self.next_stage].record(self.stream)
                        self.next_stage = (self.next_stage + 1) % STAGES
                    copied = torch.cuda.Event()
                    copied.record(self.stream)
        return out.view(dtype).reshape(info["shape"]), copied

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """A tensor's bytes on the target device (on the thread's stream for a GPU)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _free_stage(self) -> torch.Tensor:
        """The ring's next staging buffer, once the copy from it has finished."""
        done = self.stage_done[self.next_stage]
        if done is not None:
            done.synchronize()
        return self.stages[self.next_stage]

    def _read_into(self, f, buf: torch.Tensor, path: str, name: str) -> None:
        """Fill `buf` (uint8, on the host) from the file's position on."""
        view = memoryview(buf.numpy()) if buf.numel() else memoryview(b"")
        t0 = time.perf_counter()
        done = 0
        while done < len(view):
            n = f.readinto(view[done:done + CHUNK])
            if not n:
                raise OSError(f"{path}: tensor '{name}' ends past the end of the file")
            done += n
        self.read_s += time.perf_counter() - t0
        self.read_bytes += done
