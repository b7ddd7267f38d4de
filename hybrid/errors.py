"""Errors that users of the runtime are expected to catch. They are defined in the leaf
hybrid_core/errors.py, so that state_pool/ and attention/ can raise them without importing hybrid/."""
from hybrid_core.errors import (
    CapacityError, CheckpointError, ConfigurationError, EngineDeadError, HybridError, InvalidRequestError,
    NonFiniteLogitsError, RequestFailedError, StateCorruptionError,
)

__all__ = ["HybridError", "CheckpointError", "InvalidRequestError", "ConfigurationError", "CapacityError",
           "StateCorruptionError", "NonFiniteLogitsError", "RequestFailedError", "EngineDeadError"]
