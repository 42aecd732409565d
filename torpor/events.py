"""The log's vocabulary: a msgspec tagged union of conversation events, and its codec.

Bodies are lean on purpose: no usage, latency or audit fields (those go to the
``model_calls`` table). A body is what the user, the model or a tool said; the
envelope (:class:`Event`) is where the store put it.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import msgspec

from torpor.errors import AbortFields, CorruptEvent, abort_fields

__all__ = [
    "SCHEDULED_MARK",
    "AbortReason",
    "Aborted",
    "AssistantMessage",
    "Body",
    "Event",
    "Parked",
    "REDACTABLE",
    "REDACTED_TEXT",
    "Redacted",
    "Resolved",
    "Spawned",
    "Suspended",
    "TaskCard",
    "ToolCall",
    "ToolResult",
    "Unparked",
    "UserMessage",
    "abort_fields_of",
    "ends_turn",
    "aborted_body",
    "decode_body",
    "encode_body",
    "presented",
    "redaction_of",
    "searchable_text",
    "shown_text",
    "stand_in",
]


class ToolCall(msgspec.Struct, frozen=True, gc=False):
    """One call the model asked for; ``arguments`` is the decoded JSON object."""

    id: str
    name: str
    arguments: dict[str, Any] = {}


class UserMessage(msgspec.Struct, tag="user", frozen=True, gc=False, omit_defaults=True):
    """What the user said; ``metadata``: what the host said about the sender.

    ``metadata`` is the small JSON object given to ``Runtime.send(metadata=...)``
    (or set by the HTTP ``authorize`` hook), handed to the turn's tools in their
    :class:`~torpor.ToolContext`. ``omit_defaults``: absent, it costs nothing in
    the row, and rows written before it existed still decode.
    """

    text: str
    metadata: dict[str, Any] | None = None
    # The schedule that logged it (``Runtime.schedule``), not a person: the model is shown
    # the text as "[scheduled] text" (torpor.compaction.slots). None: a person's message.
    scheduled: str | None = None


SCHEDULED_MARK = "[scheduled] "
"""What the model is shown before a scheduled message's text (:func:`shown_text`)."""


def shown_text(body: UserMessage) -> str:
    """A user message's text as the model is shown it: a scheduled one marked."""
    return body.text if body.scheduled is None else SCHEDULED_MARK + body.text


class AssistantMessage(
    msgspec.Struct, tag="assistant", frozen=True, gc=False, omit_defaults=True
):
    """What the model said, and the tools it asked for.

    A text too large for one row (over the store's ``max_event_bytes``) is
    clipped on entry like a large tool result: ``text`` holds a preview and
    ``artifact`` names the stored full text (``full_size`` bytes of UTF-8).
    ``omit_defaults``: the optional fields cost nothing in the common row, and
    rows written before they existed still decode.
    """

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    artifact: str | None = None
    full_size: int | None = None


class ToolResult(msgspec.Struct, tag="tool_result", frozen=True, gc=False):
    """The real result of a tool call.

    When the content was too large it was clipped on entry: ``content`` holds a
    preview and ``artifact`` names the stored full bytes (recall can expand it).
    """

    call_id: str
    tool: str
    content: str
    is_error: bool = False
    artifact: str | None = None
    full_size: int | None = None


class Suspended(msgspec.Struct, tag="suspended", frozen=True, gc=False, omit_defaults=True):
    """The agent waits for outside answers to these tool calls.

    ``tools`` runs parallel to ``call_ids`` (the tool each call is for), so the
    store's pending-approvals index can name them without reading the log; it
    is empty in rows written before it existed.
    """

    call_ids: tuple[str, ...]
    reason: str = ""
    tools: tuple[str, ...] = ()
    # The calls (of call_ids) that wait for an approval, not an answer: an MCP tool that
    # needs one (torpor.mcp). Approving such a call runs it; its ToolResult is the tool's.
    approvals: tuple[str, ...] = ()


class Resolved(msgspec.Struct, tag="resolved", frozen=True, gc=False, omit_defaults=True):
    """An outside answer arrived for ``call_id`` (its ToolResult is logged with it).

    ``approval``: the call waited for an approval and got it (the resolver's text); no
    ToolResult comes with it: the continuation runs the call and logs the tool's result.
    """

    call_id: str
    approval: str | None = None


AbortReason: TypeAlias = Literal[
    "cancelled",  # the caller cancelled the turn
    "crashed",  # an unexpected error in the agent (it is restarted from the log)
    "model_error",  # the model failed mid-turn
    "interrupted",  # found unfinished on revival (the process died mid-turn)
    "shutdown",  # the runtime stopped while the turn ran
    "step_limit",  # the model kept calling tools past AgentConfig.max_steps
]


