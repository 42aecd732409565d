"""What a write may hold: bodies, checkpoints, audit rows, checked before anything is queued.

msgspec does not check a Struct's field types when it is built, so without
this a ``UserMessage(5)`` would be written and then fail to decode forever
after (a CorruptEvent made by ourselves), a lone surrogate would surface as a
bare ``UnicodeEncodeError`` from the encoder, and NUL would be accepted by
SQLite but refused by PostgreSQL. Here every id (call ids) must pass
:func:`torpor.text.check_id` and every text :func:`torpor.text.check_text`,
so both backends refuse the same bodies with the same
:class:`~torpor.errors.InvalidInput`, naming the field.

Cost: one regex search per text field (the same characters the encoder is
about to read anyway) and a few type checks per event.
"""

from __future__ import annotations

from typing import Any, get_args

import msgspec

from torpor.errors import InvalidInput
from torpor.events import (
    Aborted,
    AbortReason,
    AssistantMessage,
    Body,
    Event,
    Parked,
    Resolved,
    Spawned,
    Suspended,
    TaskCard,
    ToolCall,
    ToolResult,
    Unparked,
    UserMessage,
)
from torpor.store.arguments import INT32_LIMIT, POSITION_LIMIT, check_int
from torpor.store.protocol import Background, Checkpoint, Marker, ModelCall
from torpor.text import MAX_ID_LENGTH, check_id, check_text, is_storable, repair_text

__all__ = [
    "admit_model_call",
    "check_arguments",
    "check_body",
    "check_checkpoint",
    "check_checkpoint_reach",
]

_ABORT_REASONS = frozenset(get_args(AbortReason))
_MAX_DEPTH = 64  # nesting of tool-call arguments; deeper is not a real tool call
_INT_LOW, _INT_HIGH = -(1 << 63), 1 << 64  # what msgpack (and so the log) can hold


def check_body(body: Body, where: str) -> None:
    """Raise InvalidInput (``what`` names the field) unless every backend can store ``body``."""
    # The commonest bodies first, by type, their field names built only on error: a str
    # that is ASCII without NUL is what check_text passes without a scan.
    if (type(body) is UserMessage and body.metadata is None) or (
        type(body) is AssistantMessage
        and type(body.tool_calls) is tuple
        and not body.tool_calls
        and body.artifact is None
        and body.full_size is None
    ):
        text = body.text
        if type(text) is not str or not text.isascii() or "\x00" in text:
            check_text(text, f"{where}.text")
        return
    _check_any(body, where)


def _check_any(body: Body, where: str) -> None:
    """:func:`check_body` for any body (its general path)."""
    if isinstance(body, UserMessage):
        check_text(body.text, f"{where}.text")
        if body.metadata is not None:  # bounded by Runtime.send; here: storable JSON
            check_arguments(body.metadata, f"{where}.metadata")
    elif isinstance(body, AssistantMessage):
        _assistant(body, where)
    elif isinstance(body, ToolResult):
        _tool_result(body, where)
    elif isinstance(body, Suspended):
        _suspended(body, where)
    elif isinstance(body, Resolved):
        check_id(body.call_id, f"{where}.call_id")
        if body.approval is not None:
            check_text(body.approval, f"{where}.approval")
    elif isinstance(body, Aborted):
        _aborted(body, where)
    elif isinstance(body, Parked):
        check_text(body.cause, f"{where}.cause")
        _int(body.restarts, f"{where}.restarts")
    elif isinstance(body, Unparked):
        check_text(body.by, f"{where}.by")
    elif isinstance(body, Spawned):
        check_id(body.parent, f"{where}.parent")
        check_id(body.call_id, f"{where}.call_id")
        check_id(body.child, f"{where}.child")
        check_text(body.task, f"{where}.task")
    elif isinstance(body, TaskCard):
        _task_card(body, where)
    else:
        raise InvalidInput(where, f"not an event body: {type(body).__name__}")


def _assistant(body: AssistantMessage, where: str) -> None:
    check_text(body.text, f"{where}.text")
    calls = body.tool_calls
    if not isinstance(calls, tuple | list):
        raise InvalidInput(f"{where}.tool_calls", "must be a tuple of ToolCall")
    for index, call in enumerate(calls):
        at = f"{where}.tool_calls[{index}]"
        if type(call) is not ToolCall:
            raise InvalidInput(at, f"must be a ToolCall, got {type(call).__name__}")
        check_id(call.id, f"{at}.id")
        check_text(call.name, f"{at}.name")
        check_arguments(call.arguments, f"{at}.arguments")
    _artifact(body.artifact, body.full_size, where)


