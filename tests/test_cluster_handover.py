"""Adversarial checks of the cluster's guarantees, two runtimes in one process (issue 12 review).

Against a real throwaway PostgreSQL with short TTLs: a node whose renewal is
blocked stops serving before any other node can take its shards; a suspension
awaiting approval survives a takeover (the new owner answers it, the old one
refuses); an idempotency key retried on the new owner returns the same turn; a
follower on a node losing the shard ends with ShardMoved; rebalancing on a join
moves only the shards the newcomer wins.
"""

from __future__ import annotations

import contextlib
import time

import anyio
import pytest

import torpor
from torpor import (
    AgentConfig,
    AssistantMessage,
    ExternalTool,
    Resolved,
    Runtime,
    ScriptedModel,
    Suspended,
    ToolResult,
    UserMessage,
)
from torpor.cluster import desired_owner, shard_of
from torpor.cluster.leases import Leases
from torpor.llm import Call, Text

asyncpg = pytest.importorskip("asyncpg")

from tests.test_cluster_leases import (  # noqa: E402
    SHARDS,
    next_refresh,
    node,
    until_split,
)


def conversation_in(shards: set[int] | dict[int, int], prefix: str = "x") -> str:
    return next(c for c in (f"{prefix}{i}" for i in range(999)) if shard_of(c, SHARDS) in shards)


def leases_of(rt: Runtime) -> Leases:
    assert rt._cluster is not None
    return rt._cluster.member.leases


async def test_a_node_whose_renewal_is_blocked_stops_serving_before_another_can_take_over(
    pg_url: str,
) -> None:
    async with Runtime(pg_url, node=node("a", 7001)) as a, \
            Runtime(pg_url, node=node("b", 7002)) as b:
        held_a, _ = await until_split(a, b)
        mine = set(held_a)
        cid = conversation_in(mine)
        blocker = await asyncpg.connect(pg_url)
        try:
            tx = blocker.transaction()
            await tx.start()  # a's renewal statement waits on its node row (lock_timeout)
            await blocker.execute("SELECT 1 FROM nodes WHERE node_id = 'a' FOR UPDATE")
            la, lb = leases_of(a), leases_of(b)
            with anyio.fail_after(15):
                while not mine <= set(lb.held):
                    # Whenever b holds one of a's shards, a stopped serving it before.
                    for shard in mine & set(lb.held):
                        assert not la.serving(shard)
                        assert time.monotonic() >= la.valid_until
                    await next_refresh(b)
            with pytest.raises(torpor.NotOwner) as refused:
                await a.send(cid, "still yours?")
            assert refused.value.owner in (None, "127.0.0.1:7002")
            assert (await (await b.send(cid, "b serves")).result()).text == "echo: b serves"
            await tx.rollback()
        finally:
            await blocker.close()


APPROVE = ExternalTool("approve", "Ask a human to approve a payment.")


def wins(newcomer: str, prefix: str) -> str:
    """A conversation whose shard ``newcomer`` wins once it joins ``a``."""
    return next(c for c in (f"{prefix}{i}" for i in range(999))
                if desired_owner(shard_of(c, SHARDS), ["a", newcomer]) == newcomer)


async def until_served(rt: Runtime, cid: str) -> None:
    with anyio.fail_after(15):
        while not leases_of(rt).serving(shard_of(cid, SHARDS)):
            await next_refresh(rt)


async def test_a_suspension_and_a_keyed_send_survive_a_hand_off_to_the_new_owner(
    pg_url: str,
) -> None:
    suspended, keyed = wins("b", "s"), wins("b", "k")
    asking = ScriptedModel([[Text("asking "), Call("approve", {"amount": 42}, id="pay-1")],
                            [Text("first answer")]])
    agent = AgentConfig(tools=[APPROVE])
    async with Runtime(pg_url, model=asking, agent=agent, node=node("a", 7001)) as a:
        outcome = await (await a.send(suspended, "pay my bill")).result()
        assert isinstance(outcome, Suspended) and outcome.call_ids == ("pay-1",)
        first = await a.send(keyed, "only once", key="k-1")
        assert (await first.result()).text == "first answer"
        follower = a.subscribe(suspended)
        later = ScriptedModel([[Text("paid")]])
        async with Runtime(pg_url, model=later, agent=agent, node=node("b", 7002)) as b:
            await until_served(b, suspended)
            await until_served(b, keyed)
            # The follower on the node that handed the shard off ends, pointing at b.
            with pytest.raises(torpor.ShardMoved) as moved, anyio.fail_after(5):
                async for _ in follower:
                    pass
            assert moved.value.owner == "127.0.0.1:7002"
            # The old owner refuses the approval (nothing written); the new one answers it.
            with pytest.raises(torpor.NotOwner) as refused:
                await a.resolve(suspended, "pay-1", "approved")
            assert refused.value.owner == "127.0.0.1:7002"
            continuation = await b.resolve(suspended, "pay-1", "approved")
            assert continuation is not None
            assert (await continuation.result()).text == "paid"
            # A client retrying its keyed send on the new owner gets the same turn back.
            again = await b.send(keyed, "only once", key="k-1")
            assert again.number == first.number
            assert (await again.result()).text == "first answer"
            log = await b.history(keyed, limit=20)
            assert [e.body for e in log if isinstance(e.body, UserMessage)] == [
                UserMessage("only once")
            ]
            kinds = [type(e.body) for e in reversed(await b.history(suspended, limit=20))]
            assert kinds == [UserMessage, AssistantMessage, Suspended, ToolResult, Resolved,
                             AssistantMessage]


