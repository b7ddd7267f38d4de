"""Errors that users of the runtime are expected to catch. They live here, at the bottom of the
import graph (this module imports nothing), so that the leaves (state_pool/, attention/, graphs/)
can raise them without loading the runtime in hybrid/. Their public home is `hybrid.errors`, which
re-exports them: users import them from there (or from `hybrid`)."""


class HybridError(Exception):
    """Base class of every error raised on purpose by the runtime."""


class CheckpointError(HybridError, ValueError):
    """The checkpoint directory cannot be served: missing file, unknown architecture, bad tensor."""


class InvalidRequestError(HybridError, ValueError):
    """A request (prompt or sampling parameters) is invalid; other requests are unaffected."""


class ConfigurationError(HybridError, ValueError):
    """An engine argument is invalid (an unknown dtype or device, a size below 1, ...)."""


class CapacityError(HybridError, ValueError):
    """The configured engine does not fit (e.g. more sequences than memory allows)."""


class StateCorruptionError(HybridError, RuntimeError):
    """The state sanitizer (check_state=True / HYBRID_CHECK_STATE=1) found a step that would read or
    write Mamba state or KV pages it does not own: a freed slot, another request's slot, a live slot
    from a padding row, or a shared KV page. The message names the request and the slot or page."""


class NonFiniteLogitsError(HybridError, RuntimeError):
    """A request's logits held NaN or Inf (e.g. non-finite weights or an overflow): its tokens would
    be garbage, so the request fails; the others in its step carry on."""


class RequestFailedError(HybridError, RuntimeError):
    """Requests failed inside the engine (an exception in their step, non-finite logits); the engine
    and the other requests carried on. `failed` maps each failed request (LLM.generate: the prompt's
    index) to its error; `outputs` holds LLM.generate's outputs, the failed ones finished with
    finish_reason "error" and their `error` set."""

    def __init__(self, message: str, failed: dict | None = None, outputs: list | None = None) -> None:
        super().__init__(message)
        self.failed = dict(failed or {})
        self.outputs = outputs


class EngineDeadError(HybridError):
    """The engine stopped for good (an unrecoverable device error such as an illegal memory access);
    it can no longer generate. The message says why."""
