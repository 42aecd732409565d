"""The model-idle watchdog: one task for every streaming call (torpor.actors.watchdog).

A stalled stream ends its turn with ModelTimeout after its own timeout, even
while calls with far longer timeouts are watched (the task's pause follows the
shortest); a stream that keeps sending is never ended; the task holds nothing
once the calls end, and a cancel still ends a watched call as a cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from torpor import AgentConfig, ModelContextTooLong, Runtime, TurnAborted
from torpor.actors.watchdog import MIN_TICK, ModelWatchdog
from torpor.events import Aborted
from torpor.llm import Pause, ScriptedModel, Signal, Text, Wait


def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'w.db'}"


class _Agent:
    """A watched call's owner: the scope the watchdog cancels."""

    def __init__(self) -> None:
        self.scope = anyio.CancelScope()


def test_check_ends_only_the_stalled_calls_and_paces_by_the_shortest_timeout() -> None:
    async def main() -> None:
        dog = ModelWatchdog()
        slow, fast = _Agent(), _Agent()
        long_call = dog.watch(slow.scope, 300.0)
        short_call = dog.watch(fast.scope, 0.2)
        start = short_call.last
        assert dog.check(start) == pytest.approx(max(MIN_TICK, 0.002))
        short_call.last = start + 1.0  # a chunk arrived: the deadline moves on
        assert dog.check(start + 1.1) is not None and not short_call.scope.cancel_called
        pause = dog.check(start + 1.25)  # over 0.2 s without a chunk (not exactly 0.2:
        # (start + 1.2) - (start + 1.0) may round below 0.2, whatever the loop's clock reads)
        assert fast.scope.cancel_called
        assert not slow.scope.cancel_called
        assert pause == pytest.approx(3.0)  # only the 300 s call is left
        dog.release(long_call)
        assert len(dog) == 0 and dog.check(start + 2) is None

    anyio.run(main)


def test_a_shorter_timeout_wakes_the_task_from_a_long_pause() -> None:
    async def main() -> None:
        dog = ModelWatchdog()
        async with anyio.create_task_group() as tg:
            tg.start_soon(dog.run)
            with anyio.fail_after(2):
                await _until(lambda: dog._pause is None)  # nothing watched: it waits
                long_call = dog.watch(anyio.CancelScope(), 300.0)
                await _until(lambda: dog._pause == pytest.approx(3.0))
                short_call = dog.watch(anyio.CancelScope(), 0.2)
                # Woken now, not after its 3 s pause (the 2 s limit above would fail).
                await _until(lambda: dog._pause == pytest.approx(max(MIN_TICK, 0.002)))
                await _until(lambda: short_call.scope.cancel_called)
                assert not long_call.scope.cancel_called
            tg.cancel_scope.cancel()

    anyio.run(main)


async def _until(condition: Callable[[], object]) -> None:
    """Let the event loop run until ``condition`` holds (the watchdog has no event to await)."""
    while not condition():  # one loop iteration at a time, no sleeping
        await anyio.lowlevel.checkpoint()


async def test_a_short_timeout_is_kept_while_a_long_one_is_watched(tmp_path: Path) -> None:
    never = anyio.Event()
    streaming = anyio.Event()
    patient = ScriptedModel([[Signal(streaming), Text("thinking "), Wait(never)]])
    hasty = ScriptedModel([[Text("half an "), Wait(never)], [Text("back")]])

    def agent_for(conversation_id: str) -> AgentConfig:
        if conversation_id == "patient":
            return AgentConfig(model=patient, model_idle_timeout=300.0)
        return AgentConfig(model=hasty, model_idle_timeout=0.2)

    async with Runtime(db(tmp_path), agent_for=agent_for) as rt:
        long_turn = await rt.send("patient", "take your time")
        await streaming.wait()  # the watchdog now paces itself by 300 s
        turn = await rt.send("hasty", "quick")
        with anyio.fail_after(20):  # would take 3 s or more if the pause were not cut
            with pytest.raises(TurnAborted) as info:
                await turn.result()
        assert info.value.reason == "model_error" and "ModelTimeout" in info.value.detail
        assert "0.2 seconds" in info.value.detail
        last = (await rt.store.read_since("hasty", 0))[-1].body
        assert isinstance(last, Aborted) and last.partial_text == "half an "
        (call,) = await rt.store.model_calls("hasty")
        assert call.error is not None and "ModelTimeout" in call.error
        assert (await rt.admin.inspect("patient")).state == "streaming"
        assert await rt.cancel("patient") is True  # a cancel is still a cancel
        with pytest.raises(TurnAborted) as cancelled:
            await long_turn.result()
        assert cancelled.value.reason == "cancelled"
        (patient_call,) = await rt.store.model_calls("patient")
        assert patient_call.error == "cancelled"
        assert len(rt._host.watchdog) == 0  # nothing is watched once the calls ended
        with anyio.fail_after(20):
            assert (await (await rt.send("hasty", "again")).result()).text == "back"