async def epochs_and_owners(url: str) -> dict[int, tuple[int, str | None]]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT shard, epoch, owner FROM shard_leases ORDER BY shard")
    finally:
        await conn.close()
    return {r[0]: (r[1], r[2]) for r in rows}


async def until_owned_by_rendezvous(url: str, nodes: list[str], *runtimes: Runtime) -> None:
    with anyio.fail_after(15):
        while True:
            table = await epochs_and_owners(url)
            if all(owner == desired_owner(s, nodes) for s, (_, owner) in table.items()) and all(
                not leases_of(rt).leaving for rt in runtimes
            ):
                return
            await next_refresh(runtimes[0])


async def test_a_join_moves_only_the_shards_the_newcomer_wins(pg_url: str) -> None:
    async with Runtime(pg_url, node=node("a", 7001)) as a, \
            Runtime(pg_url, node=node("b", 7002)) as b:
        await until_owned_by_rendezvous(pg_url, ["a", "b"], a, b)
        before = await epochs_and_owners(pg_url)
        async with Runtime(pg_url, node=node("c", 7003)) as c:
            await until_owned_by_rendezvous(pg_url, ["a", "b", "c"], a, b, c)
            for _ in range(3):  # and it stays so: nothing moves back and forth
                await next_refresh(a)
                await next_refresh(c)
            after = await epochs_and_owners(pg_url)
    moved = {s for s in before if after[s] != before[s]}
    assert moved == {s for s in before if desired_owner(s, ["a", "b", "c"]) == "c"}
    assert moved and all(after[s][0] == before[s][0] + 1 for s in moved)  # one move each


async def test_a_graceful_leave_under_load_loses_and_duplicates_nothing(pg_url: str) -> None:
    per_conversation = 6
    owners_seen: list[str | None] = []
    acked: list[str] = []
    async with Runtime(pg_url, node=node("a", 7001)) as a:
        b = Runtime(pg_url, node=node("b", 7002))
        await b.__aenter__()
        try:
            _, held_b = await until_split(a, b)
            cids = [c for c in (f"l{i}" for i in range(200)) if shard_of(c, SHARDS) in held_b][:12]
            by_address = {"127.0.0.1:7001": a, "127.0.0.1:7002": b}
            halfway = anyio.Event()

            async def send(cid: str, text: str) -> torpor.Turn:
                target = b
                while True:
                    try:  # keyed: a retry after an ambiguous failure appends nothing
                        return await target.send(cid, text, key=text)
                    except torpor.RuntimeClosed:  # b is leaving or gone
                        target = a
                        await next_refresh(a)
                    except torpor.NotOwner as exc:
                        if target is b:
                            owners_seen.append(exc.owner)
                        target = by_address.get(exc.owner or "", a)
                        if exc.owner is None or exc.moving or not b._open:
                            # In hand-off (or a's cache is a second behind): wait for it to land
                            target = a
                            await next_refresh(a)

            async def drive(cid: str) -> None:
                for i in range(per_conversation):
                    turn = await send(cid, f"{cid}-{i}")
                    acked.append(f"{cid}-{i}")  # in the log now
                    with contextlib.suppress(torpor.TurnAborted):  # cut by the hand-off
                        await turn.result()
                    if len(acked) >= len(cids) * 2:
                        halfway.set()

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    for cid in cids:
                        tg.start_soon(drive, cid)
                    await halfway.wait()
                    await b.__aexit__(None, None, None)  # leaves with sends in flight
        finally:
            await b.__aexit__(None, None, None)
        assert len(acked) == len(cids) * per_conversation
        for cid in cids:
            texts = [e.body.text for e in await a.store.read_since(cid, 0)
                     if isinstance(e.body, UserMessage)]
            assert texts == [f"{cid}-{i}" for i in range(per_conversation)]
    # Requests refused during the leave named the node taking over, not nobody.
    assert owners_seen and set(owners_seen) == {"127.0.0.1:7001"}, owners_seen
