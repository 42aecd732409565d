"""A resolve retried under its idempotency key: the first one's outcome, read back from the log.

``resolve`` answers a suspended tool call once. A retry after the first one committed (its
reply lost: a node died, a connection dropped) finds the call answered already. With the
same key it is recognised by the events the first one logged under that key (the store's
idempotency keys, as for ``send``: :meth:`~torpor.store.protocol.EventStore.keyed`) and gets
the same outcome: None if other calls of the suspension were still unanswered, else the
continuation (the live turn, or one replayed from the log). The same key with another
answer is :class:`~torpor.errors.IdempotencyConflict`, nothing written.

The retry path only: it reads the log, which a first resolve never does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torpor.actors.aborts import turn_aborted
from torpor.actors.stream import StreamHub
from torpor.actors.turn import Turn
from torpor.errors import IdempotencyConflict, TurnAborted
from torpor.events import (
    Aborted,
    AssistantMessage,
    Event,
    Resolved,
    Suspended,
    ToolResult,
    UserMessage,
    presented,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from torpor.actors.agent import Agent, Host
    from torpor.actors.mailbox import ResolveRequest
    from torpor.store.protocol import EventStore

__all__ = ["APPROVED", "approves", "replayed_resolution"]

APPROVED = "approved"
"""The answer that approves a call waiting for an approval (an MCP tool that needs one)."""


def approves(content: str, is_error: bool) -> bool:
    """Whether a resolve's answer is the approval (case and spaces aside)."""
    return not is_error and content.strip().lower() == APPROVED

_PAGE = 128  # events read per trip while looking for the suspension or the turn's end


async def replayed_resolution(
    agent: Agent, host: Host, request: ResolveRequest, turn_start: Callable[[int], int]
) -> tuple[bool, Turn | None]:
    """(whether ``request.key`` answered this call before, that answer's outcome).

    ``turn_start(n)``: where turn ``n`` begins (a continuation's ``user_position``, as the
    first answer reported it). Raises IdempotencyConflict if the key was used for anything
    else."""
    assert request.key is not None
    store = host.store
    events = await store.keyed(agent.id, request.key)
    if events is None:
        return False, None
    if not await _same_answer(store, events[0].body, request):
        raise IdempotencyConflict(agent.id, request.key)
    number = events[0].turn
    end = events[-1].position
    if not await _last_answer(store, agent.id, number, events[0].position, end):
        return True, None  # other calls were still unanswered: no continuation then
    current = agent.current
    outcome = await _continuation_end(store, agent.id, number, end)
    if outcome is None and current is not None and current.number == number:
        return True, current  # still running: the live continuation itself
    turn = Turn(agent.id, number, turn_start(number), StreamHub().join(), replayed=True,
                continuation=True)
    if isinstance(outcome, Aborted):
        turn._fail(turn_aborted(outcome))
    elif outcome is None:  # cut off, and not running here: what revival logs for it
        turn._fail(TurnAborted("interrupted", "", "continuation not found"))
    else:
        turn._finish(outcome)
    return True, turn


async def _same_answer(store: EventStore, body: object, request: ResolveRequest) -> bool:
    if isinstance(body, Resolved) and body.approval is not None:  # an approval, logged alone
        return body.call_id == request.call_id and body.approval == request.content and (
            not request.is_error
        )
    if not isinstance(body, ToolResult) or body.call_id != request.call_id:
        return False
    if body.is_error != request.is_error:
        return False
    if body.artifact is None:
        return body.content == request.content
    # Clipped on entry: the row holds a preview, the artifact the whole answer.
    return await store.get_artifact(body.artifact) == request.content.encode()


async def _last_answer(store: EventStore, conversation_id: str, number: int, first: int,
                       end: int) -> bool:
    """Whether the answer at ``first``..``end`` completed its suspension (every call it
    waited for answered by then): the continuation started with it."""
    answered: set[str] = set()
    before = end + 1
    while before > 0:
        page = await store.page_backward(conversation_id, before, _PAGE)
        for event in page:
            body = event.body
            if event.turn == number and isinstance(body, Resolved):
                answered.add(body.call_id)
            elif event.turn == number and isinstance(body, Suspended):
                return set(body.call_ids) <= answered
            elif event.turn < number:
                return True  # no suspension found (not a log torpor writes): assume the last
        if not page:
            break
        before = page[-1].position
    return True


async def _continuation_end(
    store: EventStore, conversation_id: str, number: int, after: int
) -> AssistantMessage | Suspended | Aborted | None:
    """How the continuation after position ``after`` ended (None: not yet, by the log)."""
    start = after + 1
    while True:
        page = await store.read_range(conversation_id, start, start + _PAGE - 1)
        for event in map(presented, page):
            if event.turn != number:
                if event.turn > number and not isinstance(event.body, UserMessage):
                    return None  # a later turn runs: this one ended without a record
                continue  # a postponed message of a later turn sits inside this one
            if _ends(event):
                body = event.body
                assert isinstance(body, AssistantMessage | Suspended | Aborted)
                return body
        if len(page) < _PAGE:
            return None
        start += _PAGE


def _ends(event: Event) -> bool:
    body = event.body
    return isinstance(body, Suspended | Aborted) or (
        isinstance(body, AssistantMessage) and not body.tool_calls
    )
