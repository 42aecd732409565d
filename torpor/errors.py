"""Every error torpor raises on purpose. All derive from :class:`TorporError`."""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "ABORT_MESSAGES",
    "MODEL_ERROR_MESSAGES",
    "AbortFields",
    "AgentParked",
    "Busy",
    "ConfigError",
    "ConflictError",
    "ConversationDeleted",
    "CorruptEvent",
    "CorruptStore",
    "EventTooLarge",
    "FencedError",
    "IdempotencyConflict",
    "InvalidInput",
    "InvalidTransition",
    "MemoryChanged",
    "ModelAuthError",
    "ModelBadRequest",
    "ModelConnectionError",
    "ModelContextTooLong",
    "ModelError",
    "ModelOverloaded",
    "ModelRateLimited",
    "ModelResponseError",
    "ModelTimeout",
    "NotOwner",
    "RuntimeClosed",
    "ScheduleGone",
    "TooManySchedules",
    "ShardMoved",
    "StoreError",
    "StoreUnavailable",
    "TaskCardTooLarge",
    "ToolArgumentError",
    "TorporError",
    "TurnAborted",
    "UnknownArtifact",
    "UnknownCall",
    "UnknownConversation",
    "UnsupportedStoreURL",
    "abort_fields",
]


class TorporError(Exception):
    """Base class of every error torpor raises on purpose."""


class ConfigError(TorporError, ValueError):
    """A configuration value is invalid; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class InvalidInput(TorporError, ValueError, TypeError):
    """A caller's argument cannot be accepted (type, range, or text the log cannot hold).

    Raised before anything is written. ``what`` names the argument. Also a
    ``ValueError`` and a ``TypeError``, so code written against either catches it.
    """

    def __init__(self, what: str, message: str) -> None:
        super().__init__(f"{what}: {message}")
        self.what = what


class TaskCardTooLarge(InvalidInput):
    """A task card change would make the card cost more than ``AgentConfig.task_card_tokens``.

    Refused whole, before anything is logged: the card in effect is unchanged.
    """

    def __init__(self, tokens: int, budget: int) -> None:
        super().__init__(
            "task card",
            f"would cost {tokens} tokens, over its budget of {budget} "
            "(AgentConfig.task_card_tokens): shorten it",
        )
        self.tokens = tokens
        self.budget = budget


class StoreError(TorporError):
    """The event store failed or was given something it cannot hold."""


class StoreUnavailable(StoreError):
    """The store cannot write right now (disk full, read-only, connection lost).

    The infrastructure's fault, not the conversation's: nothing of the refused
    write was stored, and the same call may succeed once the store recovers.
    """


class FencedError(StoreUnavailable):
    """This node no longer holds the lease of the conversation's shard (scale-out).

    Another node took the shard over (its epoch moved past ``epoch``), or this
    node holds no lease on it at all. Nothing of the refused write was stored;
    the same request succeeds on the shard's current owner.
    """

    def __init__(
        self, conversation_id: str, shard: int, epoch: int | None, detail: str = ""
    ) -> None:
        held = f"epoch {epoch} is not current" if epoch is not None else "no lease held"
        super().__init__(
            f"{conversation_id}: shard {shard} fenced ({held}){': ' + detail if detail else ''}"
        )
        self.conversation_id = conversation_id
        self.shard = shard
        self.epoch = epoch


class CorruptStore(StoreError):
    """The database itself is unreadable (not a torpor store, truncated, or damaged)."""


class UnsupportedStoreURL(StoreError, ValueError):
    """The URL names a backend torpor does not have (or does not have yet)."""


class CorruptEvent(StoreError):
    """A stored row does not decode as an event. Never skipped."""

    def __init__(self, conversation_id: str, position: int, detail: str = "") -> None:
        super().__init__(
            f"corrupt event at conversation {conversation_id!r} position {position}: {detail}"
        )
        self.conversation_id = conversation_id
        self.position = position
        self.detail = detail


class ConflictError(StoreError):
    """An append expected a head the conversation no longer has (a second writer won)."""

    def __init__(self, conversation_id: str, expected: int | None, actual: int | None) -> None:
        super().__init__(
            f"conversation {conversation_id!r}: expected head {expected}, found {actual}"
        )
        self.conversation_id = conversation_id
        self.expected = expected
        self.actual = actual


class EventTooLarge(StoreError, ValueError):
    """An event body is larger than the store accepts; nothing was written."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"event body of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class IdempotencyConflict(TorporError, ValueError):
    """An idempotency key was reused with a different message; nothing was written."""

    def __init__(self, conversation_id: str, key: str) -> None:
        super().__init__(
            f"conversation {conversation_id!r}: idempotency key {key!r} was already used "
            "for a different message"
        )
        self.conversation_id = conversation_id
        self.key = key


