"""What only the PostgreSQL store has: its URLs and schema, its writer connections,
several writers (stores, processes) on one database, and a whole runtime on it.

Everything both backends promise is the contract suite (tests/test_store_*.py,
run on each backend: see store_backends.py). These run against the same
throwaway cluster (``pg_cluster``, started once per session from the machine's
PostgreSQL binaries; skipped with the reason if there are none); every test
gets a fresh schema of one database in it (``pg_url``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import textwrap
from typing import Any

import pytest

from torpor import ConfigError, ConflictError, EchoModel, Runtime, StoreError
from torpor.events import UserMessage
from torpor.store import open_store

asyncpg = pytest.importorskip("asyncpg")

from support import until  # noqa: E402

from torpor.store.postgres import PostgresStore  # noqa: E402
from torpor.store.postgres.schema import SCHEMA_VERSION  # noqa: E402


async def sql(url: str, statement: str, *args: Any) -> Any:
    """Run one statement behind the store's back (corruption, triggers, inspection)."""
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(statement, *args)
    finally:
        await conn.close()


def text_of(event: Any) -> str:
    return str(event.body.text)


# -- open, schema ---------------------------------------------------------------------


async def test_both_url_schemes_open_the_postgres_store_and_the_schema_is_versioned(
    pg_url: str,
) -> None:
    async with open_store(pg_url) as store:
        assert isinstance(store, PostgresStore)
        await store.append("c", [UserMessage("kept")])
    async with open_store(pg_url.replace("postgresql://", "postgres://", 1)) as store:
        assert isinstance(store, PostgresStore)
        assert [text_of(e) for e in await store.read_since("c", 0)] == ["kept"]
    rows = await sql(pg_url, "SELECT version FROM schema_version ORDER BY version")
    assert [r["version"] for r in rows] == list(range(1, SCHEMA_VERSION + 1))
    columns = await sql(
        pg_url, "SELECT column_name FROM information_schema.columns WHERE table_name = 'events'"
    )
    assert {"conversation_id", "position", "kind", "turn", "tokens", "created_at", "body"} <= {
        r["column_name"] for r in columns
    }
    with pytest.raises(StoreError, match="cannot open"):
        async with open_store(pg_url.split("?")[0].rsplit("/", 1)[0] + "/no_such_database"):
            pass
    await sql(pg_url, "INSERT INTO schema_version (version) VALUES ($1)", SCHEMA_VERSION + 1)
    with pytest.raises(StoreError, match="newer"):
        async with PostgresStore(pg_url):
            pass


# -- writer connections ----------------------------------------------------------------


async def test_full_durability_forces_synchronous_commit_and_options_are_checked(
    pg_url: str,
) -> None:
    async with PostgresStore(pg_url, durability="full", writers=2) as store:
        for conn in store._writer_conns:  # the test cluster's default is "off"
            assert await conn.fetchval("SHOW synchronous_commit") == "on"
        assert await store.append("c", [UserMessage("synced")]) == [0]
    for bad in ({"durability": "sometimes"}, {"writers": 0}, {"readers": 0}, {"max_batch": 0}):
        with pytest.raises(ConfigError):
            PostgresStore(pg_url, **bad)  # type: ignore[arg-type]


async def test_a_writer_connection_killed_by_the_server_is_replaced(pg_url: str) -> None:
    async with PostgresStore(pg_url) as store:
        await store.append("c", [UserMessage("before")])
        [conn] = store._writer_conns
        await sql(pg_url, "SELECT pg_terminate_backend($1)", conn.get_server_pid())
        with contextlib.suppress(StoreError):  # the batch in flight, if any, fails cleanly
            await store.append("c", [UserMessage("maybe")])
        positions = await store.append("c", [UserMessage("after")])
        log = await store.read_since("c", 0)
        assert [e.position for e in log] == list(range(len(log))) and positions == [len(log) - 1]
        assert store._writer_conns[0] is not conn


# -- two writers on one database -------------------------------------------------------------


