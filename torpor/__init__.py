"""torpor: every chat conversation a long-lived, supervised actor over an append-only log."""

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
    TorporError,
    TurnAborted,
    UnknownCall,
    UnknownConversation,
)

__all__ = [
    "AgentParked",
    "Busy",
    "ConfigError",
    "ConflictError",
    "CorruptEvent",
    "EventTooLarge",
    "ModelError",
    "RuntimeClosed",
    "StoreError",
    "TorporError",
    "TurnAborted",
    "UnknownCall",
    "UnknownConversation",
]
