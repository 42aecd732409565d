"""torpor's loggers: structlog's bound context, delivered through the standard ``logging`` module.

A library must not print. Every torpor logger is the stdlib logger of its
module under ``torpor`` (``torpor.runtime``, ``torpor.actors.tools``, …), so
levels, handlers, filters and ``logging.disable`` are the host application's.
A ``NullHandler`` on ``torpor`` keeps logging's last-resort handler from
printing warnings when the host configured nothing.

structlog is used for its bound context only (``log.bind(conversation_id=…)``).
Its global configuration belongs to the host: it is neither changed nor
consulted here, so ``structlog.configure`` in an application cannot make
torpor print either.

A record carries the event and its key/values twice, for both kinds of host:
the message reads ``agent_crashed conversation_id='c1' error='…'`` (values as
``repr``, so a newline in an id cannot forge a log line, and made encodable, so
a lone surrogate cannot break a handler), and every key/value is an attribute
of the record (``record.conversation_id``) for a structured formatter, the
event too (:func:`event_of`). A key that collides with a ``LogRecord``
attribute gets a trailing underscore (``name_``): logging refuses to overwrite
those. Events are snake_case names (``owner_unreachable``), never prose.

A logging call never raises into its caller (a supervisor must not die of its
own crash report): whatever fails while building or handing over a record is
reduced to a minimal record, or dropped.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import structlog

__all__ = [
    "EVENT_ATTRIBUTE", "ROOT_LOGGER", "TorporLogger", "event_of", "foreign_logger", "get_logger",
]

ROOT_LOGGER = "torpor"
EVENT_ATTRIBUTE = "_torpor_event"
"""The record attribute holding the event alone (``owner_unreachable``), without the values
the message appends: a formatter reads the event from it, never by cutting the message (an
event with a space in it would be cut short). Private (leading underscore): not a value."""

logging.getLogger(ROOT_LOGGER).addHandler(logging.NullHandler())

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}
# Attributes logging sets on every record (read off a real one: they vary by version).
_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
}
_CALL_KEYWORDS = ("exc_info", "stack_info")
# Frames between torpor's call site and logging: skipped so records name the call site.
# Frames skipped to find a record's caller: structlog, this module, and the store's
# failure-episode logger (its records belong to the code that reported the failure).
_WRAPPER_FILES = (
    str(Path(structlog.__file__).parent), __file__,
    str(Path(__file__).parent / "store" / "episode.py"),
)


class TorporLogger(structlog.stdlib.BoundLogger):
    """structlog's stdlib ``BoundLogger`` (``bind``, ``debug``…``exception``), made safe.

    Work happens only for records the stdlib logger will take: a disabled
    debug call costs one ``isEnabledFor``.
    """

    def _proxy_to_logger(
        self, method_name: str, event: str | None = None, *event_args: Any, **event_kw: Any
    ) -> Any:
        logger: logging.Logger = self._logger
        level = _LEVELS.get(method_name, logging.INFO)
        depth = 1
        try:
            if not logger.isEnabledFor(level):  # honours levels and logging.disable
                return None
            depth = _depth_of_call_site()
            values = {**self._context, **event_kw}
            call = {key: values.pop(key) for key in _CALL_KEYWORDS if key in values}
            call["stacklevel"] = depth + int(values.pop("stacklevel", 1)) - 1
            message = _message(event, event_args, values)
            extra = {(f"{k}_" if k in _RESERVED else k): v for k, v in values.items()}
            extra[EVENT_ATTRIBUTE] = _encodable(str(event) if event is not None else "")
            getattr(logger, method_name)(message, extra=extra, **call)
        except Exception as exc:  # see the module docstring: never into the caller
            _fallback(logger, level, event, exc, depth)
        return None


def get_logger(name: str) -> TorporLogger:
    """The logger for a torpor module: ``log = get_logger(__name__)``.

    A name outside the ``torpor`` hierarchy (``__main__``) is put inside it, so
    every torpor record passes the ``torpor`` logger and its NullHandler.
    """
    if name != ROOT_LOGGER and not name.startswith(ROOT_LOGGER + "."):
        name = f"{ROOT_LOGGER}.{name}"
    return TorporLogger(logging.getLogger(name), (), {})


def event_of(record: logging.LogRecord) -> str:
    """The event a record is for: what a torpor logger was called with, or the message of
    any other record."""
    event = getattr(record, EVENT_ATTRIBUTE, None)
    return event if isinstance(event, str) else record.getMessage()


def _message(event: object, args: tuple[Any, ...], values: dict[str, Any]) -> str:
    text = str(event) if event is not None else ""
    if args:  # stdlib %-style arguments, applied here: the record carries no args
        text = text % args
    if values:
        text = " ".join([text, *(f"{key}={_repr(value)}" for key, value in values.items())])
    return _encodable(text)


def _repr(value: object) -> str:
    try:
        return repr(value)
    except Exception as exc:  # one value's broken __repr__ must not cost the whole record
        return f"<{type(value).__name__}: repr raised {type(exc).__name__}>"


def _encodable(text: str) -> str:
    """``text`` with lone surrogates escaped (``\\udc80``): any UTF-8 handler can write it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _depth_of_call_site() -> int:
    """logging's ``stacklevel`` that names the line calling ``log.warning(…)``, not structlog."""
    frame = sys._getframe(1)  # _proxy_to_logger
    depth = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_WRAPPER_FILES):
        frame = frame.f_back
        depth += 1
    return depth


def _fallback(
    logger: logging.Logger, level: int, event: object, error: Exception, depth: int
) -> None:
    try:
        name = _encodable(event if isinstance(event, str) else _repr(event))
        logger.log(level, "%s (record dropped: %s while logging it)", name,
                   type(error).__name__, stacklevel=depth + 1)
    except Exception:  # a filter or handler that always raises: nothing more to try
        return


def stdlib_logger(name: str) -> logging.Logger:
    """The stdlib logger behind torpor's logger ``name``, for a filter a served app attaches
    to read torpor's own records into metrics (torpor.serve.metrics.LogTap)."""
    return get_logger(name)._logger


def foreign_logger(name: str) -> logging.Logger:
    """Another library's own stdlib logger (``asyncio``, ``uvicorn.error``), for a filter
    the server attaches while it runs (torpor.serve.loglimit). torpor's own records go
    through :func:`get_logger`; this is the one other door to :mod:`logging`."""
    return logging.getLogger(name)
