"""What providers and OpenAI-compatible servers say, classified into torpor's typed errors."""

from __future__ import annotations

import email.utils
import time

import pytest

from torpor import (
    ModelAuthError,
    ModelBadRequest,
    ModelConnectionError,
    ModelContextTooLong,
    ModelError,
    ModelOverloaded,
    ModelRateLimited,
    ModelTimeout,
)
from torpor.llm.provider_errors import classify, is_transport_error, retry_after, transport_error


@pytest.mark.parametrize(
    ("status", "kind", "code", "message", "expected"),
    [
        # OpenAI
        (400, "invalid_request_error", "context_length_exceeded",
         "This model's maximum context length is 128000 tokens.", ModelContextTooLong),
        (429, "requests", "rate_limit_exceeded", "Rate limit reached", ModelRateLimited),
        (401, "invalid_request_error", "invalid_api_key", "Incorrect API key", ModelAuthError),
        (404, "invalid_request_error", "model_not_found", "The model does not exist",
         ModelBadRequest),
        (500, "server_error", None, "The server had an error", ModelOverloaded),
        (None, "server_error", None, "The server had an error", ModelOverloaded),  # mid-stream
        # vLLM, llama.cpp, Mistral (OpenAI-compatible servers)
        (400, "BadRequestError", None, "This model's maximum context length is 4096 tokens. "
         "However, you requested 5000 tokens.", ModelContextTooLong),
        (400, "exceed_context_size_error", None,
         "the request exceeds the available context size, try increasing it",
         ModelContextTooLong),
        (400, "invalid_request_error", None,
         "Prompt contains 40000 tokens, too large for model with 32768 maximum context length",
         ModelContextTooLong),
        (422, None, None, "Unprocessable: temperature must be <= 2", ModelBadRequest),
        (503, None, None, "Service Unavailable", ModelOverloaded),
        # Anthropic
        (400, "invalid_request_error", None, "prompt is too long: 210834 tokens > 200000 maximum",
         ModelContextTooLong),
        (413, "request_too_large", None, "Request exceeds the maximum size", ModelContextTooLong),
        (429, "rate_limit_error", None, "Number of requests has exceeded your rate limit",
         ModelRateLimited),
        (529, "overloaded_error", None, "Overloaded", ModelOverloaded),
        (200, "overloaded_error", None, "Overloaded", ModelOverloaded),  # an SSE error event
        (200, "api_error", None, "Internal server error", ModelOverloaded),
        (403, "permission_error", None, "Your API key does not have permission",
         ModelAuthError),
        (400, "invalid_request_error", None, "messages: roles must alternate", ModelBadRequest),
        (408, None, None, "Request Timeout", ModelTimeout),
        (None, None, None, "something odd", ModelError),
        # The status wins over a body that says otherwise.
        (401, "rate_limit_error", None, "Rate limited", ModelAuthError),
        (403, "overloaded_error", None, "Overloaded", ModelAuthError),
    ],
)
def test_classify(status: int | None, kind: str | None, code: str | None, message: str,
                  expected: type[ModelError]) -> None:
    error = classify("p", status=status, kind=kind, code=code, message=message)
    assert type(error) is expected
    assert str(error).startswith("p: ") and message in str(error)
    assert error.provider == "p"
    assert error.status == (None if status in (None, 200) else status)


def test_a_spent_quota_is_rate_limited_but_not_retryable() -> None:
    error = classify("openai", status=429, kind="insufficient_quota", code="insufficient_quota",
                     message="You exceeded your current quota")
    assert isinstance(error, ModelRateLimited) and error.retryable is False
    assert ModelRateLimited.retryable is True  # the class default is untouched


def test_retry_after_reads_milliseconds_seconds_and_dates() -> None:
    assert retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert retry_after({"retry-after": "2"}) == 2.0
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    wait = retry_after({"retry-after": when})
    assert wait is not None and 25 < wait <= 31
    assert retry_after({"retry-after": "soon"}) is None
    assert retry_after({}) is None and retry_after(None) is None
    error = classify("p", status=429, message="slow down", headers={"retry-after": "7"})
    assert error.retry_after == 7.0


def test_transport_failures_are_connection_errors_or_timeouts() -> None:
    class ReadTimeout(Exception):
        __module__ = "httpx2._exceptions"

    class RemoteProtocolError(Exception):
        __module__ = "httpx._exceptions"

    assert is_transport_error(RemoteProtocolError("peer closed"))
    assert is_transport_error(ConnectionResetError())
    assert not is_transport_error(ValueError("bad"))
    assert isinstance(transport_error("p", ReadTimeout()), ModelTimeout)
    cut = transport_error("p", RemoteProtocolError("peer closed"))
    assert isinstance(cut, ModelConnectionError) and cut.retryable and "peer closed" in str(cut)


async def test_anthropic_without_any_key_is_an_auth_error_not_a_type_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    anthropic = pytest.importorskip("anthropic")
    from torpor import AgentConfig, Runtime, TurnAborted
    from torpor.events import UserMessage
    from torpor.llm import AnthropicModel

    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    # Port 9 (discard) on loopback: nothing may be sent, and nothing is.
    client = anthropic.AsyncAnthropic(base_url="http://127.0.0.1:9", max_retries=0)
    model = AnthropicModel(client, model="claude-test")
    with pytest.raises(ModelAuthError) as info:
        async for _ in model.stream([UserMessage("hi")], ()):
            pass
    assert not info.value.retryable and "authentication" in str(info.value)
    agent = AgentConfig(model=model, recall_tools=False)
    async with Runtime("sqlite://", agent=agent) as rt:
        with pytest.raises(TurnAborted) as turn_info:
            await (await rt.send("c", "hi")).result()
    assert isinstance(turn_info.value.error, ModelAuthError)
    assert not turn_info.value.retryable
