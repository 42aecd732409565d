"""Message metadata: the small JSON object a host attaches to a user message.

``Runtime.send(conversation_id, text, metadata={...})`` logs it with the
message (:class:`~torpor.events.UserMessage`), and the tools of that turn read
it in their :class:`~torpor.ToolContext` (who the caller is, their tenant, the
request's locale). It is the host's word about the sender, so it is bounded
and checked before anything is written: a JSON object with str keys, at most
:data:`MAX_METADATA_BYTES` once encoded as JSON and :data:`MAX_METADATA_DEPTH`
levels deep. Anything else is refused with :class:`~torpor.errors.InvalidInput`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

from torpor.errors import InvalidInput
from torpor.text import check_text, is_storable

__all__ = ["MAX_METADATA_BYTES", "MAX_METADATA_DEPTH", "check_metadata"]

MAX_METADATA_BYTES = 4096
"""Largest metadata, as compact JSON (UTF-8): it rides in the message's row."""

MAX_METADATA_DEPTH = 8
"""Deepest nesting of objects and arrays inside the metadata object (the object is level 1)."""

_INT_LOW, _INT_HIGH = -(1 << 63), 1 << 64  # what msgpack (and so the log) can hold
_encode = msgspec.json.Encoder()
_decode = msgspec.json.Decoder(dict[str, Any])


def check_metadata(value: object, what: str = "metadata") -> dict[str, Any] | None:
    """``value`` as it is logged (a fresh plain dict), None for None or an empty mapping.

    Raises InvalidInput, naming ``what``, for anything that is not a JSON object of
    storable values within the bounds. The copy is the caller's no longer: changing the
    mapping after ``send`` returns changes nothing logged.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidInput(what, f"must be a mapping with str keys, got {type(value).__name__}")
    if not value:
        return None
    value = dict(value)  # the encoder takes dicts (a mapping proxy, say, would not do)
    _check(value, what, 1)
    encoded = _encode.encode(value)
    if len(encoded) > MAX_METADATA_BYTES:
        raise InvalidInput(
            what, f"is {len(encoded)} bytes as JSON, more than {MAX_METADATA_BYTES}"
        )
    return _decode.decode(encoded)  # a plain copy: tuples become lists, as they read back


def _check(value: Any, what: str, depth: int) -> None:
    if isinstance(value, str):
        if not is_storable(value):
            check_text(value, what)  # raises, naming the character
    elif value is None or isinstance(value, bool):
        pass
    elif isinstance(value, int):
        if not _INT_LOW <= value < _INT_HIGH:
            raise InvalidInput(what, f"integer {value} is out of the storable range")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(what, f"{value} is not a JSON number")
    elif isinstance(value, dict | list | tuple):
        if depth > MAX_METADATA_DEPTH:
            raise InvalidInput(what, f"nested deeper than {MAX_METADATA_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                if type(key) is not str:
                    raise InvalidInput(what, f"keys must be str, got {type(key).__name__}")
                if not is_storable(key):
                    check_text(key, f"{what} key")
                _check(item, f"{what}[{key!r}]", depth + 1)
        else:
            for index, item in enumerate(value):
                _check(item, f"{what}[{index}]", depth + 1)
    else:
        raise InvalidInput(what, f"{type(value).__name__} is not a JSON value")
