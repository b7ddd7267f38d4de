"""The leaf every other package builds on: the step-batch contract (batch.py), the error classes
(errors.py) and small helpers (utils.py). It imports nothing from hybrid/, state_pool/,
attention/ or graphs/, so those can all import it without an import loop, and state_pool/ and
attention/ stay free of the runtime in hybrid/."""
