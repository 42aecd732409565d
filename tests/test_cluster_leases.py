"""Shard leases and fencing against a real throwaway PostgreSQL (issue 12).

The store level: an append whose lease epoch is stale fails alone with
FencedError while the rest of its batch commits; a takeover waits for an append
in flight; a stopped process's share lock is ended by the server
(idle_in_transaction_session_timeout), not held through the takeover. The
runtime level: two nodes split the shards, refuse each other's conversations
with NotOwner naming the owner, hand off on leave, and a node that loses a
shard mid-turn fails the turn with ShardMoved, its late append is fenced, and
the turn is logged Aborted(interrupted) on revival.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from asyncio.subprocess import Process
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import pytest

import torpor
from torpor import Aborted, AgentConfig, AssistantMessage, NodeConfig, Runtime, UserMessage
from torpor.cluster import desired_owner, shard_of, sql
from torpor.llm.protocol import ContextMessage, StreamEvent, TextDelta, ToolSpec

asyncpg = pytest.importorskip("asyncpg")

from torpor.store.postgres import PostgresStore  # noqa: E402
from torpor.store.postgres.statements import LOCK_FENCED  # noqa: E402
from torpor.store.postgres.store import node_session_settings  # noqa: E402

SHARDS = 8


class FixedFence:
    """A fence that presents fixed epochs (what a node believes it holds)."""

    idle_timeout = 5.0

    def __init__(self, epochs: dict[int, int]) -> None:
        self.epochs = epochs
        self.refused: list[tuple[int, int]] = []

    def hold(self, conversation_id: str) -> tuple[int, int]:
        shard = shard_of(conversation_id, SHARDS)
        return shard, self.epochs[shard]

    def fenced(self, shard: int, epoch: int) -> None:
        self.refused.append((shard, epoch))


def ids_in_distinct_shards(count: int) -> list[str]:
    found: dict[int, str] = {}
    n = 0
    while len(found) < count:
        name = f"conv-{n}"
        found.setdefault(shard_of(name, SHARDS), name)
        n += 1
    return list(found.values())


async def leases_table(url: str, epoch: int = 1) -> None:
    async with PostgresStore(url):  # migrates
        pass
    conn = await asyncpg.connect(url)
    try:  # every shard held by a live node n1 (a lease lives as long as its node's row)
        await conn.execute(
            "INSERT INTO nodes VALUES ('n1', 1, '127.0.0.1:1', now() + interval '1 hour')"
        )
        await conn.execute(
            "INSERT INTO shard_leases (shard, owner, owner_incarnation, epoch) "
            "SELECT g, 'n1', 1, $2 FROM generate_series(0, $1 - 1) g",
            SHARDS, epoch,
        )
    finally:
        await conn.close()


async def test_a_stale_epoch_fails_its_op_alone_and_the_rest_of_the_batch_commits(
    pg_url: str,
) -> None:
    await leases_table(pg_url)
    a, b = ids_in_distinct_shards(2)
    sa, sb = shard_of(a, SHARDS), shard_of(b, SHARDS)
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("UPDATE shard_leases SET epoch = 2 WHERE shard = $1", sb)
        fence = FixedFence({s: 1 for s in range(SHARDS)})
        async with PostgresStore(pg_url, fence=fence) as store:
            writer = store._writer
            assert writer is not None
            before = writer.batches
            results = await asyncio.gather(
                store.append(a, [UserMessage("kept")], turn=1),
                store.append(b, [UserMessage("refused")], turn=1),
                return_exceptions=True,
            )
            assert writer.batches == before + 1  # one batch held both ops
            assert results[0] == [0]
            assert isinstance(results[1], torpor.FencedError)
            assert (results[1].shard, results[1].epoch) == (sb, 1)
            assert fence.refused == [(sb, 1)]
            assert await store.head(b) is None  # nothing of the refused op, not even its row
            assert [e.body for e in await store.read_since(a, 0)] == [UserMessage("kept")]
        rows = await conn.fetch(
            "SELECT c.shard, e.epoch FROM events e JOIN conversations c "
            "ON c.key = e.conversation_id"
        )
        assert [tuple(r) for r in rows] == [(sa, 1)]
    finally:
        await conn.close()


async def test_a_single_node_store_writes_no_epoch_and_no_shard(pg_url: str) -> None:
    async with PostgresStore(pg_url) as store:
        await store.append("solo", [UserMessage("hi")], turn=1)
    conn = await asyncpg.connect(pg_url)
    try:
        row = await conn.fetchrow(
            "SELECT c.shard, e.epoch FROM events e JOIN conversations c "
            "ON c.key = e.conversation_id"
        )
        assert tuple(row) == (None, None)
    finally:
        await conn.close()


async def expire_node(conn: Any, node_id: str) -> None:
    """The node stopped renewing: its row, and so every lease it holds, ran out."""
    await conn.execute(
        "UPDATE nodes SET lease_until = now() - interval '1 second' WHERE node_id = $1", node_id
    )


async def test_a_takeover_skips_the_row_of_an_append_in_flight_and_fences_the_next(
    pg_url: str,
) -> None:
    await leases_table(pg_url)
    (a,) = ids_in_distinct_shards(1)
    shard = shard_of(a, SHARDS)
    fence = FixedFence({s: 1 for s in range(SHARDS)})
    holder = await asyncpg.connect(pg_url)
    taker = await asyncpg.connect(pg_url, server_settings={"lock_timeout": "200"})
    try:
        await taker.execute(
            "INSERT INTO nodes VALUES ('n2', 1, '127.0.0.1:2', now() + interval '1 hour')"
        )
        await expire_node(taker, "n1")  # n1's leases ran out: n2 may take the shard
        async with PostgresStore(pg_url, fence=fence) as store:
            await store.append(a, [UserMessage("first")], turn=1)
            tx = holder.transaction()
            await tx.start()  # an append batch of n1, between its lock and its commit
            await holder.fetch(LOCK_FENCED, [a], [], [shard])
            # Left for a later pass, at once: no wait that could hold up other shards.
            assert await taker.fetch(sql.ACQUIRE, "n2", 1, [shard]) == []
            await tx.commit()
            acquired = await taker.fetch(sql.ACQUIRE, "n2", 1, [shard])
            assert [(r[0], r[1], r[2]) for r in acquired] == [(shard, 2, "n1")]
            with pytest.raises(torpor.FencedError):
                await store.append(a, [UserMessage("after the takeover")], turn=2)
            assert [e.position for e in await store.read_since(a, 0)] == [0]
    finally:
        for conn in (holder, taker):
            await conn.close()


async def test_a_live_nodes_leases_are_not_taken_and_an_expired_ones_are(pg_url: str) -> None:
    await leases_table(pg_url)
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(
            "INSERT INTO nodes VALUES ('n2', 1, '127.0.0.1:2', now() + interval '1 hour')"
        )
        assert await conn.fetch(sql.ACQUIRE, "n2", 1, [0, 1]) == []
        await expire_node(conn, "n1")
        acquired = await conn.fetch(sql.ACQUIRE, "n2", 1, [0, 1])
        assert sorted((r[0], r[1], r[2]) for r in acquired) == [(0, 2, "n1"), (1, 2, "n1")]
        # n1 comes back (renews the same incarnation): what nobody took is live again and
        # its own; what n2 took says so.
        alive, shards, epochs = await conn.fetchrow(sql.RENEW, "n1", 1, 10.0)
        held = dict(zip(shards, epochs, strict=True))
        assert alive and 0 not in held and 1 not in held and held[2] == 1
        assert await conn.fetch(sql.ACQUIRE, "n2", 1, [2]) == []
    finally:
        await conn.close()


_HOLDER = """
import asyncio, sys
import asyncpg
from torpor.store.postgres.store import node_session_settings

