"""The records of derived memory: episodic and semantic items, the ledger, turn decisions.

Derived from the log, never replacing it (design sources 001 §8 and 002): a fold
with a model summarizer writes one :class:`EpisodicItem` (the span's summary)
and :class:`SemanticItem` s (facts, preferences, constraints, decisions, each
under a key); the consolidation sweep writes :class:`LedgerEntry` rows that
supersede or tombstone semantic items logically; a hot-path reconciler that
says NONE for a turn leaves a :class:`TurnDecision`. None of them ever changes
a row of the log.

Ids are deterministic, so writing the same fold twice (a retry) stores it once:
an episode is named by the checkpoint position of its fold, a semantic item by
that position and its ordinal in the fold's answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

import msgspec

from torpor.errors import InvalidInput
from torpor.store.arguments import INT32_LIMIT, POSITION_LIMIT, check_int
from torpor.text import check_id, check_text

__all__ = [
    "MAX_KEY_LENGTH",
    "MEMORY_KINDS",
    "EpisodicItem",
    "LedgerAction",
    "LedgerEntry",
    "MemoryKind",
    "MemoryRecord",
    "SemanticItem",
    "TurnDecision",
    "check_episode",
    "check_key",
    "check_fact",
    "check_ledger_entry",
    "check_items",
]

MemoryKind = Literal["fact", "preference", "constraint", "decision"]
MEMORY_KINDS: tuple[MemoryKind, ...] = ("fact", "preference", "constraint", "decision")

LedgerAction = Literal["update", "delete"]

MAX_KEY_LENGTH = 200


class EpisodicItem(msgspec.Struct, frozen=True, gc=False):
    """What one folded span was about: its summary, the turns and positions it covers."""

    position: int  # the fold's checkpoint position (the item's id)
    start: int  # first folded position
    end: int  # last folded position
    turns: tuple[int, ...]  # turn numbers in the span
    summary: str
    salience: float = 0.5  # 0..1: how much the span is worth keeping in view
    created_at: int = 0

    @property
    def id(self) -> str:
        return f"episode:{self.position}"


class SemanticItem(msgspec.Struct, frozen=True, gc=False):
    """A durable fact, preference, constraint or decision, under a key that later facts
    about the same thing reuse (so one can supersede another)."""

    position: int  # the fold that wrote it
    ordinal: int  # its place in that fold's answer
    key: str
    kind: MemoryKind
    text: str
    confidence: float = 0.5  # 0..1, as the summarizer judged it
    salience: float = 0.5
    turns: tuple[int, ...] = ()
    created_at: int = 0

    @property
    def id(self) -> str:
        return f"{self.position}.{self.ordinal}"

    @property
    def order(self) -> tuple[int, int]:
        """Newer items sort after older ones."""
        return (self.position, self.ordinal)


class LedgerEntry(msgspec.Struct, frozen=True, gc=False):
    """A decision of the consolidation sweep about one fact key (never a change to the log).

    ``update``: ``item`` is the key's current fact; ``superseded`` the ones it replaces.
    ``delete``: the key is tombstoned, every item of it up to ``item`` included.
    """

    key: str
    action: LedgerAction
    item: str
    superseded: tuple[str, ...] = ()
    reason: str = ""
    created_at: int = 0
    seq: int = 0  # assigned by the store, increasing; 0 before it is stored


class TurnDecision(msgspec.Struct, frozen=True, gc=False):
    """A hot-path reconciler's verdict on one whole turn (only NONE is ever stored)."""

    turn: int
    decision: Literal["add", "none"]
    created_at: int = 0


class MemoryRecord(msgspec.Struct, frozen=True, gc=False):
    """Everything derived memory holds for one conversation, oldest first."""

    conversation_id: str
    episodes: tuple[EpisodicItem, ...] = ()
    facts: tuple[SemanticItem, ...] = ()
    ledger: tuple[LedgerEntry, ...] = ()  # by seq
    skipped_turns: tuple[int, ...] = ()  # turns a reconciler said NONE for


def _unit(value: object, what: str) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not (
        math.isfinite(value) and 0.0 <= value <= 1.0
    ):
        raise InvalidInput(what, f"must be a number from 0 to 1, got {value!r}")


def _turns(value: object, what: str) -> None:
    if not isinstance(value, tuple | list):
        raise InvalidInput(what, "must be a tuple of turn numbers")
    for turn in value:
        check_int(turn, what, 0, INT32_LIMIT)


def check_key(key: object, what: str) -> str:
    text = check_text(key, what)
    if not 0 < len(text) <= MAX_KEY_LENGTH:
        raise InvalidInput(what, f"must be 1..{MAX_KEY_LENGTH} characters, got {len(text)}")
    return text


T = TypeVar("T")


def check_items(items: object, what: str, check: Callable[[object, str], T]) -> list[T]:
    """Every item of the sequence ``items`` through ``check`` (named ``what[i]``)."""
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise InvalidInput(what, f"must be a sequence, got {type(items).__name__}")
    return [check(item, f"{what}[{index}]") for index, item in enumerate(items)]


def check_episode(item: object, what: str = "episode") -> EpisodicItem:
    if not isinstance(item, EpisodicItem):
        raise InvalidInput(what, f"must be an EpisodicItem, got {type(item).__name__}")
    for name in ("position", "start", "end"):
        check_int(getattr(item, name), f"{what}.{name}", 0, POSITION_LIMIT + 1)
    if item.start > item.end:
        raise InvalidInput(f"{what}.start", f"must be <= end ({item.end}), got {item.start}")
    check_int(item.created_at, f"{what}.created_at", 0, 1 << 62)
    _turns(item.turns, f"{what}.turns")
    check_text(item.summary, f"{what}.summary")
    _unit(item.salience, f"{what}.salience")
    return item


def check_fact(item: object, what: str = "fact") -> SemanticItem:
    if not isinstance(item, SemanticItem):
        raise InvalidInput(what, f"must be a SemanticItem, got {type(item).__name__}")
    check_int(item.position, f"{what}.position", 0, POSITION_LIMIT + 1)
    check_int(item.ordinal, f"{what}.ordinal", 0, INT32_LIMIT)
    check_int(item.created_at, f"{what}.created_at", 0, 1 << 62)
    check_key(item.key, f"{what}.key")
    if item.kind not in MEMORY_KINDS:
        raise InvalidInput(f"{what}.kind", f"must be one of {MEMORY_KINDS}, got {item.kind!r}")
    check_text(item.text, f"{what}.text")
    _unit(item.confidence, f"{what}.confidence")
    _unit(item.salience, f"{what}.salience")
    _turns(item.turns, f"{what}.turns")
    return item


def check_ledger_entry(entry: object, what: str = "entry") -> LedgerEntry:
    if not isinstance(entry, LedgerEntry):
        raise InvalidInput(what, f"must be a LedgerEntry, got {type(entry).__name__}")
    check_key(entry.key, f"{what}.key")
    if entry.action not in ("update", "delete"):
        raise InvalidInput(f"{what}.action", f"must be 'update' or 'delete', got {entry.action!r}")
    check_id(entry.item, f"{what}.item")
    for index, item in enumerate(entry.superseded):
        check_id(item, f"{what}.superseded[{index}]")
    check_text(entry.reason, f"{what}.reason")
    check_int(entry.created_at, f"{what}.created_at", 0, 1 << 62)
    return entry

