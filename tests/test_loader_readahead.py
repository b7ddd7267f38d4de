"""The loader's background read-ahead (hybrid/loader.py _Readahead): it covers every weight file,
in the order the load first needs them, only when the files fit in half the available memory and
the load is not a tensor-parallel rank's, and the load gives the same parameters with it as without it."""
from __future__ import annotations

import torch

from hybrid import loader
from hybrid.config_parse import load_config


def _load(path: str):
    cfg = load_config(path)
    return loader.load_model(path, cfg, torch.device("cpu"), torch.float32)


def test_readahead_reads_every_file_in_first_use_order(tiny_ckpt, monkeypatch):
    path = tiny_ckpt("nemotron_h_sharded")
    seen: list[list[str]] = []
    real_run = loader._Readahead._run

    def record(self, paths):
        seen.append(list(paths))
        real_run(self, paths)

    monkeypatch.setattr(loader._Readahead, "_run", record)
    with_readahead = _load(path)
    files = loader.weight_files(path)
    assert len(seen) == 1 and sorted(seen[0]) == sorted(set(files.values())) and len(set(files.values())) > 1
    cfg = load_config(path)
    first_use = list(dict.fromkeys(files[n] for src in loader.tensor_plan(cfg).values() for n in src.disk_names))
    assert seen[0][:len(first_use)] == first_use
    monkeypatch.setattr(loader, "_available_memory", lambda: 0)  # no room: no read-ahead thread
    seen.clear()
    without = _load(path)
    assert not seen
    a, b = with_readahead.state_dict(), without.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_readahead_stops_when_told(tmp_path):
    big = tmp_path / "w.bin"
    big.write_bytes(b"\0" * (1 << 20))
    ra = loader._Readahead([str(big)])
    ra.stop()  # joins the thread: no reader left behind after a load (or a failed one)
    assert ra._thread is None or not ra._thread.is_alive()
