"""The model runner: the one call the engine makes per step.

On CPU (and with enforce_eager) it runs the model eagerly. CUDA-graph capture of decode
batches plugs in here, behind the same `execute` call.
"""
from __future__ import annotations

import torch

from hybrid.batch import StepBatch


class ModelRunner:
    def __init__(self, model, ctx, enforce_eager: bool = True) -> None:
        self.model = model
        self.ctx = ctx
        self.enforce_eager = enforce_eager

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] (fp32) for the batch."""
        return self.model(batch, self.ctx)
