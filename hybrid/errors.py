"""Errors that users of the runtime are expected to catch."""


class HybridError(Exception):
    """Base class of every error raised on purpose by the runtime."""


class CheckpointError(HybridError, ValueError):
    """The checkpoint directory cannot be served: missing file, unknown architecture, bad tensor."""


class InvalidRequestError(HybridError, ValueError):
    """A request (prompt or sampling parameters) is invalid; other requests are unaffected."""


class CapacityError(HybridError, ValueError):
    """The configured engine does not fit (e.g. more sequences than memory allows)."""


class StateCorruptionError(HybridError, RuntimeError):
    """The state sanitizer (check_state=True / HYBRID_CHECK_STATE=1) found a step that would read or
    write Mamba state or KV pages it does not own: a freed slot, another request's slot, a live slot
    from a padding row, or a shared KV page. The message names the request and the slot or page."""
