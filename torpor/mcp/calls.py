"""Running a model's call of an MCP tool, and the calls approved while a turn was suspended.

Like a local tool's, an MCP call always ends with a result: a server that is down, a
call past the tool timeout, a connection lost mid-call, an ``isError`` answer are error
results the model reads. Only a cancel escapes (the SDK tells the server with
``notifications/cancelled``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio

from torpor._logging import get_logger
from torpor.events import AssistantMessage, Event, Resolved, ToolCall, ToolResult
from torpor.text import repair_text

if TYPE_CHECKING:
    from torpor.mcp.view import MCPTool, ToolView

__all__ = ["approved_calls", "run_approved_calls", "run_mcp"]

log = get_logger(__name__)


async def run_mcp(tool: MCPTool, call: ToolCall, timeout: float) -> ToolResult:  # noqa: ASYNC109
    """One call of ``tool``, within ``timeout`` seconds (the agent's tool timeout)."""
    arguments = call.arguments if isinstance(call.arguments, dict) else {}
    content, is_error = await tool.link.call(tool.remote, dict(arguments), timeout)
    if is_error:
        log.info("mcp_tool_error", tool=call.name, call_id=call.id, error=content[:200])
    return ToolResult(call.id, call.name, repair_text(content), is_error=is_error)


def approved_calls(tail: Sequence[Event], turn: int) -> list[ToolCall]:
    """The calls of turn ``turn`` approved (``Resolved.approval``) with no result logged
    yet, in the order the model made them. Read back from the end (the tail is in turn
    order): only what follows the turn's last assistant message counts."""
    approved: set[str] = set()
    answered: set[str] = set()
    for event in reversed(tail):
        if event.turn != turn:
            if event.turn < turn:
                break
            continue
        body = event.body
        if isinstance(body, AssistantMessage):
            return [c for c in body.tool_calls if c.id in approved and c.id not in answered]
        if isinstance(body, Resolved) and body.approval is not None:
            approved.add(body.call_id)
        elif isinstance(body, ToolResult):
            answered.add(body.call_id)
    return []


async def run_approved_calls(
    calls: Sequence[ToolCall], view: ToolView, timeout: float  # noqa: ASYNC109
) -> list[ToolResult]:
    """Run the approved ``calls`` (:func:`approved_calls`) concurrently; their results in
    call order."""
    if not calls:
        return []
    await view.current_specs()  # after a restart: the servers' tools are listed first
    results: dict[str, ToolResult] = {}

    async def one(call: ToolCall) -> None:
        tool = view.get(call.name)
        if tool is None:
            results[call.id] = ToolResult(
                call.id, call.name, f"tool {call.name!r} is no longer offered by its MCP "
                                    "server: the approved call was not made", is_error=True)
            return
        results[call.id] = await run_mcp(tool, call, timeout)

    async with anyio.create_task_group() as tg:
        for call in calls:
            tg.start_soon(one, call)
    return [results[c.id] for c in calls]
