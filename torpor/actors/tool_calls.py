"""The tool calls a model streams, made loggable or refused as the model's own error.

msgspec does not check a Struct's fields when it is built, so a model of one's
own can yield a ``ToolCall`` whose arguments are a JSON string, a list or
something JSON cannot hold. Logged as it is, the store refuses the answer
(``InvalidInput``): the turn then crashes, and the fifth such turn parks a
conversation whose only fault is its model's output. Checked here, while the
stream is read, such a call fails the call as a
:class:`~torpor.errors.ModelResponseError`: the turn ends ``model_error``,
which never counts toward parking.

What the model may have meant is kept when it is clear: text the log cannot
hold is replaced visibly (U+FFFD), and arguments given as the provider's JSON
text are decoded, as the built-in adapters do. Arguments that are JSON objects
but do not fit the tool's schema are not the model's *stream* failing: the
tool answers them with an error result the model reads and can correct.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from torpor.errors import InvalidInput, ModelResponseError
from torpor.events import ToolCall
from torpor.store.admit import check_arguments
from torpor.text import MAX_ID_LENGTH, repair_text

__all__ = ["checked_call"]

_decode_arguments = msgspec.json.Decoder(dict[str, Any])
_QUOTED = 200  # characters of bad arguments quoted in the error


def checked_call(call: object, earlier: Sequence[ToolCall]) -> ToolCall:
    """``call`` as the log can hold it, or ModelResponseError saying what is wrong with it.

    ``earlier``: the calls of the same answer before it (ids must differ: each
    result answers one id).
    """
    if type(call) is not ToolCall:
        raise ModelResponseError(f"a tool call must be a ToolCall, got {type(call).__name__}")
    name, call_id, arguments = call.name, call.id, call.arguments
    if type(name) is not str or type(call_id) is not str:
        raise ModelResponseError(
            f"a tool call's name and id must be str, got {type(name).__name__} and "
            f"{type(call_id).__name__}"
        )
    name, call_id = repair_text(name), repair_text(call_id)
    what = f"tool call {name[:100]!r} ({call_id[:100]})"
    if not 0 < len(call_id) <= MAX_ID_LENGTH:
        raise ModelResponseError(f"{what}: its id must be 1..{MAX_ID_LENGTH} characters")
    if any(c.id == call_id for c in earlier):
        raise ModelResponseError(f"{what}: another call of the same answer has that id")
    if isinstance(arguments, str):  # the provider's JSON text, not decoded by the model
        raw = arguments.strip() or "{}"
        try:
            arguments = _decode_arguments.decode(raw)
        except msgspec.DecodeError:
            raise ModelResponseError(
                f"{what} came with arguments that are not a JSON object: {raw[:_QUOTED]!r}"
            ) from None
    elif not isinstance(arguments, dict):
        raise ModelResponseError(
            f"{what}: its arguments must be a dict (a decoded JSON object), got "
            f"{type(arguments).__name__}: {repr(arguments)[:_QUOTED]}"
        )
    arguments = _repaired(arguments)
    try:
        check_arguments(arguments, "arguments")
    except InvalidInput as exc:
        raise ModelResponseError(f"{what} came with arguments the log cannot hold: {exc}") from None
    if name is call.name and call_id is call.id and arguments is call.arguments:
        return call
    return ToolCall(call_id, name, arguments)


def _repaired(value: Any) -> Any:
    """``value`` with text the log cannot hold replaced visibly (U+FFFD); itself if none."""
    if isinstance(value, str):
        return repair_text(value)
    if isinstance(value, dict):
        items = {_repaired(k): _repaired(v) for k, v in value.items()}
        if len(items) != len(value):  # two keys repaired to one: changed, the last one kept
            return items
        return value if all(
            a is b and c is d for (a, c), (b, d) in zip(items.items(), value.items(), strict=True)
        ) else items
    if isinstance(value, list):
        repaired = [_repaired(v) for v in value]
        return value if all(a is b for a, b in zip(repaired, value, strict=True)) else repaired
    return value