async def main(url, shard, settings):
    conn = await asyncpg.connect(url, server_settings=settings)
    await conn.execute("BEGIN")
    await conn.fetch("SELECT epoch FROM shard_leases WHERE shard = $1 FOR SHARE", shard)
    print("locked", flush=True)
    await asyncio.sleep(60)

settings = node_session_settings(0.3) if sys.argv[3] == "node" else {}
asyncio.run(main(sys.argv[1], int(sys.argv[2]), settings))
"""


async def lock_in_stopped_process(url: str, shard: int, mode: str) -> Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLDER, url, str(shard), mode, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    with anyio.fail_after(30):
        line = await proc.stdout.readline()
    assert line.strip() == b"locked"
    os.kill(proc.pid, signal.SIGSTOP)
    return proc


async def reap(proc: Process) -> None:
    proc.kill()  # SIGKILL ends a stopped process too
    await proc.wait()


async def test_a_stopped_nodes_share_lock_is_ended_by_the_server_not_held_through_takeover(
    pg_url: str,
) -> None:
    await leases_table(pg_url)
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(
            "INSERT INTO nodes VALUES ('n2', 1, '127.0.0.1:2', now() + interval '1 hour')"
        )
        await expire_node(conn, "n1")
        # A stopped session without the node settings on shard 0 (the control), a node's
        # session on shard 1: the server ends the node's idle transaction and the takeover
        # goes through; the control still holds its row after that.
        plain = await lock_in_stopped_process(pg_url, 0, "plain")
        stopped = await lock_in_stopped_process(pg_url, 1, "node")
        try:
            with anyio.fail_after(30):
                while True:  # polling, as a takeover's next pass does
                    acquired = await conn.fetch(sql.ACQUIRE, "n2", 1, [1])
                    if acquired:
                        break
                    await asyncio.sleep(0.05)
            assert [(r[0], r[1]) for r in acquired] == [(1, 2)]
            assert await conn.fetch(sql.ACQUIRE, "n2", 1, [0]) == []
        finally:
            await reap(stopped)
            await reap(plain)
    finally:
        await conn.close()


def test_node_session_settings_bound_idle_transactions_and_keep_connections_alive() -> None:
    settings = node_session_settings(0.75)
    assert settings["idle_in_transaction_session_timeout"] == "750"
    assert {"tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count"} <= set(
        settings
    )


# -- two runtimes as nodes -------------------------------------------------------------------


class GateModel:
    """Streams "partial", then waits for ``release`` before finishing (unless ``open``)."""

    name = "gate"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.streaming = asyncio.Event()

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        text = context[-1].text if isinstance(context[-1], UserMessage) else ""
        if text.startswith("hold"):
            yield TextDelta("partial ")
            self.streaming.set()
            await self.release.wait()
        yield TextDelta(f"re: {text}")


def node(name: str, port: int) -> NodeConfig:
    return NodeConfig(node_id=name, address=f"127.0.0.1:{port}", lease_ttl=1.0, shards=SHARDS)


async def next_refresh(rt: Runtime) -> None:
    """Until ``rt``'s node reads the lease table again or changes what it holds."""
    assert rt._cluster is not None
    await rt._cluster.member.leases.next_change()


