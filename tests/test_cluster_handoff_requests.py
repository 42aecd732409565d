"""Requests for a shard in hand-off are served once its lease lands (issue 20, item 4).

Three nodes served on 127.0.0.1 (real HTTP, the real httpx client, a throwaway PostgreSQL):
a and b split the shards, a turn is held on a shard of a that a third node c wins, and c
joins. a hands the shard off only once that turn ends, so for that while the shard is in
transit: a refuses it (leaving), c does not hold it yet. A request for it, whether it lands
on a, on b (which proxies it to a) or on c, waits for the lease to land and is then served
by c, instead of the 503 ``OwnerUnreachable`` it got before (a refused, c answered 421, one
retry).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import AsyncExitStack

import anyio
import pytest

from torpor import UserMessage
from torpor.cluster import desired_owner, shard_of

asyncpg = pytest.importorskip("asyncpg")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_cluster_leases import GateModel  # noqa: E402
from test_cluster_proxy import AUTH, SHARDS, Node, node, split  # noqa: E402

from torpor.serve.app import service_of  # noqa: E402
from torpor.serve.proxy import OWNER_HEADER  # noqa: E402
from torpor.store.postgres import PostgresStore  # noqa: E402

JSON = {**AUTH, "Accept": "application/json"}


class Waits(logging.Handler):
    """Counts the requests that started waiting for a shard in hand-off."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0
        self.changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("shard_in_handoff"):
            self.count += 1
            self.changed.set()


@pytest.fixture
def waits() -> Iterator[Waits]:
    handler = Waits()
    logger = logging.getLogger("torpor.serve")
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


def on_shard(shard: int, prefix: str) -> str:
    return next(c for c in (f"{prefix}{i}" for i in range(9999)) if shard_of(c, SHARDS) == shard)


async def until_leaving(n: Node, shard: int) -> None:
    assert n.rt._cluster is not None
    leases = n.rt._cluster.member.leases
    with anyio.fail_after(20):
        while shard not in leases.leaving:
            await leases.next_change()


async def test_requests_for_a_shard_in_hand_off_are_served_by_the_new_owner(
    pg_url: str, waits: Waits
) -> None:
    async with PostgresStore(pg_url):  # the schema first, so the nodes do not race on it
        pass
    model = GateModel()
    async with node(pg_url, "a", model) as a, node(pg_url, "b", model) as b, \
            httpx.AsyncClient(timeout=30) as client:
        held = await split(a, b)
        # A shard of a that c wins once it joins (rendezvous hashing: the same on every node).
        shard = next(s for s in sorted(held["a"]) if desired_owner(s, ["a", "b", "c"]) == "c")
        slow = on_shard(shard, "slow")
        started = await client.post(f"{a.url}/v1/conversations/{slow}/messages",
                                    json={"text": "hold the shard"}, headers=JSON)
        assert started.status_code == 202
        with anyio.fail_after(10):
            await model.streaming.wait()

        async with node(pg_url, "c", model) as c:
            await until_leaving(a, shard)  # a hands it off once the held turn ends

            async def send(via: Node, cid: str) -> httpx.Response:
                # No Idempotency-Key: waiting out a hand-off never needs to repeat a request.
                return await client.post(f"{via.url}/v1/conversations/{cid}/messages",
                                         json={"text": "in transit"}, headers=JSON)

            # To the old owner, to a node that proxies to it, and to the newcomer.
            cids = {n.name: on_shard(shard, f"via-{n.name}-") for n in (a, b, c)}
            requests = [asyncio.create_task(send(n, cids[n.name])) for n in (a, b, c)]
            with anyio.fail_after(20):  # until all three wait (or one was answered at once)
                while waits.count < 3 and not any(r.done() for r in requests):
                    waits.changed.clear()
                    done = asyncio.ensure_future(waits.changed.wait())
                    await asyncio.wait({done, *requests}, return_when=asyncio.FIRST_COMPLETED)
                    done.cancel()
            answered_at_once = [r.result().status_code for r in requests if r.done()]
            assert answered_at_once == [], "answered before the hand-off ended"

            model.release.set()  # the held turn ends: a lets the shard go, c acquires it
            with anyio.fail_after(20):
                responses = await asyncio.gather(*requests)
            for via, response in zip("abc", responses, strict=True):
                assert response.status_code == 202, (via, response.status_code, response.text)
            c_address = c.url.removeprefix("http://")
            assert responses[0].headers[OWNER_HEADER] == c_address  # a proxied to c
            assert responses[1].headers[OWNER_HEADER] == c_address  # b proxied to c
            assert OWNER_HEADER not in responses[2].headers  # c served it itself
            view = await c.rt.admin.cluster()
            assert view is not None and shard in view.shards
        async with PostgresStore(pg_url) as store:
            for cid in cids.values():  # each message logged once
                events = await store.read_since(cid, 0)
                assert [type(e.body) for e in events if e.kind == "user"] == [UserMessage]


