"""hybrid: a runtime for hybrid Mamba2/attention language models."""
from hybrid.errors import CheckpointError, HybridError, InvalidRequestError
from hybrid.llm import LLM
from hybrid.outputs import CompletionOutput, RequestOutput
from hybrid.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "HybridError", "CheckpointError",
           "InvalidRequestError"]
__version__ = "0.1.0"
