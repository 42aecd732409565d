"""Hibernated agents kept as rows of arrays instead of objects: the dormant table.

Why: after a burst (every agent live at once, then hibernated) each small
object an agent keeps was allocated in between its working set's objects,
and pins the 1 MiB pymalloc arena it sits in once those are freed: the
process kept 1.9x the RSS of gradual hibernation at 20,000 agents, with the
same bytes live (``bench/burst_arenas.py``). A dormant agent is therefore no
object at all: its fields are one row of columns (``array`` of ints and
floats, lists of references to shared objects such as its state and
profile), its id is bytes in one blob, and it is found through an
open-addressing index that is itself an array. Every buffer here is large
and comes from the system allocator, which returns it when it shrinks.

Rows are linked in the order they went dormant (``prev``/``next`` columns),
so the least recently used one is found in O(1) for eviction.

Which fields are kept is fixed by :data:`STORED`; an agent goes dormant only
when every field of :data:`DROPPED` is empty and every field of
:data:`SETTLED` has its resting value (the registry checks this), so
:meth:`DormantTable.take` rebuilds an Agent equal to the one that went in.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

from torpor.actors.agent import Agent

__all__ = ["DROPPED", "SETTLED", "STORED", "DormantTable", "can_rest"]

INTS = ("head", "turn", "numbered", "cycle", "calls", "restarts", "ws_tokens", "store_failures")
FLOATS = ("last_active", "calibration")
TEXTS = ("topic", "last_error", "parked_cause")  # str or None, kept in the blob
OBJECTS = ("profile", "state", "pending", "crash_times", "compact_requested")
STORED = (*INTS, *FLOATS, *TEXTS, *OBJECTS)
"""Fields kept in columns (plus ``id``, kept in the blob like the texts). The objects
referred to are shared (a profile, a state, a bool, an empty tuple) except ``pending``
and ``crash_times`` when not empty (a suspended or crashed agent: rare)."""
DROPPED = (
    "cancels", "current", "hub", "lock", "mailbox", "postponed", "recent", "redactions",
    "scope", "taken", "task", "turn_task", "waiter", "ws",
)
"""Fields that must be empty (None or an empty container): a dormant agent has none."""
SETTLED: dict[str, object] = {
    "cancellable": False, "unlogged": "",
    "ws_bytes": 0, "accounted": 0,
}
"""Fields that must hold these values to go dormant (and get them back on revival)."""

_EMPTY = 0  # index slot never used; otherwise row + 1, or _DELETED
_DELETED = -1
_UNSIGNED = (1 << 63) - 1


def can_rest(agent: Agent) -> bool:
    """The agent holds nothing a dormant row cannot (see the module docstring)."""
    for name in DROPPED:
        if getattr(agent, name):
            return False
    for name, value in SETTLED.items():
        if getattr(agent, name) != value:
            return False
    return agent.hibernated


def _encode(conversation_id: str) -> bytes:
    return conversation_id.encode("utf-8", "surrogatepass")


class DormantTable:
    """Dormant agents by conversation id. Rows are reused; ids live in one blob."""

    __slots__ = (
        "_blob", "_count", "_floats", "_free", "_garbage", "_hash", "_head", "_ints", "_length",
        "_mask", "_next", "_objects", "_offset", "_prev", "_slots", "_tail", "_texts", "_used",
    )

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._count = 0
        self._slots = array("q", bytes(8 * 8))  # the index: row + 1 per slot
        self._mask = 7
        self._used = 0  # index slots not _EMPTY (rows and tombstones)
        self._blob = bytearray()  # per row: its id then its texts, utf-8, back to back
        self._garbage = 0  # blob bytes no row refers to any more
        self._hash, self._offset, self._length = array("q"), array("q"), array("q")
        self._texts = [array("q") for _ in TEXTS]  # byte length, -1 for None
        self._prev, self._next = array("q"), array("q")
        self._head = self._tail = -1  # oldest and newest row
        self._free = array("q")  # rows to reuse
        self._ints = [array("q") for _ in INTS]
        self._floats = [array("d") for _ in FLOATS]
        self._objects: list[list[Any]] = [[] for _ in OBJECTS]

    def __len__(self) -> int:
        return self._count

    def __contains__(self, conversation_id: str) -> bool:
        return self._count > 0 and self._find(conversation_id)[1] >= 0

    # -- the index -------------------------------------------------------------------
    def _find(self, conversation_id: str) -> tuple[int, int]:
        """(index slot, row): the row's slot, or (first free slot, -1) when absent."""
        h = hash(conversation_id)
        key: bytes | None = None
        slots, mask, hashes = self._slots, self._mask, self._hash
        i = h & mask
        perturb = h & _UNSIGNED
        free = -1
        while True:
            entry = slots[i]
            if entry == _EMPTY:
                return (i if free < 0 else free), -1
            if entry == _DELETED:
                if free < 0:
                    free = i
            else:
                row = entry - 1
                if hashes[row] == h:
                    if key is None:
                        key = _encode(conversation_id)
                    offset = self._offset[row]
                    if self._blob[offset : offset + self._length[row]] == key:
                        return i, row
            perturb >>= 5
            i = (i * 5 + perturb + 1) & mask

    def _resize(self) -> None:
        """Rebuild the index for the rows there are (drops tombstones)."""
        size = 8
        while size * 2 < (self._count + 1) * 3:  # at most two thirds full
            size *= 2
        self._slots = slots = array("q", bytes(8 * size))
        self._mask = mask = size - 1
        self._used = self._count
        row = self._head
        while row >= 0:
            h = self._hash[row]
            i = h & mask
            perturb = h & _UNSIGNED
            while slots[i] != _EMPTY:
                perturb >>= 5
                i = (i * 5 + perturb + 1) & mask
            slots[i] = row + 1
            row = self._next[row]

    def _compact_blob(self) -> None:
        """Copy the live ids into a new blob once most of the old one is garbage."""
        blob, new = self._blob, bytearray()
        row = self._head
        while row >= 0:
            offset = self._offset[row]
            self._offset[row] = len(new)
            new += blob[offset : offset + self._span(row)]
            row = self._next[row]
        self._blob, self._garbage = new, 0

    # -- rows --------------------------------------------------------------------------
    def put(self, agent: Agent) -> None:
        """Keep ``agent`` as a row (it must pass :func:`can_rest` and not be here yet)."""
        slot, found = self._find(agent.id)
        if found >= 0:
            raise ValueError(f"{agent.id} is dormant already")
        key = _encode(agent.id)
        if self._free:
            row = self._free.pop()
        else:
            row = len(self._hash)
            for column in (self._hash, self._offset, self._length, self._prev, self._next,
                           *self._texts):
                column.append(0)
            for ints in self._ints:
                ints.append(0)
            for floats in self._floats:
                floats.append(0.0)
            for objects in self._objects:
                objects.append(None)
        self._hash[row] = hash(agent.id)
        self._offset[row] = len(self._blob)
        self._length[row] = len(key)
        self._blob += key
        for name, lengths in zip(TEXTS, self._texts, strict=True):
            text = getattr(agent, name)
            if text is None:
                lengths[row] = -1
            else:
                encoded = _encode(text)
                lengths[row] = len(encoded)
                self._blob += encoded
        for name, ints in zip(INTS, self._ints, strict=True):
            ints[row] = getattr(agent, name)
        for name, floats in zip(FLOATS, self._floats, strict=True):
            floats[row] = getattr(agent, name)
        for name, objects in zip(OBJECTS, self._objects, strict=True):
            objects[row] = getattr(agent, name)
        self._link(row)
        if self._slots[slot] == _EMPTY:
            self._used += 1
        self._slots[slot] = row + 1
        self._count += 1
        if self._used * 3 > len(self._slots) * 2:
            self._resize()

    def take(self, conversation_id: str) -> Agent | None:
        """The agent, rebuilt, and its row freed; None when it is not dormant."""
        if not self._count:
            return None
        slot, row = self._find(conversation_id)
        if row < 0:
            return None
        agent = self._build(row, conversation_id)
        self._slots[slot] = _DELETED
        self._drop(row)
        return agent

    def take_oldest(self) -> Agent | None:
        row = self._head
        if row < 0:
            return None
        return self.take(self._id(row))

    def oldest_last_active(self) -> float | None:
        """When the least recently used dormant agent was last active; None if none is."""
        row = self._head
        return None if row < 0 else self._floats[0][row]

    def peek(self) -> Iterator[Agent]:
        """A copy of each dormant agent, oldest first, for reading: the rows stay."""
        row = self._head
        while row >= 0:
            following = self._next[row]
            yield self._build(row, self._id(row))
            row = following

    def states(self) -> dict[str, int]:
        """Dormant agents by state (every one is hibernated, with no working set)."""
        counts: dict[str, int] = {}
        column = self._objects[OBJECTS.index("state")]
        row = self._head
        while row >= 0:
            key = str(column[row])
            counts[key] = counts.get(key, 0) + 1
            row = self._next[row]
        return counts

    def ids(self) -> Iterator[str]:
        row = self._head
        while row >= 0:
            following = self._next[row]
            yield self._id(row)
            row = following

    def _id(self, row: int) -> str:
        offset = self._offset[row]
        return self._blob[offset : offset + self._length[row]].decode("utf-8", "surrogatepass")

    def _span(self, row: int) -> int:
        """The row's bytes in the blob: its id and its texts."""
        return self._length[row] + sum(max(0, lengths[row]) for lengths in self._texts)

    def _build(self, row: int, conversation_id: str) -> Agent:
        objects = self._objects
        at = self._offset[row] + self._length[row]
        texts: list[str | None] = []
        for lengths in self._texts:
            length = lengths[row]
            if length < 0:
                texts.append(None)
            else:
                texts.append(self._blob[at : at + length].decode("utf-8", "surrogatepass"))
                at += length
        agent = Agent(conversation_id, objects[0][row])
        for name, ints in zip(INTS, self._ints, strict=True):
            setattr(agent, name, ints[row])
        for name, floats in zip(FLOATS, self._floats, strict=True):
            setattr(agent, name, floats[row])
        for name, column in zip(OBJECTS, objects, strict=True):
            setattr(agent, name, column[row])
        for name, text in zip(TEXTS, texts, strict=True):
            setattr(agent, name, text)
        for name, value in SETTLED.items():
            setattr(agent, name, value)
        return agent

    def _drop(self, row: int) -> None:
        self._unlink(row)
        for objects in self._objects:
            objects[row] = None  # no reference kept to a state, a profile, a tuple
        self._garbage += self._span(row)
        self._count -= 1
        if not self._count:  # all revived: give every buffer back
            self._reset()
            return
        self._free.append(row)
        if self._garbage > 4096 and self._garbage * 2 > len(self._blob):
            self._compact_blob()
        if self._count * 8 < len(self._slots) and len(self._slots) > 64:
            self._resize()

    def _link(self, row: int) -> None:
        self._prev[row] = self._tail
        self._next[row] = -1
        if self._tail >= 0:
            self._next[self._tail] = row
        else:
            self._head = row
        self._tail = row

    def _unlink(self, row: int) -> None:
        prev, following = self._prev[row], self._next[row]
        if prev >= 0:
            self._next[prev] = following
        else:
            self._head = following
        if following >= 0:
            self._prev[following] = prev
        else:
            self._tail = prev
