"""AnthropicModel: Messages streaming through the official ``anthropic`` SDK.

The SDK does HTTP, SSE, auth, retries with backoff and timeouts; this module
maps torpor's context to the Messages API (system blocks, user and assistant
turns, ``tool_use`` and ``tool_result`` blocks), assembles each tool call from
its ``input_json_delta`` pieces, reports usage with the cache figures, and
turns the SDK's errors, those of an ``error`` event mid-stream included, into
torpor's.

Prompt caching: the log never rewrites its prefix, so between folds a
conversation's context only grows at its end. Up to four ``cache_control``
breakpoints (the provider's limit) mark what stays the same:

1. the system prompt block (the same for the whole conversation, folds included);
2. the last system block: the handoff a fold left (markers and any summary: the
   same until the next fold), or the task card before any fold (the same until
   it changes);
3. the end of the stable history: the last block of the message just before the
   newest user message (everything up to there was sent, unchanged, last turn);
4. the last block of the final message (so the next call of this turn, after
   tool results, or of the next turn, reads the current turn from the cache).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from torpor.errors import ConfigError, ModelAuthError, ModelError, ModelResponseError
from torpor.events import AssistantMessage, ToolCall, ToolResult, UserMessage
from torpor.llm.closing import close_quietly
from torpor.llm.protocol import (
    ContextMessage,
    StreamEvent,
    SystemMessage,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
    Usage,
)
from torpor.llm.provider_errors import classify, is_transport_error, transport_error

if TYPE_CHECKING:
    import anthropic

__all__ = ["MAX_BREAKPOINTS", "AnthropicModel", "anthropic_request"]

MAX_BREAKPOINTS = 4
"""The Messages API accepts at most four ``cache_control`` breakpoints per request."""

EMPTY_TEXT = "(empty)"
"""Stands in for an empty message text: the API refuses empty text blocks."""

LEFT_OUT = "[earlier messages of this conversation were left out of this context]"
"""Opens a context that would otherwise start with an assistant message."""

_decode_arguments = msgspec.json.Decoder(dict[str, Any])
_UNSAFE_ID = re.compile(r"[^a-zA-Z0-9_-]")


def _tool_id(call_id: str) -> str:
    """A call id as the API accepts it (letters, digits, ``_`` and ``-``); ids made by
    other providers or models are mapped the same way every time."""
    return _UNSAFE_ID.sub("_", call_id) or "_"


def anthropic_request(
    context: Sequence[ContextMessage],
    tools: Sequence[ToolSpec],
    *,
    cache: bool = True,
    ttl: str | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(system blocks, messages, tools) for a context, breakpoints placed when ``cache``."""
    control: dict[str, Any] = {"type": "ephemeral"}
    if ttl is not None:
        control["ttl"] = ttl
    system: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    newest_user = -1
    results: list[dict[str, Any]] | None = None  # the open user message of tool results
    for message in context:
        kind = type(message)
        if kind is ToolResult:
            assert isinstance(message, ToolResult)
            block: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": _tool_id(message.call_id),
                "content": message.content or EMPTY_TEXT,
            }
            if message.is_error:
                block["is_error"] = True
            if results is None:
                results = []
                messages.append({"role": "user", "content": results})
            results.append(block)
            continue
        results = None
        if kind is SystemMessage:
            assert isinstance(message, SystemMessage)
            if message.text:
                if messages:  # not expected after the start: kept, as a user note
                    messages.append({"role": "user", "content": [_text(message.text)]})
                else:
                    system.append(_text(message.text))
        elif kind is UserMessage:
            assert isinstance(message, UserMessage)
            newest_user = len(messages)
            messages.append({"role": "user", "content": [_text(message.text)]})
        else:
            assert isinstance(message, AssistantMessage)
            content: list[dict[str, Any]] = []
            if message.text or not message.tool_calls:
                content.append(_text(message.text))
            content.extend(
                {"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": c.arguments}
                for c in message.tool_calls
            )
            messages.append({"role": "assistant", "content": content})
    if messages and messages[0]["role"] == "assistant":
        # The API wants a user turn first; a context cut to fit its ceiling may start with
        # an answer. The same stand-in every time, so the prefix stays stable.
        messages.insert(0, {"role": "user", "content": [_text(LEFT_OUT)]})
        if newest_user >= 0:
            newest_user += 1
    specs = [
        {"name": s.name, "description": s.description, "input_schema": s.parameters}
        for s in tools
    ]
    if cache:
        # The system prompt and the last head block (the fold's handoff, or the task card
        # before any fold): both change only at a fold or a card change.
        marks = [system[0], system[-1]] if system else []
        if newest_user > 0:
            marks.append(messages[newest_user - 1]["content"][-1])
        if messages:
            marks.append(messages[-1]["content"][-1])
        seen: set[int] = set()
        for block in marks[:MAX_BREAKPOINTS]:
            if id(block) not in seen:
                seen.add(id(block))
                block["cache_control"] = control
    return system, messages, specs


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text or EMPTY_TEXT}


def _api_error(provider: str, exc: BaseException) -> ModelError | None:
    import anthropic

    if isinstance(exc, anthropic.APITimeoutError | anthropic.APIConnectionError):
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        return transport_error(provider, cause)
    if isinstance(exc, anthropic.APIStatusError):
        # An `error` event inside a 200 stream comes with the stream's status: the error
        # type in its body says what happened.
        return classify(provider, status=exc.status_code, kind=exc.type,
                        code=exc.error_code, message=exc.api_message or exc.message,
                        headers=exc.response.headers)
    if isinstance(exc, anthropic.APIError):
        return classify(provider, status=None, message=exc.message)
    if isinstance(exc, TypeError) and "authentication" in str(exc):
        # No key or token anywhere: the SDK says so with a TypeError when it builds the
        # request's headers.
        return ModelAuthError(f"{provider}: {exc}", provider=provider)
    return None