class Aborted(msgspec.Struct, tag="aborted", frozen=True, gc=False, omit_defaults=True):
    """A turn that did not finish, and any text the model had streamed before it died.

    A ``partial_text`` too large for one row is clipped on entry like an
    assistant message's text: a preview here, the full text in ``artifact``.

    What a caller decides on (:class:`torpor.errors.AbortFields`): ``error``, the
    torpor error name behind the abort (``"ModelRateLimited"``), ``retryable``,
    ``retry_after`` (seconds), ``status`` (the provider's HTTP status) and
    ``message``, a fixed sentence safe to show an end user. ``detail`` keeps the
    provider's own text, for operators. Rows written before these fields existed
    decode with ``message == ""`` (:func:`abort_fields_of` derives them from the
    reason then); ``omit_defaults`` keeps them out of rows where they are empty.
    """

    reason: AbortReason
    partial_text: str = ""
    detail: str = ""
    artifact: str | None = None
    full_size: int | None = None
    error: str | None = None
    retryable: bool = False
    retry_after: float | None = None
    status: int | None = None
    message: str = ""


class Parked(msgspec.Struct, tag="parked", frozen=True, gc=False):
    """The supervisor gave up restarting this agent; ``cause`` says why."""

    cause: str
    restarts: int = 0


class Unparked(msgspec.Struct, tag="unparked", frozen=True, gc=False):
    """An operator allowed a parked agent to run again."""

    by: str = "operator"


class Spawned(msgspec.Struct, tag="spawned", frozen=True, gc=False, omit_defaults=True):
    """A sub-agent link (``Runtime.spawn``), logged in both conversations.

    In ``parent``'s log: its pending tool call ``call_id`` is answered by the
    conversation ``child``. In ``child``'s log (its first event): whose call it
    answers, and the ``task`` it was given (so a restart can hand it over again).
    The child's final answer becomes that call's result.
    """

    parent: str
    call_id: str
    child: str
    task: str = ""


class TaskCard(msgspec.Struct, tag="task_card", frozen=True, gc=False, omit_defaults=True):
    """The conversation's task card as it stands after a change (the whole card, not a patch).

    Logged by ``rt.task(conversation).update(...)`` (``by="code"``) or the model's
    ``task_card`` tool (``by="model"``). The latest one in the log is the card in
    effect: it is rendered right after the system prompt and never folded or stubbed
    (see :mod:`torpor.compaction.task_card`). ``key_positions``: log positions the
    task turns on, which the model can ``expand``.
    """

    goal: str = ""
    constraints: tuple[str, ...] = ()
    open_loops: tuple[str, ...] = ()
    key_positions: tuple[int, ...] = ()
    by: Literal["code", "model"] = "code"


class Redacted(msgspec.Struct, tag="redacted", frozen=True, gc=False, omit_defaults=True):
    """An event whose content was removed by ``Runtime.redact`` (the one in-place update
    of the log, audited in the store's ``deletions``).

    ``kind``: the original's kind; ``reason``: the caller's; ``at``: epoch ms. What keeps
    the turn structure valid is kept, never content: a tool result's ``call_id`` and
    ``tool``, an assistant message's calls with their ids and names but no arguments, an
    abort's reason. The model is shown it as the original kind with the text
    :data:`REDACTED_TEXT` (:func:`stand_in`).
    """

    kind: str
    reason: str = ""
    at: int = 0
    call_id: str = ""
    tool: str = ""
    is_error: bool = False
    tool_calls: tuple[ToolCall, ...] = ()
    abort: str = ""


Body: TypeAlias = (
    UserMessage
    | AssistantMessage
    | ToolResult
    | Suspended
    | Resolved
    | Aborted
    | Parked
    | Unparked
    | TaskCard
    | Spawned
    | Redacted
)


