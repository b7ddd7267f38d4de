"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}, and the one mapping from
what the engine raises to what a client sees (our own errors as they are, the engine's deliberate
errors with their message, anything else a generic 500 whose details go to the log only)."""
from __future__ import annotations

import logging
import re
import uuid

from hybrid.async_engine import EngineDeadError
from hybrid.errors import HybridError, InvalidRequestError, NonFiniteLogitsError, RequestFailedError

logger = logging.getLogger("hybrid.server")

GENERIC_500 = "The server had an error while processing your request."


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(name: str, why: str) -> APIError:
    """A 400 for the request field `name`."""
    return APIError(f"'{name}': {why}", 400, name, "invalid_value")


_PARAM_RE = re.compile(r"invalid sampling parameter (\w+)=")


def from_invalid(e: InvalidRequestError, default_param: str | None = None) -> APIError:
    """A 400 for the engine's InvalidRequestError, naming the sampling field it is about if it says."""
    msg = str(e)
    m = _PARAM_RE.search(msg)
    return APIError(msg, 400, m.group(1) if m else default_param, "invalid_value")


def internal_error(where: str, e: BaseException) -> APIError:
    """A 500 that says nothing about the internals; the traceback goes to the log under `ref`."""
    ref = uuid.uuid4().hex[:12]
    logger.error("%s failed (error id %s)", where, ref, exc_info=(type(e), e, e.__traceback__))
    return APIError(f"{GENERIC_500} (error id {ref})", 500, None, None, type="server_error")


def engine_dead_error() -> APIError:
    return APIError("The engine stopped after an unrecoverable error; see /health and the server log.", 503, None,
                    "engine_dead", type="server_error")


def request_failed_error(e: RequestFailedError, where: str) -> APIError:
    """A request that failed inside the engine (the engine and the other requests carried on).
    The engine's reason starts with the error's class name; only the non-finite logits case is
    told to the client (it is about the model, not the code); any other cause stays in the log."""
    reasons = [str(r) for r in e.failed.values()]
    prefix = f"{InvalidRequestError.__name__}: "
    if reasons and all(r.startswith(prefix) for r in reasons):  # the request's own settings: the client's to fix
        return APIError(reasons[0][len(prefix):], 400, None, "invalid_value")
    ref = uuid.uuid4().hex[:12]
    logger.error("%s: %s (error id %s)", where, e, ref)
    if reasons and all(r.startswith(NonFiniteLogitsError.__name__) for r in reasons):
        why = "the model produced non-finite logits (NaN or Inf) for it"
    else:
        why = "an error in its engine step"
    return APIError(f"The request failed inside the engine ({why}); other requests are unaffected. "
                    f"(error id {ref})", 500, None, "request_failed", type="server_error")


def error_for(e: BaseException, where: str) -> APIError:
    """The APIError a client sees for `e`: our own errors as they are, the engine's deliberate
    errors (HybridError: written for users) with their message, anything else generic."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return from_invalid(e)
    if isinstance(e, EngineDeadError):  # its message carries the failed step's repr: log it only
        logger.error("%s: %s", where, e)
        return engine_dead_error()
    if isinstance(e, RequestFailedError):
        return request_failed_error(e, where)
    if isinstance(e, HybridError):
        logger.error("%s: %s", where, e)
        return APIError(str(e), 500, None, None, type="server_error")
    return internal_error(where, e)
