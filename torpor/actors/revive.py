"""Reading an agent's state back out of the log: the log is its memory.

Everything an agent must know on revival follows from the latest checkpoint
and the events after it: the last turn number, whether it is suspended (and
on which calls), parked (and why), or died mid-turn (then an ``Aborted`` is
owed to the log).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from torpor.actors.state import AgentState
from torpor.compaction.order import in_turn_order
from torpor.events import (
    Aborted,
    AssistantMessage,
    Event,
    Parked,
    Resolved,
    Suspended,
    ToolResult,
    Unparked,
    UserMessage,
)

__all__ = ["Restored", "restore"]


class Restored(msgspec.Struct, frozen=True):
    state: AgentState
    turn: int  # the open turn, or the last one run
    pending: tuple[str, ...] = ()  # suspended: the call ids still unanswered
    parked_cause: str | None = None
    unfinished: bool = False  # the open turn neither finished, aborted nor suspended
    postponed: tuple[Event, ...] = ()  # user messages logged behind the open turn, in order
    numbered: int = 0  # the highest turn number in the events (a turn ended unrun included)


def restore(events: Sequence[Event], postponed: frozenset[int] | None = None) -> Restored:
    """Derive the agent's state from the events since its latest checkpoint.

    Events are read in turn order (:mod:`torpor.compaction.order`). A user
    message met while the turn before it is still open was postponed behind
    it: it and every later user message wait for their turns, in order.
    ``postponed``: positions known to be postponed turns that have not started
    (their record says so), whatever precedes them.
    """
    turn = 0
    parked: str | None = None
    for event in events:  # parking is about time, not turns: position order
        body = event.body
        if isinstance(body, Parked):
            parked = body.cause
        elif isinstance(body, Unparked):
            parked = None
    last_assistant: AssistantMessage | None = None
    answered: set[str] = set()
    suspended_on: frozenset[str] = frozenset()
    finished = True
    waiting: list[Event] = []
    held = postponed or frozenset()
    for event in in_turn_order(events):
        body = event.body
        if waiting:  # behind an open turn only user messages can follow
            if isinstance(body, UserMessage) and event.turn > waiting[-1].turn:
                waiting.append(event)
            elif isinstance(body, Aborted):  # a postponed turn ended before it ran (a drain)
                waiting = [w for w in waiting if w.turn != event.turn]
            # else: a second message logged under a number already given (older
            # versions could do that): it belongs to that turn, not to one of its own
            continue
        if isinstance(body, UserMessage):
            if (not finished or event.position in held) and event.turn > turn:
                waiting.append(event)
                continue
            if not finished and event.turn <= turn:
                continue  # as above: part of the open turn, which it joins in the context
            turn = max(turn, event.turn)
            finished = False
            last_assistant = None
            answered = set()
            suspended_on = frozenset()
            continue
        turn = max(turn, event.turn)
        if isinstance(body, AssistantMessage):
            last_assistant = body
            answered = set()
            suspended_on = frozenset()
            finished = not body.tool_calls
        elif isinstance(body, ToolResult):
            answered.add(body.call_id)
        elif isinstance(body, Resolved) and body.approval is not None:
            # Approved: no longer waiting outside. Its result, if the turn died before
            # logging one, is never made up: the turn is unfinished (at most once).
            answered.add(body.call_id)
        elif isinstance(body, Suspended):
            suspended_on = frozenset(body.call_ids)
        elif isinstance(body, Aborted):
            finished = True
            last_assistant = None
            suspended_on = frozenset()
    queued = tuple(waiting)
    numbered = max((e.turn for e in events), default=0)
    if parked is not None:
        return Restored(
            AgentState.PARKED, turn, parked_cause=parked, unfinished=not finished,
            postponed=queued, numbered=numbered,
        )
    if finished:
        return Restored(AgentState.AWAITING_INPUT, turn, postponed=queued, numbered=numbered)
    if last_assistant is not None and suspended_on:
        pending = tuple(
            c.id for c in last_assistant.tool_calls if c.id not in answered and c.id in suspended_on
        )
        unanswered_local = [
            c.id
            for c in last_assistant.tool_calls
            if c.id not in answered and c.id not in suspended_on
        ]
        if pending and not unanswered_local:
            return Restored(AgentState.SUSPENDED, turn, pending=pending, postponed=queued,
                            numbered=numbered)
    return Restored(AgentState.AWAITING_INPUT, turn, unfinished=True, postponed=queued,
                    numbered=numbered)
