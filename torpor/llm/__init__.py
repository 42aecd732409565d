"""The model side of torpor: the Model protocol, the deterministic local models, and the
provider adapters (``OpenAIChatModel``, ``AnthropicModel``).

The adapters are imported on first use, so ``import torpor`` never pulls in an SDK; each
needs its extra (``pip install 'torpor[openai]'`` or ``'torpor[anthropic]'``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torpor.llm.echo import EchoModel
from torpor.llm.embedding import Embedder, HashingEmbedder
from torpor.llm.protocol import (
    CONTEXT_TOKENS,
    CONVERSATION,
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

if TYPE_CHECKING:
    from torpor.llm.anthropic_messages import AnthropicModel
    from torpor.llm.openai_chat import OpenAIChatModel
    from torpor.llm.openai_embeddings import OpenAIEmbedder

__all__ = [
    "CONTEXT_TOKENS",
    "CONVERSATION",
    "Action",
    "AnthropicModel",
    "Call",
    "ContextMessage",
    "EchoModel",
    "Embedder",
    "Fail",
    "HashingEmbedder",
    "Model",
    "OpenAIChatModel",
    "OpenAIEmbedder",
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

_ADAPTERS = {
    "OpenAIChatModel": ("torpor.llm.openai_chat", "openai", "openai"),
    "OpenAIEmbedder": ("torpor.llm.openai_embeddings", "openai", "openai"),
    "AnthropicModel": ("torpor.llm.anthropic_messages", "anthropic", "anthropic"),
}


def __getattr__(name: str) -> Any:
    """The adapters, imported when first asked for; a missing SDK names the extra."""
    entry = _ADAPTERS.get(name)
    if entry is None:
        raise AttributeError(f"module 'torpor.llm' has no attribute {name!r}")
    module, sdk, extra = entry
    try:
        importlib.import_module(sdk)
    except ImportError as exc:
        raise ImportError(
            f"{name} needs the {sdk!r} package: pip install 'torpor[{extra}]'"
        ) from exc
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
