"""The model side of torpor: the Model protocol and the deterministic local models."""

from torpor.llm.echo import EchoModel
from torpor.llm.protocol import (
    ContextMessage,
    Model,
    StreamEvent,
    SystemMessage,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
    Usage,
)
from torpor.llm.scripted import (
    Action,
    Call,
    Fail,
    Pause,
    Report,
    ScriptedModel,
    Signal,
    Step,
    Text,
    Wait,
)

__all__ = [
    "Action",
    "Call",
    "ContextMessage",
    "EchoModel",
    "Fail",
    "Model",
    "Pause",
    "Report",
    "ScriptedModel",
    "Signal",
    "Step",
    "StreamEvent",
    "SystemMessage",
    "Text",
    "TextDelta",
    "ToolCallDelta",
    "ToolSpec",
    "Usage",
    "Wait",
]
