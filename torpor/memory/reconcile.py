"""Write reconciliation on the hot path (design source 001, section 8.3): ADD or NONE per turn.

A :class:`Reconciler` is consulted at the one place an agent's appends go
through (:func:`torpor.actors.turn_loop.logged`), once per turn, when the
turn's last event is logged (its answer, or its abort), with every event of
the turn: a user message and its tool calls are kept or skipped together
(turn atomicity, 8.4). It must be cheap and synchronous, and it may answer
only ``"add"`` or ``"none"``; anything else, or an exception, counts as
``"add"`` (logged). It runs on the event loop, holding the conversation's
append lock: a decide that blocks stalls the runtime (nothing can time out a
synchronous call), so anything slow belongs in the sweep.

NONE never touches the log: the turn is appended like any other. It is
recorded (:meth:`~torpor.store.protocol.EventStore.put_turn_decision`) so
that the derived memory (the fold's summarizer; a push index) leaves the turn
out. With no reconciler configured nothing is consulted and nothing recorded:
every turn is ADD, as if reconciliation did not exist.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from torpor._logging import get_logger
from torpor.events import Aborted, AssistantMessage, Event

if TYPE_CHECKING:
    from torpor.compaction.working_set import WorkingSet
    from torpor.store.protocol import EventStore

__all__ = ["AddEverything", "HotDecision", "Reconciler", "closes_turn", "reconcile_logged"]

log = get_logger(__name__)

HotDecision = Literal["add", "none"]


@runtime_checkable
class Reconciler(Protocol):
    """Decides, once per finished turn, whether its events feed the derived memory."""

    def decide(self, conversation_id: str, turn: int, events: Sequence[Event]) -> HotDecision:
        ...


class AddEverything:
    """The default: every turn is ADD (what a runtime with no reconciler does anyway)."""

    def decide(self, conversation_id: str, turn: int, events: Sequence[Event]) -> HotDecision:
        return "add"


def closes_turn(event: Event) -> bool:
    """The turn's last event: an answer without tool calls, or an abort."""
    body = event.body
    if isinstance(body, AssistantMessage):
        return not body.tool_calls
    return isinstance(body, Aborted)


def _turn_events(ws: WorkingSet | None, turn: int, logged: Sequence[Event]) -> list[Event]:
    """The turn's events: those the working set holds (a running turn is never folded
    away) and the ones just logged, in log order."""
    found = [e for e in logged if e.turn == turn]
    if ws is not None:
        seen = {e.position for e in found}
        for event in reversed(ws.tail):
            if event.turn < turn:
                break
            if event.turn == turn and event.position not in seen:
                found.append(event)
    found.sort(key=lambda e: e.position)
    return found


def _decide(
    reconciler: Reconciler, conversation_id: str, turn: int, events: Sequence[Event]
) -> HotDecision:
    try:
        decision = reconciler.decide(conversation_id, turn, events)
    except Exception as exc:  # a reconciler's bug must not fail a turn: the log is complete
        log.warning("reconciler_failed", conversation_id=conversation_id, turn=turn,
                    error=repr(exc))
        return "add"
    if decision not in ("add", "none"):  # UPDATE/DELETE belong to the sweep, never here
        if inspect.iscoroutine(decision):  # an async decide slipped in: never awaited here
            decision.close()
        log.warning("reconciler_refused", conversation_id=conversation_id, turn=turn,
                    decision=repr(decision))
        return "add"
    return decision


async def reconcile_logged(
    store: EventStore,
    reconciler: Reconciler,
    conversation_id: str,
    turn: int,
    ws: WorkingSet | None,
    logged: Sequence[Event],
) -> HotDecision | None:
    """Consult ``reconciler`` if ``logged`` finished turn ``turn``; record a NONE.

    Returns the decision, or None when the turn is not finished yet.
    """
    if not any(e.turn == turn and closes_turn(e) for e in logged):
        return None
    decision = _decide(reconciler, conversation_id, turn, _turn_events(ws, turn, logged))
    if decision == "none":
        try:
            await store.put_turn_decision(conversation_id, turn, "none")
        except Exception as exc:  # the turn is logged: failing here would say it is not
            log.warning("turn_decision_unrecorded", conversation_id=conversation_id,
                        turn=turn, error=repr(exc))
    return decision
