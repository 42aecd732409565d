"""Turns through the runtime: the log, streaming, fan-out, cancel, model errors, tools, Busy."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

import torpor
from torpor import (
    Aborted,
    AgentConfig,
    AssistantMessage,
    Busy,
    EchoModel,
    Runtime,
    RuntimeConfig,
    ScriptedModel,
    TextDelta,
    ToolResult,
    TurnAborted,
    UserMessage,
)
from torpor.llm import Call, Fail, Signal, Text, Wait
from torpor.llm.protocol import StreamEvent, Usage


async def log_of(rt: Runtime, conv: str) -> list[torpor.Event]:
    return list(reversed(await rt.history(conv, limit=1000)))


async def test_a_turn_logs_user_then_assistant_and_streams_the_text() -> None:
    async with Runtime("sqlite://", model=EchoModel(chunk_size=3)) as rt:
        turn = await rt.send("c1", "hello there")
        pieces = [item.text async for item in turn if isinstance(item, TextDelta)]
        final = await turn.result()
        assert final.text == "echo: hello there"
        assert "".join(pieces) == final.text
        events = await log_of(rt, "c1")
        assert [type(e.body) for e in events] == [UserMessage, AssistantMessage]
        assert [e.position for e in events] == [0, 1]
        assert all(e.turn == 1 for e in events)
        info = await rt.admin.inspect("c1")
        assert info.state == "awaiting_input"
        assert info.head == 1


async def test_send_returns_once_the_user_message_is_durable() -> None:
    go = anyio.Event()
    model = ScriptedModel([[Wait(go), Text("late")]])
    async with Runtime("sqlite://", model=model) as rt:
        turn = await rt.send("c", "persist me first")
        # The model has not produced anything yet, but the message is in the log.
        events = await log_of(rt, "c")
        assert [e.body for e in events] == [UserMessage("persist me first")]
        go.set()
        assert (await turn.result()).text == "late"


async def test_subscriber_joining_mid_stream_gets_the_full_text_exactly_once() -> None:
    reached, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("Hello, "), Text("wor"), Signal(reached), Wait(go),
                            Text("ld"), Text("!")]])
    async with Runtime("sqlite://", model=model) as rt:
        turn = await rt.send("c", "hi")
        await reached.wait()
        items: list[object] = []
        async with rt.subscribe("c") as sub:  # follows the conversation until closed
            go.set()
            async for item in sub:
                items.append(item)
                if isinstance(item, torpor.Event) and isinstance(item.body, AssistantMessage):
                    break
        text = "".join(i.text for i in items if isinstance(i, TextDelta))
        assert text == "Hello, world!"
        finals = [i for i in items if isinstance(i, torpor.Event)]
        assert isinstance(finals[-1].body, AssistantMessage)
        assert finals[-1].body.text == "Hello, world!"
        assert (await turn.result()).text == "Hello, world!"


async def test_cancel_mid_stream_logs_the_partial_text_and_returns_to_awaiting_input() -> None:
    reached, never = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("partial "), Text("answer"), Signal(reached), Wait(never)],
                           [Text("second")]])
    async with Runtime("sqlite://", model=model) as rt:
        turn = await rt.send("c", "go")
        await reached.wait()
        assert (await rt.admin.inspect("c")).state == "streaming"
        assert await rt.cancel("c") is True
        with pytest.raises(TurnAborted) as info:
            await turn.result()
        assert info.value.reason == "cancelled"
        assert info.value.partial_text == "partial answer"
        events = await log_of(rt, "c")
        last = events[-1].body
        assert isinstance(last, Aborted)
        assert last.reason == "cancelled" and last.partial_text == "partial answer"
        assert (await rt.admin.inspect("c")).state == "awaiting_input"
        assert (await (await rt.send("c", "again")).result()).text == "second"
        assert await rt.cancel("c") is False


async def test_model_error_mid_stream_is_logged_and_the_agent_lives_on() -> None:
    model = ScriptedModel([[Text("abc"), Fail(ConnectionError("provider hung up"))],
                           [Text("fine")]])
    async with Runtime("sqlite://", model=model) as rt:
        turn = await rt.send("c", "x")
        with pytest.raises(TurnAborted) as info:
            await turn.result()
        assert info.value.reason == "model_error"
        aborted = (await log_of(rt, "c"))[-1].body
        assert isinstance(aborted, Aborted)
        assert aborted.reason == "model_error" and aborted.partial_text == "abc"
        assert "provider hung up" in aborted.detail
        assert (await (await rt.send("c", "y")).result()).text == "fine"
        assert (await rt.admin.stats()).crashes == 0
        calls = await rt.store.model_calls("c")
        assert calls[0].error is not None and calls[1].error is None


async def test_tools_that_raise_time_out_or_do_not_exist_become_error_results() -> None:
    never = anyio.Event()

    @torpor.tool
    async def explode(n: int) -> str:
        """Always fails."""
        raise RuntimeError(f"boom {n}")

    @torpor.tool(timeout=0.05)
    async def hang() -> str:
        """Never answers."""
        await never.wait()
        return "unreachable"

    @torpor.tool
    async def add(a: int, b: int) -> int:
        """Adds."""
        return a + b

    model = ScriptedModel([
        [Call("explode", {"n": 7}, id="t1"), Call("hang", {}, id="t2"),
         Call("nope", {}, id="t3"), Call("add", {"a": "x"}, id="t4"),
         Call("add", {"a": 2, "b": 3}, id="t5")],
        [Text("recovered")],
    ])
    config = AgentConfig(tools=[explode, hang, add])
    async with Runtime("sqlite://", model=model, agent=config) as rt:
        final = await (await rt.send("c", "use tools")).result()
        assert final.text == "recovered"
        results = {e.body.call_id: e.body for e in await log_of(rt, "c")
                   if isinstance(e.body, ToolResult)}
        assert results["t1"].is_error and "boom 7" in results["t1"].content
        assert results["t2"].is_error and "timed out" in results["t2"].content.lower()
        assert results["t3"].is_error and "unknown tool" in results["t3"].content.lower()
        assert results["t4"].is_error
        assert not results["t5"].is_error and results["t5"].content == "5"
        # The model saw every result, in call order, right after its own tool calls.
        second_context = model.calls[1]
        ids = [m.call_id for m in second_context if isinstance(m, ToolResult)]
        assert ids == ["t1", "t2", "t3", "t4", "t5"]


async def test_a_send_while_streaming_returns_once_logged_and_runs_after() -> None:
    go = anyio.Event()
    model = ScriptedModel([[Wait(go), Text("one")], [Text("two")]])
    async with Runtime("sqlite://", model=model) as rt:
        first = await rt.send("c", "first")
        second = await rt.send("c", "second")  # durable now, though the first still streams
        assert second.postponed and not first.done()
        assert (await rt.admin.inspect("c")).postponed == 1
        go.set()
        assert (await first.result()).text == "one"
        assert (await second.result()).text == "two"
        kinds = [(type(e.body).__name__, e.turn) for e in await log_of(rt, "c")]
        assert kinds == [("UserMessage", 1), ("UserMessage", 2),
                         ("AssistantMessage", 1), ("AssistantMessage", 2)]
        # Turns never interleave for the model: the second call sees the first answer first.
        texts = [getattr(m, "text", None) for m in model.calls[1]]
        assert texts[-3:] == ["first", "one", "second"]


async def test_input_beyond_the_mailbox_bound_is_refused_with_busy() -> None:
    go = anyio.Event()
    model = ScriptedModel([[Wait(go), Text("a")], [Text("b")]])
    async with Runtime("sqlite://", model=model,
                       config=RuntimeConfig(mailbox_bound=1)) as rt:
        async with anyio.create_task_group() as tg:
            first = await rt.send("c", "1")
            tg.start_soon(rt.send, "c", "2")
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(Busy):
                await rt.send("c", "3")
            go.set()
            await first.result()
        texts = [e.body.text for e in await log_of(rt, "c") if isinstance(e.body, UserMessage)]
        assert texts == ["1", "2"]  # the refused message never reached the log


async def test_idempotency_key_makes_a_retried_send_return_the_same_turn() -> None:
    async with Runtime("sqlite://", model=EchoModel()) as rt:
        first = await rt.send("c", "pay invoice 42", key="req-1")
        assert (await first.result()).text == "echo: pay invoice 42"
        again = await rt.send("c", "pay invoice 42", key="req-1")
        assert again.replayed and again.user_position == first.user_position
        assert (await again.result()).text == "echo: pay invoice 42"
        users = [e for e in await log_of(rt, "c") if isinstance(e.body, UserMessage)]
        assert len(users) == 1


async def test_bad_input_gets_typed_errors_and_writes_nothing() -> None:
    async with Runtime("sqlite://") as rt:
        with pytest.raises(ValueError):
            await rt.send("", "x")
        with pytest.raises(ValueError):
            await rt.send("x" * 257, "x")
        with pytest.raises(TypeError):
            await rt.send("c", 42)  # type: ignore[arg-type]
        assert await rt.store.conversations() == []
    with pytest.raises(torpor.RuntimeClosed):
        await rt.send("c", "after close")


async def test_leaving_the_runtime_mid_stream_logs_a_shutdown_abort(tmp_path: object) -> None:
    url = f"sqlite:///{tmp_path}/db.sqlite"
    reached, never = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("half"), Signal(reached), Wait(never)]])
    async with Runtime(url, model=model) as rt:
        turn = await rt.send("c", "long question")
        await reached.wait()
    with pytest.raises(TurnAborted):
        await turn.result()
    async with Runtime(url) as rt2:
        last = (await log_of(rt2, "c"))[-1].body
        assert isinstance(last, Aborted) and last.reason == "shutdown"
        assert last.partial_text == "half"


async def test_concurrent_sends_while_streaming_never_exceed_the_mailbox_bound() -> None:
    # Found by the fuzzer (and the flaky test above): messages being logged behind the
    # open turn were not counted until written, so concurrent sends all got in.
    go = anyio.Event()
    model = ScriptedModel([[Wait(go), Text("a")]], loop=True)
    async with Runtime("sqlite://", model=model,
                       config=RuntimeConfig(mailbox_bound=2)) as rt:
        first = await rt.send("c", "0")
        outcomes: list[object] = []

        async def send(text: str) -> None:
            try:
                outcomes.append(await rt.send("c", text))
            except Busy as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tg:
            for i in range(1, 6):
                tg.start_soon(send, str(i))
        assert sum(isinstance(o, torpor.Turn) for o in outcomes) == 2
        assert sum(isinstance(o, Busy) for o in outcomes) == 3
        go.set()
        await first.result()
        texts = [e.body.text for e in await log_of(rt, "c") if isinstance(e.body, UserMessage)]
        assert len(texts) == 3


async def test_requests_queued_before_a_turn_started_do_not_wait_for_it_to_end() -> None:
    # Found by the fuzzer: the actor read its mailbox only between turns, so a send or a
    # cancel queued while the agent was reviving waited for the whole first turn, forever
    # if its model hung.
    never = anyio.Event()
    model = ScriptedModel([[Text("stuck"), Wait(never)], [Text("second answer")]])
    async with Runtime("sqlite://", model=model) as rt:
        results: dict[str, object] = {}

        async def send(text: str) -> None:
            results[text] = await rt.send("c", text)

        async def cancel() -> None:
            results["cancel"] = await rt.cancel("c")

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:  # all queued before it revives
                tg.start_soon(send, "first")
                tg.start_soon(send, "second")
                tg.start_soon(cancel)
        first, second = results["first"], results["second"]
        assert isinstance(first, torpor.Turn) and isinstance(second, torpor.Turn)
        assert second.postponed and results["cancel"] is True
        with pytest.raises(TurnAborted):
            await first.result()
        assert (await second.result()).text == "second answer"
        kinds = [(type(e.body).__name__, e.turn) for e in await log_of(rt, "c")]
        assert kinds == [("UserMessage", 1), ("UserMessage", 2), ("Aborted", 1),
                         ("AssistantMessage", 2)]


async def test_cancelling_one_wait_for_the_result_leaves_the_turn_and_the_other_waits() -> None:
    go = anyio.Event()
    model = ScriptedModel([[Wait(go), Text("done")], [Text("boom"), Fail("down")]])
    async with Runtime("sqlite://", model=model) as rt:
        turn = await rt.send("c", "hi")
        got: list[object] = []

        async def wait() -> None:
            got.append(await turn.result())

        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as gave_up:
                tg.start_soon(wait)
                tg.start_soon(wait)
                await anyio.wait_all_tasks_blocked()
                gave_up.cancel()
                await turn.result()  # cancelled here: only this wait
            assert gave_up.cancelled_caught and not turn.done()
            go.set()
        assert [type(g) for g in got] == [AssistantMessage, AssistantMessage]
        assert got[0] is got[1] is await turn.result()  # and again once it is over
        failing = await rt.send("c", "again")
        for _ in range(2):  # a failed turn raises its error to every wait, each time
            with pytest.raises(TurnAborted) as raised:
                await failing.result()
            assert raised.value.reason == "model_error"


class _OddUsage:
    """Answers, then reports token counts no audit row can hold."""

    name = "odd-usage"

    async def stream(self, context: object, tools: object) -> AsyncIterator[StreamEvent]:
        yield TextDelta("fine")
        yield Usage(prompt_tokens=-1, completion_tokens=2**70, cache_read_tokens=3)


async def test_token_counts_a_provider_gets_wrong_are_unknown_not_a_failed_turn() -> None:
    async with Runtime("sqlite://", model=_OddUsage()) as rt:
        assert (await (await rt.send("c", "hi")).result()).text == "fine"
        (call,) = await rt.store.model_calls("c")
        assert call.error is None and call.reported_prompt_tokens is None
        assert call.completion_tokens is None and call.cache_read_tokens == 3
        assert (await rt.admin.stats()).crashes == 0
