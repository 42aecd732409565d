"""Supervision: crashes restart from the log, crash loops park durably, two writers conflict."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from support import until

from torpor import (
    Aborted,
    AgentConfig,
    AgentParked,
    ConflictError,
    EchoModel,
    Event,
    Parked,
    Runtime,
    RuntimeConfig,
    TurnAborted,
    Unparked,
)


class BrokenSummarizer:
    """Fails every fold: an exception inside the agent, not the model, so the agent crashes."""

    async def summarize(self, previous: str, events: Sequence[Event]) -> str:
        raise RuntimeError("summarizer is down")


CRASHY = AgentConfig(summarizer=BrokenSummarizer(), working_budget=40, tail_turns=1)
FAST_RESTARTS = RuntimeConfig(max_restarts=2, restart_window=3600, backoff_initial=0.0)


async def test_a_crash_loop_ends_parked_durably_and_unpark_lets_it_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/p.db"
    async with Runtime(url, model=EchoModel(), agent=CRASHY, config=FAST_RESTARTS) as rt:
        await (await rt.send("c", "a fairly long first message " * 4)).result()
        with rt.admin.watch() as watcher:
            for attempt in range(3):
                turn = await rt.send("c", f"message that forces a fold {attempt} " * 4)
                with pytest.raises(TurnAborted) as info:
                    await turn.result()
                assert info.value.reason == "crashed"
                if attempt < 2:
                    await until(watcher, "c", "awaiting_input", old="reviving")
                else:
                    await until(watcher, "c", "parked")
        stats = (await rt.admin.stats())
        assert stats.crashes == 3 and stats.restarts == 2 and stats.parks == 1
        info2 = await rt.admin.inspect("c")
        assert info2.state == "parked" and "summarizer is down" in (info2.parked_cause or "")
        with pytest.raises(AgentParked):
            await rt.send("c", "anyone?")
        # Other agents and the runtime itself are unaffected.
        assert (await (await rt.send("other", "hi")).result()).text == "echo: hi"
        bodies = [e.body for e in reversed(await rt.history("c", limit=100))]
        assert sum(isinstance(b, Aborted) and b.reason == "crashed" for b in bodies) == 3
        assert isinstance(bodies[-1], Parked)

    # Parking is in the log: a new runtime on the same file still refuses the agent.
    async with Runtime(url, model=EchoModel()) as rt2:
        assert (await rt2.admin.inspect("c")).parked_cause is not None
        with pytest.raises(AgentParked):
            await rt2.send("c", "still parked?")
        assert await rt2.admin.unpark("c") is True
        assert isinstance((await rt2.history("c", limit=1))[0].body, Unparked)
        assert (await (await rt2.send("c", "hello")).result()).text == "echo: hello"
        assert await rt2.admin.unpark("c") is False


async def test_a_restart_revives_from_the_log_at_once() -> None:
    async with Runtime("sqlite://", model=EchoModel(), agent=CRASHY,
                       config=RuntimeConfig(max_restarts=10, backoff_initial=0.0)) as rt:
        await (await rt.send("c", "first message with enough words to fold " * 3)).result()
        with rt.admin.watch() as watcher:
            crashing = await rt.send("c", "this one crashes while folding " * 3)
            with pytest.raises(TurnAborted):
                await crashing.result()
            await until(watcher, "c", "awaiting_input", old="reviving")
        info = await rt.admin.inspect("c")
        assert info.restarts == 1 and info.last_error is not None
        assert info.state == "awaiting_input"
        head_before = info.head
        assert head_before is not None
        # The log after the restart continues densely from where it was.
        positions = [e.position for e in reversed(await rt.history("c", limit=100))]
        assert positions == list(range(head_before + 1))


async def test_two_writers_on_one_file_conflict_instead_of_interleaving(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/two.db"
    restarts = RuntimeConfig(backoff_initial=0.0)
    async with Runtime(url, model=EchoModel(), config=restarts) as one, \
            Runtime(url, model=EchoModel(), config=restarts) as two:
        await (await one.send("c", "from one")).result()
        await (await two.send("c", "from two")).result()
        with one.admin.watch() as watcher:
            with pytest.raises(ConflictError):
                await one.send("c", "stale writer")
            await until(watcher, "c", "awaiting_input", old="reviving")
        # After the conflict the first runtime re-reads the log and writes after it.
        assert (await (await one.send("c", "one again")).result()).text == "echo: one again"
        events = list(reversed(await one.history("c", limit=100)))
        assert [e.position for e in events] == list(range(6))
        assert [e.turn for e in events] == [1, 1, 2, 2, 3, 3]
        texts = [getattr(e.body, "text", None) for e in events]
        assert "stale writer" not in texts
