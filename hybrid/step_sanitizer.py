"""The state sanitizer's engine side (check_state=True): runs the two halves of state_pool/sanitizer.py
on every step and says which requests a fault fails.

state_pool/sanitizer.py holds the checks themselves and imports nothing of the runtime; this room
joins them with what they check: the resources (which slots and pages each row owns, the NaN in
their state), the model runner (the index tensors that actually ran, the attention backend's
must-stay-zero workspaces) and the scheduler (the running sequences, to fail the owner of a slot a
faulty row ran on). The engine calls it around each forward and when a step's results come back:
- `before_forward`: the host half (`check_batch`, which refuses the step by raising
  StateCorruptionError) and the NaN flags of the state the rows read;
- `device_checks`: the device half, queued behind the forward, read back with the sampled tokens;
- `fault`: what the device half found, as the error to fail and the requests that fail with it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybrid.batch import StepBatch
from hybrid.errors import StateCorruptionError
from hybrid.resources import ResourceManager, row_owners
from state_pool.sanitizer import ExpectedInputs, device_checks, read_faults

if TYPE_CHECKING:
    from hybrid.launcher import LaunchedStep
    from hybrid.request import ScheduledChunk
    from hybrid.scheduler import Scheduler


class StepSanitizer:
    def __init__(self, runner, resources: ResourceManager, scheduler: Scheduler) -> None:
        """`runner`: the model runner (graphs/runner.py), whose inputs_that_ran() and context's
        attention backend the device half checks."""
        self.runner = runner
        self.resources = resources
        self.scheduler = scheduler

    def before_forward(self, batch: StepBatch,
                       chunks: list[ScheduledChunk]) -> tuple[ExpectedInputs, torch.Tensor]:
        """The host half, before the forward is queued: (what the batch's index tensors must hold as
        they run, per batch row whether the state it reads holds NaN). Raises StateCorruptionError
        (check_batch) if the batch would touch a slot or page its rows do not own."""
        expected = self.check_batch(batch, chunks)
        # read by the rows: queued before the forward (a first chunk reads no state)
        return expected, self.resources.state_nan(batch) & batch.has_initial_state

    def check_batch(self, batch: StepBatch, chunks: list[ScheduledChunk]) -> ExpectedInputs:
        """Raise StateCorruptionError if the batch would touch a slot or page its rows do not own;
        return what its index tensors must hold as they run (state_pool/sanitizer.py)."""
        return self.resources.check_batch(batch, chunks)

    def device_checks(self, expected: ExpectedInputs | None) -> dict[str, torch.Tensor]:
        """The device half for the step just queued (state_pool/sanitizer.py): what ran, padding rows
        the runner added included."""
        ran = self.runner.inputs_that_ran() if expected is not None else None
        return device_checks(expected, ran, self._zero_regions())

    def _zero_regions(self) -> list[tuple[str, torch.Tensor]]:
        ctx = self.runner.ctx
        return ctx.attention_backend.must_stay_zero() if ctx is not None else []

    def fault(self, step: LaunchedStep, checks: dict[str, list]) -> tuple[StateCorruptionError, list[str]] | None:
        """(the error, the request ids to fail with it) when the device half found a fault in `step`:
        its requests, and the owners of any slot a faulty row ran on. None when the step was clean."""
        fault = read_faults(checks, row_owners(step.chunks), [name for name, _ in self._zero_regions()])
        if fault is None:
            return None
        if fault.dirty_regions:
            self.runner.ctx.attention_backend.clear_regions()  # so that the next steps can run
        victims = [s.request_id for s in self.scheduler.running if s.slot in fault.named_slots]
        return StateCorruptionError(fault.reason), [c.seq.request_id for c in step.chunks] + victims
