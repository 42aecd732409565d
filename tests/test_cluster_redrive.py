"""Issue 20, item 3, forced as the issue describes it, on a real PostgreSQL.

Two nodes. On ``n1`` (a process of its own) a turn streams (a model that never
finishes it) and a second message is acknowledged as postponed; ``n2`` (this
process) holds the other shards. ``n1`` is killed with SIGKILL. With no new
request, ``n2`` takes the shard over once ``n1``'s lease has run out and
re-drives it from the store's open-work index: the log gets
``Aborted(interrupted)`` for the cut turn and an answer for the postponed
message, written under ``n2``'s epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import textwrap
import time
from collections.abc import AsyncIterator

import anyio
import pytest
from test_runtime_redrive import logged_until_answered

from torpor import Aborted, AssistantMessage, EchoModel, NodeConfig, Runtime, UserMessage
from torpor.cluster import desired_owner, shard_of

asyncpg = pytest.importorskip("asyncpg")

SHARDS = 8
TTL = 2.0

NODE1 = textwrap.dedent(
    """
    import asyncio, sys, logging, structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    from torpor import NodeConfig, Runtime, UserMessage
    from torpor.llm.protocol import TextDelta

    class Held:
        # Streams a little of the first turn, then never finishes it.
        name = "held"

        def __init__(self):
            self.streaming = asyncio.Event()

        async def stream(self, context, tools):
            yield TextDelta("partial ")
            self.streaming.set()
            await asyncio.Event().wait()

    async def main(url, conversation, ttl, shards):
        model = Held()
        node = NodeConfig(node_id="n1", address="127.0.0.1:7101", lease_ttl=ttl, shards=shards)
        async with Runtime(url, model=model, node=node) as rt:
            await rt.send(conversation, "hold on")
            await model.streaming.wait()
            second = await rt.send(conversation, "second")
            assert second.postponed
            print("postponed", flush=True)
            await asyncio.Event().wait()

    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))
    """
)


def n1_conversation() -> str:
    """A conversation whose shard stays with n1 once n2 has joined."""
    return next(
        c for c in (f"conv-{i}" for i in range(1000))
        if desired_owner(shard_of(c, SHARDS), ["n1", "n2"]) == "n1"
    )


async def n2_holds(rt: Runtime, shards: set[int]) -> None:
    """Until ``rt``'s node holds exactly ``shards`` (re-read at each lease refresh)."""
    assert rt._cluster is not None
    leases = rt._cluster.member.leases
    while set(leases.held) != shards or leases.leaving:
        await leases.next_change()


async def owner_of(url: str, shard: int) -> str:
    conn = await asyncpg.connect(url)
    try:
        return str(await conn.fetchval("SELECT owner FROM shard_leases WHERE shard = $1", shard))
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def n1_then_n2(
    pg_url: str, script: str, ready: bytes, conversation: str, address: str,
) -> AsyncIterator[tuple[asyncio.subprocess.Process, Runtime]]:
    """``script`` runs ``n1`` in a process of its own (arguments: the URL, the conversation,
    the lease TTL, the shard count); once it printed ``ready``, ``n2`` (this process, an
    echo model, at ``address``) joins and holds its share, the conversation's shard staying
    with ``n1``. Yields ``n1``'s process (kill it to hand over) and ``n2``."""
    n2_shards = {s for s in range(SHARDS) if desired_owner(s, ["n1", "n2"]) == "n2"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, pg_url, conversation, str(TTL), str(SHARDS),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        with anyio.fail_after(60):
            assert (await proc.stdout.readline()).strip() == ready
        node = NodeConfig(node_id="n2", address=address, lease_ttl=TTL, shards=SHARDS)
        async with Runtime(pg_url, model=EchoModel(), node=node) as n2:
            with anyio.fail_after(30):  # n1 hands n2 its shards; the conversation's stays
                await n2_holds(n2, n2_shards)
            assert await owner_of(pg_url, shard_of(conversation, SHARDS)) == "n1"
            yield proc, n2
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def epochs(url: str, conversation: str) -> list[int]:
    """The epoch each of the conversation's events was written under, in log order."""
    conn = await asyncpg.connect(url)
    try:
        return [r[0] for r in await conn.fetch(
            "SELECT e.epoch FROM events e JOIN conversations c ON c.key = e.conversation_id "
            "WHERE c.external_id = $1 ORDER BY e.position", conversation
        )]
    finally:
        await conn.close()


async def test_a_takeover_aborts_the_cut_turn_and_answers_the_postponed_message_unasked(
    pg_url: str,
) -> None:
    conversation = n1_conversation()
    async with n1_then_n2(pg_url, NODE1, b"postponed", conversation, "127.0.0.1:7102") as (
        proc, n2,
    ):
        left = await n2.store.read_since(conversation, 0)
        assert [e.body for e in left] == [UserMessage("hold on"), UserMessage("second")]
        proc.kill()
        await proc.wait()
        killed = time.monotonic()
        with anyio.fail_after(TTL + 30):  # nothing is sent: only the takeover re-drives
            await n2_holds(n2, set(range(SHARDS)))
            settled = await logged_until_answered(n2, conversation, after=1, turn=2)
        took = time.monotonic() - killed
        print(f"takeover and re-drive: {took:.2f} s after SIGKILL (lease TTL {TTL} s)")
    aborted, answer = settled
    assert isinstance(aborted.body, Aborted) and aborted.body.reason == "interrupted"
    assert (aborted.turn, aborted.position) == (1, 2)
    assert answer.body == AssistantMessage("echo: second") and answer.position == 3
    written = await epochs(pg_url, conversation)
    assert written[0] == written[1] < written[2] == written[3]  # n1's epoch, then n2's