async def until_split(*runtimes: Runtime) -> list[dict[int, int]]:
    """Until the nodes' shards partition all shards (each node serving some)."""
    with anyio.fail_after(15):
        while True:
            views = [await rt.admin.cluster() for rt in runtimes]
            held = [v.shards for v in views if v is not None]
            if all(held) and sum(len(h) for h in held) == SHARDS and not any(
                v.leaving for v in views if v is not None
            ):
                return held
            await next_refresh(runtimes[0])


async def test_two_nodes_split_the_shards_refuse_each_others_conversations_and_hand_off(
    pg_url: str,
) -> None:
    async with Runtime(pg_url, node=node("a", 7001)) as a:
        view = await a.admin.cluster()
        assert view is not None and len(view.shards) == SHARDS  # alone: every shard
        async with Runtime(pg_url, node=node("b", 7002)) as b:
            held_a, held_b = await until_split(a, b)
            ca = next(c for c in (f"x{i}" for i in range(99)) if shard_of(c, SHARDS) in held_a)
            cb = next(c for c in (f"x{i}" for i in range(99)) if shard_of(c, SHARDS) in held_b)
            with pytest.raises(torpor.NotOwner) as refused:
                await a.send(cb, "wrong node")
            assert refused.value.owner == "127.0.0.1:7002"
            with pytest.raises(torpor.NotOwner):
                b.subscribe(ca)
            with pytest.raises(torpor.NotOwner):
                await b.cancel(ca)
            with pytest.raises(torpor.NotOwner):
                await b.resolve(ca, "call-1", "result")
            assert (await (await a.send(ca, "one")).result()).text == "echo: one"
            assert (await (await b.send(cb, "two")).result()).text == "echo: two"
            members = {m.node_id for m in (await b.admin.cluster() or view).members if m.live}
            assert members == {"a", "b"}
        # b left gracefully: its shards come to a, with their logs.
        with anyio.fail_after(10):
            while len((await a.admin.cluster() or view).shards) < SHARDS:
                await next_refresh(a)
        assert (await (await a.send(cb, "three")).result()).text == "echo: three"
        texts = [getattr(e.body, "text", None) for e in await a.history(cb, limit=10)]
        assert texts[::-1] == ["two", "echo: two", "three", "echo: three"]
    conn = await asyncpg.connect(pg_url)
    try:
        epochs = await conn.fetch(
            "SELECT e.epoch, c.shard FROM events e JOIN conversations c "
            "ON c.key = e.conversation_id WHERE c.external_id = $1 ORDER BY e.position", cb
        )
        assert epochs[0][0] < epochs[-1][0]  # b's epoch, then a's after the hand-off
        assert len({r[1] for r in epochs}) == 1
    finally:
        await conn.close()


