"""Tensor parallelism on torch.distributed (gloo on CPU, NCCL on CUDA): the model sharded over N
ranks, the engine in the driver (rank 0), N - 1 worker processes that run each step's forward on
their shards. See README.md, "Tensor parallelism"."""
from hybrid.parallel.sharding import check_shapes, local_config

__all__ = ["check_shapes", "local_config"]
