"""The PostgreSQL store shows the SQLite store's behaviour, and holds up to two writers.

Runs against a throwaway cluster (``pg_cluster``, started once per session from
the machine's PostgreSQL binaries; skipped with the reason if there are none);
every test gets a fresh schema of one database in it (``pg_url``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from torpor import (
    ConfigError,
    ConflictError,
    CorruptEvent,
    EchoModel,
    EventTooLarge,
    InvalidInput,
    Runtime,
    StoreError,
)
from torpor.events import AssistantMessage, Suspended, ToolCall, ToolResult, UserMessage
from torpor.store import Checkpoint, ModelCall, open_store
from torpor.store.prepare import PREVIEW_BYTES

asyncpg = pytest.importorskip("asyncpg")

from support import until  # noqa: E402

from torpor.store.postgres import PostgresStore  # noqa: E402
from torpor.store.postgres.schema import SCHEMA_VERSION  # noqa: E402

FILLER = "the build ran and the tests passed without any surprises today"


@pytest.fixture
async def pg_url(pg_database: str) -> str:
    """A fresh schema of the session's test database (``search_path`` in the URL): as
    empty as a new database for the store, at a millisecond instead of a few hundred."""
    schema = "t_" + uuid.uuid4().hex[:16]
    admin = await asyncpg.connect(pg_database)
    try:
        await admin.execute(f"CREATE SCHEMA {schema}")
    finally:
        await admin.close()
    return f"{pg_database}?search_path={schema}"


@pytest.fixture
async def store(pg_url: str) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(pg_url) as opened:
        yield opened


async def sql(url: str, statement: str, *args: Any) -> Any:
    """Run one statement behind the store's back (corruption, triggers, inspection)."""
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(statement, *args)
    finally:
        await conn.close()