class AnthropicModel:
    """A torpor Model over ``client.messages.create(stream=True)``.

    ``client`` is an ``anthropic.AsyncAnthropic`` configured as you like.
    ``max_tokens`` bounds each answer (the API requires it). ``cache``: place the
    prompt-caching breakpoints described in the module doc; ``cache_ttl``:
    ``"5m"`` or ``"1h"`` (None: the provider's default). ``request_options`` go
    to every ``create`` call as given (``temperature``, ``metadata``,
    ``extra_headers``, …). ``name``: how the audit names this model (default
    ``anthropic:MODEL``).
    """

    provider = "anthropic"

    def __init__(
        self,
        client: anthropic.AsyncAnthropic,
        *,
        model: str,
        max_tokens: int = 4096,
        cache: bool = True,
        cache_ttl: Literal["5m", "1h"] | None = None,
        name: str | None = None,
        **request_options: Any,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ConfigError("model", f"must be a non-empty model name, got {model!r}")
        if type(max_tokens) is not int or max_tokens < 1:
            raise ConfigError("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
        if cache_ttl not in (None, "5m", "1h"):
            raise ConfigError("cache_ttl", f"must be None, '5m' or '1h', got {cache_ttl!r}")
        for reserved in ("messages", "model", "stream", "system", "tools", "max_tokens"):
            if reserved in request_options:
                raise ConfigError(reserved, "is set by the adapter for every call")
        self.client = client
        self.model = model
        self.max_tokens = max_tokens
        self.cache = cache
        self.cache_ttl = cache_ttl
        self.name = name if name is not None else f"anthropic:{model}"
        self.request_options = request_options

    def request(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> dict[str, Any]:
        """The keyword arguments of the ``create`` call for this context."""
        system, messages, specs = anthropic_request(
            context, tools, cache=self.cache, ttl=self.cache_ttl
        )
        params: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "messages": messages,
            "stream": True,
        }
        if system:
            params["system"] = system
        if specs:
            params["tools"] = specs
        params.update(self.request_options)
        return params

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        provider = self.provider
        response: Any = None
        try:
            try:
                response = await self.client.messages.create(**self.request(context, tools))
                blocks: dict[int, tuple[str, str, list[str]]] = {}  # index -> id, name, json
                start: Any = None  # usage of message_start
                final: Any = None  # usage of the last message_delta
                stopped = False
                async for event in response:
                    kind = event.type
                    if kind == "content_block_delta":
                        delta = event.delta
                        if delta.type == "text_delta":
                            if delta.text:
                                yield TextDelta(delta.text)
                        elif delta.type == "input_json_delta":
                            pending = blocks.get(event.index)
                            if pending is not None:
                                pending[2].append(delta.partial_json)
                    elif kind == "content_block_start":
                        block = event.content_block
                        if block.type == "tool_use":
                            blocks[event.index] = (block.id, block.name, [])
                        elif block.type == "text" and block.text:
                            yield TextDelta(block.text)
                    elif kind == "content_block_stop":
                        pending = blocks.pop(event.index, None)
                        if pending is not None:
                            yield ToolCallDelta(_call(provider, *pending))
                    elif kind == "message_start":
                        start = event.message.usage
                    elif kind == "message_delta":
                        final = event.usage
                    elif kind == "message_stop":
                        stopped = True
            except Exception as exc:
                mapped = _api_error(provider, exc)
                if mapped is None and is_transport_error(exc):
                    mapped = transport_error(provider, exc)
                if mapped is None:
                    raise
                raise mapped from exc
            if not stopped:
                raise ModelResponseError(
                    f"{provider}: the stream ended before the model finished its answer",
                    provider=provider,
                )
            yield _usage(start, final)
        finally:
            if response is not None:  # the server sees the connection close, even on a cancel
                await close_quietly(response)

    def __repr__(self) -> str:
        return f"AnthropicModel(model={self.model!r}, name={self.name!r})"


def _call(provider: str, call_id: str, name: str, parts: list[str]) -> ToolCall:
    raw = "".join(parts).strip() or "{}"
    try:
        arguments = _decode_arguments.decode(raw)
    except msgspec.DecodeError as exc:
        raise ModelResponseError(
            f"{provider}: tool call {name!r} ({call_id}) came with input that is not a JSON "
            f"object: {raw[:200]!r}",
            provider=provider,
        ) from exc
    return ToolCall(call_id, name, arguments)


def _usage(start: Any, final: Any) -> Usage:
    """Usage from message_start, updated by the cumulative figures of message_delta.

    The API counts cache reads and writes apart from ``input_tokens``; torpor's
    ``prompt_tokens`` is the whole prompt, so it is their sum.
    """

    def pick(name: str) -> int | None:
        for source in (final, start):
            value = getattr(source, name, None) if source is not None else None
            if value is not None:
                return int(value)
        return None

    fresh = pick("input_tokens")
    read = pick("cache_read_input_tokens")
    write = pick("cache_creation_input_tokens")
    prompt = None if fresh is None else fresh + (read or 0) + (write or 0)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=pick("output_tokens"),
        cache_read_tokens=read,
        cache_write_tokens=write,
    )
