"""hybrid: a runtime for hybrid Mamba2/attention language models.

The public names below are resolved on first use (module __getattr__), so that importing one
module of the package (hybrid.batch, hybrid.errors, ...) does not load the whole runtime, and no
submodule ever finds this package half-initialised.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "hybrid.llm",
    "SamplingParams": "hybrid.sampling",
    "StructuredOutputsParams": "hybrid.structured_outputs",
    "BeamSearchParams": "hybrid.beam_search",
    "RequestOutput": "hybrid.outputs",
    "CompletionOutput": "hybrid.outputs",
    "RequestOutputKind": "hybrid.sampling",
    "TextPrompt": "hybrid.inputs",
    "TokensPrompt": "hybrid.inputs",
    **{name: "hybrid.errors" for name in ("HybridError", "CheckpointError", "InvalidRequestError",
                                          "ConfigurationError", "CapacityError", "RequestFailedError")},
}

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "RequestOutputKind", "TextPrompt", "TokensPrompt", "HybridError",
           "CheckpointError", "InvalidRequestError", "ConfigurationError", "CapacityError", "RequestFailedError"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from hybrid.errors import (
        CapacityError, CheckpointError, ConfigurationError, HybridError, InvalidRequestError, RequestFailedError,
    )
    from hybrid.beam_search import BeamSearchParams
    from hybrid.llm import LLM
    from hybrid.inputs import TextPrompt, TokensPrompt
    from hybrid.outputs import CompletionOutput, RequestOutput
    from hybrid.sampling import RequestOutputKind, SamplingParams
    from hybrid.structured_outputs import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybrid' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
