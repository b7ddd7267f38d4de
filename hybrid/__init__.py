"""hybrid: a runtime for hybrid Mamba2/attention language models."""
from hybrid.errors import (
    CapacityError, CheckpointError, ConfigurationError, HybridError, InvalidRequestError, RequestFailedError,
)
from hybrid.llm import LLM
from hybrid.outputs import CompletionOutput, RequestOutput
from hybrid.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "HybridError", "CheckpointError",
           "InvalidRequestError", "ConfigurationError", "CapacityError", "RequestFailedError"]
__version__ = "0.1.0"
