"""What can be posted to an agent, and the bounded, ordered mailbox that holds it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from torpor.actors.turn import Turn
    from torpor.events import Event
    from torpor.store.schedules import Firing

__all__ = [
    "CancelRequest",
    "CardRequest",
    "HibernateRequest",
    "Mailbox",
    "Message",
    "RedactRequest",
    "ResolveRequest",
    "SendRequest",
    "SpawnRequest",
    "StopRequest",
    "UnparkRequest",
]


class SendRequest:
    """A user message. ``accepted`` resolves to the Turn once the message is in the log.

    ``metadata``: checked already (:func:`torpor.metadata.check_metadata`), logged with it.
    ``origin``: the sender's trace (``Observer.origin``), for the turn's observers.
    """

    __slots__ = ("accepted", "fired", "key", "metadata", "origin", "text")

    def __init__(
        self, text: str, key: str | None, accepted: asyncio.Future[Turn],
        metadata: dict[str, Any] | None = None, origin: object | None = None,
        fired: Firing | None = None,
    ) -> None:
        self.text = text
        self.key = key
        self.accepted = accepted
        self.metadata = metadata
        self.origin = origin
        # A schedule's firing (torpor.runtime.schedules): logged as its scheduled message,
        # the schedule moved by the same append (ScheduleGone: nothing logged).
        self.fired = fired


class ResolveRequest:
    """An outside answer to a suspended tool call."""

    __slots__ = ("call_id", "content", "done", "is_error", "key", "origin")

    def __init__(
        self, call_id: str, content: str, is_error: bool, done: asyncio.Future[Turn | None],
        key: str | None = None, origin: object | None = None,
    ) -> None:
        self.call_id = call_id
        self.content = content
        self.is_error = is_error
        self.done = done
        self.key = key  # idempotency key: the answer's events are logged under it
        self.origin = origin  # the resolver's trace, for the continuation's observers


class CancelRequest:
    """Abandon a suspended turn (a streaming turn is cancelled through its scope instead)."""

    __slots__ = ("done",)

    def __init__(self, done: asyncio.Future[bool]) -> None:
        self.done = done


class SpawnRequest:
    """Log that a sub-agent's conversation answers a suspended tool call (``Runtime.spawn``).

    ``done`` resolves to the child's id: ``child``, or the child already linked to
    the call (spawning twice for one call links once).
    """

    __slots__ = ("call_id", "child", "done", "task")

    def __init__(self, call_id: str, child: str, task: str, done: asyncio.Future[str]) -> None:
        self.call_id = call_id
        self.child = child
        self.task = task
        self.done = done


class CardRequest:
    """A task card change for an agent that is not live yet: logged once it is revived."""

    __slots__ = ("done", "patch")

    def __init__(self, patch: dict[str, Any], done: asyncio.Future[Event]) -> None:
        self.patch = patch
        self.done = done


class HibernateRequest:
    """Drop the caches and end the task if idle (the lifecycle sweep, eviction, admin).

    ``done`` (optional) resolves to True once hibernated, False when the agent
    was not idle (a turn open, other mail waiting): then nothing changed.
    """

    __slots__ = ("done",)

    def __init__(self, done: asyncio.Future[bool] | None = None) -> None:
        self.done = done


HIBERNATE = HibernateRequest()  # the sweep's: nobody waits for the answer


class UnparkRequest:
    """Let a parked agent run again: the actor logs ``Unparked`` and revives from the log.

    ``done`` resolves to True once logged, False when the agent was not parked.
    """

    __slots__ = ("done",)

    def __init__(self, done: asyncio.Future[bool]) -> None:
        self.done = done


class RedactRequest:
    """Redact one event (``Runtime.redact``): the actor has the store do it, between
    turns (one running finishes first: no fold of it may copy the text after), and
    rebuilds its working set from the log. ``done`` resolves to the store's answer."""

    __slots__ = ("done", "position", "reason")

    def __init__(self, position: int, reason: str, done: asyncio.Future[bool]) -> None:
        self.position = position
        self.reason = reason
        self.done = done


class StopRequest:
    """The conversation moved to another node: stop for good, failing what waits with
    ``error`` (the new owner runs the logged turns). Its task is cancelled as it is
    posted: the actor finds it as it stops."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

Message: TypeAlias = (
    SendRequest | ResolveRequest | CancelRequest | SpawnRequest | CardRequest | HibernateRequest
    | StopRequest | UnparkRequest | RedactRequest
)


class Mailbox:
    """Ordered; user messages bounded, control messages (resolve, cancel) always accepted.

    Taken strictly in order, in every state: a user message taken while a turn
    is open is logged at once and its turn postponed behind it.
    """

    __slots__ = ("_items", "sends", "work")

    def __init__(self) -> None:
        # A list, not a deque: it holds a few messages (user messages are bounded, a turn
        # settles what waits as it starts), and an agent makes one per message it is sent
        # (dropped when empty), where a deque allocates a 64-slot block each time.
        self._items: list[Message] = []
        self.sends = 0  # user messages waiting
        self.work = 0  # messages other than a request to hibernate

    def __len__(self) -> int:
        return len(self._items)

    def put(self, message: Message) -> None:
        if isinstance(message, SendRequest):
            self.sends += 1
        if not isinstance(message, HibernateRequest | StopRequest):
            self.work += 1
        self._items.append(message)

    def take(self) -> Message | None:
        items = self._items
        if not items:
            return None
        message = items.pop(0)
        if isinstance(message, SendRequest):
            self.sends -= 1
        if not isinstance(message, HibernateRequest | StopRequest):
            self.work -= 1
        return message

    def remove(self, message: Message) -> bool:
        try:
            self._items.remove(message)
        except ValueError:
            return False
        if isinstance(message, SendRequest):
            self.sends -= 1
        if not isinstance(message, HibernateRequest | StopRequest):
            self.work -= 1
        return True

    def take_unpark(self) -> UnparkRequest | None:
        """The first UnparkRequest waiting here (taken out), None if none waits."""
        for message in self._items:
            if isinstance(message, UnparkRequest):
                self.remove(message)
                return message
        return None

    def take_stop(self) -> BaseException | None:
        """The error of a StopRequest waiting here (taken out), None if none waits."""
        for message in self._items:
            if isinstance(message, StopRequest):
                self.remove(message)
                return message.error
        return None

    def drain(self) -> list[Message]:
        items = list(self._items)
        self._items.clear()
        self.sends = self.work = 0
        return items
