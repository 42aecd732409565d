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

import asyncio
import sys
import textwrap

import anyio
import pytest
from test_cluster_redrive import SHARDS, TTL, n1_conversation, n2_holds, owner_of

from torpor import AssistantMessage, EchoModel, Event, NodeConfig, Runtime, UserMessage
from torpor.cluster import desired_owner, shard_of

asyncpg = pytest.importorskip("asyncpg")

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
    shard = shard_of(conversation, SHARDS)
    n2_shards = {s for s in range(SHARDS) if desired_owner(s, ["n1", "n2"]) == "n2"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", NODE1, pg_url, conversation, str(TTL), str(SHARDS),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        with anyio.fail_after(60):
            assert (await proc.stdout.readline()).strip() == b"scheduled"
        node = NodeConfig(node_id="n2", address="127.0.0.1:7112", lease_ttl=TTL, shards=SHARDS)
        async with Runtime(pg_url, model=EchoModel(), node=node) as n2:
            with anyio.fail_after(30):
                await n2_holds(n2, n2_shards)
            assert await owner_of(pg_url, shard) == "n1"
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
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    fired = [e for e in log if isinstance(e.body, UserMessage) and e.body.scheduled]
    assert [e.body.text for e in fired] == ["wake up"]  # type: ignore[union-attr]
    assert log[-1].body == AssistantMessage("echo: [scheduled] wake up")
    conn = await asyncpg.connect(pg_url)
    try:
        epochs = [r[0] for r in await conn.fetch(
            "SELECT e.epoch FROM events e JOIN conversations c ON c.key = e.conversation_id "
            "WHERE c.external_id = $1 ORDER BY e.position", conversation
        )]
    finally:
        await conn.close()
    assert epochs[0] == epochs[1] < epochs[2] == epochs[3]  # n1's epoch, then n2's
