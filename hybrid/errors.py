"""Errors that users of the runtime are expected to catch: their public home. They are defined in
state_pool/errors.py, at the bottom of the import graph, so that state_pool/, attention/ and graphs/
can raise them without importing hybrid/."""
from state_pool.errors import (
    CapacityError, CheckpointError, ConfigurationError, EngineDeadError, HybridError, InvalidRequestError,
    NonFiniteLogitsError, RequestFailedError, StateCorruptionError,
)

__all__ = ["HybridError", "CheckpointError", "InvalidRequestError", "ConfigurationError", "CapacityError",
           "StateCorruptionError", "NonFiniteLogitsError", "RequestFailedError", "EngineDeadError"]
