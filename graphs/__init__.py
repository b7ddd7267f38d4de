"""Runs the model on a step batch: CUDA-graph replay for decode batches, eager otherwise."""
from graphs.runner import ModelRunner

__all__ = ["ModelRunner"]
