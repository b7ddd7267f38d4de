"""The step batch (StepBatch) and to_device: defined in state_pool/step_batch.py (the lowest package), whose
docstring is the index contract shared by state_pool/, attention/ and graphs/; re-exported here
for the runtime's own modules. Importing this loads nothing else of the runtime."""
from state_pool.step_batch import StepBatch, to_device

__all__ = ["StepBatch", "to_device"]