class Event(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """A body as stored: where (conversation, position), when, in which turn, how big.

    ``hints``: what compaction extracted from the body when it was appended (topic
    candidates for a fold's marker, in compaction's own encoding), or None when the
    store was given no extractor or the row predates them. Opaque to everything else.
    """

    conversation_id: str
    position: int
    turn: int
    tokens: int
    created_at: int  # epoch milliseconds
    body: Body
    hints: bytes | None = None

    @property
    def kind(self) -> str:
        return kind_of(self.body)


_KINDS: dict[type, str] = {
    cls: cls.__struct_config__.tag  # type: ignore[misc]
    for cls in (
        UserMessage, AssistantMessage, ToolResult, Suspended, Resolved, Aborted, Parked, Unparked,
        Spawned,
        TaskCard,
        Redacted,
    )
}
KINDS: frozenset[str] = frozenset(_KINDS.values())


def aborted_body(
    reason: AbortReason,
    partial_text: str = "",
    detail: str = "",
    error: BaseException | None = None,
) -> Aborted:
    """The ``Aborted`` body for ``reason``, with the fields a caller decides on (derived
    from ``error``, the exception behind it: the model's typed error for ``model_error``)."""
    fields = abort_fields(reason, error)
    return Aborted(reason, partial_text, detail, error=fields.error, retryable=fields.retryable,
                   retry_after=fields.retry_after, status=fields.status, message=fields.message)


def abort_fields_of(body: Aborted) -> AbortFields:
    """The caller-facing fields of a logged abort; for a row written before they existed
    (no ``message``), what its reason implies."""
    if not body.message:
        return abort_fields(body.reason)
    return AbortFields(body.error, body.retryable, body.retry_after, body.status, body.message)


def ends_turn(event: Event, turn: int) -> bool:
    """Whether ``event`` is where turn ``turn`` ends for a caller: its answer (an assistant
    message without tool calls), its suspension or its abort (a turn's stream ends there)."""
    if event.turn != turn:
        return False
    body = event.body
    return isinstance(body, Suspended | Aborted) or (
        isinstance(body, AssistantMessage) and not body.tool_calls
    )


def kind_of(body: Body) -> str:
    """The ``kind`` tag of a body (``user``, ``assistant``, ``tool_result``, …)."""
    return _KINDS[type(body)]


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Body] = msgspec.msgpack.Decoder(Body)


def encode_body(body: Body) -> bytes:
    return _encoder.encode(body)


def decode_body(data: bytes, *, conversation_id: str, position: int) -> Body:
    """Decode one stored body; anything that is not a valid event raises CorruptEvent."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError) as exc:
        raise CorruptEvent(conversation_id, position, str(exc)) from exc


def searchable_text(body: Body) -> str:
    """The text full-text search indexes for an event (tool names and arguments included)."""
    if isinstance(body, UserMessage):
        return body.text
    if isinstance(body, AssistantMessage):
        if not body.tool_calls:
            return body.text
        calls = " ".join(
            f"{c.name} {msgspec.json.encode(c.arguments).decode()}" for c in body.tool_calls
        )
        return f"{body.text} {calls}" if body.text else calls
    if isinstance(body, ToolResult):
        return f"{body.tool} {body.content}"
    if isinstance(body, Suspended):
        return body.reason
    if isinstance(body, Aborted):
        return body.partial_text
    if isinstance(body, Parked):
        return body.cause
    if isinstance(body, Spawned):
        return body.task
    if isinstance(body, TaskCard):
        return " ".join((body.goal, *body.constraints, *body.open_loops)).strip()
    return ""


REDACTED_TEXT = "[redacted]"
"""What the model is shown in place of a redacted event's content."""

REDACTABLE: frozenset[str] = frozenset(
    {"user", "assistant", "tool_result", "aborted", "task_card"}
)
"""Kinds that hold content a redaction can remove. The others (suspensions, answers'
markers, parking, sub-agent links) are the turn structure itself: refused."""


def redaction_of(body: Body, reason: str, at: int) -> Redacted:
    """The ``Redacted`` body that replaces ``body`` (a kind in :data:`REDACTABLE`)."""
    kind = kind_of(body)
    if isinstance(body, ToolResult):
        return Redacted(kind, reason, at, call_id=body.call_id, tool=body.tool,
                        is_error=body.is_error)
    if isinstance(body, AssistantMessage):
        calls = tuple(ToolCall(c.id, c.name) for c in body.tool_calls)
        return Redacted(kind, reason, at, tool_calls=calls)
    if isinstance(body, Aborted):
        return Redacted(kind, reason, at, abort=body.reason)
    return Redacted(kind, reason, at)


def stand_in(body: Redacted) -> Body:
    """What the runtime and the model see for a redacted event: the original kind, its
    structure kept, its text :data:`REDACTED_TEXT` (a tool result still answers its call;
    an assistant message still makes its calls, with empty arguments)."""
    if body.kind == "tool_result":
        return ToolResult(body.call_id, body.tool, REDACTED_TEXT, is_error=body.is_error)
    if body.kind == "assistant":
        return AssistantMessage(REDACTED_TEXT, body.tool_calls)
    if body.kind == "aborted":
        reason = body.abort if body.abort in _ABORT_REASONS else "crashed"
        return Aborted(reason, REDACTED_TEXT)  # type: ignore[arg-type]
    if body.kind == "task_card":
        return TaskCard(goal=REDACTED_TEXT)
    return UserMessage(REDACTED_TEXT)


_ABORT_REASONS = frozenset(
    {"cancelled", "crashed", "model_error", "interrupted", "shutdown", "step_limit"}
)


def presented(event: Event) -> Event:
    """``event`` as the runtime works with it: a redacted one with its :func:`stand_in`
    body (same position, turn and tokens), any other unchanged."""
    body = event.body
    if type(body) is not Redacted:
        return event
    return Event(event.conversation_id, event.position, event.turn, event.tokens,
                 event.created_at, stand_in(body))