def check_arguments(arguments: object, what: str) -> None:
    """A tool call's arguments as every backend can store them: a dict of JSON values."""
    if not isinstance(arguments, dict):
        raise InvalidInput(what, "must be a dict")
    _value(arguments, what, 0)


def _tool_result(body: ToolResult, where: str) -> None:
    check_id(body.call_id, f"{where}.call_id")
    check_text(body.tool, f"{where}.tool")
    check_text(body.content, f"{where}.content")
    if type(body.is_error) is not bool:
        raise InvalidInput(f"{where}.is_error", "must be a bool")
    _artifact(body.artifact, body.full_size, where)


def _suspended(body: Suspended, where: str) -> None:
    if not isinstance(body.call_ids, tuple | list):
        raise InvalidInput(f"{where}.call_ids", "must be a tuple of call ids")
    for index, call_id in enumerate(body.call_ids):
        check_id(call_id, f"{where}.call_ids[{index}]")
    check_text(body.reason, f"{where}.reason")
    if not isinstance(body.tools, tuple | list):
        raise InvalidInput(f"{where}.tools", "must be a tuple of tool names")
    if body.tools and len(body.tools) != len(body.call_ids):
        raise InvalidInput(
            f"{where}.tools",
            f"must name one tool per call id ({len(body.call_ids)}), got {len(body.tools)}",
        )
    for index, tool in enumerate(body.tools):
        check_text(tool, f"{where}.tools[{index}]")
    if not isinstance(body.approvals, tuple | list) or not set(body.approvals) <= set(
        body.call_ids
    ):
        raise InvalidInput(f"{where}.approvals", "must be a tuple of some of its call ids")


def _task_card(body: TaskCard, where: str) -> None:
    check_text(body.goal, f"{where}.goal")
    for name in ("constraints", "open_loops"):
        items = getattr(body, name)
        if not isinstance(items, tuple | list):
            raise InvalidInput(f"{where}.{name}", "must be a tuple of str")
        for index, item in enumerate(items):
            check_text(item, f"{where}.{name}[{index}]")
    if not isinstance(body.key_positions, tuple | list):
        raise InvalidInput(f"{where}.key_positions", "must be a tuple of positions")
    for index, position in enumerate(body.key_positions):
        check_int(position, f"{where}.key_positions[{index}]", 0, POSITION_LIMIT)
    if body.by not in ("code", "model"):
        raise InvalidInput(f"{where}.by", "must be 'code' or 'model'")


def _aborted(body: Aborted, where: str) -> None:
    if body.reason not in _ABORT_REASONS:
        raise InvalidInput(f"{where}.reason", f"must be one of {sorted(_ABORT_REASONS)}")
    check_text(body.partial_text, f"{where}.partial_text")
    check_text(body.detail, f"{where}.detail")
    _artifact(body.artifact, body.full_size, where)
    error = body.error
    if error is not None and (type(error) is not str or not error.isidentifier()
                              or not error.isascii() or len(error) > 64):
        raise InvalidInput(f"{where}.error", f"must be an error's name, got {error!r:.80}")
    if type(body.retryable) is not bool:
        raise InvalidInput(f"{where}.retryable", "must be true or false")
    after = body.retry_after
    if after is not None and (type(after) not in (int, float) or not 0 <= after < 1e9):
        raise InvalidInput(f"{where}.retry_after", f"must be seconds from 0 to 1e9, got {after!r}")
    if body.status is not None and (type(body.status) is not int
                                    or not 100 <= body.status <= 599):
        raise InvalidInput(f"{where}.status", f"must be an HTTP status, got {body.status!r}")
    check_text(body.message, f"{where}.message")


def _artifact(artifact: object, full_size: object, where: str) -> None:
    """A caller may hand in an already clipped body: its reference must be sound too."""
    if artifact is not None:
        check_id(artifact, f"{where}.artifact")
    if full_size is not None:
        _int(full_size, f"{where}.full_size")


def _int(value: object, what: str) -> None:
    if type(value) is not int or value < 0 or value >= _INT_HIGH:
        raise InvalidInput(what, f"must be a non-negative int, got {value!r}")


