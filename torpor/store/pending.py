"""The pending-approvals index: which tool calls wait for an outside answer, per conversation.

A projection of the log, maintained in the append transaction so it is never
behind it: a ``Suspended`` event adds one row per call id, a ``Resolved``
removes its call's row, an ``Aborted`` removes every row of its conversation.
Unlike the events table, this table is updated and deleted: it is derived, and
the log stays the truth (a migration rebuilds it from the log).

``admin.pending()`` reads it through its primary key (conversation id, call
id), so listing every conversation waiting on an answer, evicted or not, costs
an index range scan, never a scan of the log and never waking an agent.

A group-commit batch folds the changes of all its operations into their net
effect (:class:`PendingChanges`) before writing, so the order in which the
rows reach the database (grouped by statement) cannot matter: per
conversation, "clear all" comes first, then single removals, then insertions,
and no call is both removed and inserted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torpor.events import Aborted, AssistantMessage, Body, Resolved, Suspended
from torpor.store.protocol import OpenCall

__all__ = [
    "INDEXED_KINDS",
    "PendingChanges",
    "PendingRow",
    "backfill_rows",
    "call_names",
    "named",
    "open_calls",
    "unnamed",
]

INDEXED_KINDS = frozenset({"suspended", "resolved", "aborted"})

PendingRow = tuple[str, str, str, int, int, int]
"""(conversation id, call id, tool, since ms, position, ordinal within its Suspended)."""


@dataclass(slots=True)
class _Conversation:
    clear: bool = False  # every stored row of the conversation goes
    removed: set[str] = field(default_factory=set)  # stored rows that go
    added: dict[str, PendingRow] = field(default_factory=dict)


class PendingChanges:
    """The net effect of some events on the index, in the order they were applied."""

    def __init__(self) -> None:
        self._conversations: dict[str, _Conversation] = {}

    def __bool__(self) -> bool:
        return bool(self._conversations)

    def apply(self, conversation_id: str, position: int, created_at: int, body: Body) -> None:
        if isinstance(body, Suspended):
            conv = self._of(conversation_id)
            tools = body.tools
            for ordinal, call_id in enumerate(body.call_ids):
                tool = tools[ordinal] if ordinal < len(tools) else ""
                conv.removed.discard(call_id)  # replaced by the insert (an upsert)
                conv.added[call_id] = (
                    conversation_id, call_id, tool, created_at, position, ordinal
                )
        elif isinstance(body, Resolved):
            conv = self._of(conversation_id)
            conv.added.pop(body.call_id, None)
            if not conv.clear:
                conv.removed.add(body.call_id)
        elif isinstance(body, Aborted):
            self._conversations[conversation_id] = _Conversation(clear=True)

    def _of(self, conversation_id: str) -> _Conversation:
        conv = self._conversations.get(conversation_id)
        if conv is None:
            conv = self._conversations[conversation_id] = _Conversation()
        return conv

    def cleared(self) -> list[str]:
        """Conversations every stored row of which is deleted (before the insertions)."""
        return [name for name, conv in self._conversations.items() if conv.clear]

    def removed(self) -> list[tuple[str, str]]:
        """(conversation id, call id) of stored rows to delete."""
        return [
            (name, call_id)
            for name, conv in self._conversations.items()
            for call_id in conv.removed
        ]

    def inserted(self) -> list[PendingRow]:
        """Rows to insert (or replace)."""
        return [row for conv in self._conversations.values() for row in conv.added.values()]


def backfill_rows(events: Iterable[tuple[str, int, int, Body]]) -> list[PendingRow]:
    """The index as the log implies it. ``events``: (conversation, position, created_at, body)
    of the indexed kinds, in log order per conversation."""
    changes = PendingChanges()
    for conversation_id, position, created_at, body in events:
        changes.apply(conversation_id, position, created_at, body)
    return changes.inserted()


def unnamed(rows: Iterable[PendingRow]) -> dict[str, tuple[int, set[str]]]:
    """Rows from a Suspended that predates ``tools``: conversation -> (latest position, call
    ids), to look their names up in the AssistantMessages before that position."""
    wanted: dict[str, tuple[int, set[str]]] = {}
    for name, call_id, tool, _, position, _ in rows:
        if not tool:
            latest, calls = wanted.get(name, (position, set()))
            calls.add(call_id)
            wanted[name] = (max(latest, position), calls)
    return wanted


def named(rows: Iterable[PendingRow], names: dict[tuple[str, str], str]) -> list[PendingRow]:
    """``rows`` with the tool names found (``""`` where none was)."""
    return [
        row if row[2] else (row[0], row[1], names.get((row[0], row[1]), ""), *row[3:])
        for row in rows
    ]


def call_names(body: Body) -> Iterable[tuple[str, str]]:
    """(call id, tool name) of the calls an assistant message made."""
    if isinstance(body, AssistantMessage):
        return [(call.id, call.name) for call in body.tool_calls]
    return []


def open_calls(rows: Iterable[tuple[str, str, int, int]], made_by: Body | None) -> list[OpenCall]:
    """A conversation's index rows (call id, tool, since, position) in log order, with the
    arguments ``made_by`` (the newest assistant message before the oldest row's Suspended)
    gave them. While a call waits no model step runs, so that message made every call
    still waiting; a call it does not hold gets ``{}``."""
    arguments: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}
    if isinstance(made_by, AssistantMessage):
        for call in made_by.tool_calls:
            arguments[call.id] = call.arguments
            names[call.id] = call.name
    return [
        OpenCall(call_id, tool or names.get(call_id, ""), arguments.get(call_id, {}), since,
                 position)
        for call_id, tool, since, position in rows
    ]
