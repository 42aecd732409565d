"""Tool interactions: each tool call paired with its result, a view derived from the log.

Design source 002's TOOL_INTERACTION: for inspection and summaries, never
stored. A call is ``success`` or ``error`` once its result is logged,
``aborted`` when its turn was aborted before the result came, and ``pending``
while it waits (a suspension for an outside answer, or a turn still running).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import msgspec

from torpor.events import Aborted, AssistantMessage, Event, ToolResult

__all__ = ["InteractionStatus", "ToolInteraction", "pair_tool_calls"]

InteractionStatus = Literal["success", "error", "pending", "aborted"]


class ToolInteraction(msgspec.Struct, frozen=True, gc=False):
    call_id: str
    tool: str
    arguments: dict[str, Any]
    turn: int
    call_position: int  # of the assistant message that made the call
    status: InteractionStatus
    result: str | None = None  # the logged content (a preview, when it was clipped)
    result_position: int | None = None
    artifact: str | None = None  # the full result's artifact, when it was clipped


def pair_tool_calls(events: Iterable[Event]) -> list[ToolInteraction]:
    """Every tool call of ``events`` (log order) with its result or its fate, in call order.

    A result answers the latest unanswered call with its id: some providers number
    calls per response (``call_0`` in every turn), so an id alone is not unique.
    """
    out: list[ToolInteraction] = []
    open_calls: dict[str, int] = {}  # call id -> index in ``out`` of its unanswered call
    aborted: dict[str, int] = {}  # the same, for calls whose turn was aborted (a late
    # result still pairs with its call)
    for event in events:
        body = event.body
        if isinstance(body, AssistantMessage):
            for call in body.tool_calls:
                aborted.pop(call.id, None)
                open_calls[call.id] = len(out)
                out.append(ToolInteraction(call.id, call.name, dict(call.arguments),
                                           event.turn, event.position, "pending"))
        elif isinstance(body, ToolResult):
            index = open_calls.pop(body.call_id, None)
            if index is None:
                index = aborted.pop(body.call_id, None)
            if index is not None:
                out[index] = msgspec.structs.replace(
                    out[index], status="error" if body.is_error else "success",
                    result=body.content, result_position=event.position, artifact=body.artifact)
        elif isinstance(body, Aborted):  # its turn's unanswered calls will never be answered
            for call_id, index in list(open_calls.items()):
                if out[index].turn == event.turn:
                    out[index] = msgspec.structs.replace(out[index], status="aborted")
                    aborted[call_id] = open_calls.pop(call_id)
    return out
