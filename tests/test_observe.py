"""Observers (``Runtime.observe``): what they are told of turns, model and tool calls,
folds and aborts, in which nesting, and the sender's origin carried to a later turn."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import anyio
import pytest

import torpor
from torpor import (
    AbortInfo,
    AgentConfig,
    FoldInfo,
    ModelCallInfo,
    ModelCallWatch,
    ModelContextTooLong,
    ModelRateLimited,
    Observer,
    Runtime,
    ScriptedModel,
    ToolCallInfo,
    TurnAborted,
    TurnInfo,
)
from torpor.llm import Call, Fail, Report, Signal, Text, Wait
from torpor.llm.protocol import Usage

REQUEST: ContextVar[str | None] = ContextVar("request", default=None)


class _Watch(ModelCallWatch):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def note(self, line: str) -> None:
        self.recorder.notes.append("  " * self.recorder.depth + line)

    def first_token(self) -> None:
        self.note("first_token")

    def usage(self, usage: Usage) -> None:
        self.note(f"usage {usage.prompt_tokens}/{usage.completion_tokens}")

    def answered(self, message: torpor.AssistantMessage) -> None:
        self.note(f"answered calls={len(message.tool_calls)}")

    def failed(self, error: BaseException) -> None:
        self.note(f"failed {type(error).__name__}")


class Recorder(Observer):
    """Notes every hook as a line; ``depth`` shows the nesting the hooks were entered in."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.depth = 0

    def origin(self) -> object | None:
        return REQUEST.get()

    @contextlib.contextmanager
    def _span(self, label: str) -> Iterator[None]:
        self.notes.append("  " * self.depth + "enter " + label)
        self.depth += 1
        try:
            yield
        except BaseException as exc:
            self.notes.append("  " * self.depth + f"raised {type(exc).__name__}")
            raise
        finally:
            self.depth -= 1
            self.notes.append("  " * self.depth + "exit " + label)

    def turn(
        self, info: TurnInfo, origin: object | None
    ) -> contextlib.AbstractContextManager[None]:
        more = " continuation" if info.continuation else ""
        more += " postponed" if info.postponed else ""
        return self._span(f"turn {info.conversation_id}#{info.turn} origin={origin}{more}")

    @contextlib.contextmanager
    def model_call(self, info: ModelCallInfo) -> Iterator[ModelCallWatch]:
        with self._span(f"model {info.model} call={info.call_index}"):
            yield _Watch(self)

    def tool_call(self, info: ToolCallInfo) -> contextlib.AbstractContextManager[None]:
        return self._span(f"tool {info.tool} {info.call_id}")

    def fold(self, info: FoldInfo) -> contextlib.AbstractContextManager[None]:
        return self._span(f"fold cycle={info.cycle}")

    def aborted(self, info: AbortInfo) -> None:
        error = type(info.error).__name__ if info.error is not None else None
        self.notes.append("  " * self.depth + f"aborted {info.reason} {error}")


@torpor.tool
async def lookup(order: str) -> str:
    """Look an order up."""
    return f"order {order}: shipped"


async def test_a_turn_with_a_tool_call_nests_model_tool_model_under_the_turn() -> None:
    model = ScriptedModel([
        [Text("let me look"), Call("lookup", {"order": "A1"}), Report(100, 7)],
        [Text("it shipped"), Report(120, 3)],
    ], name="scripted-1")
    recorder = Recorder()
    async with Runtime("sqlite://", model=model,
                       agent=AgentConfig(tools=[lookup])) as rt:
        rt.observe(recorder)
        token = REQUEST.set("req-1")
        try:
            turn = await rt.send("c", "where is A1?")
        finally:
            REQUEST.reset(token)
        assert (await turn.result()).text == "it shipped"
    assert recorder.notes == [
        "enter turn c#1 origin=req-1",
        "  enter model scripted-1 call=1",
        "    first_token",
        "    usage 100/7",
        "    answered calls=1",
        "  exit model scripted-1 call=1",
        "  enter tool lookup call_1",
        "  exit tool lookup call_1",
        "  enter model scripted-1 call=2",
        "    first_token",
        "    usage 120/3",
        "    answered calls=0",
        "  exit model scripted-1 call=2",
        "exit turn c#1 origin=req-1",
    ]


async def test_a_postponed_turn_runs_under_its_own_senders_origin() -> None:
    reached, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Signal(reached), Wait(go), Text("one")], "two"])
    recorder = Recorder()
    async with Runtime("sqlite://", model=model) as rt:
        rt.observe(recorder)
        REQUEST.set("first")
        first = await rt.send("c", "1")
        await reached.wait()
        REQUEST.set("second")
        second = await rt.send("c", "2")
        assert second.postponed
        REQUEST.set("elsewhere")  # what the actor's task sees later must not matter
        go.set()
        assert (await first.result()).text == "one"
        assert (await second.result()).text == "two"
    turns = [n for n in recorder.notes if n.startswith("enter turn")]
    assert turns == ["enter turn c#1 origin=first", "enter turn c#2 origin=second postponed"]


