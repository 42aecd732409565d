"""Where one turn's stream stands in the log: ``GET …/stream?turn=N``.

A turn's stream (what ``POST …/messages`` sends) holds that turn's events and text
and ends at its answer, suspension or abort. Resuming it from an id needs to know
whether the client already got that end (then there is nothing more: 204, which
also tells a browser's ``EventSource`` not to reconnect), and, without an id,
where the turn starts. Both come from the log read backward from its head: the
newest event of the turn, then its user message.
"""

from __future__ import annotations

from dataclasses import dataclass

from torpor.errors import UnknownConversation
from torpor.events import UserMessage
from torpor.serve.problems import HTTPProblem
from torpor.serve.sse import ends_turn
from torpor.store.protocol import EventStore

__all__ = ["TurnSpan", "turn_span"]

_PAGE = 100


@dataclass(frozen=True, slots=True)
class TurnSpan:
    start: int  # the position of the turn's user message
    last: int  # the position of its newest event
    ended: bool  # whether that newest event ends its stream (answer, suspension, abort)

    def over_for(self, position: int) -> bool:
        """Whether a client that got everything up to ``position`` has the turn's end."""
        return self.ended and self.last <= position


async def turn_span(store: EventStore, conversation_id: str, turn: int) -> TurnSpan:
    """Turn ``turn``'s span in the log; 404 ``UnknownTurn`` if it is not logged (yet).

    Reads back from the head to the turn's user message: for the turn in flight or
    the last one, a page; for an old turn, the turns logged since."""
    before: int | None = None
    last: int | None = None
    ended = False
    while True:
        page = await store.page_backward(conversation_id, before, _PAGE)
        if not page and before is None:
            raise UnknownConversation(conversation_id)
        for event in page:
            if event.turn == turn and last is None:
                last = event.position
                ended = ends_turn(event, turn)
            if isinstance(event.body, UserMessage) and event.turn <= turn:
                if event.turn < turn or last is None:
                    # turns are numbered in log order: an earlier turn's message first
                    # means this one was never logged
                    break
                return TurnSpan(event.position, last, ended)
        else:
            if len(page) == _PAGE:
                before = page[-1].position
                continue
        raise HTTPProblem(f"conversation {conversation_id!r} has no turn {turn}", status=404,
                          title="Unknown Turn", error="UnknownTurn")
