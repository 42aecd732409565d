"""The two providers seen the same way by the tests: replies in each wire format, and the
adapter over the official SDK client pointed at the replay server."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import anthropic
import openai
from replay import (
    Recorded,
    ReplayServer,
    Reply,
    anthropic_error,
    anthropic_stream,
    openai_error,
    openai_stream,
)

from torpor.llm.anthropic_messages import AnthropicModel
from torpor.llm.openai_chat import OpenAIChatModel

__all__ = ["ANTHROPIC", "OPENAI", "PROVIDERS", "Provider", "threaded_server"]

Calls = Sequence[tuple[str, str, Sequence[str]]]


class Provider:
    name = ""

    def client(self, server: ReplayServer, max_retries: int = 0) -> Any:
        raise NotImplementedError

    def model(self, server: ReplayServer, *, max_retries: int = 0, **options: Any) -> Any:
        raise NotImplementedError

    def text(self, pieces: Sequence[str], *, usage: tuple[int, int, int, int] = (12, 5, 0, 0)
             ) -> Reply:
        """A streamed answer; usage is (whole prompt, completion, cache read, cache write)."""
        raise NotImplementedError

    def calls(self, calls: Calls, text: Sequence[str] = ()) -> Reply:
        raise NotImplementedError

    def error_midstream(self, pieces: Sequence[str]) -> Reply:
        """Some text, then the provider reports it is overloaded inside the stream."""
        raise NotImplementedError

    def rate_limited(self, retry_after: str = "2", header: str = "retry-after") -> Reply:
        raise NotImplementedError

    def too_long(self) -> Reply:
        raise NotImplementedError

    def messages(self, request: Recorded) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = request.json()["messages"]
        return messages


class _OpenAI(Provider):
    name = "openai"

    def client(self, server: ReplayServer, max_retries: int = 0) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="test-key",
                                  max_retries=max_retries)

    def model(self, server: ReplayServer, *, max_retries: int = 0, **options: Any
              ) -> OpenAIChatModel:
        return OpenAIChatModel(self.client(server, max_retries), model="gpt-test", **options)

    def text(self, pieces: Sequence[str], *, usage: tuple[int, int, int, int] = (12, 5, 0, 0)
             ) -> Reply:
        prompt, completion, read, _ = usage
        return Reply(openai_stream(pieces, usage=(prompt, completion, read)))

    def calls(self, calls: Calls, text: Sequence[str] = ()) -> Reply:
        return Reply(openai_stream(text, calls=calls))

    def error_midstream(self, pieces: Sequence[str]) -> Reply:
        return Reply(openai_stream(pieces, error={
            "message": "The server had an error while processing your request.",
            "type": "server_error", "param": None, "code": None}))

    def rate_limited(self, retry_after: str = "2", header: str = "retry-after") -> Reply:
        return openai_error(
            429, "Rate limit reached for gpt-test on requests per min (RPM): Limit 3, Used 3, "
                 "Requested 1. Please try again in 2s.",
            kind="requests", code="rate_limit_exceeded", headers={header: retry_after})

    def too_long(self) -> Reply:
        return openai_error(
            400, "This model's maximum context length is 128000 tokens. However, your messages "
                 "resulted in 130532 tokens. Please reduce the length of the messages.",
            kind="invalid_request_error", code="context_length_exceeded", param="messages")


class _Anthropic(Provider):
    name = "anthropic"

    def client(self, server: ReplayServer, max_retries: int = 0) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=server.url, api_key="test-key",
                                        max_retries=max_retries)

    def model(self, server: ReplayServer, *, max_retries: int = 0, **options: Any
              ) -> AnthropicModel:
        return AnthropicModel(self.client(server, max_retries), model="claude-test",
                              max_tokens=256, **options)

    def text(self, pieces: Sequence[str], *, usage: tuple[int, int, int, int] = (12, 5, 0, 0)
             ) -> Reply:
        prompt, completion, read, write = usage
        fresh = prompt - read - write  # the API counts cached tokens apart from input_tokens
        return Reply(anthropic_stream(pieces, usage=(fresh, completion, read, write)))

    def calls(self, calls: Calls, text: Sequence[str] = ()) -> Reply:
        return Reply(anthropic_stream(text, calls=calls))

    def error_midstream(self, pieces: Sequence[str]) -> Reply:
        return Reply(anthropic_stream(pieces, error={"type": "overloaded_error",
                                                     "message": "Overloaded"}))

    def rate_limited(self, retry_after: str = "2", header: str = "retry-after") -> Reply:
        return anthropic_error(
            429, "This request would exceed the rate limit for your organization of 50 requests "
                 "per minute.", kind="rate_limit_error", headers={header: retry_after})

    def too_long(self) -> Reply:
        return anthropic_error(400, "prompt is too long: 210834 tokens > 200000 maximum",
                               kind="invalid_request_error")


OPENAI = _OpenAI()
ANTHROPIC = _Anthropic()
PROVIDERS = (OPENAI, ANTHROPIC)


@contextmanager
def threaded_server(server: ReplayServer) -> Iterator[ReplayServer]:
    """Run ``server`` on an event loop of its own thread (for tests that block, such as
    ones that wait for a subprocess)."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop: asyncio.Event | None = None

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with server:
            started.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield server
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
