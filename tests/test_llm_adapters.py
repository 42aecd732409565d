"""The provider adapters over real HTTP streams: the official SDK clients against a local
server replaying each provider's documented wire format, chunk by chunk.

Each case runs for both providers: a turn with text, a turn with two tool calls
whose arguments arrive in fragments, cancel and shutdown mid-stream (the server
sees the connection close), each error case ending with its typed error and an
``Aborted`` that holds the partial text, and usage reaching the audit and the
fold trigger.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from providers import ANTHROPIC, OPENAI, PROVIDERS, Provider
from replay import ReplayServer, Reply, anthropic_stream, openai_stream

import torpor
from torpor import (
    Aborted,
    AgentConfig,
    ModelConnectionError,
    ModelContextTooLong,
    ModelError,
    ModelOverloaded,
    ModelRateLimited,
    ModelResponseError,
    Runtime,
    TextDelta,
    TurnAborted,
)
from torpor.events import UserMessage
from torpor.llm.protocol import SystemMessage, ToolCallDelta, ToolSpec, Usage

pytestmark = pytest.mark.parametrize("provider", PROVIDERS, ids=lambda p: p.name)


@pytest.fixture
async def server() -> AsyncIterator[ReplayServer]:
    async with ReplayServer() as running:
        yield running


@torpor.tool
async def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def config(model: Any, **overrides: Any) -> AgentConfig:
    return AgentConfig(model=model, system_prompt="Be brief.", recall_tools=False, **overrides)


def chunk_with(reply: Reply, marker: bytes) -> int:
    """The index of the first chunk holding ``marker`` (where to cut or hold the stream)."""
    return next(i for i, chunk in enumerate(reply.chunks) if marker in chunk)


async def aborted(rt: Runtime, conversation: str) -> Aborted:
    last = (await rt.history(conversation, limit=1))[0].body
    assert isinstance(last, Aborted), last
    return last


async def test_a_turn_streams_text_as_it_arrives_and_audits_usage(
    provider: Provider, server: ReplayServer
) -> None:
    server.add(provider.text(["Hel", "lo, ", "world"], usage=(1200, 9, 1000, 150)))
    async with Runtime("sqlite://", agent=config(provider.model(server))) as rt:
        turn = await rt.send("c", "hi there")
        deltas = [item.text async for item in turn if isinstance(item, TextDelta)]
        final = await turn.result()
        calls = await rt.store.model_calls("c")
    # Streamed as it arrived (a subscriber that falls behind gets consecutive deltas joined).
    assert "".join(deltas) == "Hello, world" and deltas
    assert final.text == "Hello, world" and final.tool_calls == ()
    [call] = calls
    assert call.reported_prompt_tokens == 1200 and call.completion_tokens == 9
    assert call.cache_read_tokens == 1000
    assert call.cache_write_tokens == (150 if provider is ANTHROPIC else None)
    assert call.model == f"{provider.name}:{'gpt-test' if provider is OPENAI else 'claude-test'}"
    assert call.error is None and call.ttft_ms is not None
    [request] = server.requests
    messages = provider.messages(request)
    body = request.json()
    assert body["stream"] is True
    if provider is OPENAI:
        assert request.path == "/v1/chat/completions"
        assert body["stream_options"] == {"include_usage": True}
        assert messages == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "hi there"}]
        assert "prompt_cache_key" not in body  # not api.openai.com: unknown fields may fail
    else:
        assert request.path == "/v1/messages"
        assert body["system"][0]["text"] == "Be brief." and body["max_tokens"] == 256
        assert messages[0]["role"] == "user"
        assert messages[0]["content"][0]["text"] == "hi there"
        key = request.headers.get("x-api-key") or request.headers.get("authorization", "")
        assert key.endswith("test-key") and "anthropic-version" in request.headers


async def test_two_tool_calls_in_fragments_then_the_answer(
    provider: Provider, server: ReplayServer
) -> None:
    ids = ("call_1", "call_2") if provider is OPENAI else ("toolu_01", "toolu_02")
    server.add(
        provider.calls([
            (ids[0], "lookup", ['{"ci', 'ty": "Pa', 'ris"}']),  # split mid-key and mid-value
            (ids[1], "lookup", ["{", '"city"', ': "Ro', 'me"', "}"]),
        ], text=["Checking both."]),
        provider.text(["Paris and Rome ", "are sunny."]),
    )
    async with Runtime("sqlite://", agent=config(provider.model(server), tools=[lookup])) as rt:
        final = await (await rt.send("c", "weather in Paris and Rome?")).result()
        events = [e.body for e in reversed(await rt.history("c", limit=10))]
    assert final.text == "Paris and Rome are sunny."
    asked = events[1]
    assert isinstance(asked, torpor.AssistantMessage) and asked.text == "Checking both."
    assert [(c.id, c.name, c.arguments) for c in asked.tool_calls] == [
        (ids[0], "lookup", {"city": "Paris"}), (ids[1], "lookup", {"city": "Rome"})]
    results = [e for e in events if isinstance(e, torpor.ToolResult)]
    assert [(r.call_id, r.content) for r in results] == [
        (ids[0], "sunny in Paris"), (ids[1], "sunny in Rome")]
    # The second request carries both calls and both results in the provider's own shapes.
    second = provider.messages(server.requests[1])
    if provider is OPENAI:
        assert second[2]["tool_calls"][1] == {
            "id": ids[1], "type": "function",
            "function": {"name": "lookup", "arguments": '{"city":"Rome"}'}}
        assert second[3:] == [
            {"role": "tool", "tool_call_id": ids[0], "content": "sunny in Paris"},
            {"role": "tool", "tool_call_id": ids[1], "content": "sunny in Rome"}]
        assert server.requests[1].json()["tools"][0]["function"]["name"] == "lookup"
    else:
        assert [b["type"] for b in second[1]["content"]] == ["text", "tool_use", "tool_use"]
        assert second[1]["content"][2]["input"] == {"city": "Rome"}
        blocks = second[2]["content"]  # every result of a turn in one user message
        assert second[2]["role"] == "user" and len(second) == 3
        assert [(b["type"], b["tool_use_id"], b["content"]) for b in blocks] == [
            ("tool_result", ids[0], "sunny in Paris"), ("tool_result", ids[1], "sunny in Rome")]
        assert server.requests[1].json()["tools"][0]["input_schema"]["required"] == ["city"]


async def test_cancel_mid_stream_closes_the_connection(
    provider: Provider, server: ReplayServer
) -> None:
    reply = provider.text(["Hel", "lo", " never sent"])
    reply.hold_after = chunk_with(reply, b"never sent")
    server.add(reply)
    async with Runtime("sqlite://", agent=config(provider.model(server))) as rt:
        turn = await rt.send("c", "hi")
        seen = ""
        with anyio.fail_after(10):  # a hang fails the test instead of stalling CI
            async for item in turn:
                seen += item.text if isinstance(item, TextDelta) else ""
                if seen == "Hello":
                    break
            await server.holding.wait()
            assert await rt.cancel("c") is True
            await server.disconnected.wait()  # the server saw the connection go
        with pytest.raises(TurnAborted) as info:
            await turn.result()
        assert info.value.reason == "cancelled" and info.value.partial_text == "Hello"
        last = await aborted(rt, "c")
        assert last.reason == "cancelled" and last.partial_text == "Hello"
        [call] = await rt.store.model_calls("c")
        assert call.error == "cancelled"


async def test_leaving_the_runtime_mid_stream_closes_the_connection(
    provider: Provider, server: ReplayServer, tmp_path: Any
) -> None:
    reply = provider.text(["Par", "tial", " never sent"])
    reply.hold_after = chunk_with(reply, b"never sent")
    server.add(reply)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    async with Runtime(url, agent=config(provider.model(server))) as rt:
        turn = await rt.send("c", "hi")
        seen = ""
        with anyio.fail_after(10):
            async for item in turn:
                seen += item.text if isinstance(item, TextDelta) else ""
                if seen == "Partial":
                    break
    with anyio.fail_after(10):
        await server.disconnected.wait()
    with pytest.raises(TurnAborted):
        await turn.result()
    async with Runtime(url) as rt:
        last = await aborted(rt, "c")
    assert last.reason == "shutdown" and last.partial_text == "Partial"


async def test_an_error_inside_the_stream_ends_the_turn_with_the_partial_text(
    provider: Provider, server: ReplayServer
) -> None:
    server.add(provider.error_midstream(["Half ", "an answer"]))
    async with Runtime("sqlite://", agent=config(provider.model(server))) as rt:
        turn = await rt.send("c", "hi")
        with pytest.raises(TurnAborted) as info:
            await turn.result()
        last = await aborted(rt, "c")
        [call] = await rt.store.model_calls("c")
    assert info.value.reason == "model_error" and info.value.partial_text == "Half an answer"
    assert last.reason == "model_error" and last.partial_text == "Half an answer"
    assert last.detail.startswith("ModelOverloaded: ")
    assert call.error is not None and call.error.startswith("ModelOverloaded(")


async def test_a_connection_cut_mid_stream_is_a_connection_error(
    provider: Provider, server: ReplayServer
) -> None:
    reply = provider.text(["Cut ", "short", " never sent"])
    reply.cut_after = chunk_with(reply, b"never sent")
    server.add(reply)
    async with Runtime("sqlite://", agent=config(provider.model(server))) as rt:
        with pytest.raises(TurnAborted):
            await (await rt.send("c", "hi")).result()
        last = await aborted(rt, "c")
    assert server.cut.is_set()
    assert last.partial_text == "Cut short"
    assert last.detail.startswith("ModelConnectionError: ")


async def test_a_429_is_rate_limited_with_the_wait_the_provider_asked_for(
    provider: Provider, server: ReplayServer
) -> None:
    server.add(provider.rate_limited("2"))
    model = provider.model(server)
    with pytest.raises(ModelRateLimited) as info:
        async for _ in model.stream([UserMessage("hi")], ()):
            pass
    error = info.value
    assert error.retryable and error.retry_after == 2.0 and error.status == 429
    assert error.provider == provider.name and "rate limit" in str(error).lower()
    server.add(provider.rate_limited("2"))
    async with Runtime("sqlite://", agent=config(model)) as rt:
        with pytest.raises(TurnAborted) as turn_info:
            await (await rt.send("c", "hi")).result()
        last = await aborted(rt, "c")
    # The caller gets the typed error too, not only its text: it can decide to retry.
    assert isinstance(turn_info.value.error, ModelRateLimited) and turn_info.value.retryable
    assert turn_info.value.__cause__ is turn_info.value.error
    assert turn_info.value.error.retry_after == 2.0
    assert last.reason == "model_error" and last.partial_text == ""
    assert last.detail.startswith("ModelRateLimited: ")
    assert last.detail.endswith("; a retry may help after 2 s")


async def test_the_sdk_retries_a_429_itself_when_allowed(
    provider: Provider, server: ReplayServer
) -> None:
    server.add(provider.rate_limited("1", header="retry-after-ms"), provider.text(["fine"]))
    async with Runtime("sqlite://", agent=config(provider.model(server, max_retries=1))) as rt:
        final = await (await rt.send("c", "hi")).result()
    assert final.text == "fine" and len(server.requests) == 2


async def test_context_too_long_folds_once_and_retries_once(
    provider: Provider, server: ReplayServer
) -> None:
    agent = config(provider.model(server), tail_turns=1, working_budget=20_000)
    async with Runtime("sqlite://", agent=agent) as rt:
        for i in range(3):
            server.add(provider.text([f"answer {i}"]))
            await (await rt.send("c", f"question {i} " + "words " * 40)).result()
        assert await rt.store.checkpoints("c") == []
        server.add(provider.too_long(), provider.text(["after the fold"]))
        final = await (await rt.send("c", "one more")).result()
        [checkpoint] = await rt.store.checkpoints("c")
        calls = await rt.store.model_calls("c")
    assert final.text == "after the fold"
    failed, retried = server.requests[-2:]
    assert len(retried.body) < len(failed.body)  # the fold made it shorter
    assert len(provider.messages(retried)) < len(provider.messages(failed))
    assert calls[-2].error is not None and calls[-2].error.startswith("ModelContextTooLong(")
    assert calls[-1].error is None and calls[-1].compaction_cycle == checkpoint.cycle == 1


async def test_context_too_long_twice_gives_up_with_the_typed_error(
    provider: Provider, server: ReplayServer
) -> None:
    server.add(provider.too_long(), provider.too_long())
    async with Runtime("sqlite://", agent=config(provider.model(server))) as rt:
        with pytest.raises(TurnAborted) as info:
            await (await rt.send("c", "hi")).result()
        last = await aborted(rt, "c")
    assert len(server.requests) == 2  # one retry, not more
    assert info.value.reason == "model_error"
    assert last.detail.startswith("ModelContextTooLong: ")
    assert last.detail.endswith("; a retry will not help")
    server.add(provider.too_long())
    with pytest.raises(ModelContextTooLong) as error:
        async for _ in provider.model(server).stream([UserMessage("x")], ()):
            pass
    assert error.value.retryable is False and error.value.status == 400


async def test_reported_prompt_tokens_reach_the_fold_trigger(
    provider: Provider, server: ReplayServer
) -> None:
    agent = config(provider.model(server), context_window=10_000, max_output_tokens=1_000,
                   safety_margin=0, working_budget=7_000, tail_turns=1)
    async with Runtime("sqlite://", agent=agent) as rt:
        server.add(provider.text(["a"]), provider.text(["b"], usage=(8_500, 1, 0, 0)))
        for text in ("short 0", "short 1"):
            await (await rt.send("c", text)).result()
        assert await rt.store.checkpoints("c") == []  # far under our own estimate
        server.add(provider.text(["c"]))
        await (await rt.send("c", "next")).result()
        calls = await rt.store.model_calls("c")
        assert len(await rt.store.checkpoints("c")) == 1  # the provider's count asked for it
    assert calls[1].reported_prompt_tokens == 8_500 and calls[2].compaction_cycle == 1


async def test_each_conversation_can_have_its_own_model(
    provider: Provider, server: ReplayServer
) -> None:
    own = config(provider.model(server))
    default = AgentConfig()
    server.add(provider.text(["from the provider"]))
    async with Runtime("sqlite://", agent_for=lambda c: own if c == "vip" else default) as rt:
        assert (await (await rt.send("vip", "hi")).result()).text == "from the provider"
        assert (await (await rt.send("plain", "hi")).result()).text == "echo: hi"
        vip = await rt.store.model_calls("vip")
        plain = await rt.store.model_calls("plain")
    assert vip[0].model.startswith(provider.name) and plain[0].model == "echo"
    assert len(server.requests) == 1


async def test_arguments_that_are_not_a_json_object_are_a_response_error(
    provider: Provider, server: ReplayServer
) -> None:
    server.add(provider.calls([("call_x", "lookup", ['{"city": "Par'])]))  # cut mid-JSON
    with pytest.raises(ModelResponseError) as info:
        async for _ in provider.model(server).stream([UserMessage("hi")], ()):
            pass
    assert "not a JSON object" in str(info.value) and info.value.retryable


async def test_a_stream_that_ends_before_the_model_finished_is_an_error(
    provider: Provider, server: ReplayServer
) -> None:
    if provider is OPENAI:  # no finish_reason, no [DONE]: the server just stopped
        chunks = openai_stream(["Hal"], usage=None, done=False)[:-1]
    else:  # no message_delta / message_stop
        chunks = anthropic_stream(["Hal"])[:-2]
    server.add(Reply(chunks))
    seen: list[object] = []
    with pytest.raises(ModelResponseError):
        async for event in provider.model(server).stream([UserMessage("hi")], ()):
            seen.append(event)
    assert seen == [TextDelta("Hal")]


async def test_the_adapter_alone_yields_deltas_calls_and_usage(
    provider: Provider, server: ReplayServer
) -> None:
    server.add(provider.calls([("call_a", "lookup", ['{"city":', ' "Oslo"}'])], text=["On it"]))
    tools = [ToolSpec("lookup", "weather", {"type": "object",
                                            "properties": {"city": {"type": "string"}}})]
    events = [e async for e in provider.model(server).stream(
        [SystemMessage("sys"), UserMessage("weather in Oslo?")], tools)]
    assert events[0] == TextDelta("On it")
    assert isinstance(events[1], ToolCallDelta) and events[1].call.arguments == {"city": "Oslo"}
    assert isinstance(events[-1], Usage) and len(events) == 3


def test_errors_say_whether_a_retry_may_help(provider: Provider) -> None:
    assert ModelRateLimited.retryable and ModelOverloaded.retryable
    assert ModelConnectionError.retryable and ModelResponseError.retryable
    assert not ModelContextTooLong.retryable and not torpor.ModelAuthError.retryable
    assert not torpor.ModelBadRequest.retryable
    for cls in (ModelRateLimited, ModelContextTooLong, torpor.ModelAuthError):
        assert issubclass(cls, ModelError) and issubclass(cls, torpor.TorporError)

