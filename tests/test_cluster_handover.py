"""Adversarial checks of the cluster's guarantees, two runtimes in one process (issue 12 review).

Against a real throwaway PostgreSQL with short TTLs: a node whose renewal is
blocked stops serving before any other node can take its shards; a suspension
awaiting approval survives a takeover (the new owner answers it, the old one
refuses); an idempotency key retried on the new owner returns the same turn; a
follower on a node losing the shard ends with ShardMoved; rebalancing on a join
moves only the shards the newcomer wins.
"""

from __future__ import annotations

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
    pg_url,
    until_split,
)

__all__ = ["pg_url"]  # the fixture, re-exported for pytest


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
