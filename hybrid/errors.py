"""Errors that users of the runtime are expected to catch: their public home. They are defined in
state_pool/errors.py, at the bottom of the import graph, so that state_pool/, attention/ and graphs/
can raise them without importing hybrid/. Also which device errors the engine cannot recover from."""
import torch

from state_pool.errors import (
    CapacityError, CheckpointError, ConfigurationError, EngineDeadError, HybridError, InvalidRequestError,
    NonFiniteLogitsError, RequestFailedError, StateCorruptionError,
)

__all__ = ["is_fatal_device_error", "HybridError", "CheckpointError", "InvalidRequestError", "ConfigurationError", "CapacityError",
           "StateCorruptionError", "NonFiniteLogitsError", "RequestFailedError", "EngineDeadError"]

# Messages of device errors after which the CUDA context is unusable (every later call fails too).
_FATAL_DEVICE_ERRORS = (
    "illegal memory access", "device-side assert", "unspecified launch failure", "illegal instruction",
    "misaligned address", "launch timed out", "uncorrectable ECC", "hardware stack error", "illegal address",
)


def is_fatal_device_error(error: BaseException) -> bool:
    """Whether `error` means the device can no longer be used (out of memory is recoverable)."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    if isinstance(error, EngineDeadError):  # e.g. a tensor-parallel worker died (hybrid/parallel/driver.py)
        return True
    msg = str(error)
    return any(marker in msg for marker in _FATAL_DEVICE_ERRORS)
