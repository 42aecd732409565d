"""One-line descriptions of log events, for people (chat's /history, inspect's last events)."""

from __future__ import annotations

from typing import Any

import msgspec

from torpor.compaction.task_card import card_lines
from torpor.events import (
    Aborted,
    AssistantMessage,
    Body,
    Event,
    Parked,
    Resolved,
    Spawned,
    Suspended,
    TaskCard,
    ToolCall,
    ToolResult,
    Unparked,
    UserMessage,
    kind_of,
)

__all__ = ["body_text", "call_text", "clip", "event_json", "event_line"]


def clip(text: str, width: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def call_text(call: ToolCall) -> str:
    return f"{call.name}({msgspec.json.encode(call.arguments).decode()})"


def body_text(body: Body) -> str:
    """What the event says, in words."""
    if isinstance(body, UserMessage):
        if body.metadata:  # what the host said about the sender: an operator may need it
            return f"{body.text} [metadata {msgspec.json.encode(body.metadata).decode()}]"
        return body.text
    if isinstance(body, AssistantMessage):
        calls = " ".join(f"-> {call_text(c)} [{c.id}]" for c in body.tool_calls)
        return f"{body.text} {calls}".strip()
    if isinstance(body, ToolResult):
        error = " (error)" if body.is_error else ""
        full = f" [{body.full_size} bytes in artifact]" if body.artifact else ""
        return f"{body.tool}{error}: {body.content}{full}"
    if isinstance(body, Suspended):
        reason = f": {body.reason}" if body.reason else ""
        return f"waiting for {', '.join(body.call_ids)}{reason}"
    if isinstance(body, Resolved):
        return f"answer to {body.call_id}"
    if isinstance(body, Aborted):
        partial = f" after {body.partial_text!r}" if body.partial_text else ""
        error = f" [{body.error}{f' {body.status}' if body.status else ''}]" if body.error else ""
        return f"{body.reason}{error}{partial}" + (f" ({body.detail})" if body.detail else "")
    if isinstance(body, Parked):
        return f"parked after {body.restarts} restarts: {body.cause}"
    if isinstance(body, Unparked):
        return f"unparked by {body.by}"
    if isinstance(body, Spawned):
        return f"sub-agent {body.child} for {body.parent} [{body.call_id}]"
    if isinstance(body, TaskCard):
        return f"task card ({body.by}): " + " | ".join(card_lines(body).splitlines())
    return ""


def event_line(event: Event, width: int = 100) -> str:
    return f"#{event.position:<5} turn {event.turn:<4} {kind_of(event.body):<11} " + clip(
        body_text(event.body), width
    )


def event_json(event: Event) -> dict[str, Any]:
    return {
        "position": event.position,
        "turn": event.turn,
        "kind": kind_of(event.body),
        "tokens": event.tokens,
        "created_at": event.created_at,
        "body": msgspec.to_builtins(event.body),
    }