async def test_a_stream_that_keeps_sending_is_not_ended(tmp_path: Path) -> None:
    gaps = [anyio.Event() for _ in range(12)]
    steps: list[object] = []
    for gap in gaps:
        steps += [Text("."), Wait(gap)]
    model = ScriptedModel([[*steps, Text("done")]])  # type: ignore[list-item]
    async with Runtime(db(tmp_path), model=model,
                       agent=AgentConfig(model_idle_timeout=1.0)) as rt:
        turn = await rt.send("c", "go")
        for gap in gaps:  # 12 x 0.1 s: longer than the timeout, each gap far shorter
            await anyio.sleep(0.1)
            gap.set()
        with anyio.fail_after(20):
            assert (await turn.result()).text == "." * 12 + "done"


class _RaisesOnCall:
    """A model whose ``stream`` is a plain method (the protocol allows it) that raises
    before returning a stream on its first call, then streams ``then``'s steps."""

    name = "raises-on-call"

    def __init__(self, then: ScriptedModel) -> None:
        self.then = then
        self.calls = 0

    def stream(self, context: object, tools: object) -> object:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("bad request, refused before any stream")
        return self.then.stream(context, tools)  # type: ignore[arg-type]


async def test_a_call_that_fails_before_its_stream_leaves_nothing_watched(
    tmp_path: Path,
) -> None:
    """A stream() that raises at once must not leave its call registered: the watchdog
    would later cancel whatever turn of the agent runs then (as if a caller had)."""
    gaps = [anyio.Event() for _ in range(12)]
    steps: list[object] = []
    for gap in gaps:
        steps += [Text("."), Wait(gap)]
    model = _RaisesOnCall(ScriptedModel([[*steps, Text("done")]]))  # type: ignore[list-item]
    async with Runtime(db(tmp_path), model=model,  # type: ignore[arg-type]
                       agent=AgentConfig(model_idle_timeout=1.0)) as rt:
        with pytest.raises(TurnAborted):
            await (await rt.send("c", "first")).result()
        assert len(rt._host.watchdog) == 0  # the failed call is not watched any more
        turn = await rt.send("c", "second")
        for gap in gaps:  # 12 x 0.1 s: past the failed call's timeout, each gap far shorter
            await anyio.sleep(0.1)
            gap.set()
        with anyio.fail_after(20):
            assert (await turn.result()).text == "." * 12 + "done"


class _TooLongSlowToClose:
    """First call: the provider refuses the context at once, and closing that response
    takes ``close`` seconds (a slow connection teardown); then ``then`` answers."""

    name = "too-long-slow-close"

    def __init__(self, close: float, then: ScriptedModel) -> None:
        self.close = close
        self.then = then
        self.calls = 0

    def stream(self, context: object, tools: object) -> object:
        self.calls += 1
        if self.calls > 1:
            return self.then.stream(context, tools)  # type: ignore[arg-type]
        close = self.close

        class Refused:
            def __aiter__(self) -> Refused:
                return self

            async def __anext__(self) -> object:
                raise ModelContextTooLong("prompt is too long")

            async def aclose(self) -> None:
                await anyio.sleep(close)  # the model's own slowness, not a test's wait

        return Refused()


async def test_the_retry_after_a_context_too_long_is_not_ended_by_the_first_call(
    tmp_path: Path,
) -> None:
    """The first call fails and takes longer than the idle timeout to close: the watchdog
    must not end its turn meanwhile (the runtime folds and retries within the same turn)."""
    model = _TooLongSlowToClose(0.6, ScriptedModel([[Pause(0.0), Text("fits now")]]))
    async with Runtime(db(tmp_path), model=model,  # type: ignore[arg-type]
                       agent=AgentConfig(model_idle_timeout=0.2)) as rt:
        with anyio.fail_after(20):
            assert (await (await rt.send("c", "hello")).result()).text == "fits now"
        assert len(rt._host.watchdog) == 0


async def test_a_stop_landing_with_the_watchdog_still_stops_the_agent(tmp_path: Path) -> None:
    """The watchdog ends a stalled call in the same loop turn as the runtime (shutdown, a
    shard moving away) cancels the agent's task: the task still stops. The watchdog's
    cancel must not be taken for the whole cancellation and turned into a model error."""
    never, streaming = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Signal(streaming), Text("half "), Wait(never)]])
    async with Runtime(db(tmp_path), model=model,
                       agent=AgentConfig(model_idle_timeout=300.0)) as rt:
        await rt.send("c", "go")
        await streaming.wait()
        agent = rt._registry.get("c")
        assert agent is not None and agent.task is not None
        task = agent.task
        rt._host.watchdog.check(asyncio.get_running_loop().time() + 1000.0)  # stalled: ended
        task.cancel()  # and, in the same loop turn, the runtime stops the agent
        done, _ = await asyncio.wait({task}, timeout=10)
        assert done, "the agent's task ignored its cancel and went on"
        last = (await rt.store.read_since("c", 0))[-1].body
        assert isinstance(last, Aborted) and last.reason == "shutdown"
