"""A tool call's :class:`~torpor.actors.tool_context.ToolContext`, made from the agent's turn.

The metadata is the turn's own: that of the user message that started the
turn, read from the log, so a postponed turn, a turn continued after an
approval and a turn of a revived agent see what their message was sent with.
Usually the message is in the working set; after a fold took it, it is read
back from the log.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import msgspec

from torpor.actors.tool_context import EMPTY_METADATA, ToolContext
from torpor.events import Event, ToolCall, UserMessage

if TYPE_CHECKING:
    from torpor.actors.agent import Agent, Host
    from torpor.store.protocol import EventStore

__all__ = ["context_for", "turn_metadata"]

_PAGE = 128  # events read per trip when the turn's message was folded out of the working set
_copy = msgspec.json.Decoder(dict[str, Any])
_encode = msgspec.json.Encoder()


async def context_for(agent: Agent, host: Host, call: ToolCall) -> ToolContext:
    """The context of ``call``, made in the agent's current turn."""
    ws = agent.ws
    metadata = await turn_metadata(host.store, agent.id, agent.turn, ws.tail if ws else ())
    return ToolContext(
        conversation_id=agent.id,
        turn=agent.turn,
        call_id=call.id,
        tool_name=call.name,
        # A copy of its own: a tool that changes a nested value changes nothing logged.
        metadata=MappingProxyType(_copy.decode(_encode.encode(metadata))) if metadata
        else EMPTY_METADATA,
    )


async def turn_metadata(
    store: EventStore, conversation_id: str, turn: int, tail: Sequence[Event]
) -> dict[str, Any] | None:
    """The metadata of turn ``turn``'s user message: from ``tail`` (the working set's
    events) when it is there, else from the log, before ``tail``."""
    for event in tail:  # the turn's first user message is the one that started it
        if event.turn == turn and type(event.body) is UserMessage:
            return event.body.metadata
    before = tail[0].position if tail else None
    while before is None or before > 0:
        page = await store.page_backward(conversation_id, before, _PAGE)
        if not page:
            return None
        found: UserMessage | None = None
        for event in page:  # newest first: the last one met is the turn's first
            if event.turn == turn and type(event.body) is UserMessage:
                found = event.body
        if found is not None:
            return found.metadata
        before = page[-1].position
    return None