async def test_the_continuation_after_an_approval_runs_under_the_resolvers_origin() -> None:
    approve = torpor.ExternalTool("approve", "ask a person")
    model = ScriptedModel([[Call("approve", {}, id="k1")], "approved, done"])
    recorder = Recorder()
    async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[approve])) as rt:
        rt.observe(recorder)
        REQUEST.set("asker")
        turn = await rt.send("c", "pay")
        assert isinstance(await turn.result(), torpor.Suspended)
        REQUEST.set("approver")
        continuation = await rt.resolve("c", "k1", "yes")
        assert continuation is not None
        assert (await continuation.result()).text == "approved, done"
    turns = [n for n in recorder.notes if n.startswith("enter turn")]
    assert turns == ["enter turn c#1 origin=asker",
                     "enter turn c#1 origin=approver continuation"]


async def test_a_model_error_is_reported_inside_its_call_then_as_the_turns_abort() -> None:
    model = ScriptedModel([[Text("par"), Fail(ModelRateLimited("slow down", retry_after=2.0))]])
    recorder = Recorder()
    async with Runtime("sqlite://", model=model) as rt:
        rt.observe(recorder)
        turn = await rt.send("c", "hi")
        with pytest.raises(TurnAborted):
            await turn.result()
    assert recorder.notes == [
        "enter turn c#1 origin=None",
        "  enter model scripted call=1",
        "    first_token",
        "    failed ModelRateLimited",
        "    raised ModelFailed",
        "  exit model scripted call=1",
        "  aborted model_error ModelRateLimited",
        "exit turn c#1 origin=None",
    ]


async def test_a_fold_forced_by_a_context_too_long_is_observed_between_the_calls() -> None:
    model = ScriptedModel(["a", "b", "c", [Fail(ModelContextTooLong("too long"))], "fits now"])
    recorder = Recorder()
    async with Runtime("sqlite://", model=model) as rt:
        for text in ("one", "two", "three"):  # something to fold
            await (await rt.send("c", text)).result()
        rt.observe(recorder)
        turn = await rt.send("c", "hi")
        assert (await turn.result()).text == "fits now"
    labels = [n.strip() for n in recorder.notes if "enter" in n]
    assert labels == ["enter turn c#4 origin=None", "enter model scripted call=1",
                      "enter fold cycle=1", "enter model scripted call=1"]


async def test_removing_an_observer_stops_it_and_two_observers_both_hear() -> None:
    model = ScriptedModel.replies("a", "b")
    first, second = Recorder(), Recorder()
    async with Runtime("sqlite://", model=model) as rt:
        remove = rt.observe(first)
        rt.observe(second)
        await (await rt.send("c", "1")).result()
        remove()
        await (await rt.send("c", "2")).result()
    assert [n for n in first.notes if n.startswith("enter turn")] == [
        "enter turn c#1 origin=None"]
    assert [n for n in second.notes if n.startswith("enter turn")] == [
        "enter turn c#1 origin=None", "enter turn c#2 origin=None"]


def test_an_observer_must_subclass_observer() -> None:
    rt = Runtime("sqlite://", model=ScriptedModel.replies("x"))
    with pytest.raises(TypeError):
        rt.observe(object())  # type: ignore[arg-type]


class AbortCounter(Observer):
    def __init__(self) -> None:
        self.aborts: list[tuple[int, str, str | None, bool]] = []

    def aborted(self, info: AbortInfo) -> None:
        self.aborts.append((info.turn, info.reason, info.error_type, info.retryable))


async def test_a_drain_reports_the_running_turn_and_each_postponed_one_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not only a turn's own end: the postponed turns a stopping runtime ends in the log
    reach the observers and the log too, once each."""
    import logging

    caplog.set_level(logging.INFO, logger="torpor")
    reached = anyio.Event()
    model = ScriptedModel([[Text("half"), Signal(reached), Wait(anyio.Event())]])
    counter = AbortCounter()
    async with Runtime("sqlite://", model=model) as rt:
        rt.observe(counter)
        first = await rt.send("c", "1")
        await reached.wait()
        second = await rt.send("c", "2")
        third = await rt.send("c", "3")
        assert second.postponed and third.postponed
    for turn in (first, second, third):
        with pytest.raises(TurnAborted) as info:
            await turn.result()
        assert info.value.reason == "shutdown" and info.value.retryable
    assert sorted(counter.aborts) == [(1, "shutdown", None, True), (2, "shutdown", None, True),
                                      (3, "shutdown", None, True)]
    records = [r for r in caplog.records if r.getMessage().startswith("turn_aborted")]
    assert sorted(r.turn for r in records) == [1, 2, 3]  # type: ignore[attr-defined]
    assert {r.levelno for r in records} == {logging.WARNING}


class _Tagged(Recorder):
    """A recorder whose origin is its own tag plus the request (two observers, two origins)."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def origin(self) -> object | None:
        return f"{self.tag}:{REQUEST.get()}"


async def test_with_two_observers_each_gets_back_its_own_origin() -> None:
    reached, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Signal(reached), Wait(go), Text("one")], "two"])
    first, second = _Tagged("a"), _Tagged("b")
    async with Runtime("sqlite://", model=model) as rt:
        rt.observe(first)
        rt.observe(second)
        REQUEST.set("r1")
        turn = await rt.send("c", "1")
        await reached.wait()
        REQUEST.set("r2")
        later = await rt.send("c", "2")
        go.set()
        await turn.result()
        await later.result()
    assert [n for n in first.notes if n.startswith("enter turn")] == [
        "enter turn c#1 origin=a:r1", "enter turn c#2 origin=a:r2 postponed"]
    assert [n for n in second.notes if n.startswith("enter turn")] == [
        "enter turn c#1 origin=b:r1", "enter turn c#2 origin=b:r2 postponed"]