def _value(value: Any, what: str, depth: int) -> None:
    """A JSON-like value whose strings (keys included) the log can hold."""
    if isinstance(value, str):
        if not is_storable(value):
            check_text(value, what)  # raises, naming the character
    elif value is None or isinstance(value, bool | float):
        pass
    elif isinstance(value, int):
        if not _INT_LOW <= value < _INT_HIGH:
            raise InvalidInput(what, f"integer {value} is out of the storable range")
    elif depth >= _MAX_DEPTH:
        raise InvalidInput(what, f"nested deeper than {_MAX_DEPTH} levels")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidInput(what, f"keys must be str, got {type(key).__name__}")
            if not is_storable(key):
                check_text(key, f"{what} key")
            _value(item, f"{what}[{key!r}]", depth + 1)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _value(item, f"{what}[{index}]", depth + 1)
    else:
        raise InvalidInput(what, f"{type(value).__name__} is not a JSON value")


def check_checkpoint(checkpoint: object) -> Checkpoint:
    """A checkpoint every backend can store (its handoff text included)."""
    if not isinstance(checkpoint, Checkpoint):
        raise InvalidInput("checkpoint", f"must be a Checkpoint, got {type(checkpoint).__name__}")
    check_id(checkpoint.conversation_id, "checkpoint.conversation_id")
    check_int(checkpoint.position, "checkpoint.position", 0, POSITION_LIMIT + 1)
    check_int(checkpoint.created_at, "checkpoint.created_at", 0, _INT_HIGH >> 1)
    check_int(checkpoint.cycle, "checkpoint.cycle", 0, INT32_LIMIT)
    check_int(checkpoint.tokens, "checkpoint.tokens", 0, INT32_LIMIT)
    check_text(checkpoint.summary, "checkpoint.summary")
    check_text(checkpoint.memory, "checkpoint.memory")
    card = checkpoint.task_card
    if card is not None:
        if not isinstance(card, Event) or not isinstance(card.body, TaskCard):
            raise InvalidInput("checkpoint.task_card", "must be None or a TaskCard event")
        check_int(card.position, "checkpoint.task_card.position", 0, POSITION_LIMIT)
        check_body(card.body, "checkpoint.task_card.body")
    _check_background(checkpoint.background)
    if not isinstance(checkpoint.markers, tuple | list):
        raise InvalidInput("checkpoint.markers", "must be a tuple of Marker")
    for index, marker in enumerate(checkpoint.markers):
        at = f"checkpoint.markers[{index}]"
        if not isinstance(marker, Marker):
            raise InvalidInput(at, f"must be a Marker, got {type(marker).__name__}")
        for name in ("start", "end", "start_ms", "end_ms", "level"):
            check_int(getattr(marker, name), f"{at}.{name}", 0, _INT_HIGH >> 1)
        if not isinstance(marker.topics, tuple | list):
            raise InvalidInput(f"{at}.topics", "must be a tuple of str")
        for topic_index, topic in enumerate(marker.topics):
            check_text(topic, f"{at}.topics[{topic_index}]")
    return checkpoint


def _check_background(background: object) -> None:
    if background is None:
        return
    if not isinstance(background, Background):
        raise InvalidInput("checkpoint.background", "must be None or a Background")
    check_int(background.events, "checkpoint.background.events", 0, _INT_HIGH >> 1)
    words, counts = background.words, background.counts
    if not isinstance(words, tuple | list) or not isinstance(counts, tuple | list):
        raise InvalidInput("checkpoint.background", "words and counts must be tuples")
    if len(words) != len(counts):
        raise InvalidInput("checkpoint.background", "needs one count per word")
    for index, (word, count) in enumerate(zip(words, counts, strict=True)):
        check_text(word, f"checkpoint.background.words[{index}]")
        check_int(count, f"checkpoint.background.counts[{index}]", 0, _INT_HIGH >> 1)


def check_checkpoint_reach(checkpoint: Checkpoint, head: int) -> None:
    """A checkpoint covers only events that exist: position 0 .. head + 1 (all of them).

    Checked where the batch plans it, against the head the batch sees.
    """
    if not 0 <= checkpoint.position <= head + 1:
        raise InvalidInput(
            "checkpoint.position",
            f"{checkpoint.position} is outside conversation {checkpoint.conversation_id!r} "
            f"(head {head})",
        )


def admit_model_call(call: object) -> ModelCall:
    """An audit row every backend can store.

    Its ids and numbers are checked like any caller input; its free text (the
    model's name, an error message, which may quote whatever a provider sent)
    is repaired instead, because the audit must not fail a turn over text.
    """
    if type(call) is ModelCall and _plain(call):  # the runtime's own rows: one expression
        return call
    return _admitted(call)


