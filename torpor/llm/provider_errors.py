"""Provider failures as typed torpor errors: what happened, and whether a retry may help.

Both SDKs already raise typed errors, but each its own, and an error that
arrives inside a stream (an SSE ``error`` event) comes with the status of the
stream (200), not of the failure. This module classifies what the provider
said (status, error type, error code, message) into one of the
:class:`~torpor.errors.ModelError` subclasses, the same way for every
provider, so callers branch on ``retryable`` instead of on wording.
"""

from __future__ import annotations

import email.utils
import math
import re
import time
from collections.abc import Mapping

from torpor.errors import (
    ModelAuthError,
    ModelBadRequest,
    ModelConnectionError,
    ModelContextTooLong,
    ModelError,
    ModelOverloaded,
    ModelRateLimited,
    ModelTimeout,
)

__all__ = ["classify", "is_transport_error", "retry_after", "transport_error"]

# What providers and OpenAI-compatible servers say when the prompt does not fit:
# OpenAI and vLLM ("maximum context length"), llama.cpp ("exceeds the available context
# size", exceed_context_size_error), Anthropic ("prompt is too long", "exceed context
# limit"), Mistral ("too large for model"), and the codes some of them set.
_TOO_LONG = re.compile(
    r"context[ _-]?(?:length|size|window|limit)|maximum context|prompt is too long"
    r"|too many (?:input )?tokens|reduce the length|exceeds? (?:the )?(?:available )?context"
    r"|too large for (?:the )?model|input is too long|request_too_large",
    re.IGNORECASE,
)
_RATE_KINDS = frozenset({"rate_limit_error", "rate_limit_exceeded", "tokens", "requests"})
_OVERLOADED_KINDS = frozenset({"overloaded_error", "api_error", "server_error", "overloaded"})
_AUTH_KINDS = frozenset({
    "authentication_error", "permission_error", "invalid_api_key", "permission_denied",
})
_BAD_KINDS = frozenset({"invalid_request_error", "not_found_error", "not_found"})


def retry_after(headers: Mapping[str, str] | None) -> float | None:
    """Seconds the provider asked us to wait (``retry-after-ms``, then ``retry-after`` as
    seconds or as an HTTP date), or None."""
    if not headers:
        return None
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) / scale
        except ValueError:
            if scale == 1000.0:
                continue
            try:
                parsed = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError, IndexError):
                return None
            seconds = parsed.timestamp() - time.time()
        if math.isfinite(seconds):
            return max(0.0, seconds)
    return None


def classify(
    provider: str,
    *,
    status: int | None,
    kind: str | None = None,
    code: str | None = None,
    message: str = "",
    headers: Mapping[str, str] | None = None,
) -> ModelError:
    """The torpor error for what the provider said.

    ``status`` is the HTTP status (None or 200 for an error event inside a
    stream); ``kind`` the provider's error type (``overloaded_error``,
    ``invalid_request_error``, …) and ``code`` its error code
    (``context_length_exceeded``, ``rate_limit_exceeded``, …).
    """
    kind = (kind or "").lower()
    code = (code or "").lower()
    text = message.strip() or kind or code or "no detail given"
    where = f" (HTTP {status})" if status and status != 200 else ""
    what = f" [{kind or code}]" if (kind or code) and (kind or code) not in text else ""
    full = f"{provider}: {text}{what}{where}"
    reported = status if status != 200 else None
    wait = retry_after(headers)

    def make(cls: type[ModelError], *, wait_applies: bool = False) -> ModelError:
        return cls(full, provider=provider, status=reported,
                   retry_after=wait if wait_applies else None)

    client_error = status is None or status == 200 or 400 <= status < 500
    if client_error and status != 429 and (
        code == "context_length_exceeded"
        or kind in ("exceed_context_size_error", "request_too_large")
        or status == 413
        or _TOO_LONG.search(text) is not None
    ):
        return make(ModelContextTooLong)
    if status in (401, 403):  # the status is the server's word, whatever the body says
        return make(ModelAuthError)
    if status == 429 or kind in _RATE_KINDS or code in _RATE_KINDS:
        error = make(ModelRateLimited, wait_applies=True)
        if code == "insufficient_quota" or kind == "insufficient_quota":
            error.retryable = False  # the quota is spent: waiting does not bring it back
        return error
    if status in (401, 403) or kind in _AUTH_KINDS or code in _AUTH_KINDS:
        return make(ModelAuthError)
    if status == 408:
        return make(ModelTimeout, wait_applies=True)
    if (status is not None and status >= 500) or kind in _OVERLOADED_KINDS:
        return make(ModelOverloaded, wait_applies=True)
    if (status is not None and 400 <= status < 500) or kind in _BAD_KINDS:
        return make(ModelBadRequest)
    return make(ModelError)


_TRANSPORT_MODULES = ("httpx", "httpcore", "h11", "h2", "anyio")


def is_transport_error(exc: BaseException) -> bool:
    """A network failure below the SDK (the socket closed, a chunked body cut short).

    Matched by module so it holds whichever HTTP stack (httpx or its successor)
    the installed SDK uses; OS-level socket errors count too.
    """
    if isinstance(exc, OSError | EOFError):
        return True
    for cls in type(exc).__mro__:
        if cls in (BaseException, Exception, object):
            continue
        if cls.__module__.split(".", 1)[0].rstrip("0123456789") in _TRANSPORT_MODULES:
            return True
    return False


def transport_error(provider: str, exc: BaseException) -> ModelError:
    """A connection failure, named (timeouts become :class:`ModelTimeout`)."""
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if "timeout" in type(exc).__name__.lower():
        return ModelTimeout(f"{provider}: timed out ({detail})", provider=provider)
    return ModelConnectionError(f"{provider}: connection failed ({detail})", provider=provider)
