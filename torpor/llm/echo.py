"""EchoModel: a deterministic, offline model for tests, demos and runtime benchmarks.

It answers with the last user message (or, right after tool calls, a summary of
their results), streamed in fixed-size chunks. With ``delay=0`` it never
touches the event loop, so a benchmark that drives it measures the runtime's
own per-turn overhead and nothing else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import anyio
import msgspec

from torpor.errors import ConfigError
from torpor.events import AssistantMessage, ToolResult, UserMessage
from torpor.llm.protocol import ContextMessage, StreamEvent, TextDelta, ToolSpec, Usage

__all__ = ["EchoModel", "estimate_tokens"]

_SUMMARY_CLIP = 120  # characters of each tool result echoed back


def estimate_tokens(chars: int) -> int:
    """The crude "four characters a token" estimate, rounded up."""
    return (chars + 3) // 4


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _summarise_results(results: Sequence[ToolResult]) -> str:
    parts = []
    for result in results:
        verb = "failed" if result.is_error else "returned"
        parts.append(f"{result.tool} {verb} {_clip(result.content, _SUMMARY_CLIP)}")
    return "; ".join(parts)


def _context_chars(context: Sequence[ContextMessage], tools: Sequence[ToolSpec]) -> int:
    """Characters a provider would bill as prompt: message texts, call arguments, tool schemas."""
    total = 0
    for message in context:
        if isinstance(message, ToolResult):
            total += len(message.content)
        elif isinstance(message, AssistantMessage):
            total += len(message.text)
            for call in message.tool_calls:
                total += len(call.name) + len(msgspec.json.encode(call.arguments))
        else:
            total += len(message.text)
    for spec in tools:
        total += len(msgspec.json.encode(spec))
    return total


class EchoModel:
    """Replies ``prefix + <last user text>``, or a summary of trailing tool results.

    ``delay`` simulates model latency: it is awaited before every chunk, the
    first one included (so it is also the time to first token). By default
    the usage report leaves ``prompt_tokens`` unknown, like a provider that
    does not report it; ``report_prompt_tokens=True`` reports a chars/4
    estimate so calibration against provider counts can be exercised.
    """

    __slots__ = ("chunk_size", "delay", "name", "prefix", "report_prompt_tokens")

    def __init__(
        self,
        *,
        chunk_size: int = 16,
        delay: float = 0.0,
        prefix: str = "echo: ",
        name: str = "echo",
        report_prompt_tokens: bool = False,
    ) -> None:
        if chunk_size < 1:
            raise ConfigError("chunk_size", f"must be at least 1, got {chunk_size}")
        if delay < 0:
            raise ConfigError("delay", f"must not be negative, got {delay}")
        self.chunk_size = chunk_size
        self.delay = delay
        self.prefix = prefix
        self.name = name
        self.report_prompt_tokens = report_prompt_tokens

    def reply_for(self, context: Sequence[ContextMessage]) -> str:
        """The full text this model answers to ``context`` (what ``stream`` yields, joined)."""
        end = len(context)
        start = end
        while start > 0 and isinstance(context[start - 1], ToolResult):
            start -= 1
        if start < end:
            results = [m for m in context[start:end] if isinstance(m, ToolResult)]
            return self.prefix + _summarise_results(results)
        for message in reversed(context):
            if isinstance(message, UserMessage):
                return self.prefix + message.text
        return self.prefix

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        reply = self.reply_for(context)
        size = self.chunk_size
        delay = self.delay
        for start in range(0, len(reply), size):
            if delay > 0:
                await anyio.sleep(delay)
            yield TextDelta(reply[start : start + size])
        prompt = (
            estimate_tokens(_context_chars(context, tools)) if self.report_prompt_tokens else None
        )
        yield Usage(prompt_tokens=prompt, completion_tokens=estimate_tokens(len(reply)))

    def __repr__(self) -> str:
        return f"EchoModel(name={self.name!r}, chunk_size={self.chunk_size}, delay={self.delay})"
