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
    """Every tool call of ``events`` (log order) with its result or its fate, in call order."""
    calls: dict[str, tuple[Event, Any]] = {}
    results: dict[str, Event] = {}
    aborted_turns: dict[int, int] = {}  # turn -> position of its last abort
    for event in events:
        body = event.body
        if isinstance(body, AssistantMessage):
            for call in body.tool_calls:
                calls.setdefault(call.id, (event, call))
        elif isinstance(body, ToolResult):
            results.setdefault(body.call_id, event)
        elif isinstance(body, Aborted):
            aborted_turns[event.turn] = event.position
    out: list[ToolInteraction] = []
    for call_id, (event, call) in calls.items():
        found = results.get(call_id)
        if found is not None:
            result = found.body
            assert isinstance(result, ToolResult)
            out.append(ToolInteraction(
                call_id, call.name, dict(call.arguments), event.turn, event.position,
                "error" if result.is_error else "success", result.content, found.position,
                result.artifact))
            continue
        abort = aborted_turns.get(event.turn)
        status: InteractionStatus = (
            "aborted" if abort is not None and abort > event.position else "pending"
        )
        out.append(ToolInteraction(call_id, call.name, dict(call.arguments), event.turn,
                                   event.position, status))
    return out