def _plain(call: ModelCall) -> bool:
    """True when ``call`` passes every check of :func:`_admitted` unchanged: exact types,
    numbers in range, ASCII text without NUL. False says nothing (the full check decides)."""
    high, low32 = _INT_HIGH >> 1, INT32_LIMIT
    ids, error, sections = call.conversation_id, call.error, call.sections
    r, c, cr, cw = (
        call.reported_prompt_tokens, call.completion_tokens,
        call.cache_read_tokens, call.cache_write_tokens,
    )
    u, lat, ttft = call.utilization, call.latency_ms, call.ttft_ms
    if not (
        type(ids) is str and 0 < len(ids) <= MAX_ID_LENGTH and ids.isascii() and "\x00" not in ids
        and type(call.turn) is int and 0 <= call.turn < low32
        and type(call.call_index) is int and 0 <= call.call_index < low32
        and type(call.compaction_cycle) is int and 0 <= call.compaction_cycle < low32
        and type(call.created_at) is int and 0 <= call.created_at < high
        and type(call.estimated_prompt_tokens) is int and 0 <= call.estimated_prompt_tokens < high
        and (r is None or (type(r) is int and 0 <= r < high))
        and (c is None or (type(c) is int and 0 <= c < high))
        and (cr is None or (type(cr) is int and 0 <= cr < high))
        and (cw is None or (type(cw) is int and 0 <= cw < high))
        and (u is None or type(u) is float or type(u) is int)
        and (lat is None or type(lat) is float or type(lat) is int)
        and (ttft is None or type(ttft) is float or type(ttft) is int)
        and type(call.recipe) is bytes and type(sections) is dict
        and type(call.rendered_hash) is str and type(call.model) is str
        and type(call.purpose) is str and (error is None or type(error) is str)
    ):
        return False
    text = f"{call.rendered_hash}{call.model}{call.purpose}{error or ''}"
    if not text.isascii() or "\x00" in text:
        return False
    for name, size in sections.items():
        if type(name) is not str or not name.isascii() or "\x00" in name:
            return False
        if type(size) is not int or not _INT_LOW <= size < high:
            return False
    return True


def _admitted(call: object) -> ModelCall:
    if not isinstance(call, ModelCall):
        raise InvalidInput("call", f"must be a ModelCall, got {type(call).__name__}")
    check_id(call.conversation_id, "call.conversation_id")
    check_int(call.turn, "call.turn", 0, INT32_LIMIT)
    check_int(call.call_index, "call.call_index", 0, INT32_LIMIT)
    check_int(call.compaction_cycle, "call.compaction_cycle", 0, INT32_LIMIT)
    check_int(call.created_at, "call.created_at", 0, _INT_HIGH >> 1)
    check_int(call.estimated_prompt_tokens, "call.estimated_prompt_tokens", 0, _INT_HIGH >> 1)
    for name in (
        "reported_prompt_tokens", "completion_tokens", "cache_read_tokens", "cache_write_tokens"
    ):
        value = getattr(call, name)
        if value is not None:
            check_int(value, f"call.{name}", 0, _INT_HIGH >> 1)
    for name in ("utilization", "latency_ms", "ttft_ms"):
        value = getattr(call, name)
        if value is not None and (type(value) not in (int, float)):
            raise InvalidInput(f"call.{name}", f"must be a number, got {type(value).__name__}")
    if not isinstance(call.recipe, bytes):
        raise InvalidInput("call.recipe", "must be bytes")
    if not isinstance(call.sections, dict):
        raise InvalidInput("call.sections", "must be a dict of section name to tokens")
    for size in call.sections.values():
        check_int(size, "call.sections", _INT_LOW, _INT_HIGH >> 1)
    texts = [call.rendered_hash, call.model, call.purpose, *call.sections]
    if call.error is not None:
        texts.append(call.error)
    for text in texts:
        if not isinstance(text, str):
            raise InvalidInput("call", f"text fields must be str, got {type(text).__name__}")
    if is_storable("".join(texts)):  # joining pairs no surrogates up: one search for all
        return call
    return msgspec.structs.replace(
        call,
        rendered_hash=repair_text(call.rendered_hash),
        model=repair_text(call.model),
        purpose=repair_text(call.purpose),
        sections={repair_text(name): size for name, size in call.sections.items()},
        error=None if call.error is None else repair_text(call.error),
    )
