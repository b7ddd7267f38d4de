"""The prefetching loader onto the GPU (hybrid/load_prefetch.py: page-locked staging ring, copies on the thread's
stream): the same parameters, bit for bit, as the loader's own reads, also with staging buffers much smaller than
the tensors (each tensor in many pieces, every buffer reused many times) and with the loader's stream busy."""
from __future__ import annotations

import pytest
import torch

from hybrid import load_prefetch
from hybrid.config_parse import load_config
from hybrid.load_prefetch import Prefetcher
from hybrid.loader import load_model

CUDA = torch.device("cuda")


def _state(path, monkeypatch, on: bool) -> dict[str, torch.Tensor]:
    monkeypatch.setenv("HYBRID_LOAD_PREFETCH", "1" if on else "0")
    model = load_model(str(path), load_config(str(path)), CUDA, torch.bfloat16)
    torch.cuda.synchronize()
    return {k: v.cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("chunk", [None, 4096])
@pytest.mark.parametrize("name", ["nemotron_h_sharded", "granite_moe"])
def test_prefetched_gpu_load_equals_the_loaders_own_reads(tiny_ckpt, monkeypatch, name, chunk):
    path = tiny_ckpt(name)
    if chunk is not None:  # (4 KB pieces through a ring of 2: most tensors in several pieces)
        monkeypatch.setattr(load_prefetch, "CHUNK", chunk)
        monkeypatch.setattr(load_prefetch, "STAGES", 2)
    taken = []
    real_take = Prefetcher.take
    monkeypatch.setattr(Prefetcher, "take", lambda self, n: taken.append(n) or real_take(self, n))
    got = _state(path, monkeypatch, True)
    assert taken
    want = _state(path, monkeypatch, False)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_take_orders_the_copies_before_the_callers_work(tmp_path, monkeypatch):
    """The loader's stream is kept busy while the thread copies: what it reads after take() is the file's bytes."""
    from safetensors.torch import save_file

    monkeypatch.setattr(load_prefetch, "CHUNK", 1 << 16)
    monkeypatch.setattr(load_prefetch, "STAGES", 2)
    tensors = {f"t{i}": torch.randn(512, 1024, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    path = str(tmp_path / "w.safetensors")
    save_file(tensors, path)
    busy = torch.randn(4096, 4096, device=CUDA)
    with Prefetcher({n: path for n in tensors}, list(tensors), CUDA) as pf:
        for name, want in tensors.items():
            for _ in range(4):  # (work queued on the caller's stream ahead of the copied tensor's use)
                busy = busy @ busy / 4096 ** 0.5
            got = pf.take(name) * 1.0
            assert torch.equal(got.cpu(), want), name
    assert not pf.thread.is_alive()
