"""OpenAIChatModel: Chat Completions streaming through the official ``openai`` SDK.

Chat Completions is the wire format every OpenAI-compatible server speaks (vLLM,
llama.cpp server, Ollama, LM Studio, LiteLLM's proxy), so this one adapter
covers hosted OpenAI and local models alike: point the client's ``base_url``
at the server. The SDK does HTTP, SSE, auth, retries with backoff and
timeouts; this module maps torpor's context to messages, assembles the
streamed tool-call fragments, and turns the SDK's errors into torpor's.

Prompt caching: the messages are built the same way from the same context
every time (fixed key order, one system message, arguments encoded
deterministically), so between folds each request's body starts with the
bytes of the previous one up to its last message, which is what automatic
prefix caching (OpenAI, vLLM, llama.cpp) matches on. For api.openai.com a
``prompt_cache_key`` derived from the conversation routes a conversation's
requests to the same cache.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from torpor.errors import ConfigError, ModelError, ModelResponseError
from torpor.events import AssistantMessage, ToolCall, ToolResult, UserMessage
from torpor.llm.closing import close_quietly
from torpor.llm.protocol import (
    CONVERSATION,
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
    import openai

__all__ = ["OpenAIChatModel", "openai_messages", "openai_tools"]

_json = msgspec.json.Encoder(order="deterministic")
_decode_arguments = msgspec.json.Decoder(dict[str, Any])


def openai_messages(context: Sequence[ContextMessage]) -> list[dict[str, Any]]:
    """torpor's context as Chat Completions messages (the same bytes for the same context).

    Leading system messages (the prompt, then the fold's handoff) become one
    system message: several servers' chat templates accept only one, first.
    """
    out: list[dict[str, Any]] = []
    system: list[str] = []
    for message in context:
        kind = type(message)
        if kind is SystemMessage:
            assert isinstance(message, SystemMessage)
            if out:  # not expected after the start; kept in place rather than dropped
                out.append({"role": "system", "content": message.text})
            elif message.text:
                system.append(message.text)
            continue
        if system:
            out.append({"role": "system", "content": "\n\n".join(system)})
            system = []
        if kind is UserMessage:
            assert isinstance(message, UserMessage)
            out.append({"role": "user", "content": message.text})
        elif kind is AssistantMessage:
            assert isinstance(message, AssistantMessage)
            if message.tool_calls:
                out.append({
                    "role": "assistant",
                    "content": message.text or None,
                    "tool_calls": [
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {
                                "name": call.name,
                                "arguments": _json.encode(call.arguments).decode(),
                            },
                        }
                        for call in message.tool_calls
                    ],
                })
            else:
                out.append({"role": "assistant", "content": message.text})
        else:
            assert isinstance(message, ToolResult)
            out.append({
                "role": "tool", "tool_call_id": message.call_id, "content": message.content,
            })
    if system:
        out.append({"role": "system", "content": "\n\n".join(system)})
    return out


def openai_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": spec.name,
                "description": spec.description,
                "parameters": spec.parameters,
            },
        }
        for spec in tools
    ]


def cache_key(conversation_id: str) -> str:
    """A stable, opaque prompt-cache key for a conversation (its id is not sent as is)."""
    return "torpor-" + hashlib.sha256(conversation_id.encode()).hexdigest()[:32]


class _Fragments:
    """One streamed tool call being put together from its pieces."""

    __slots__ = ("arguments", "id", "name")

    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self.arguments: list[str] = []

    def call(self, provider: str) -> ToolCall:
        if not self.id:  # a server that sends no ids: results still need one to answer
            self.id = "call_" + secrets.token_hex(6)
        raw = "".join(self.arguments).strip() or "{}"
        try:
            arguments = _decode_arguments.decode(raw)
        except msgspec.DecodeError as exc:  # not JSON, or JSON but not an object
            raise ModelResponseError(
                f"{provider}: tool call {self.name!r} ({self.id}) came with arguments that are "
                f"not a JSON object: {raw[:200]!r}",
                provider=provider,
            ) from exc
        return ToolCall(self.id, self.name, arguments)


def _api_error(provider: str, exc: BaseException) -> ModelError | None:
    """The torpor error for an ``openai`` exception (None: not one of the SDK's)."""
    import openai

    if isinstance(exc, openai.APITimeoutError | openai.APIConnectionError):
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        return transport_error(provider, cause)
    if isinstance(exc, openai.APIError):
        body = exc.body
        message = exc.message
        if isinstance(body, dict):
            detail = body.get("message")
            if isinstance(detail, str) and detail:
                message = detail
        status = exc.status_code if isinstance(exc, openai.APIStatusError) else None
        headers = exc.response.headers if isinstance(exc, openai.APIStatusError) else None
        return classify(provider, status=status, kind=exc.type, code=exc.code,
                        message=message, headers=headers)
    return None


class OpenAIChatModel:
    """A torpor Model over ``client.chat.completions.create(stream=True)``.

    ``client`` is an ``openai.AsyncOpenAI`` configured as you like (``base_url``
    for a local server, keys, proxies, ``max_retries``, a custom httpx client).
    ``request_options`` go to every ``create`` call as given (``temperature``,
    ``max_completion_tokens``, ``reasoning_effort``, ``extra_body``, …).

    ``stream_usage``: ask for usage in the last chunk (``stream_options.include_usage``);
    turn it off only for a server that refuses the option. ``cache_key``: send
    a per-conversation ``prompt_cache_key``; None (the default) sends it only
    to api.openai.com, since other servers may refuse unknown fields.
    ``name``: how the audit names this model (default ``openai:MODEL``).
    """

    provider = "openai"

    def __init__(
        self,
        client: openai.AsyncOpenAI,
        *,
        model: str,
        stream_usage: bool = True,
        cache_key: bool | None = None,
        name: str | None = None,
        **request_options: Any,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ConfigError("model", f"must be a non-empty model name, got {model!r}")
        for reserved in ("messages", "model", "stream", "tools"):
            if reserved in request_options:
                raise ConfigError(reserved, "is set by the adapter for every call")
        self.client = client
        self.model = model
        self.stream_usage = stream_usage
        if cache_key is None:
            base = getattr(client, "base_url", None)
            cache_key = getattr(base, "host", None) == "api.openai.com"
        self.cache_key = cache_key
        self.name = name if name is not None else f"openai:{model}"
        self.request_options = request_options

    def request(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> dict[str, Any]:
        """The keyword arguments of the ``create`` call for this context."""
        params: dict[str, Any] = {
            "model": self.model,
            "messages": openai_messages(context),
            "stream": True,
        }
        if tools:
            params["tools"] = openai_tools(tools)
        if self.stream_usage:
            params["stream_options"] = {"include_usage": True}
        conversation = CONVERSATION.get()
        if self.cache_key and conversation is not None:
            params["prompt_cache_key"] = cache_key(conversation)
        params.update(self.request_options)
        return params

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        provider = self.provider
        response: Any = None
        try:
            try:
                response = await self.client.chat.completions.create(
                    **self.request(context, tools)
                )
                calls: dict[int, _Fragments] = {}
                usage: Any = None
                finished = False
                async for chunk in response:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    for choice in chunk.choices:
                        if choice.index != 0:
                            continue
                        delta = choice.delta
                        if delta.content:
                            yield TextDelta(delta.content)
                        elif delta.refusal:  # the model's answer, as text
                            yield TextDelta(delta.refusal)
                        for fragment in delta.tool_calls or ():
                            index = fragment.index
                            if index is None:  # some servers leave it out: an id starts a call
                                index = len(calls) if fragment.id or not calls else max(calls)
                            slot = calls.get(index)
                            if slot is None:
                                slot = calls[index] = _Fragments()
                            if fragment.id:
                                slot.id = fragment.id
                            function = fragment.function
                            if function is not None:
                                if function.name and not slot.name:
                                    slot.name = function.name
                                if function.arguments:
                                    slot.arguments.append(function.arguments)
                        if choice.finish_reason is not None:
                            finished = True
            except Exception as exc:
                mapped = _api_error(provider, exc)
                if mapped is None and is_transport_error(exc):
                    mapped = transport_error(provider, exc)
                if mapped is None:
                    raise
                raise mapped from exc
            if not finished:
                raise ModelResponseError(
                    f"{provider}: the stream ended before the model finished its answer",
                    provider=provider,
                )
            for index in sorted(calls):
                yield ToolCallDelta(calls[index].call(provider))
            yield _usage(usage)
        finally:
            if response is not None:  # the server sees the connection close, even on a cancel
                await close_quietly(response)

    def __repr__(self) -> str:
        return f"OpenAIChatModel(model={self.model!r}, name={self.name!r})"


def _usage(usage: Any) -> Usage:
    if usage is None:
        return Usage()
    details = usage.prompt_tokens_details
    read = write = None
    if details is not None:
        read = details.cached_tokens
        write = getattr(details, "cache_write_tokens", None)
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cache_read_tokens=read,
        cache_write_tokens=write,
    )
