"""Runs the model on a step batch: CUDA-graph replay for decode batches, eager otherwise."""
from graphs.padding import bucket_for, default_capture_sizes, pad_decode_batch
from graphs.runner import ModelRunner

__all__ = ["ModelRunner", "bucket_for", "default_capture_sizes", "pad_decode_batch"]
