"""vLLM's module path for the sampling parameters (`from vllm.sampling_params import ...`): the same classes as
hybrid.sampling, hybrid.structured_outputs and hybrid.beam_search define."""
from __future__ import annotations

from hybrid.beam_search import BeamSearchParams
from hybrid.sampling import RequestOutputKind, SamplingParams
from hybrid.structured_outputs import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "RequestOutputKind", "StructuredOutputsParams", "GuidedDecodingParams",
           "BeamSearchParams"]