class UnknownArtifact(StoreError, KeyError):
    """No artifact by that id (a KeyError too, as ``get_artifact`` always promised)."""

    def __init__(self, artifact_id: str) -> None:
        super().__init__(f"no artifact {artifact_id!r}")
        self.artifact_id = artifact_id

    def __str__(self) -> str:  # KeyError would show the repr of the message
        return str(self.args[0])


class UnknownConversation(TorporError, LookupError):
    """The conversation has no events."""


class ConversationDeleted(UnknownConversation):
    """The conversation was deleted (``Runtime.delete``): what waited on it, what was
    sent while the delete ran, and every follower's stream end with this."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"conversation {conversation_id!r} was deleted")
        self.conversation_id = conversation_id


class ScheduleGone(TorporError):
    """A schedule's firing found it cancelled, or fired already for that due time (by
    another node, or before a restart): nothing was written."""

    def __init__(self, conversation_id: str, schedule_id: str) -> None:
        super().__init__(f"{conversation_id!r}: schedule {schedule_id!r} is not due any more")
        self.conversation_id = conversation_id
        self.schedule_id = schedule_id


class TooManySchedules(InvalidInput):
    """A conversation already has as many pending schedules as it may
    (``AgentConfig.max_schedules`` for the model's schedule tool)."""

    def __init__(self, conversation_id: str, limit: int) -> None:
        super().__init__("schedule", f"{conversation_id!r} already has {limit} pending schedules")
        self.limit = limit


class MemoryChanged(TorporError):
    """A consolidation sweep's decisions name memory items that are no longer stored (a
    redaction dropped the fold that made them since the sweep read them): nothing was
    recorded. Sweep again: the next sweep reads what stands now."""

    def __init__(self, conversation_id: str, items: tuple[str, ...]) -> None:
        super().__init__(
            f"{conversation_id!r}: memory items {', '.join(items)} are no longer stored"
        )
        self.conversation_id = conversation_id
        self.items = items


class UnknownCall(TorporError, LookupError):
    """``resolve`` named a tool call the agent is not waiting for."""


class Busy(TorporError):
    """The agent's mailbox is full: input was refused, nothing was written."""


class AgentParked(TorporError):
    """The supervisor parked this agent after repeated crashes; an operator must unpark it."""

    def __init__(self, conversation_id: str, cause: str) -> None:
        super().__init__(f"agent {conversation_id!r} is parked: {cause}")
        self.conversation_id = conversation_id
        self.cause = cause


class NotOwner(TorporError):
    """Another node owns the conversation's shard (scale-out): send the request there.

    ``owner`` is that node's advertised address (``"host:port"``), or None when
    no live node holds the shard right now (retry shortly). ``moving``: the
    shard is in hand-off through this node (leaving it, or about to be acquired
    by it); its lease lands within about ``handoff_deadline`` plus two lease
    refreshes (the HTTP layer waits for that, then serves or proxies).
    """

    def __init__(
        self, conversation_id: str, shard: int, owner: str | None, *, moving: bool = False
    ) -> None:
        where = f"node at {owner}" if owner is not None else "no live node yet"
        super().__init__(f"{conversation_id}: shard {shard} is owned by {where}"
                         + (" (in hand-off)" if moving else ""))
        self.conversation_id = conversation_id
        self.shard = shard
        self.owner = owner
        self.moving = moving


class ShardMoved(NotOwner):
    """The shard moved to another node while this request waited; retry at ``owner``.

    Pending turns of a conversation whose shard this node lost fail with it.
    """


class RuntimeClosed(TorporError):
    """The runtime is not running (not entered yet, or already left)."""


class ToolArgumentError(TorporError, ValueError):
    """A tool call's arguments do not fit the tool's schema; the model gets ``str(self)`` back."""

    def __init__(self, tool: str, detail: str) -> None:
        super().__init__(f"invalid arguments for tool {tool!r}: {detail}")
        self.tool = tool
        self.detail = detail


class ModelError(TorporError):
    """The model failed while producing a turn.

    ``retryable`` says whether the same request may succeed if sent again (after
    ``retry_after`` seconds when the provider said so); ``provider`` and
    ``status`` name who answered and with which HTTP status, when known. The
    subclasses are what the provider adapters raise; a model of your own may
    raise any of them too.
    """

    retryable: bool = False

    def __init__(
        self,
        message: str = "",
        *,
        provider: str | None = None,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.provider = provider
        self.status = status
        self.retry_after = retry_after

    @property
    def advice(self) -> str:
        """Whether a retry may help, in words (logged with the turn's ``Aborted``)."""
        if not self.retryable:
            return "a retry will not help"
        if self.retry_after:
            return f"a retry may help after {self.retry_after:g} s"
        return "a retry may help"


class ModelTimeout(ModelError, TimeoutError):
    """The model's stream produced nothing for longer than the agent's idle timeout
    (or the provider client's own timeout expired). A retry may help."""

    retryable = True


class ModelRateLimited(ModelError):
    """The provider refused the request for now (HTTP 429): wait ``retry_after``
    seconds when given, then a retry may help."""

    retryable = True


class ModelOverloaded(ModelError):
    """The provider is overloaded or failing on its side (HTTP 5xx, 529,
    ``overloaded_error``). A retry may help, later."""

    retryable = True


class ModelConnectionError(ModelError):
    """The connection to the provider failed or was cut mid-stream. A retry may help."""

    retryable = True


class ModelContextTooLong(ModelError):
    """The rendered context is longer than the model accepts. The same request will
    fail again; a shorter one may not (the runtime folds once and retries once)."""

    retryable = False


class ModelAuthError(ModelError):
    """The provider refused the credentials (HTTP 401/403). A retry will not help."""

    retryable = False


class ModelBadRequest(ModelError):
    """The provider refused the request as malformed or unsupported (HTTP 400/404/422:
    an unknown model, a bad option). A retry will not help."""

    retryable = False


class ModelResponseError(ModelError):
    """The provider's answer could not be used: a tool call whose arguments are not a
    JSON object, a stream that ended before the model finished. A retry may help."""

    retryable = True


class InvalidTransition(TorporError, RuntimeError):
    """An undeclared state change: a bug in the actor, so it crashes (and is restarted)."""


class AbortFields(NamedTuple):
    """What a caller (a UI) is told of an aborted turn, besides its reason.

    ``error``: the torpor error name behind it (``"ModelRateLimited"``,
    ``"StepLimit"``…; None for a cancel, a crash, a shutdown or an interruption:
    the reason says it all). ``retryable``: whether sending the message again may
    succeed (after ``retry_after`` seconds when known). ``status``: the model
    provider's HTTP status, when there was one. ``message``: a fixed English
    sentence a UI may show an end user; never the provider's text (that stays in
    the abort's ``detail``, for operators).
    """

    error: str | None
    retryable: bool
    retry_after: float | None
    status: int | None
    message: str


# One fixed sentence per model error type: never the provider's own words, which may name
# internals (a proxy's model group, an upstream URL) that an end user must not see.
MODEL_ERROR_MESSAGES: dict[str, str] = {
    "ModelTimeout": "The model took too long to respond; try again.",
    "ModelRateLimited": "The model provider is rate limiting requests; try again in a moment.",
    "ModelOverloaded": "The model provider is overloaded or unavailable; try again later.",
    "ModelConnectionError": "The connection to the model provider failed; try again.",
    "ModelContextTooLong": "The conversation is too long for the model to process.",
    "ModelAuthError": "The service could not authenticate with the model provider.",
    "ModelBadRequest": "The model provider refused the request.",
    "ModelResponseError": "The model's answer could not be used; try again.",
    "ModelError": "The model failed to answer.",
}
_QUOTA_SPENT = "The model provider's usage quota is exhausted."
ABORT_MESSAGES: dict[str, str] = {
    "cancelled": "The turn was cancelled.",
    "crashed": "Something went wrong while answering; the error was logged.",
    "model_error": MODEL_ERROR_MESSAGES["ModelError"],
    "interrupted": "The answer was interrupted; try again.",
    "shutdown": "The service stopped before the answer was complete; try again shortly.",
    "step_limit": "The assistant took too many steps without finishing its answer.",
}
# Sending again may succeed after these (the service comes back, the process restarted);
# not after a cancel (the caller's choice), a crash (the same input may crash again) or the
# step limit (the same conversation calls the same tools again).
_RETRYABLE_REASONS = frozenset({"interrupted", "shutdown"})


def abort_fields(reason: str, error: BaseException | None = None) -> AbortFields:
    """The fields of an abort for ``reason`` and the exception behind it (the model's typed
    error for ``model_error``)."""
    if reason == "model_error":
        if isinstance(error, ModelError):
            # a subclass of one of ours is named as ours: the names are a fixed vocabulary
            # (what a UI and an alert match on)
            name = next((c.__name__ for c in type(error).__mro__
                         if c.__module__ == __name__ and c.__name__ in MODEL_ERROR_MESSAGES),
                        "ModelError")
            message = MODEL_ERROR_MESSAGES[name]
            if isinstance(error, ModelRateLimited) and not error.retryable:
                message = _QUOTA_SPENT
            return AbortFields(name, bool(error.retryable), _seconds(error.retry_after),
                               _status(error.status), message)
        return AbortFields("ModelError", False, None, None, MODEL_ERROR_MESSAGES["ModelError"])
    return AbortFields(
        "StepLimit" if reason == "step_limit" else None,
        reason in _RETRYABLE_REASONS,
        None,
        None,
        ABORT_MESSAGES.get(reason, "The turn ended without an answer."),
    )


def _seconds(value: object) -> float | None:
    """A retry delay as the log holds it (a model of one's own may set anything)."""
    if isinstance(value, int | float) and not isinstance(value, bool) \
            and 0 <= value < 1e9:  # NaN fails both comparisons
        return float(value)
    return None


def _status(value: object) -> int | None:
    return value if type(value) is int and 100 <= value <= 599 else None


class TurnAborted(TorporError):
    """A turn ended without a final answer; ``reason`` is the logged abort reason.

    ``error``: for ``model_error``, the typed :class:`ModelError` the model raised
    (also the exception's ``__cause__``), None when the turn is replayed from the
    log. What a caller decides on is the logged abort's fields (see
    :class:`AbortFields`): ``error_type`` (the torpor error name, ``"ModelRateLimited"``;
    the ``error`` field of the ``aborted`` event over HTTP), :attr:`retryable`,
    ``retry_after``, ``status`` and ``message`` (a fixed sentence safe to show an end
    user); ``detail`` has the provider's own text, for operators.
    """

    def __init__(
        self,
        reason: str,
        partial_text: str = "",
        detail: str = "",
        error: BaseException | None = None,
        *,
        fields: AbortFields | None = None,
    ) -> None:
        super().__init__(f"turn aborted ({reason}){': ' + detail if detail else ''}")
        self.reason = reason
        self.partial_text = partial_text
        self.detail = detail
        self.error = error
        self.__cause__ = error
        if fields is None:
            fields = abort_fields(reason, error)
        self.error_type = fields.error
        self.retryable = fields.retryable
        """Whether sending again may succeed: the model's error says so (a timeout, a rate
        limit, an overload, a dropped connection), or the turn was cut by a shutdown or
        the process's end; False for a cancel, a crash, the step limit."""
        self.retry_after = fields.retry_after
        self.status = fields.status
        self.message = fields.message

    @property
    def fields(self) -> AbortFields:
        return AbortFields(self.error_type, self.retryable, self.retry_after, self.status,
                           self.message)
