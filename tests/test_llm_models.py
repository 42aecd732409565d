"""The deterministic local models: EchoModel and ScriptedModel."""

from collections.abc import Sequence

import anyio
import pytest

from torpor.errors import ConfigError, ModelError
from torpor.events import AssistantMessage, ToolCall, ToolResult, UserMessage
from torpor.llm import (
    Call,
    ContextMessage,
    EchoModel,
    Fail,
    Model,
    Pause,
    Report,
    ScriptedModel,
    Signal,
    StreamEvent,
    SystemMessage,
    Text,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
    Usage,
    Wait,
)


async def collect(
    model: Model, context: Sequence[ContextMessage], tools: Sequence[ToolSpec] = ()
) -> list[StreamEvent]:
    return [event async for event in model.stream(context, tools)]


def text_of(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


# --- EchoModel ---------------------------------------------------------------------------


def test_models_satisfy_the_protocol() -> None:
    assert isinstance(EchoModel(), Model)
    assert isinstance(ScriptedModel.replies("x"), Model)


async def test_echo_replies_to_the_last_user_message() -> None:
    context: list[ContextMessage] = [
        SystemMessage("be brief"),
        UserMessage("first"),
        AssistantMessage("echo: first"),
        UserMessage("second question"),
    ]
    events = await collect(EchoModel(), context)
    assert text_of(events) == "echo: second question"
    assert events == await collect(EchoModel(), context)  # deterministic


async def test_echo_streams_in_chunks_of_chunk_size() -> None:
    events = await collect(EchoModel(chunk_size=4, prefix=">"), [UserMessage("abcdefghij")])
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert deltas == [">abc", "defg", "hij"]
    assert isinstance(events[-1], Usage)
    assert len([e for e in events if isinstance(e, Usage)]) == 1


async def test_echo_usage_leaves_prompt_tokens_unknown_by_default() -> None:
    events = await collect(EchoModel(), [UserMessage("x" * 40)])
    usage = events[-1]
    assert isinstance(usage, Usage)
    assert usage.prompt_tokens is None
    assert usage.completion_tokens == (len("echo: ") + 40 + 3) // 4


async def test_echo_can_report_an_estimated_prompt_size() -> None:
    model = EchoModel(report_prompt_tokens=True)
    short = (await collect(model, [UserMessage("x" * 40)]))[-1]
    long = (await collect(model, [UserMessage("x" * 4000)]))[-1]
    spec = ToolSpec("lookup", "find things", {"type": "object", "properties": {}})
    with_tools = (await collect(model, [UserMessage("x" * 40)], [spec]))[-1]
    assert isinstance(short, Usage) and isinstance(long, Usage) and isinstance(with_tools, Usage)
    assert short.prompt_tokens == 10
    assert long.prompt_tokens == 1000
    assert with_tools.prompt_tokens is not None and with_tools.prompt_tokens > 10


async def test_echo_summarises_tool_results_after_a_tool_call() -> None:
    context: list[ContextMessage] = [
        UserMessage("look it up"),
        AssistantMessage("", (ToolCall("c1", "lookup", {"q": "x"}), ToolCall("c2", "fetch"))),
        ToolResult("c1", "lookup", "42 apples"),
        ToolResult("c2", "fetch", "no route", is_error=True),
    ]
    reply = text_of(await collect(EchoModel(), context))
    assert reply == "echo: lookup returned 42 apples; fetch failed no route"


async def test_echo_ignores_old_tool_results_once_the_user_speaks_again() -> None:
    context: list[ContextMessage] = [
        UserMessage("a"),
        AssistantMessage("", (ToolCall("c1", "lookup"),)),
        ToolResult("c1", "lookup", "result"),
        AssistantMessage("done"),
        UserMessage("b"),
    ]
    assert text_of(await collect(EchoModel(), context)) == "echo: b"


async def test_echo_clips_long_tool_results_in_its_summary() -> None:
    context: list[ContextMessage] = [UserMessage("a"), ToolResult("c1", "dump", "z" * 10_000)]
    reply = text_of(await collect(EchoModel(), context))
    assert reply.startswith("echo: dump returned zzz")
    assert len(reply) < 200


async def test_echo_sleeps_between_chunks_only_when_delayed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(anyio, "sleep", fake_sleep)
    await collect(EchoModel(chunk_size=4), [UserMessage("abcdefghij")])
    assert slept == []
    await collect(EchoModel(chunk_size=4, delay=0.25, prefix=""), [UserMessage("abcdefghij")])
    assert slept == [0.25, 0.25, 0.25]


def test_echo_rejects_bad_configuration() -> None:
    with pytest.raises(ConfigError) as info:
        EchoModel(chunk_size=0)
    assert info.value.field == "chunk_size"
    with pytest.raises(ConfigError):
        EchoModel(delay=-1)


# --- ScriptedModel -----------------------------------------------------------------------


async def test_replies_play_in_order_then_the_script_runs_out() -> None:
    model = ScriptedModel.replies("a", "b", name="script")
    assert text_of(await collect(model, [UserMessage("1")])) == "a"
    assert text_of(await collect(model, [UserMessage("2")])) == "b"
    assert model.remaining == 0
    with pytest.raises(ModelError, match=r"'script'.*3 times.*2 steps"):
        await collect(model, [UserMessage("3")])


async def test_a_looping_script_starts_over() -> None:
    model = ScriptedModel.replies("a", "b", loop=True)
    replies = [text_of(await collect(model, [UserMessage("?")])) for _ in range(5)]
    assert replies == ["a", "b", "a", "b", "a"]


async def test_it_records_every_context_and_tool_list() -> None:
    model = ScriptedModel.replies("a", "b")
    spec = ToolSpec("lookup", "", {"type": "object"})
    context: list[ContextMessage] = [SystemMessage("sys"), UserMessage("hi")]
    await collect(model, context, [spec])
    context.append(UserMessage("later"))  # the model kept its own copy
    await collect(model, [UserMessage("again")])
    assert model.calls == [[SystemMessage("sys"), UserMessage("hi")], [UserMessage("again")]]
    assert model.tool_specs == [(spec,), ()]


async def test_calls_get_deterministic_ids_unless_given() -> None:
    model = ScriptedModel(
        [
            [Text("let me look"), Call("lookup", {"q": "x"}), Call("fetch", id="mine")],
            [Call("lookup")],
        ]
    )
    first = await collect(model, [])
    second = await collect(model, [])
    assert first == [
        TextDelta("let me look"),
        ToolCallDelta(ToolCall("call_1", "lookup", {"q": "x"})),
        ToolCallDelta(ToolCall("mine", "fetch", {})),
    ]
    assert second == [ToolCallDelta(ToolCall("call_2", "lookup", {}))]


async def test_fail_raises_mid_stream_after_the_text_before_it() -> None:
    boom = RuntimeError("provider fell over")
    model = ScriptedModel([[Text("par"), Text("tial"), Fail(boom), Text("never")]])
    received: list[StreamEvent] = []
    with pytest.raises(RuntimeError) as info:
        async for event in model.stream([], []):
            received.append(event)
    assert info.value is boom
    assert received == [TextDelta("par"), TextDelta("tial")]


async def test_report_yields_usage_where_scripted() -> None:
    model = ScriptedModel([[Text("ok"), Report(prompt_tokens=120, completion_tokens=3)]])
    assert await collect(model, []) == [TextDelta("ok"), Usage(120, 3)]


async def test_wait_holds_the_stream_until_the_test_releases_it() -> None:
    reached, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("a"), Signal(reached), Wait(go), Text("b")]])
    received: list[StreamEvent] = []
    finished = anyio.Event()

    async def consume() -> None:
        async for event in model.stream([], []):
            received.append(event)
        finished.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await reached.wait()
        assert received == [TextDelta("a")]
        assert not finished.is_set()
        go.set()
        await finished.wait()
    assert received == [TextDelta("a"), TextDelta("b")]


async def test_pause_sleeps_for_the_given_time(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(anyio, "sleep", fake_sleep)
    model = ScriptedModel([[Text("a"), Pause(1.5), Text("b")]])
    assert text_of(await collect(model, [])) == "ab"
    assert slept == [1.5]


async def test_steps_accept_shorthands() -> None:
    model = ScriptedModel(["plain text", Call("lookup", id="c"), [Text("x"), Text("y")]])
    assert await collect(model, []) == [TextDelta("plain text")]
    assert await collect(model, []) == [ToolCallDelta(ToolCall("c", "lookup"))]
    assert text_of(await collect(model, [])) == "xy"


def test_bad_scripts_fail_at_construction() -> None:
    with pytest.raises(ConfigError):
        ScriptedModel([[Text("ok"), "not an action"]])  # type: ignore[list-item]
    with pytest.raises(ConfigError):
        ScriptedModel("abc")
    with pytest.raises(ConfigError):
        ScriptedModel([], loop=True)
