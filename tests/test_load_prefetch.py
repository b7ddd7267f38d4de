"""hybrid/load_prefetch.py: the loader's tensors read ahead on a thread give the same model, bit for bit, as the
loader's own reads (single-file and sharded checkpoints, FP8 ones); the prefetcher hands tensors in the
loader's order within its budget, leaves names it does not read to the loader, raises the thread's errors,
and stops with its context when the loader stops early."""
from __future__ import annotations

import json
import struct
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from hybrid import load_prefetch
from hybrid.config_parse import load_config
from hybrid.errors import CheckpointError
from hybrid.load_prefetch import Prefetcher
from hybrid.loader import load_model, weight_files

CPU = torch.device("cpu")


def _load(path, monkeypatch, on: bool):
    monkeypatch.setenv("HYBRID_LOAD_PREFETCH", "1" if on else "0")
    return load_model(str(path), load_config(str(path)), CPU, torch.float32)


@pytest.mark.parametrize("name", ["nemotron_h", "nemotron_h_sharded", "granite_moe", "zamba2"])
def test_prefetched_load_equals_the_loaders_own_reads(tiny_ckpt, monkeypatch, name):
    path = tiny_ckpt(name)
    calls = []
    real_take = Prefetcher.take
    monkeypatch.setattr(Prefetcher, "take", lambda self, n: calls.append(n) or real_take(self, n))
    with_prefetch = _load(path, monkeypatch, True).state_dict()
    assert calls  # the loader took its tensors from the prefetcher
    without = _load(path, monkeypatch, False).state_dict()
    assert with_prefetch.keys() == without.keys()
    for k in without:
        assert torch.equal(with_prefetch[k], without[k]), k


@pytest.mark.parametrize("scheme", ["modelopt_fp8", "ct_fp8_dynamic"])
def test_prefetched_fp8_checkpoint_load_equals_the_loaders_own_reads(tiny_ckpt, monkeypatch, tmp_path, scheme):
    import fp8_reference as R

    path = R.quantize(tiny_ckpt("granite_moe"), tmp_path / scheme, scheme)
    with_prefetch = _load(path, monkeypatch, True).state_dict()
    without = _load(path, monkeypatch, False).state_dict()
    assert with_prefetch.keys() == without.keys()
    for k in without:
        assert torch.equal(with_prefetch[k], without[k]), k


def test_a_broken_checkpoint_still_fails_clearly_and_the_thread_stops(tiny_ckpt, monkeypatch, tmp_path):
    """A tensor of the wrong shape: the loader's CheckpointError, and no prefetch thread left running."""
    src = tiny_ckpt("nemotron_h")
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    files = weight_files(str(dst))
    path = files[next(iter(files))]
    from safetensors.torch import load_file

    tensors = load_file(path)
    victim = sorted(tensors)[len(tensors) // 2]
    tensors[victim] = torch.zeros(3, 3)
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match="shape mismatch"):
        _load(dst, monkeypatch, True)
    assert not [t for t in threading.enumerate() if t.name == "hybrid-load-prefetch"]


def _file(tmp_path, tensors: dict, name="w.safetensors") -> str:
    path = str(tmp_path / name)
    save_file(tensors, path)
    return path


def test_tensors_come_in_order_within_the_budget_and_unknown_names_go_to_the_loader(tmp_path):
    tensors = {f"t{i}": torch.full((64, 64), float(i)) for i in range(6)}
    tensors["flags"] = torch.ones(4, dtype=torch.bool)  # a dtype the thread does not read
    path = _file(tmp_path, tensors)
    files = {n: path for n in tensors}
    order = ["t0", "t1", "t1", "flags", "t2", "t3", "t4", "t5", "absent"]
    with Prefetcher(files, order, CPU, budget=2 * 64 * 64 * 4) as pf:
        time.sleep(0.05)
        assert pf.ahead <= 2 * 64 * 64 * 4  # the thread waits for the loader past its budget
        for i in range(3):
            assert torch.equal(pf.take(f"t{i}"), tensors[f"t{i}"])
        assert pf.take("t1") is None  # asked twice: the loader reads it again itself
        assert pf.take("flags") is None and pf.take("absent") is None
        assert torch.equal(pf.take("t5"), tensors["t5"])  # out of order: waits past the budget, no deadlock
        assert torch.equal(pf.take("t3"), tensors["t3"])
    assert not pf.thread.is_alive()


def test_a_read_error_on_the_thread_is_raised_by_take(tmp_path):
    path = _file(tmp_path, {"a": torch.zeros(8), "b": torch.ones(1024)})
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    end = 8 + n + header["b"]["data_offsets"][1]
    with open(path, "r+b") as f:
        f.truncate(end - 100)  # b ends past the end of the file
    with Prefetcher({"a": path, "b": path}, ["a", "b"], CPU) as pf:
        assert torch.equal(pf.take("a"), torch.zeros(8))
        with pytest.raises(OSError, match="past the end"):
            pf.take("b")


def test_leaving_early_stops_the_thread(tmp_path):
    tensors = {f"t{i}": torch.zeros(256, 256) for i in range(8)}
    path = _file(tmp_path, tensors)
    pf = Prefetcher({n: path for n in tensors}, list(tensors), CPU, budget=1)
    with pf:
        pf.take("t0")
    assert not pf.thread.is_alive() and not pf.ready


def test_the_switch(monkeypatch):
    monkeypatch.delenv("HYBRID_LOAD_PREFETCH", raising=False)
    assert load_prefetch.prefetch_enabled()  # (on by default)
    monkeypatch.setenv("HYBRID_LOAD_PREFETCH", "0")
    assert not load_prefetch.prefetch_enabled()


@pytest.mark.parametrize("fail_at", [0, 3])
def test_out_of_memory_ahead_hands_the_rest_to_the_loader(tiny_ckpt, monkeypatch, caplog, fail_at):
    """The thread's allocation for a tensor read ahead fails (device memory full beside the model): the tensors
    already read are taken, the loader reads the rest itself, and the parameters are the same bit for bit."""
    path = tiny_ckpt("granite_moe")
    calls = []
    real = Prefetcher._allocate

    def allocate(self, nbytes):
        calls.append(nbytes)
        if len(calls) > fail_at:
            raise torch.OutOfMemoryError("out of memory (test)")
        return real(self, nbytes)

    monkeypatch.setattr(Prefetcher, "_allocate", allocate)
    taken = []
    real_take = Prefetcher.take
    monkeypatch.setattr(Prefetcher, "take", lambda self, n: (lambda t: taken.append(t is not None) or t)(
        real_take(self, n)))
    with caplog.at_level("WARNING", logger="hybrid"):
        got = _load(path, monkeypatch, True).state_dict()
    assert "out of device memory" in caplog.text
    assert sum(taken) == fail_at and len(taken) > fail_at  # (the first fail_at from the thread, then None)
    monkeypatch.undo()
    want = _load(path, monkeypatch, False).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
