"""The open-work index: which conversations owe a run, found without reading their logs.

A conversation owes work when its process died with a turn open (revival logs
``Aborted(interrupted)`` for it) or with user messages logged behind that turn
(postponed turns, which the next run runs), unless it waits for an outside
answer (suspended: postponed turns wait for that answer, which survives a
restart) or is parked (it runs nothing until unparked). The node that takes a
shard over, and a runtime that starts, re-drive exactly those
(``torpor.runtime.redrive``); everything else stays asleep in the log.

Four columns of the conversation's own row hold it, a projection of the log
maintained in the append transaction:

* ``user_turn``: the highest turn of a ``UserMessage`` (-1: none);
* ``settled_turn``: the highest turn ended by a final ``AssistantMessage`` (no
  tool calls) or an ``Aborted`` (-1: none);
* ``suspended``: set by ``Suspended``; cleared by ``Resolved``, a final answer
  and an ``Aborted``;
* ``parked``: set by ``Parked``, cleared by ``Unparked``.

Open means ``user_turn > settled_turn and not suspended and not parked``; a
partial index over the open rows lists them (keyset-paged by id), so the
query never scans the log nor every conversation.

Checked against :func:`torpor.actors.revive.restore` (the truth): the actor
numbers turns in log order and ends them in that order (a drain ends the open
turn before the postponed ones behind it), so a settled turn at or above every
user turn means nothing is left to run. The index errs only towards waking a
conversation for nothing (revival finds nothing to do): a suspension on
several calls of which some are answered reads as not suspended.

Every change composes without reading the row: the turns by maximum, the flags
by their last value. A group-commit batch folds its appends into one change
per conversation, and the UPDATE that moves the conversation's head applies it
(``max``/``greatest``, and ``coalesce(nullif(flag, -1), column)``): no statement
and no round trip more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from torpor.errors import InvalidInput
from torpor.events import AssistantMessage, Body, decode_body
from torpor.store.arguments import check_int
from torpor.store.fence import shard_of

__all__ = [
    "NO_CHANGE",
    "WORK_KINDS",
    "BACKFILL_SELECT",
    "Backfill",
    "WorkChange",
    "ShardFilter",
    "Measured",
    "compose",
    "event_change",
    "shard_filter",
    "work_change",
]

WorkChange = tuple[int, int, int, int]
"""(user turn, settled turn, suspended, parked) an append brings; -1 leaves a column as it
is, a flag is otherwise 0 or 1. Plain ints: SQLite's driver binds them directly (None and
bool go through its adaptation path, which cost more than the rest of the change)."""

NO_CHANGE: WorkChange = (-1, -1, -1, -1)

WORK_KINDS = frozenset(
    {"user", "assistant", "aborted", "suspended", "resolved", "parked", "unparked"}
)
"""The kinds that can move the index (of ``assistant``, only a final answer does)."""


class Measured(Protocol):
    """An event as an append prepares it (``torpor.store.prepare.PreparedEvent``)."""

    @property
    def kind(self) -> str: ...

    @property
    def turn(self) -> int: ...

    @property
    def value(self) -> Body: ...


def work_change(events: Iterable[Measured]) -> WorkChange | None:
    """The change an append's ``events`` make, in order; None: none (most appends)."""
    change = None
    for event in events:
        kind = event.kind
        if kind in WORK_KINDS:
            moved = event_change(kind, event.turn, event.value)
            change = moved if change is None else compose(change, moved)
    return change


def event_change(kind: str, turn: int, body: Body | None) -> WorkChange | None:
    """The change of one event; the body is only looked at for ``assistant`` (a final
    answer settles its turn, a step with tool calls does not)."""
    if kind == "user":
        return (turn, -1, -1, -1)
    if kind == "aborted":
        return (-1, turn, 0, -1)
    if kind == "assistant":
        if isinstance(body, AssistantMessage) and not body.tool_calls:
            return (-1, turn, 0, -1)
        return None
    if kind == "suspended":
        return (-1, -1, 1, -1)
    if kind == "resolved":
        return (-1, -1, 0, -1)
    if kind == "parked":
        return (-1, -1, -1, 1)
    if kind == "unparked":
        return (-1, -1, -1, 0)
    return None


def compose(first: WorkChange | None, then: WorkChange | None) -> WorkChange | None:
    """``first``, then ``then``: one change."""
    if first is None:
        return then
    if then is None:
        return first
    return (
        first[0] if first[0] > then[0] else then[0],
        first[1] if first[1] > then[1] else then[1],
        first[2] if then[2] < 0 else then[2],
        first[3] if then[3] < 0 else then[3],
    )


class Backfill:
    """The columns of every conversation as its log sets them (what a migration writes).

    Fed the rows of the :data:`WORK_KINDS`, each conversation's in log order; only an
    ``assistant`` row's body is decoded (is it a final answer?), so a migration passes
    None for the others and reads no other body.
    """

    def __init__(self) -> None:
        self._changes: dict[str, WorkChange] = {}  # conversation -> its log's change, so far

    def add(self, name: str, kind: str, turn: int, position: int, body: bytes | None) -> None:
        value = None
        if kind == "assistant" and body is not None:
            value = decode_body(bytes(body), conversation_id=name, position=position)
        change = compose(self._changes.get(name), event_change(kind, turn, value))
        if change is not None:
            self._changes[name] = change

    def rows(self) -> list[tuple[int, int, int, int, str]]:
        """(user turn, settled turn, suspended, parked, conversation) per conversation seen;
        the flags 0 or 1."""
        return [(u, s, max(susp, 0), max(parked, 0), name)
                for name, (u, s, susp, parked) in self._changes.items()]


BACKFILL_SELECT = (
    "SELECT c.external_id, e.kind, e.turn, e.position, "
    "CASE WHEN e.kind = 'assistant' THEN e.body END FROM events AS e "
    "JOIN conversations AS c ON c.key = e.conversation_id WHERE e.kind IN "
    f"({', '.join(repr(k) for k in sorted(WORK_KINDS))}) "
    "ORDER BY e.conversation_id, e.position"
)
"""The rows :class:`Backfill` takes, in its order (the same SQL on both backends)."""


class ShardFilter:
    """Which open rows a node asked for: those of ``shards`` of a cluster of ``count``.

    A row knows its shard when a node created it; one a single node wrote (before the
    database served a cluster) has none, and is placed by its id, as a node places it.
    """

    __slots__ = ("count", "shards")

    def __init__(self, shards: object, count: object) -> None:
        if count is None:
            raise InvalidInput("shard_count", "is needed with shards (the cluster's count)")
        self.count = check_int(count, "shard_count", 1, 65_537)
        if isinstance(shards, str | bytes) or not isinstance(shards, Iterable):
            raise InvalidInput("shards", "must be a collection of shard numbers")
        self.shards = frozenset(check_int(s, "shards", 0, self.count) for s in shards)

    def wanted(self) -> list[int]:
        return sorted(self.shards)

    def keeps(self, conversation_id: str, shard: int | None) -> bool:
        if shard is None:
            shard = shard_of(conversation_id, self.count)
        return shard in self.shards


def shard_filter(shards: Sequence[int] | None, count: int | None) -> ShardFilter | None:
    """None (every open row) without ``shards``; else the checked filter."""
    return None if shards is None else ShardFilter(shards, count)
