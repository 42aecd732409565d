"""The deterministic model behind ``torpor chat``: an echo that can also use tools on request.

With no provider configured, a chat should still show everything the runtime
does: streamed text, a local tool call and its result, a suspension that
waits for a person, recall over the log. Messages that start with ``!`` ask
for those; anything else is echoed back.

``!clock`` calls the local ``clock`` tool; ``!approve WHAT`` calls the external
``approve`` tool (the agent suspends until the chat answers); ``!recall QUERY``
calls the built-in ``recall`` tool over the whole log.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from torpor.actors.tools import ExternalTool, LocalTool, tool
from torpor.events import ToolCall, ToolResult, UserMessage
from torpor.llm.echo import EchoModel
from torpor.llm.protocol import ContextMessage, StreamEvent, TextDelta, ToolCallDelta, ToolSpec

__all__ = ["DEMO_HELP", "DemoModel", "demo_tools"]

DEMO_HELP = (
    "!clock (a local tool), !approve WHAT (a tool that waits for you), "
    "!recall QUERY (search the whole log)"
)


@tool
async def clock() -> str:
    """The current time on this machine (UTC)."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


APPROVE = ExternalTool(
    "approve",
    "Ask the person at the terminal to approve an action.",
    {"type": "object", "properties": {"what": {"type": "string"}}, "required": ["what"]},
)


def demo_tools() -> list[LocalTool | ExternalTool]:
    return [clock, APPROVE]


def _request(text: str) -> tuple[str, dict[str, Any]] | None:
    """The tool a ``!`` message asks for, with its arguments."""
    command, _, rest = text.strip().partition(" ")
    rest = rest.strip()
    if command == "!clock":
        return "clock", {}
    if command == "!approve":
        return "approve", {"what": rest or "the last request"}
    if command == "!recall" and rest:
        return "recall", {"query": rest, "k": 5}
    return None


class DemoModel:
    """EchoModel plus tool calls on ``!`` commands; stateless like every model."""

    __slots__ = ("_echo", "name")

    def __init__(self, *, delay: float = 0.0) -> None:
        self._echo = EchoModel(delay=delay, chunk_size=4, name="demo")
        self.name = "demo"

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        last = context[-1] if context else None
        request = _request(last.text) if isinstance(last, UserMessage) else None
        offered = {spec.name for spec in tools}
        if request is not None and request[0] in offered and not isinstance(last, ToolResult):
            name, arguments = request
            yield TextDelta(f"calling {name}…")
            yield ToolCallDelta(ToolCall(f"{name}-{secrets.token_hex(3)}", name, arguments))
            return
        async for event in self._echo.stream(context, tools):
            yield event
