"""Must show (issue 26), on a real PostgreSQL: a schedule of a conversation whose node is
killed fires on the new owner, once.

``n1`` (a process of its own) owns the conversation and sets a schedule due now by the
wall clock, but its own clock runs an hour behind, so it never fires it (the test's way to
hold the firing for the takeover, without waiting). ``n2`` (this process, the real clock)
joins; ``n1`` is SIGKILLed; once ``n1``'s lease has run out ``n2`` takes the shard over, its
timer finds the schedule overdue and fires it: one scheduled message, under ``n2``'s epoch,
answered, and the schedule gone.
"""

from __future__ import annotations

import textwrap

import anyio
import pytest
from test_cluster_redrive import SHARDS, TTL, epochs, n1_conversation, n1_then_n2, n2_holds

from torpor import AssistantMessage, Event, UserMessage

pytest.importorskip("asyncpg")

NODE1 = textwrap.dedent(
    """
    import asyncio, sys, time, logging, structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    from torpor import NodeConfig, Runtime, RuntimeConfig

    async def main(url, conversation, ttl, shards):
        node = NodeConfig(node_id="n1", address="127.0.0.1:7111", lease_ttl=ttl, shards=shards)
        late = RuntimeConfig(clock=lambda: time.time() - 3600)  # never finds it due
        async with Runtime(url, node=node, config=late) as rt:
            await (await rt.send(conversation, "hi")).result()
            await rt.schedule(conversation, "wake up", at=time.time())
            print("scheduled", flush=True)
            await asyncio.Event().wait()

    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))
    """
)


async def test_a_schedule_of_a_killed_node_fires_on_the_new_owner_once(pg_url: str) -> None:
    conversation = n1_conversation()
    async with n1_then_n2(pg_url, NODE1, b"scheduled", conversation, "127.0.0.1:7112") as (
        proc, n2,
    ):
        assert len(await n2.store.read_since(conversation, 0)) == 2  # not fired yet
        assert len(await n2.schedules(conversation)) == 1
        proc.kill()
        await proc.wait()
        with anyio.fail_after(TTL + 30):  # nothing is sent: the takeover fires it
            await n2_holds(n2, set(range(SHARDS)))
            async with n2.subscribe(conversation, after=1) as follower:
                async for item in follower:
                    if (isinstance(item, Event) and isinstance(item.body, AssistantMessage)
                            and item.turn == 2):
                        break
        log = await n2.store.read_since(conversation, 0)
        assert await n2.schedules(conversation) == []
    fired = [e for e in log if isinstance(e.body, UserMessage) and e.body.scheduled]
    assert [e.body.text for e in fired] == ["wake up"]  # type: ignore[union-attr]
    assert log[-1].body == AssistantMessage("echo: [scheduled] wake up")
    written = await epochs(pg_url, conversation)
    assert written[0] == written[1] < written[2] == written[3]  # n1's epoch, then n2's