async def test_a_lost_lease_fails_the_turn_with_shard_moved_fences_its_abort_and_revival_logs_it(
    pg_url: str,
) -> None:
    model = GateModel()
    async with Runtime(pg_url, model=model, node=node("a", 7001)) as rt:
        turn = await rt.send("c", "hold on")
        await model.streaming.wait()
        shard = shard_of("c", SHARDS)
        conn = await asyncpg.connect(pg_url)
        try:  # another node took the shard over (and its lease already ran out)
            await conn.execute(  # no node row: the ghost's lease is not live
                "UPDATE shard_leases SET owner = 'ghost', owner_incarnation = 1, "
                "epoch = epoch + 1 WHERE shard = $1", shard
            )
        finally:
            await conn.close()
        with pytest.raises(torpor.ShardMoved), anyio.fail_after(10):
            await turn.result()
        model.release.set()
        with anyio.fail_after(10):  # a takes the expired lease back, with a new epoch
            while True:
                try:
                    again = await rt.send("c", "again")
                    break
                except torpor.NotOwner:
                    await next_refresh(rt)
        assert (await again.result()).text == "re: again"
        events = await rt.history("c", limit=10)
        view = await rt.admin.cluster()
        # The cut-off turn's own Aborted was refused: its epoch was no longer current.
        assert view is not None and view.fenced_appends >= 1 and view.shards[shard] >= 3
    bodies = [e.body for e in reversed(events)]
    assert bodies[0] == UserMessage("hold on")
    assert isinstance(bodies[1], Aborted) and bodies[1].reason == "interrupted"
    assert bodies[2] == UserMessage("again")
    assert isinstance(bodies[3], AssistantMessage) and bodies[3].text == "re: again"
    assert len(bodies) == 4  # nothing of the fenced turn's own abort landed


