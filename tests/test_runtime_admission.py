"""The live-agent cap holds in an activation storm: queue, stay durable, run in order."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio

import torpor
from torpor import Runtime, RuntimeConfig, UserMessage
from torpor.llm.protocol import ContextMessage, StreamEvent, TextDelta, ToolSpec


class GatedEcho:
    """Echoes the last user message once the gate opens; records the order of calls."""

    name = "gated"

    def __init__(self) -> None:
        self.gate = anyio.Event()
        self.order: list[str] = []

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        last = next(m for m in reversed(context) if isinstance(m, UserMessage))
        self.order.append(last.text)
        await self.gate.wait()
        yield TextDelta(f"echo: {last.text}")


async def test_a_storm_over_the_cap_is_durable_at_once_and_answered_in_arrival_order(
    tmp_path: Path,
) -> None:
    model = GatedEcho()
    cap, n = 5, 40
    config = RuntimeConfig(max_live_agents=cap, hibernate_after=3600, evict_after=7200)
    async with Runtime(f"sqlite:///{tmp_path}/s.db", model=model, config=config) as rt:
        peak = 0
        turns: list[torpor.Turn] = []
        with rt.admin.watch() as watcher:
            for i in range(n):  # one message each, all while every live agent is busy
                turns.append(await rt.send(f"c{i:02d}", f"m{i:02d}"))
                peak = max(peak, (await rt.admin.stats()).live)
            stats = await rt.admin.stats()
            assert stats.live <= cap and stats.queued == n - cap
            # Durable before any slot was free: every message is in the log already.
            for i in range(n):
                newest = (await rt.history(f"c{i:02d}", limit=1))[0]
                assert isinstance(newest.body, UserMessage) and newest.body.text == f"m{i:02d}"
            model.gate.set()
            with anyio.fail_after(20):
                answers = [(await t.result()) for t in turns]
            assert [a.text for a in answers if isinstance(a, torpor.AssistantMessage)] == [
                f"echo: m{i:02d}" for i in range(n)
            ]
            watcher.close()
            live = set()
            admitted: list[str] = []
            async for t in watcher:  # replay what was buffered: live never above the cap
                if t.new == "evicted":
                    live.discard(t.conversation_id)
                elif t.old in ("evicted", "queued"):
                    live.add(t.conversation_id)
                if t.old == "queued":
                    admitted.append(t.conversation_id)
                peak = max(peak, len(live))
        assert peak <= cap
        assert admitted == [f"c{i:02d}" for i in range(cap, n)]  # slots in arrival order
        stats = await rt.admin.stats()
        assert stats.queued == 0 and stats.queue_wait_p99_ms is not None
        assert stats.crashes == 0


async def test_a_queued_conversation_with_history_and_a_retry_keeps_every_message(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path}/h.db"
    async with Runtime(url) as rt:
        for i in range(3):
            await (await rt.send("old", f"before {i}")).result()
    model = GatedEcho()
    config = RuntimeConfig(max_live_agents=1)
    async with Runtime(url, model=model, config=config) as rt:
        busy = await rt.send("busy", "hold the only slot")
        first = await rt.send("old", "queued one", key="k1")
        again = await rt.send("old", "queued one", key="k1")  # a retried send: same turn
        second = await rt.send("old", "queued two")
        assert again is first and first.postponed and first.number == 4
        assert second.number == 5
        model.gate.set()
        assert (await busy.result()).text == "echo: hold the only slot"
        assert (await first.result()).text == "echo: queued one"
        assert (await second.result()).text == "echo: queued two"
        kinds = [(type(e.body).__name__, e.turn) for e in reversed(await rt.history("old"))]
        assert kinds[-4:] == [("UserMessage", 4), ("UserMessage", 5),
                              ("AssistantMessage", 4), ("AssistantMessage", 5)]
        assert not any(isinstance(e.body, torpor.Aborted) for e in await rt.history("old"))
