"""The tensor-parallel process group: one per LLM, built on its own TCPStore (not the global
default group, so several LLMs can live in one process), gloo on CPU, NCCL on CUDA."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# How long a collective may wait for a peer before it fails (a backstop: a dead worker is normally
# noticed within a second, see hybrid/parallel/driver.py). HYBRID_TP_TIMEOUT_S overrides it.
DEFAULT_TIMEOUT_S = 60.0


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("HYBRID_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S)))


class TPGroup:
    """Rank `rank` of `world_size`; all_reduce / all_gather on the group's process group."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        timeout = collective_timeout()
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` across the ranks, in place; returns it."""
        self.pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` concatenated along the last dim, in rank order."""
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.world_size)]
        self.pg.allgather([outs], [t]).wait()
        return torch.cat(outs, dim=-1)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def abort(self) -> None:
        """Make collectives blocked on a dead peer return (NCCL; gloo notices the closed socket)."""
        abort = getattr(self.pg, "abort", None)
        if abort is not None:
            try:
                abort()
            except Exception:  # best effort: the engine is being torn down anyway
                pass


def make_store(world_size: int, rank: int, port: int = 0) -> dist.TCPStore:
    """Rank 0 (the driver) listens on a free port (`port` 0); the workers connect to its port."""
    return dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=collective_timeout(),
                         wait_for_workers=False)