async def test_consolidate_on_a_node_that_does_not_own_the_conversation_raises_not_owner(
    pg_url: str,
) -> None:
    a_node, b_node = node("a", 7001), node("b", 7002)
    async with Runtime(pg_url, node=a_node) as a, Runtime(pg_url, node=b_node) as b:
        await consolidate_elsewhere(a, b)


async def consolidate_elsewhere(a: Runtime, b: Runtime) -> None:
    """``a`` consolidates a conversation of ``b``'s, with facts its sweep would update."""
    from torpor.store.memory import SemanticItem

    held_b = (await until_split(a, b))[1]
    cid = next(c for c in (f"x{i}" for i in range(99)) if shard_of(c, SHARDS) in held_b)
    await (await b.send(cid, "hello")).result()
    facts = [SemanticItem(2, 0, "db", "fact", "postgres 14", confidence=0.8),
             SemanticItem(6, 0, "db", "fact", "postgres 16", confidence=0.8)]
    await b.store.put_memory(cid, facts=facts)
    with pytest.raises(torpor.NotOwner) as refused:  # not FencedError from its write
        await a.consolidate(cid)
    assert refused.value.owner == "127.0.0.1:7002"
    assert (await b.store.memory(cid)).ledger == ()  # a wrote nothing
    assert [d.action for d in (await b.consolidate(cid)).decisions] == ["update"]


