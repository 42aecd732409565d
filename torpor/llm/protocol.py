"""The Model protocol: a stateless function from a rendered context to a stream.

The runtime re-sends the whole projection every call. A context is a sequence of
message structs (never one concatenated string) so the text objects are shared
with the working set instead of copied. It is read-only and may be a view over
the working set's render cache, not a ``list``: a model that keeps, changes or
encodes it as a whole (``msgspec``, ``json``, ``+``) makes a list first
(``list(context)``); iterating, ``len`` and indexing work as on a list. The shape fits OpenAI- and
Anthropic-style streaming: text deltas, whole tool calls, a final usage report.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextvars import ContextVar
from typing import Any, Protocol, TypeAlias, runtime_checkable

import msgspec

from torpor.events import AssistantMessage, ToolCall, ToolResult, UserMessage

__all__ = [
    "CONTEXT_TOKENS",
    "CONVERSATION",
    "ContextMessage",
    "Model",
    "StreamEvent",
    "SystemMessage",
    "TextDelta",
    "ToolCallDelta",
    "ToolSpec",
    "Usage",
]


class SystemMessage(msgspec.Struct, tag="system", frozen=True, gc=False):
    """Instructions and pointer markers: never part of the log, never evicted."""

    text: str


ContextMessage: TypeAlias = SystemMessage | UserMessage | AssistantMessage | ToolResult


class ToolSpec(msgspec.Struct, frozen=True):
    """What the model is told about a tool: a name, a description, a JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]


class TextDelta(msgspec.Struct, tag="text", frozen=True, gc=False):
    text: str


class ToolCallDelta(msgspec.Struct, tag="tool_call", frozen=True, gc=False):
    """A complete tool call (adapters assemble provider fragments before yielding).

    ``call.arguments`` is the decoded JSON object (JSON text is decoded for you); a
    call that is malformed fails the turn as the model's error (``model_error``).
    """

    call: ToolCall


class Usage(msgspec.Struct, tag="usage", frozen=True, gc=False):
    """What the provider counted for one call.

    ``prompt_tokens`` is the whole prompt, cached parts included (it calibrates
    torpor's estimate and triggers folds); ``cache_read_tokens`` of it were read
    from the provider's prompt cache and ``cache_write_tokens`` written to it,
    where the provider reports them (None: not reported).
    """

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None


StreamEvent: TypeAlias = TextDelta | ToolCallDelta | Usage

CONVERSATION: ContextVar[str | None] = ContextVar("torpor_conversation", default=None)
"""The conversation a model call is made for, set by the runtime around each call.

The Model protocol stays ``stream(context, tools)``; an adapter that can use a
stable per-conversation key (OpenAI's ``prompt_cache_key``, say) reads it here.
"""

CONTEXT_TOKENS: ContextVar[int | None] = ContextVar("torpor_context_tokens", default=None)
"""torpor's estimate of the tokens of the context a model call is made with (system
prompt, tools and messages, as counted when it was assembled), set by the runtime
around each call: a wrapper that measures calls reads it instead of walking the
context (None: the call was not made by the runtime).
"""


@runtime_checkable
class Model(Protocol):
    """Anything that streams an answer to a rendered context."""

    name: str

    def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        """Yield text deltas and tool calls, then at most one Usage. Raise to fail the turn."""
        ...
