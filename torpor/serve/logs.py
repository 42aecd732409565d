"""Log formats for ``torpor serve``: JSON lines or console lines, with request and conversation ids.

The library stays silent unless the host configures logging; ``torpor serve``
is a host, so it does (``torpor.cli.serve``), with these formatters and
:class:`ContextFilter`. Every record handled while
a request is served carries its ``request_id`` and, on conversation routes,
its ``conversation_id`` (bound through context variables by the app, so a
record from deep inside the runtime gets them too when it is logged in the
request's task).
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from typing import Any

from torpor._logging import event_of

__all__ = [
    "ConsoleFormatter",
    "ContextFilter",
    "JsonFormatter",
    "bound",
    "conversation_id_var",
    "request_id_var",
]

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "torpor_request_id", default=None
)
conversation_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "torpor_conversation_id", default=None
)

_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "taskName", "color_message",
}


def bound() -> dict[str, str]:
    """The ids bound to the current request, for a log call or a response."""
    out: dict[str, str] = {}
    request_id = request_id_var.get()
    if request_id is not None:
        out["request_id"] = request_id
    conversation_id = conversation_id_var.get()
    if conversation_id is not None:
        out["conversation_id"] = conversation_id
    return out


class ContextFilter(logging.Filter):
    """Puts the bound request and conversation ids on every record (never overriding)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in bound().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


_PLAIN = (str, int, float, bool, type(None))
_encode = json.JSONEncoder(ensure_ascii=False, default=repr).encode  # one, not one per record


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, event, then every bound key."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._second: tuple[int, str] = (-1, "")  # the UTC second last formatted, its text

    def format(self, record: logging.LogRecord) -> str:
        second, stamp = self._second
        if int(record.created) != second:  # a line a request: the second's text is reused
            second = int(record.created)
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = (second, stamp)
        out: dict[str, Any] = {
            "ts": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": event_of(record),  # whole: never cut from the message
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, _PLAIN) else repr(value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return _encode(out)


class ConsoleFormatter(logging.Formatter):
    """``HH:MM:SS level logger: message [request_id=… conversation_id=…]`` for a person."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        message = record.getMessage()
        ids = " ".join(f"{k}={getattr(record, k)}" for k in ("request_id", "conversation_id")
                       if hasattr(record, k) and f"{k}=" not in message)
        line = f"{stamp} {record.levelname.lower():<7} {record.name}: {message}"
        if ids:
            line += f" [{ids}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line