@pytest.mark.parametrize("request_name", ["resolve", "cancel"])
async def test_a_shard_lost_while_resolve_or_cancel_reads_the_store_gives_not_owner(
    pg_url: str, request_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ownership check passes, then the store read (the conversation is not in memory)
    yields and the shard moves meanwhile: the request must not revive an agent here."""
    cid = "moving"
    async with Runtime(pg_url, node=node("a", 7001)) as a:
        await (await a.send(cid, "hello")).result()
    async with Runtime(pg_url, node=node("a", 7001)) as a:  # its leases back, nothing in memory
        assert a._registry.get(cid) is None
        read = a.store.head

        async def head_then_lose_the_shard(conversation_id: str) -> Any:
            answer = await read(conversation_id)
            conn = await asyncpg.connect(pg_url)
            try:  # another node takes the shard over, with a lease that stays live
                await conn.execute(
                    "INSERT INTO nodes VALUES ('ghost', 1, '127.0.0.1:9', "
                    "now() + interval '1 hour') ON CONFLICT DO NOTHING"
                )
                await conn.execute(
                    "UPDATE shard_leases SET owner = 'ghost', owner_incarnation = 1, "
                    "epoch = epoch + 1 WHERE shard = $1", shard_of(cid, SHARDS)
                )
            finally:
                await conn.close()
            with anyio.fail_after(10):
                while a._cluster is not None and a._cluster.serves(cid):
                    await next_refresh(a)
            return answer

        monkeypatch.setattr(a.store, "head", head_then_lose_the_shard)
        with pytest.raises(torpor.NotOwner):
            if request_name == "resolve":
                await a.resolve(cid, "call-1", "result")
            else:
                await a.cancel(cid)
        assert a._registry.get(cid) is None  # no agent revived for a shard it lost


def test_node_config_is_validated() -> None:
    with pytest.raises(torpor.ConfigError, match="address"):
        NodeConfig(node_id="a", address="nohost")
    with pytest.raises(torpor.ConfigError, match="shards"):
        NodeConfig(node_id="a", address="h:1", shards=0)
    with pytest.raises(torpor.ConfigError, match="node"):
        Runtime("sqlite://", node=NodeConfig(node_id="a", address="h:1"))
    assert time.monotonic() > 0


async def test_a_node_without_a_shard_count_adopts_the_clusters_and_a_different_one_is_refused(
    pg_url: str,
) -> None:
    async with Runtime(pg_url, node=node("a", 7001)) as a:  # creates the cluster with SHARDS
        joiner = NodeConfig(node_id="b", address="127.0.0.1:7002", lease_ttl=1.0)
        assert joiner.shards is None
        async with Runtime(pg_url, node=joiner) as b:
            view = await b.admin.cluster()
            assert view is not None and view.shard_count == SHARDS
            _, held_b = await until_split(a, b)
            mine = next(c for c in (f"x{i}" for i in range(99)) if shard_of(c, SHARDS) in held_b)
            assert (await (await b.send(mine, "hi")).result()).text == "echo: hi"
        wrong = NodeConfig(node_id="c", address="127.0.0.1:7003", lease_ttl=1.0, shards=16)
        with pytest.raises(torpor.ConfigError, match=f"created with {SHARDS} shards, not 16"):
            async with Runtime(pg_url, node=wrong):
                pass


async def test_the_first_node_without_a_shard_count_creates_the_cluster_with_512(
    pg_url: str,
) -> None:
    first = NodeConfig(node_id="a", address="127.0.0.1:7001", lease_ttl=1.0)
    async with Runtime(pg_url, node=first) as rt:
        view = await rt.admin.cluster()
        assert view is not None and view.shard_count == 512 == len(view.shards)


async def torpor_cli(*args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TORPOR_DB"}
    env["COLUMNS"] = "120"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "torpor", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_torpor_inspect_cluster_prints_the_members_and_the_lease_table(
    pg_url: str, tmp_path: Any
) -> None:
    async with Runtime(pg_url, node=node("a", 7001)):
        code, out, err = await torpor_cli("inspect", "--db", pg_url, "--cluster", "--json", "-")
        assert code == 0, err
        data = json.loads(out)
        assert [(m["node_id"], m["live"]) for m in data["members"]] == [("a", True)]
        assert [(r["shard"], r["owner"], r["epoch"], r["live"]) for r in data["leases"]] == [
            (s, "a", 1, True) for s in range(SHARDS)
        ]
        code, out, err = await torpor_cli("inspect", "--db", pg_url, "--cluster")
        assert code == 0, err
        assert "shard leases" in out and "127.0.0.1:7001" in out
    code, _, err = await torpor_cli("inspect", "--db", f"sqlite:///{tmp_path}/x.db", "--cluster")
    assert code != 0 and "postgresql://" in err


async def test_rebalancing_on_join_lets_the_turn_in_flight_finish_before_the_shard_moves(
    pg_url: str,
) -> None:
    model = GateModel()
    cid = next(c for c in (f"r{i}" for i in range(999))
               if desired_owner(shard_of(c, SHARDS), ["a", "b"]) == "b")
    async with Runtime(pg_url, model=model, node=node("a", 7001)) as a:
        turn = await a.send(cid, "hold this")
        await model.streaming.wait()
        async with Runtime(pg_url, node=node("b", 7002)) as b:
            with anyio.fail_after(10):  # a hands off: new requests refused, the turn runs on
                while shard_of(cid, SHARDS) not in (await a.admin.cluster() or _none()).leaving:
                    await next_refresh(a)
            with pytest.raises(torpor.NotOwner) as refused:
                await a.send(cid, "not now")
            assert refused.value.owner == "127.0.0.1:7002"
            model.release.set()
            assert (await turn.result()).text == "partial re: hold this"  # finished, not cut
            with anyio.fail_after(10):
                while True:
                    try:
                        answer = await (await b.send(cid, "then here")).result()
                        break
                    except torpor.NotOwner:
                        await next_refresh(b)
            assert answer.text == "echo: then here"
            kinds = [type(e.body).__name__ for e in reversed(await b.history(cid, limit=10))]
            assert kinds == ["UserMessage", "AssistantMessage", "UserMessage", "AssistantMessage"]


def _none() -> Any:
    raise AssertionError("not a cluster node")


async def test_torpor_serve_node_flags_are_checked_before_anything_starts(tmp_path: Any) -> None:
    code, _, err = await torpor_cli("serve", "--db", f"sqlite:///{tmp_path}/x.db", "--port", "0",
                                    "--node-id", "a")
    assert code != 0 and "--node-id" in err and "postgresql://" in err
    code, _, err = await torpor_cli("serve", "--db", f"sqlite:///{tmp_path}/x.db", "--port", "0",
                                    "--advertise", "127.0.0.1:1")
    assert code != 0 and "--advertise needs --node-id" in err


_NODE = """
import asyncio, sys
from torpor import NodeConfig, Runtime

async def main(url):
    node = NodeConfig(node_id="a", address="127.0.0.1:7001", lease_ttl=30.0, shards=8)
    async with Runtime(url, node=node) as rt:
        await (await rt.send("before", "hello")).result()
        print("serving", flush=True)
        await asyncio.sleep(120)

asyncio.run(main(sys.argv[1]))
"""


async def test_a_node_restarted_under_its_id_takes_its_leases_back_at_once_and_fences_the_old(
    pg_url: str,
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _NODE, pg_url, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    with anyio.fail_after(60):
        assert (await proc.stdout.readline()).strip() == b"serving"
    proc.kill()  # its leases run for 30 s more: only its own next incarnation may take them
    await proc.wait()
    # 5 s of patience would not do if the restart had to wait for the leases to expire.
    with anyio.fail_after(5):
        async with Runtime(pg_url, node=NodeConfig(node_id="a", address="127.0.0.1:7001",
                                                   lease_ttl=30.0, shards=SHARDS)) as rt:
            view = await rt.admin.cluster()
            assert view is not None and view.incarnation == 2
            assert view.shards == {s: 2 for s in range(SHARDS)}  # every epoch moved on
            assert (await (await rt.send("before", "again")).result()).text == "echo: again"


async def statements_of_one_batch(store: PostgresStore, names: list[str]) -> list[str]:
    """The statements the writer connection ran for one batch appending to ``names``."""
    seen: list[str] = []

    def logged(record: Any) -> None:
        seen.append(record.query)

    conn = store._writer_conns[0]
    conn.add_query_logger(logged)
    writer = store._writer
    assert writer is not None
    before = writer.batches
    try:
        await asyncio.gather(*(store.append(n, [UserMessage("x")], turn=2) for n in names))
    finally:
        conn.remove_query_logger(logged)
    assert writer.batches == before + 1
    return seen


async def test_fencing_costs_no_extra_round_trip(pg_url: str) -> None:
    await leases_table(pg_url)
    names = ids_in_distinct_shards(3)
    async with PostgresStore(pg_url) as store:
        for name in names:  # existing conversations: the batch's normal path
            await store.append(name, [UserMessage("first")], turn=1)
        plain = await statements_of_one_batch(store, names)
    fence = FixedFence({s: 1 for s in range(SHARDS)})
    async with PostgresStore(pg_url, fence=fence) as store:
        await statements_of_one_batch(store, names)  # statements prepared (types looked up)
        fenced = await statements_of_one_batch(store, names)
    assert len(fenced) == len(plain)
    assert sum("shard_leases" in q for q in fenced) == 1  # inside the one locking statement
    assert not any("shard_leases" in q for q in plain)


async def test_a_sub_agent_lives_on_its_parents_shard_and_its_link_moves_with_the_shard(
    pg_url: str,
) -> None:
    """A child is placed on its parent's shard (its id carries the parent's hash tag), and
    the node that acquires that shard picks the open link up: a child cut off by the
    hand-off is told to continue there, and its answer resolves the parent once."""
    from torpor.llm.scripted import Call, ScriptedModel, Text, Wait

    research = torpor.ExternalTool("research", "ask a sub-agent")
    parent = next(c for c in (f"p{i}" for i in range(999))
                  if desired_owner(shard_of(c, SHARDS), ["a", "b"]) == "b")
    gate = anyio.Event()  # never set: the child is still working when its shard moves
    on_a = AgentConfig(model=ScriptedModel([[Call("research", {"q": "x"}, id="r1")]]),
                       tools=[research], recall_tools=False)
    child_on_a = AgentConfig(model=ScriptedModel([[Wait(gate), Text("never")]]),
                             recall_tools=False)
    on_b = {
        "parent": AgentConfig(model=ScriptedModel([[Text("parent done")]]),
                              tools=[research], recall_tools=False),
        "child": AgentConfig(model=ScriptedModel([[Text("x is 42")]]), recall_tools=False),
    }
    config_a = NodeConfig(node_id="a", address="127.0.0.1:7001", lease_ttl=1.0,
                          shards=SHARDS, handoff_deadline=0.2)
    async with Runtime(pg_url, agent=on_a, node=config_a) as a:
        assert isinstance(await (await a.send(parent, "go")).result(), torpor.Suspended)
        with pytest.raises(torpor.InvalidInput):  # another shard: refused before writing
            await a.spawn(parent, "r1", task="t",
                          child=next(c for c in (f"q{i}" for i in range(99))
                                     if shard_of(c, SHARDS) != shard_of(parent, SHARDS)))
        child = await a.spawn(parent, "r1", task="find x", agent=child_on_a)
        assert shard_of(child, SHARDS) == shard_of(parent, SHARDS)
        head = await a.store.head(parent)
        assert head is not None

        def agent_for(conversation: str) -> AgentConfig:
            return on_b["child" if conversation == child else "parent"]

        async with Runtime(pg_url, agent_for=agent_for, node=node("b", 7002)) as b:
            with anyio.fail_after(20):  # the shard moves to b, which takes the link up
                outcome = await final_body(b, parent, head)
            assert outcome == AssistantMessage("parent done")
            results = [e.body for e in reversed(await b.history(parent, limit=50))
                       if isinstance(e.body, torpor.ToolResult)]
            assert [(r.call_id, r.content, r.is_error) for r in results] == [
                ("r1", "x is 42", False)
            ]


async def final_body(rt: Runtime, conversation: str, after: int) -> AssistantMessage:
    """The conversation's next final answer after ``after``, followed on ``rt``."""
    while True:
        try:
            async with rt.subscribe(conversation, after=after) as follower:
                async for item in follower:
                    if isinstance(item, torpor.Event) and isinstance(
                        item.body, AssistantMessage
                    ) and not item.body.tool_calls:
                        return item.body
        except torpor.NotOwner:
            await next_refresh(rt)


def test_a_hash_tag_picks_the_shard() -> None:
    from torpor.cluster import routing_key

    assert routing_key("{p}/r1") == routing_key("p") == "p"
    assert routing_key("{tenant-1}chat-9") == "tenant-1"
    for untagged in ("plain", "x{y", "a{}b", "}{"):
        assert routing_key(untagged) == untagged
    assert shard_of("{p7}/r1", SHARDS) == shard_of("p7", SHARDS)


async def test_a_node_leaves_even_when_its_leases_change_as_it_goes(pg_url: str) -> None:
    """The lease manager is woken (a takeover, a drop) in the same loop pass as leave()
    cancels it: the cancel must still stop it. asyncio.wait_for on Python 3.11 swallowed
    such a cancel, and leaving the cluster (so stopping the runtime) then hung for good."""
    async with Runtime(pg_url, node=node("a", 7001)) as a:
        assert a._cluster is not None
        member = a._cluster.member
        with anyio.fail_after(10):
            await next_refresh(a)
            await anyio.wait_all_tasks_blocked()  # the manager waits for a change
            member.leases.changed.set()  # the manager is woken ...
            await member.leave()  # ... and cancelled before it runs
        assert member._tasks == [] and not member.leases.held