async def test_two_stores_racing_on_one_conversation_never_gap_or_duplicate(pg_url: str) -> None:
    async with PostgresStore(pg_url) as one, PostgresStore(pg_url) as two:
        await one.append("c", [UserMessage("start")])
        outcomes: list[tuple[str, object]] = []
        for round_ in range(20):
            head = await one.head("c")
            assert head is not None and await two.head("c") == head
            results = await asyncio.gather(
                one.append("c", [UserMessage(f"one {round_}")], expect_head=head),
                two.append("c", [UserMessage(f"two {round_}")], expect_head=head),
                return_exceptions=True,
            )
            won = [r for r in results if isinstance(r, list)]
            lost = [r for r in results if isinstance(r, ConflictError)]
            assert won == [[head + 1]] and len(lost) == 1, results
            assert lost[0].expected == head and lost[0].actual == head + 1
            outcomes.append((f"one {round_}" if results[0] == won[0] else f"two {round_}", won))

        # unconditional appends from both stores, to shared and to brand-new conversations
        async def burst(store: PostgresStore, who: str) -> list[tuple[str, int, str]]:
            acked = []
            for step in range(15):
                for conv in ("c", f"fresh-{step % 5}"):
                    text = f"{who} {step}"
                    [position] = await store.append(conv, [UserMessage(text)])
                    acked.append((conv, position, text))
            return acked

        acked_one, acked_two = await asyncio.gather(
            *(burst(store, who) for store, who in ((one, "one"), (two, "two")))
        )
        for conv in ("c", *(f"fresh-{i}" for i in range(5))):
            log = await two.read_since(conv, 0)
            assert [e.position for e in log] == list(range(len(log)))  # dense, no duplicates
            by_position = {e.position: text_of(e) for e in log}
            for conv_, position, text in acked_one + acked_two:
                if conv_ == conv:
                    assert by_position[position] == text
        log = await one.read_since("c", 0)
        for position, (text, _) in enumerate(outcomes, start=1):
            assert text_of(log[position]) == text
        for store in (one, two):  # the row locks serialised the writers: no write ever
            writer = store._writer  # collided with a row the other had already written
            assert writer is not None and writer.stats.isolated == 0


CHILD = textwrap.dedent(
    """
    import asyncio, logging, sys, structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    from torpor.events import UserMessage
    from torpor.store import open_store

    async def main() -> None:
        async with open_store(sys.argv[1]) as store:
            for i in range(60):
                [p] = await store.append("shared", [UserMessage(f"child {i}")])
                print(p, flush=True)

    asyncio.run(main())
    """
)


async def test_another_process_appending_to_the_same_conversation(pg_url: str) -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, pg_url, stdout=asyncio.subprocess.PIPE
    )
    mine = []
    async with PostgresStore(pg_url) as store:
        for i in range(60):
            [p] = await store.append("shared", [UserMessage(f"parent {i}")])
            mine.append(p)
        out, _ = await child.communicate()
        assert child.returncode == 0
        theirs = [int(line) for line in out.split()]
        log = await store.read_since("shared", 0)
        assert store._writer is not None and store._writer.stats.isolated == 0
    assert sorted(mine + theirs) == list(range(120)) == [e.position for e in log]
    assert all(text_of(log[p]).startswith("child") for p in theirs)


# -- the runtime on PostgreSQL ------------------------------------------------------------------


async def test_a_whole_runtime_works_on_postgres_including_evict_and_revive(pg_url: str) -> None:
    async with Runtime(pg_url, model=EchoModel()) as rt:
        assert (await (await rt.send("c", "hi")).result()).text == "echo: hi"
        with rt.admin.watch() as watcher:
            while not (await rt.admin.evict("c")):  # evictable once the turn's bookkeeping is done
                await until(watcher, "c", "awaiting_input")
        info = await rt.admin.inspect("c")
        assert info.state == "evicted" and not info.live
        with rt.admin.watch() as watcher:
            turn = await rt.send("c", "again")
            await until(watcher, "c", "awaiting_input", old="reviving")
        assert (await turn.result()).text == "echo: again"
        assert (await rt.admin.stats()).revivals >= 1
    async with Runtime(pg_url, model=EchoModel()) as rt:  # a new process revives from the log
        assert (await (await rt.send("c", "third")).result()).text == "echo: third"
        history = [e.body for e in reversed(await rt.history("c"))]
        users = [b.text for b in history if isinstance(b, UserMessage)]
        assert users == ["hi", "again", "third"]
