"""Turn order: the order in which the model sees the log.

The log is in arrival order. A user message that arrives while a turn is open
(streaming, running tools, suspended on an approval) is logged at once, so it
is durable and visible in history, but its turn runs after the open one
ends: it is *postponed*. The context a model is sent therefore lists events
by turn, and within a turn by position. That is a stable sort of the log by
turn number, and it is the identity on a log with no postponed input (turn
numbers never decrease there), which is the common case this keeps free.
"""

from __future__ import annotations

from collections.abc import Sequence

from torpor.events import Event

__all__ = ["in_turn_order", "up_to_turn"]


def in_turn_order(events: Sequence[Event]) -> list[Event]:
    """``events`` stably sorted by turn (a plain copy when already in turn order)."""
    last = -1
    for event in events:
        if event.turn < last:
            return sorted(events, key=_turn)
        last = event.turn
    return list(events)


def up_to_turn(events: Sequence[Event], turn: int) -> list[Event]:
    """The events of turns up to ``turn``, in turn order: what a call in ``turn`` could see."""
    return in_turn_order([e for e in events if e.turn <= turn])


def _turn(event: Event) -> int:
    return event.turn
