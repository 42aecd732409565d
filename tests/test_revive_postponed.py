"""What revival makes of user messages logged behind an open turn (torpor.actors.revive).

A message logged while the turn ahead of it was still open was postponed. If nothing
of its own turn followed in the log, it never started (or was cut before it logged
anything, so running it repeats no side effect): revival runs it. A turn that did log
something of its own and then stopped was interrupted.
"""

from __future__ import annotations

from torpor.actors.revive import restore
from torpor.actors.state import AgentState
from torpor.events import AssistantMessage, Body, Event, ToolCall, UserMessage


def log(*entries: tuple[int, Body]) -> list[Event]:
    return [Event("c", position, turn, 1, 0, body) for position, (turn, body) in enumerate(entries)]


def test_a_message_queued_behind_a_turn_that_then_finished_waits_to_run() -> None:
    events = log((1, UserMessage("first")), (2, UserMessage("queued")),
                 (1, AssistantMessage("answer")))
    restored = restore(events)
    assert restored.state is AgentState.AWAITING_INPUT and not restored.unfinished
    assert [e.body for e in restored.postponed] == [UserMessage("queued")]


def test_a_message_sent_after_the_turn_ended_that_logged_nothing_was_interrupted() -> None:
    events = log((1, UserMessage("first")), (1, AssistantMessage("answer")),
                 (2, UserMessage("later")))
    restored = restore(events)
    assert restored.unfinished and restored.turn == 2 and restored.postponed == ()


def test_a_queued_message_whose_turn_logged_something_was_interrupted() -> None:
    call = ToolCall("t1", "work", {})
    events = log((1, UserMessage("first")), (2, UserMessage("queued")),
                 (1, AssistantMessage("answer")), (2, AssistantMessage("", (call,))))
    restored = restore(events)
    assert restored.unfinished and restored.turn == 2 and restored.postponed == ()


def test_queued_messages_behind_an_open_turn_wait_behind_it() -> None:
    events = log((1, UserMessage("first")), (2, UserMessage("queued")),
                 (3, UserMessage("and this")))
    restored = restore(events)
    assert restored.unfinished and restored.turn == 1
    assert [e.turn for e in restored.postponed] == [2, 3]
