"""Text at the boundary: what the log can hold, checked the same way on every backend.

Input from a caller (ids, user text, idempotency keys, resolutions) that the
log cannot hold is refused with :class:`~torpor.errors.InvalidInput` before
anything is written. Text the runtime produces itself (a model's stream, a
tool's return value) is repaired visibly instead, so a turn never dies of it.

Two things no backend may receive: a lone surrogate (not encodable as UTF-8,
so neither SQLite's codec nor PostgreSQL's accepts it) and NUL (PostgreSQL
text refuses it; SQLite would take it, and the backends must agree).
"""

from __future__ import annotations

import re

from torpor.errors import InvalidInput

__all__ = ["MAX_ID_LENGTH", "check_id", "check_text", "is_storable", "repair_text"]

MAX_ID_LENGTH = 256

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def is_storable(text: str) -> bool:
    """True when every backend can hold ``text`` as it is."""
    if text.isascii():  # a flag CPython keeps on the string: no surrogate, only NUL to find
        return "\x00" not in text
    return _UNSTORABLE.search(text) is None


def check_text(value: object, what: str) -> str:
    """``value`` itself when it is a storable str; else :class:`InvalidInput` naming ``what``."""
    if not isinstance(value, str):
        raise InvalidInput(what, f"must be a str, got {type(value).__name__}")
    if value.isascii() and "\x00" not in value:  # most text: no scan by the pattern
        return value
    match = _UNSTORABLE.search(value)
    if match is not None:
        char = "NUL" if match.group() == "\x00" else f"a lone surrogate U+{ord(match.group()):04X}"
        raise InvalidInput(
            what, f"contains {char} at index {match.start()}, which the log cannot hold"
        )
    return value


def check_id(value: object, what: str = "conversation_id") -> str:
    """A conversation id, idempotency key or call id: a storable str of 1..256 characters."""
    text = check_text(value, what)
    if not 0 < len(text) <= MAX_ID_LENGTH:
        raise InvalidInput(what, f"must be 1..{MAX_ID_LENGTH} characters, got {len(text)}")
    return text


def repair_text(text: str) -> str:
    """Replace what the log cannot hold with U+FFFD, visibly. Free when nothing needs it."""
    if is_storable(text):
        return text
    return _UNSTORABLE.sub("\ufffd", text)
