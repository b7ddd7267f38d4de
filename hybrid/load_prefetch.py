"""Weights read from disk ahead of the loader, on a thread: the disk's reads overlap the copies to the GPU.

Why: the loader opens each file with safetensors on the load device, so each tensor is read from the file
(page faults on the mapping) and then copied to the GPU, one after the other, on one thread. A cold load of the
8B shape read at 77-83% of the disk's speed on an H100 machine (BENCHMARKS.md, issue 15), while on the CPU alone
(no copy to a GPU) the same mapped reads run at the disk's speed.

How: `Prefetcher(files, order)` reads the tensors of `order` (on-disk names, in the order the loader will ask for
them) on a thread: for each, its bytes at the offsets of its file's safetensors header, with large `readinto`
calls (which release the GIL) into a buffer of its own, page-locked when the target is a GPU, at most `budget`
bytes ahead of the loader. `take(name)` hands the loader the next tensor, copied to the device without blocking
(from page-locked memory, so the copy overlaps the next reads), or None for a name the thread does not read
(the loader then reads it itself): a name outside `order`, a dtype it does not know, a second request for a name.
Any error on the thread is raised again by the `take` that meets it. The switch: HYBRID_LOAD_PREFETCH=1 (off by
default: not measured on the device yet).
"""
from __future__ import annotations

import json
import os
import struct
import threading

import torch

# safetensors' dtype names the thread reads (others: the loader reads them through safetensors)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32}
BUDGET = 1 << 30  # bytes read ahead of the loader at most (one tensor larger than this is read alone)
CHUNK = 64 << 20  # bytes a readinto call asks for


def prefetch_enabled() -> bool:
    return os.environ.get("HYBRID_LOAD_PREFETCH", "0") == "1"


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
        self.files, self.device, self.budget = files, device, budget
        self.pin = device.type == "cuda"
        self.headers: dict[str, tuple[int, dict]] = {}
        seen = set()
        self.order = [n for n in order if n in files and not (n in seen or seen.add(n))]
        self.wanted = set(self.order)
        self.ready: dict[str, torch.Tensor] = {}
        self.skipped: set[str] = set()  # names of a dtype the thread does not read
        self.ahead = 0  # bytes read and not yet taken
        self.waiting = False  # the loader waits in take()
        self.error: BaseException | None = None
        self.stop = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="hybrid-load-prefetch", daemon=True)

    def __enter__(self) -> "Prefetcher":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        self.thread.join()
        self.ready.clear()

    def take(self, name: str) -> torch.Tensor | None:
        """The tensor `name` on the device (copied without blocking), or None: read it yourself."""
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
            host = self.ready.pop(name)
            self.ahead -= host.numel() * host.element_size()
            self.cond.notify_all()
        return host.to(self.device, non_blocking=self.pin)

    def _run(self) -> None:
        try:
            for name in self.order:
                host = self._read(name)
                with self.cond:
                    if host is None:  # not ours to read: the loader's take() returns None for it
                        self.skipped.add(name)
                        self.cond.notify_all()
                        continue
                    size = host.numel() * host.element_size()
                    while self.ahead and self.ahead + size > self.budget and not (self.stop or self.waiting):
                        self.cond.wait()
                    if self.stop:
                        return
                    self.ready[name] = host
                    self.ahead += size
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the loader's next take()
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _read(self, name: str) -> torch.Tensor | None:
        path = self.files[name]
        if path not in self.headers:
            self.headers[path] = read_header(path)
        base, header = self.headers[path]
        info = header[name]
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            return None
        start, end = info["data_offsets"]
        buf = torch.empty(end - start, dtype=torch.uint8, pin_memory=self.pin)
        view = memoryview(buf.numpy()) if buf.numel() else memoryview(b"")
        with open(path, "rb", buffering=0) as f:
            f.seek(base + start)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:done + CHUNK])
                if not n:
                    raise OSError(f"{path}: tensor '{name}' ends past the end of the file")
                done += n
        return buf.view(dtype).reshape(info["shape"])
