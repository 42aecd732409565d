"""The conversation actor: state machine, mailbox, turn loop, streaming fan-out, tools."""

from torpor.actors.config import AgentConfig
from torpor.actors.state import AgentState
from torpor.actors.stream import StreamItem, Subscriber, TurnDelta
from torpor.actors.tool_context import ToolContext
from torpor.actors.tools import ExternalTool, LocalTool, Toolbox, tool
from torpor.actors.turn import Turn

__all__ = [
    "AgentConfig",
    "AgentState",
    "ExternalTool",
    "LocalTool",
    "StreamItem",
    "Subscriber",
    "ToolContext",
    "Toolbox",
    "Turn",
    "TurnDelta",
    "tool",
]