async def script(url: str, statements: str) -> None:
    """Run several statements behind the store's back (simple query protocol)."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(statements)
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


# -- appends ---------------------------------------------------------------------------


async def test_concurrent_appenders_get_dense_unique_positions_and_their_own(
    store: PostgresStore,
) -> None:
    conversations, appenders, rounds = 20, 5, 8
    told: dict[int, list[tuple[int, str]]] = {c: [] for c in range(conversations)}

    async def appender(conv: int, writer: int) -> None:
        for step in range(rounds):
            texts = [f"c{conv} w{writer} s{step} e{i}" for i in range(1 + step % 3)]
            positions = await store.append(f"conv-{conv}", [UserMessage(t) for t in texts])
            assert positions == list(range(positions[0], positions[0] + len(texts)))
            told[conv].extend(zip(positions, texts, strict=True))

    await asyncio.gather(*(appender(c, w) for c in range(conversations) for w in range(appenders)))
    for conv in range(conversations):
        log = await store.read_since(f"conv-{conv}", 0)
        assert [e.position for e in log] == list(range(len(log)))
        assert len(told[conv]) == len(log)
        stored = {e.position: e.body for e in log}
        for position, text in told[conv]:
            assert stored[position] == UserMessage(text)
        assert await store.head(f"conv-{conv}") == len(log) - 1
    writer = store._writer
    assert writer is not None and writer.largest_batch > 1  # appends were grouped


async def test_expect_head_conflict_writes_nothing(store: PostgresStore) -> None:
    assert await store.append("c", [UserMessage("a")], expect_head=-1) == [0]
    assert await store.append("c", [UserMessage("b")], expect_head=0) == [1]
    with pytest.raises(ConflictError) as caught:
        await store.append("c", [UserMessage("stale")], expect_head=0)
    assert (caught.value.expected, caught.value.actual) == (0, 1)
    with pytest.raises(ConflictError):
        await store.append("new", [UserMessage("x")], expect_head=3)
    assert [text_of(e) for e in await store.read_since("c", 0)] == ["a", "b"]
    assert await store.conversation("new") is None  # a refused append creates nothing


async def test_invalid_append_in_a_batch_fails_only_itself(store: PostgresStore) -> None:
    await store.append("a", [UserMessage("seed")])
    writer = store._writer
    assert writer is not None
    before = writer.batches
    outcomes = await asyncio.gather(
        store.append("a", [UserMessage("ok 1")]),
        store.append("a", [UserMessage("conflict")], expect_head=7),
        store.append("b", [UserMessage("ok 2")]),
        store.append("a", [UserMessage("ok 3")], expect_head=1),
        return_exceptions=True,
    )
    assert writer.batches == before + 1  # all four were in one transaction
    assert outcomes[0] == [1] and outcomes[2] == [0] and outcomes[3] == [2]
    assert isinstance(outcomes[1], ConflictError)
    assert [text_of(e) for e in await store.read_since("a", 0)] == ["seed", "ok 1", "ok 3"]


async def test_a_write_the_database_refuses_fails_alone(pg_url: str) -> None:
    async with PostgresStore(pg_url) as store:
        await store.append("a", [UserMessage("seed")])
        await script(
            pg_url,
            """
            CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF position('poison' IN encode(NEW.body, 'escape')) > 0 THEN
                    RAISE EXCEPTION 'poisoned row';
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER poison BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION poison();
            """,
        )
        outcomes = await asyncio.gather(
            store.append("a", [UserMessage("ok 1")]),
            store.append("b", [UserMessage("fine"), UserMessage("poison")]),
            store.append("a", [UserMessage("ok 2")]),
            return_exceptions=True,
        )
        assert outcomes[0] == [1] and outcomes[2] == [2]
        assert isinstance(outcomes[1], StoreError) and "poisoned row" in str(outcomes[1])
        assert store._writer is not None and store._writer.stats.isolated == 1
        assert await store.conversation("b") is None  # its new row was rolled back too
        assert await store.append("b", [UserMessage("later")]) == [0]


async def test_idempotency_key_returns_the_first_positions_and_writes_nothing(
    pg_url: str,
) -> None:
    async with PostgresStore(pg_url) as store:
        first = await store.append("c", [UserMessage("hi"), UserMessage("there")], key="m1")
        await store.append("c", [UserMessage("other")])
        assert await store.append("c", [UserMessage("hi")], key="m1", expect_head=-1) == first
        assert await store.append("d", [UserMessage("hi")], key="m1") == [0]  # per conversation
        both = await asyncio.gather(
            store.append("e", [UserMessage("x")], key="k"),
            store.append("e", [UserMessage("x")], key="k"),
        )
        assert list(both) == [[0], [0]]
        assert await store.head("e") == 0
    async with PostgresStore(pg_url) as again:  # keys are in the database, not the process
        assert await again.append("c", [UserMessage("hi")], key="m1") == [0, 1]
        events = await again.append_events("c", [UserMessage("hi")], key="m1")
        assert [text_of(e) for e in events] == ["hi", "there"]
        assert len(await again.read_since("c", 0)) == 3


async def test_append_events_returns_what_was_stored_and_tokens_are_counted_once(
    pg_url: str,
) -> None:
    seen: list[object] = []

    def counter(body: object) -> int:
        seen.append(body)
        return 42

    body = AssistantMessage("calling", (ToolCall("t1", "grep", {"pattern": "x"}),))
    async with PostgresStore(pg_url, token_counter=counter) as store:
        events = await store.append_events("c", [UserMessage("q"), body], turn=3, key="k")
        assert [e.position for e in events] == [0, 1]
        assert all(e.turn == 3 and e.tokens == 42 and e.conversation_id == "c" for e in events)
        assert await store.read_since("c", 0) == events
        await store.resume("c")
        assert seen == [UserMessage("q"), body]  # once each, at append; never on reads
        assert await store.append_events("c", [UserMessage("q"), body], key="k") == events


@pytest.mark.parametrize("bad", ["", "x" * 257, None, 7, "nul\x00inside"])
async def test_bad_conversation_ids_are_refused(store: PostgresStore, bad: object) -> None:
    with pytest.raises(ValueError):
        await store.append(bad, [UserMessage("a")])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await store.read_since(bad, 0)  # type: ignore[arg-type]
    assert await store.conversations() == []


async def test_bad_appends_are_refused_before_anything_is_written(store: PostgresStore) -> None:
    assert await store.append("x" * 256, [UserMessage("longest id is fine")]) == [0]
    with pytest.raises(InvalidInput):
        await store.append("c", [])
    with pytest.raises(InvalidInput):
        await store.append("c", ["not a body"])  # type: ignore[list-item]
    with pytest.raises(EventTooLarge):
        await store.append("c", [UserMessage("ok"), UserMessage("x" * (1024 * 1024 + 1))])
    with pytest.raises(InvalidInput):
        await store.append("c", [UserMessage("a")], key="nul\x00")
    # text no backend can hold as text is refused the same way on both (SQLite too)
    with pytest.raises(InvalidInput):
        await store.append("c", [UserMessage("nul \x00 byte")])
    assert await store.head("c") is None


async def test_close_commits_what_is_queued_and_refuses_later_work(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    await store.open()
    pending = [asyncio.ensure_future(store.append(f"c{i}", [UserMessage("x")])) for i in range(50)]
    await asyncio.sleep(0)  # let them queue (not a synchronisation: they are already queued)
    await store.close()
    assert [p.result() for p in pending] == [[0]] * 50
    with pytest.raises(StoreError):
        await store.append("c0", [UserMessage("late")])
    with pytest.raises(StoreError):
        await store.read_since("c0", 0)
    async with PostgresStore(pg_url) as reopened:
        assert len(await reopened.conversations(limit=100)) == 50


async def test_a_cancelled_append_that_was_not_yet_taken_is_never_written(
    store: PostgresStore,
) -> None:
    task = asyncio.ensure_future(store.append("c", [UserMessage("never")]))
    await asyncio.sleep(0)  # one loop turn: the append is queued, the writer not yet run
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.append("c", [UserMessage("first")]) == [0]
    assert len(await store.read_since("c", 0)) == 1


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


# -- reads -----------------------------------------------------------------------------


async def fill(store: PostgresStore, conv: str, count: int) -> None:
    await asyncio.gather(
        *(
            store.append(conv, [UserMessage(f"m{start + i}") for i in range(min(7, count - start))])
            for start in range(0, count, 7)
        )
    )


@pytest.mark.parametrize("limit", [1, 7, 1000])
async def test_page_backward_walks_the_whole_log_exactly_once(
    store: PostgresStore, limit: int
) -> None:
    await fill(store, "c", 103)
    await fill(store, "other", 5)
    seen: list[int] = []
    before = None
    while page := await store.page_backward("c", before=before, limit=limit):
        assert len(page) <= limit
        seen.extend(e.position for e in page)
        before = page[-1].position
    assert seen == list(range(102, -1, -1))
    assert all(e.conversation_id == "c" for e in await store.page_backward("c"))


async def test_read_since_after_a_checkpoint_and_resume_in_one_round_trip(
    store: PostgresStore,
) -> None:
    empty = await store.resume("nobody")
    assert (empty.head, empty.checkpoint, empty.events) == (None, None, ())
    for i in range(30):
        await store.append("c", [UserMessage(f"m{i}")])
    first = Checkpoint("c", position=20, created_at=5, cycle=1, tokens=9)
    await store.put_checkpoint(first)
    assert await store.latest_checkpoint("c") == first
    tail = await store.read_since("c", 20)
    assert [text_of(e) for e in tail] == [f"m{i}" for i in range(20, 30)]
    assert len(await store.read_since("c", 0)) == 30  # a checkpoint deletes nothing
    later = Checkpoint("c", position=25, created_at=6, cycle=2, summary="so far")
    await store.put_checkpoint(later)
    await store.append("c", [Suspended(("t1",), "approval")])
    assert await store.checkpoints("c") == [first, later]
    with pytest.raises(ValueError):
        await store.put_checkpoint(Checkpoint("c", 32, 0, 3))  # beyond head + 1

    calls: list[str] = []
    pool = store._pool

    class Counting:  # the store's reader pool, counting the statements sent through it
        def __getattr__(self, name: str) -> Any:
            method = getattr(pool, name)

            async def counted(query: str, *args: Any) -> Any:
                calls.append(query)
                return await method(query, *args)

            return counted

    store._pool = Counting()  # type: ignore[assignment]
    resumed = await store.resume("c")
    store._pool = pool
    assert len(calls) == 1  # checkpoint, head and events: one statement
    assert resumed.head == 30 and resumed.checkpoint == later
    assert [e.position for e in resumed.events] == list(range(25, 31))
    info = await store.conversation("c")
    assert info is not None and info.checkpoint_position == 25 and info.head == 30


async def test_listings_heads_ranges_and_model_calls(store: PostgresStore) -> None:
    names = [f"conv-{i:02d}" for i in range(12)] + ["Zeta", "alpha"]  # bytewise order
    for i, name in enumerate(reversed(names)):
        await store.append(name, [UserMessage("x")] * (1 + i % 3))
    listed = []
    after = None
    while page := await store.conversations(after=after, limit=5):
        listed.extend(page)
        after = page[-1].conversation_id
    assert [info.conversation_id for info in listed] == sorted(names)
    for info in listed:
        count = len(await store.read_since(info.conversation_id, 0))
        assert info.head == count - 1 and info.event_count == count and info.bytes > 0
    assert [e.position for e in await store.read_range("conv-00", 0, 1)] == [0, 1]
    assert await store.head("missing") is None and await store.read_since("missing", 0) == []
    calls = [
        ModelCall("c", turn, index, 0, b"\x90", f"h{turn}{index}", {"tail": 100}, 110, 0.1)
        for turn in range(1, 4)
        for index in range(2)
    ]
    for call in calls:
        await store.record_model_call(call)
    stored = await store.model_calls("c")
    assert [(c.turn, c.call_index) for c in stored] == [(c.turn, c.call_index) for c in calls]
    assert all(c.created_at > 0 for c in stored)  # stamped
    assert [c.rendered_hash for c in await store.model_calls("c", turn=2)] == ["h20", "h21"]
    assert len(await store.model_calls("c", limit=3)) == 3


@pytest.mark.parametrize("garbage", [b"\xc1\xff garbage", b"", b"\x81\xa4kind\xa4nope"])
async def test_a_corrupt_body_raises_corrupt_event_with_its_position(
    pg_url: str, garbage: bytes
) -> None:
    async with PostgresStore(pg_url) as store:
        await store.append("c", [UserMessage(f"word{i}") for i in range(10)])
        await sql(pg_url, "UPDATE events SET body = $1 WHERE position = 6", garbage)
        for read in (
            store.read_since("c", 0),
            store.page_backward("c"),
            store.read_range("c", 5, 7),
            store.resume("c"),
            store.search("c", "word6"),
        ):
            with pytest.raises(CorruptEvent) as caught:
                await read
            assert (caught.value.conversation_id, caught.value.position) == ("c", 6)
        assert [e.position for e in await store.read_since("c", 7)] == [7, 8, 9]
        assert len(await store.page_backward("c", before=6)) == 6


# -- search and artifacts ------------------------------------------------------------------


async def test_search_finds_a_hash_and_a_path_appended_long_ago(store: PostgresStore) -> None:
    await store.append("c", [UserMessage("we are at commit 3f9a2c1e77b0 now")])
    call = ToolCall("t1", "open", {"path": "src/torpor/store/batch.py"})
    await store.append("c", [AssistantMessage("", (call,))])
    await asyncio.gather(*(store.append("c", [UserMessage(f"{FILLER} {i}")]) for i in range(300)))
    await store.append("other", [UserMessage("3f9a2c1e77b0 is also here")])

    hits = await store.search("c", "3f9a2c1e77b0")
    assert [h.position for h in hits] == [0]  # only this conversation
    assert "3f9a2c1e77b0" in hits[0].snippet and hits[0].kind == "user"
    for query in ("src/torpor/store/batch.py", "store/batch.py", "batch.py", "torpor/store"):
        path_hits = await store.search("c", query)
        assert [h.position for h in path_hits] == [1], query
        assert "src/torpor/store/batch.py" in path_hits[0].snippet


async def test_scores_rank_better_matches_higher_and_k_limits(store: PostgresStore) -> None:
    await store.append(
        "c",
        [
            UserMessage("deploy the service"),
            UserMessage("rollback the deploy of the payment service now"),
            UserMessage("unrelated words entirely"),
            UserMessage("payment"),
        ],
    )
    hits = await store.search("c", "payment rollback", k=10)
    assert hits[0].position == 1 and {h.position for h in hits} == {1, 3}
    assert hits[0].score > hits[1].score > 0
    assert len(await store.search("c", "deploy service payment", k=2)) == 2


@pytest.mark.parametrize(
    "query", ['"', "AND", "a | b", "!x", "&", "col:umn", "-x", "(", "it's", 'a"b', "\\", "'"]
)
async def test_queries_with_tsquery_syntax_characters_do_not_raise(
    store: PostgresStore, query: str
) -> None:
    await store.append("c", [UserMessage("AND it's a column: value (x) -x !x a | b")])
    assert all(h.position == 0 for h in await store.search("c", query))
    assert await store.search("c", "   ") == []


async def test_large_tool_results_are_clipped_into_artifacts_and_found_beyond_the_preview(
    pg_url: str,
) -> None:
    tail = "needle-b7e4 is only at the very end"
    content = "x " * 20_000 + tail
    async with PostgresStore(pg_url) as store:
        [event] = await store.append_events("c", [ToolResult("call-1", "cat", content)])
        body = event.body
        assert isinstance(body, ToolResult) and body.artifact is not None
        assert body.full_size == len(content.encode()) and tail not in body.content
        assert len(body.content.encode()) < PREVIEW_BYTES + 200 and event.tokens < 400
        assert (await store.read_since("c", 0))[0].body == body
        assert (await store.get_artifact(body.artifact)).decode() == content
        hits = await store.search("c", "needle-b7e4")
        assert [h.position for h in hits] == [0] and "needle-b7e4" in hits[0].snippet
        # a text longer than one index chunk is searchable to its end
        long = " ".join(f"w{i}" for i in range(40_000)) + " last-9c1d"
        await store.append("c", [ToolResult("call-2", "cat", long)])
        assert [h.position for h in await store.search("c", "last-9c1d")] == [1]
        data = bytes(range(256)) * 100
        assert await store.get_artifact(await store.put_artifact("c", data)) == data
        with pytest.raises(KeyError):
            await store.get_artifact("art-missing")


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
