"""What a captured graph reads must be made inside its capture (CPU: the capture calls are faked).

A verify graph's Mamba metadata (index tensors derived from the graph's input buffers,
hybrid/mamba_metadata.py) is cached on the batch by the first model call. If the eager warm-up runs
cached it, the capture would record reads of tensors outside the graph's pool, freed with the batch
view after capture: on the H200 the replayed graph then gathered with whatever reused that memory
(a device-side index assert). The capture must rebuild it.
"""
from __future__ import annotations

import contextlib

import torch

from graphs.runner import ModelRunner
from graphs.padding import padding_verify_batch


class _RecordingModel:
    """Stands in for the model: records, per call, whether the batch arrived with cached metadata,
    then caches a fresh object like hybrid.mamba_metadata.step_metadata does."""

    def __init__(self) -> None:
        self.seen: list[object] = []

    def __call__(self, batch, ctx):
        self.seen.append(batch.mamba_metadata)
        batch.mamba_metadata = object()
        return torch.zeros(batch.num_tokens, 4)


def test_capture_rebuilds_the_step_metadata_cached_by_the_warmup_runs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    model = _RecordingModel()
    runner = object.__new__(ModelRunner)
    runner.model, runner.ctx, runner.pool = model, None, None
    monkeypatch.setattr(ModelRunner, "_device", lambda self: torch.device("cpu"))
    scratch = (torch.zeros(1, 2, 4, 1, 1), torch.zeros(1, 2, 4, 1, 1, 1))
    batch = padding_verify_batch(2, 4, 16, "cpu", 9, scratch)
    runner._capture_graph(batch)
    assert len(model.seen) == 3
    assert model.seen[0] is None and model.seen[1] is not None  # the warm-up runs share the cache
    assert model.seen[2] is None, "the captured call reused metadata built outside the capture"


def test_verify_graphs_need_mamba_kernels_that_run_verify_rows(monkeypatch):
    # the library decode kernels leave verify rows to the torch path, whose host-side index checks
    # cannot be captured: no verify graphs (and no memory reserved for them) with those kernels
    from types import SimpleNamespace

    from graphs.padding import verify_graphs_requested

    def model(*supports):
        mixers = [SimpleNamespace(kernels=SimpleNamespace(supports_verify=s)) for s in supports]
        return SimpleNamespace(mamba_mixers=lambda: mixers)

    monkeypatch.delenv("HYBRID_VERIFY_GRAPHS", raising=False)
    assert verify_graphs_requested(3) and verify_graphs_requested(3, model(True, True))
    assert not verify_graphs_requested(3, model(True, False)) and not verify_graphs_requested(0, model(True))
    assert not verify_graphs_requested(3, SimpleNamespace(mamba_mixers=lambda: [SimpleNamespace(kernels=None)]))
    monkeypatch.setenv("HYBRID_VERIFY_GRAPHS", "0")
    assert not verify_graphs_requested(3, model(True))