async def test_a_proxied_request_is_not_given_up_while_its_owner_hands_the_shard_off(
    pg_url: str,
) -> None:
    """The watch that gives up on a paused owner (item 7) stays quiet while the owner is
    alive and hands the shard off: that owner answers (421 naming the new one), and a
    request that is not safe to repeat must not be refused for it."""
    async with PostgresStore(pg_url):
        pass
    model = GateModel()
    async with AsyncExitStack() as outer:
        a = await outer.enter_async_context(node(pg_url, "a", model))
        async with node(pg_url, "b", model) as b:
            held = await split(a, b)
            shard = next(s for s in sorted(held["a"])
                         if desired_owner(s, ["a", "b", "c"]) == "c")
            cid = on_shard(shard, "w")
            a_address = a.url.removeprefix("http://")
            watch = asyncio.create_task(b.rt.admin.moved(cid, a_address))
            async with node(pg_url, "c", model) as c:
                c_address = c.url.removeprefix("http://")
                assert b.rt._cluster is not None
                leases = b.rt._cluster.member.leases
                with anyio.fail_after(20):  # b's cache sends the conversation to c now
                    while (await b.rt.admin.route(cid)).owner != c_address:  # type: ignore[union-attr]
                        await leases.next_change()
                for _ in range(2):  # and the watch has looked at that
                    await leases.next_change()
                assert not watch.done(), "gave up on a live owner handing off"
                await outer.aclose()  # a leaves: its node row expires at once
                with anyio.fail_after(20):
                    route = await watch
                assert route is not None and route.owner == c_address


async def test_a_draining_node_hands_its_shards_off_and_proxies_instead_of_refusing(
    pg_url: str,
) -> None:
    """Graceful shutdown of a served cluster node (what SIGTERM under ``torpor serve``
    starts): it begins leaving the cluster at once, so while a turn of one of its shards
    finishes, its other shards are already served by the node that stays, and a request
    that still reaches it is proxied there (202), not refused with 503 ``Draining``. The
    turn may run for the drain's grace, not only the (here zero) rebalancing deadline."""
    async with PostgresStore(pg_url):
        pass
    model = GateModel()
    async with node(pg_url, "a", model, handoff_deadline=0.0) as a, \
            node(pg_url, "b", model) as b, httpx.AsyncClient(timeout=30) as client:
        held = await split(a, b)
        busy, idle = sorted(held["a"])[:2]
        slow = on_shard(busy, "slow")
        started = await client.post(f"{a.url}/v1/conversations/{slow}/messages",
                                    json={"text": "hold the shard"}, headers=JSON)
        assert started.status_code == 202
        with anyio.fail_after(10):
            await model.streaming.wait()
        draining = service_of(a.app).shutdown(10.0)
        assert b.rt._cluster is not None
        leases_b = b.rt._cluster.member.leases
        with anyio.fail_after(20):  # the idle shard moves while the held turn still runs
            while idle not in leases_b.held:
                await leases_b.next_change()
        assert not draining.done()
        late = await client.post(f"{a.url}/v1/conversations/{on_shard(idle, 'late')}/messages",
                                 json={"text": "still here?"}, headers=JSON)
        assert late.status_code == 202, late.text
        assert late.headers[OWNER_HEADER] == b.url.removeprefix("http://")
        model.release.set()
        with anyio.fail_after(20):
            await draining
        with anyio.fail_after(20):  # and the busy shard follows once its turn ended
            while busy not in leases_b.held:
                await leases_b.next_change()
        events = await b.rt.history(slow)
        assert [type(e.body).__name__ for e in reversed(events)] == [
            "UserMessage", "AssistantMessage"]  # finished where it ran, not cut off
