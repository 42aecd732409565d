"""Every error torpor raises on purpose. All derive from :class:`TorporError`."""

from __future__ import annotations

__all__ = [
    "AgentParked",
    "Busy",
    "ConfigError",
    "ConflictError",
    "CorruptEvent",
    "CorruptStore",
    "EventTooLarge",
    "FencedError",
    "IdempotencyConflict",
    "InvalidInput",
    "InvalidTransition",
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


class TurnAborted(TorporError):
    """A turn ended without a final answer; ``reason`` is the logged abort reason.

    ``error``: for ``model_error``, the typed :class:`ModelError` the model raised
    (also the exception's ``__cause__``), so a caller can tell whether to retry
    (:attr:`retryable`, ``error.retry_after``) without parsing ``detail``.
    """

    def __init__(
        self,
        reason: str,
        partial_text: str = "",
        detail: str = "",
        error: BaseException | None = None,
    ) -> None:
        super().__init__(f"turn aborted ({reason}){': ' + detail if detail else ''}")
        self.reason = reason
        self.partial_text = partial_text
        self.detail = detail
        self.error = error
        self.__cause__ = error

    @property
    def retryable(self) -> bool:
        """Whether sending again may succeed: the model's error says so (a timeout, a
        rate limit, an overload, a dropped connection); False for every other abort."""
        return isinstance(self.error, ModelError) and self.error.retryable
