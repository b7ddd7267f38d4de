"""What the driver and the workers exchange over their pipes (pickled with the standard pickler:
CPU tensors by value, never shared-memory or CUDA IPC handles), and the state-pool mirror.

The driver decides every slot id, padding row, fork, verify commit and prefix-cache copy once; its
state pool and KV cache log each state write they make outside the forward (zeroing a new slot,
poisoning a freed one, copies, commits), and that log travels with the next step, so every rank
applies the same writes to its own shard, in the same order relative to the forwards."""
from __future__ import annotations

import dataclasses
import pickle

import torch

from attention.kv_cache import PagedKVCache
from state_pool.pool import MambaStatePool
from state_pool.step_batch import StepBatch

_FIELDS = [f.name for f in dataclasses.fields(StepBatch) if f.init]


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load its shard (sent at spawn)."""
    model_dir: str
    device_type: str  # "cpu" | "cuda"
    first_device_index: int  # cuda: rank r runs on cuda:(first_device_index + r)
    dtype: torch.dtype
    check_weights: bool
    fused_ops: bool
    mamba_decode_kernels: str
    num_threads: int


@dataclasses.dataclass(frozen=True)
class SetupSpec:
    """The sizes the driver settled, for the worker's state pool, KV cache and runner."""
    num_slots: int
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype
    spec_scratch: tuple[int, int] | None  # (rows, positions) of the verify scratch
    num_kv_pages: int
    page_size: int
    max_num_seqs: int
    max_model_len: int
    enforce_eager: bool
    cuda_graph_sizes: tuple[int, ...] | None


def dumps(msg) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes):
    return pickle.loads(data)


def encode_batch(batch: StepBatch) -> dict:
    """The batch as plain data: tensors on the host, the verify scratch (the driver's pool's own
    tensors) as a flag that the worker replaces by its pool's scratch."""
    out = {}
    for name in _FIELDS:
        v = getattr(batch, name)
        if name == "state_scratch":
            v = v is not None
        elif isinstance(v, torch.Tensor):
            v = v.cpu()
        out[name] = v
    return out


def decode_batch(data: dict, device: torch.device, pool: MambaStatePool) -> StepBatch:
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in data.items()}
    kw["state_scratch"] = pool.spec_scratch if kw["state_scratch"] else None
    return StepBatch(**kw)


# ---------------------------------------------------------------------------------- state mirror
class RecordingStatePool(MambaStatePool):
    """The driver's pool (rank 0's shard); every state write outside the forward is also logged."""

    tp_log: list

    def allocate(self):
        slot = super().allocate()
        if slot is not None:
            self.tp_log.append(("zero", slot))
        return slot

    def poison(self, slot: int) -> None:
        super().poison(slot)
        self.tp_log.append(("nan", slot))

    def copy_slot(self, src: int, dst: int) -> None:
        super().copy_slot(src, dst)
        self.tp_log.append(("copy", src, dst))

    def commit_spec(self, slot: int, scratch_index: int, position: int) -> None:
        super().commit_spec(slot, scratch_index, position)
        self.tp_log.append(("commit", slot, scratch_index, position))


class RecordingKVCache(PagedKVCache):
    tp_log: list

    def copy_page(self, src: int, dst: int) -> None:
        super().copy_page(src, dst)
        self.tp_log.append(("page", src, dst))


def apply_ops(ops: list, pool: MambaStatePool, kv: PagedKVCache) -> None:
    """A worker replays the driver's logged writes on its shard (no allocator: the ids are decided)."""
    for op in ops:
        kind = op[0]
        if kind == "zero":
            pool.conv_state[:, op[1]].zero_()
            pool.ssm_state[:, op[1]].zero_()
        elif kind == "nan":
            pool.conv_state[:, op[1]].fill_(float("nan"))
            pool.ssm_state[:, op[1]].fill_(float("nan"))
        elif kind == "copy":
            pool.conv_state[:, op[2]].copy_(pool.conv_state[:, op[1]])
            pool.ssm_state[:, op[2]].copy_(pool.ssm_state[:, op[1]])
        elif kind == "commit":
            _, slot, r, j = op
            pool.conv_state[:, slot].copy_(pool.spec_conv[:, r, j])
            pool.ssm_state[:, slot].copy_(pool.spec_ssm[:, r, j])
        elif kind == "page":
            kv.kv[:, op[2]].copy_(kv.kv[:, op[1]])
        else:
            raise AssertionError(f"unknown state op {op!r}")


def slots_with_nan(pool: MambaStatePool) -> list[bool]:
    """Per slot (scratch row included): whether any of its conv or SSM state is NaN, on this rank."""
    if pool.conv_state.shape[0] == 0:
        return [False] * (pool.num_slots + 1)
    conv = pool.conv_state.isnan().flatten(2).any(-1).any(0)
    ssm = pool.ssm_state.isnan().flatten(2).any(-1).any(0)
    return (conv | ssm).tolist()
