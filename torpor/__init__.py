"""torpor: every chat conversation a long-lived, supervised actor over an append-only log.

Public API re-exports only; see README.md for a tour.
"""

from torpor.actors import AgentConfig, AgentState, ExternalTool, LocalTool, Subscriber, Turn, tool
from torpor.errors import (
    AgentParked,
    Busy,
    ConfigError,
    ConflictError,
    CorruptEvent,
    EventTooLarge,
    ModelError,
    RuntimeClosed,
    StoreError,
    ToolArgumentError,
    TorporError,
    TurnAborted,
    UnknownCall,
    UnknownConversation,
)
from torpor.events import (
    Aborted,
    AssistantMessage,
    Body,
    Event,
    Parked,
    Resolved,
    Suspended,
    ToolCall,
    ToolResult,
    Unparked,
    UserMessage,
)
from torpor.llm import EchoModel, Model, ScriptedModel, TextDelta, ToolSpec
from torpor.runtime import AgentInfo, Runtime, RuntimeConfig, RuntimeStats, Transition
from torpor.store import open_store
from torpor.store.protocol import Checkpoint, EventStore, Marker, ModelCall, SearchHit

__version__ = "0.1.0"

__all__ = [
    "Aborted",
    "AgentConfig",
    "AgentInfo",
    "AgentParked",
    "AgentState",
    "AssistantMessage",
    "Body",
    "Busy",
    "Checkpoint",
    "ConfigError",
    "ConflictError",
    "CorruptEvent",
    "EchoModel",
    "Event",
    "EventStore",
    "EventTooLarge",
    "ExternalTool",
    "LocalTool",
    "Marker",
    "Model",
    "ModelCall",
    "ModelError",
    "Parked",
    "Resolved",
    "Runtime",
    "RuntimeClosed",
    "RuntimeConfig",
    "RuntimeStats",
    "ScriptedModel",
    "SearchHit",
    "StoreError",
    "Subscriber",
    "Suspended",
    "TextDelta",
    "ToolArgumentError",
    "ToolCall",
    "ToolResult",
    "ToolSpec",
    "TorporError",
    "Transition",
    "Turn",
    "TurnAborted",
    "UnknownCall",
    "UnknownConversation",
    "Unparked",
    "UserMessage",
    "__version__",
    "open_store",
    "tool",
]
