"""Append throughput and read latency of the PostgreSQL event store.

Measures, each on a fresh database:

* ``single``: one appender, one event per ``append``, events/s;
* ``group``: N conversations (default 1,000) appending concurrently, one event
  per ``append``, through group commit (search indexing included), events/s,
  with one writer connection and with two;
* ``per_append``: the alternative design, a pool of connections with one
  transaction per append (the same store with ``max_batch=1`` and 16 writer
  connections: the same SQL, no batching);
* ``raw``: the physical reference: asyncpg inserting the same rows (events and
  search documents) with the same ``unnest`` statements, 1,000 rows per
  transaction, no locking, no planning;
* ``read_since`` and ``resume``: p50/p99 latency for the last 50 events of one
  conversation among C conversations x E events (default 10,000 x 100); resume
  reads a checkpoint at E - 50 plus the 50 events after it.

Unless ``--url`` names a database server, a throwaway cluster is started from
the machine's PostgreSQL binaries (``tests/pg_cluster.py``), with ``fsync`` on
(as a production server would run) unless ``--no-fsync``.

Usage: ``python bench/store_postgres.py [--conversations 1000] [--events 20]
[--read-conversations 10000] [--read-events 100] [--url postgresql://…]
[--no-fsync]``. Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import structlog

from torpor.events import UserMessage, encode_body, searchable_text
from torpor.store import Checkpoint
from torpor.store.postgres import PostgresStore
from torpor.store.postgres.lexemes import document_chunks
from torpor.store.prepare import estimate_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from pg_cluster import running_cluster

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))

WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "ru", "sa", "te", "vo") for b in range(400)]
WEIGHTS = [1 / (rank + 1) for rank in range(len(WORDS))]


def sentences(count: int, seed: int, words: int = 30) -> list[str]:
    """Zipf-distributed words, like prose: a few common, many rare."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, WEIGHTS, k=words)) for _ in range(count)]


class Server:
    """Hands out fresh databases on one server."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def fresh(self) -> str:
        name = "bench_" + uuid.uuid4().hex[:12]
        admin = await asyncpg.connect(self.url)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        base, _, _ = self.url.rpartition("/")
        return f"{base}/{name}"


@contextlib.asynccontextmanager
async def fresh_store(server: Server, **options: Any) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(await server.fresh(), **options) as store:
        yield store


async def single_appender(server: Server, texts: Sequence[str]) -> float:
    async with fresh_store(server) as store:
        start = time.perf_counter()
        for text in texts:
            await store.append("solo", [UserMessage(text)])
        return len(texts) / (time.perf_counter() - start)


async def concurrent(
    server: Server, conversations: int, per_conversation: int, texts: Sequence[str], **options: Any
) -> dict[str, float]:
    async with fresh_store(server, **options) as store:

        async def appender(index: int) -> None:
            name = f"conv-{index:06d}"
            for step in range(per_conversation):
                text = texts[(step * conversations + index) % len(texts)]
                await store.append(name, [UserMessage(text)])

        start = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for index in range(conversations):
                group.create_task(appender(index))
        elapsed = time.perf_counter() - start
        writer = store._writer
        assert writer is not None
        return {
            "events_per_s": conversations * per_conversation / elapsed,
            "batches": writer.batches,
            "largest_batch": writer.largest_batch,
        }


async def raw_reference(
    server: Server, conversations: int, per_conversation: int, texts: Sequence[str], rows: int
) -> float:
    """The same rows through the same unnest statements: the physical ceiling."""
    url = await server.fresh()
    async with PostgresStore(url):  # creates the schema
        pass
    conn = await asyncpg.connect(url)
    try:
        await conn.executemany(
            "INSERT INTO conversations (external_id, created_at, updated_at) VALUES ($1, 0, 0)",
            [(f"conv-{key:06d}",) for key in range(conversations)],
        )
        keys = dict(await conn.fetch("SELECT external_id, key FROM conversations"))
        prepared = []
        for step in range(per_conversation):
            for index in range(conversations):
                body = UserMessage(texts[(step * conversations + index) % len(texts)])
                text = searchable_text(body)
                [(chunk, lexemes)] = document_chunks(text)
                key = keys[f"conv-{index:06d}"]
                prepared.append(
                    (key, step, estimate_tokens(body), encode_body(body), chunk, lexemes)
                )
        start = time.perf_counter()
        for offset in range(0, len(prepared), rows):
            part = prepared[offset : offset + rows]
            async with conn.transaction():
                await conn.execute(
                    "INSERT INTO events (conversation_id, position, turn, kind, tokens,"
                    " created_at, body) SELECT c, p, 0, 'user', t, 0, b"
                    " FROM unnest($1::bigint[], $2::bigint[], $3::int[], $4::bytea[])"
                    " AS u(c, p, t, b)",
                    [r[0] for r in part], [r[1] for r in part],
                    [r[2] for r in part], [r[3] for r in part],
                )  # fmt: skip
                await conn.execute(
                    "INSERT INTO events_fts (conversation_id, position, chunk, document)"
                    " SELECT c, p, 0, CASE WHEN l = '' THEN to_tsvector('simple', t)"
                    " ELSE to_tsvector('simple', t) || array_to_tsvector(string_to_array(l, ' '))"
                    " END"
                    " FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::text[])"
                    " AS u(c, p, t, l)",
                    [r[0] for r in part], [r[1] for r in part],
                    [r[4] for r in part], [r[5] for r in part],
                )  # fmt: skip
        return len(prepared) / (time.perf_counter() - start)
    finally:
        await conn.close()


async def read_latency(
    server: Server, conversations: int, per_conversation: int, samples: int
) -> dict[str, float]:
    texts = sentences(4096, seed=3)
    async with fresh_store(server) as store:
        start = time.perf_counter()

        async def filler(index: int) -> None:
            name = f"conv-{index:06d}"
            for step in range(0, per_conversation, 10):
                bodies = [
                    UserMessage(texts[(index * 7 + step + j) % len(texts)]) for j in range(10)
                ]
                await store.append(name, bodies[: per_conversation - step])
            await store.put_checkpoint(Checkpoint(name, per_conversation - 50, 0, 1))

        async with asyncio.TaskGroup() as group:
            for index in range(conversations):
                group.create_task(filler(index))
        fill_rate = conversations * per_conversation / (time.perf_counter() - start)
        pool = store._pool
        assert pool is not None
        await pool.execute("VACUUM ANALYZE")

        rng = random.Random(7)
        since = per_conversation - 50
        reads, resumes = [], []
        for _ in range(samples):
            name = f"conv-{rng.randrange(conversations):06d}"
            t0 = time.perf_counter()
            events = await store.read_since(name, since)
            t1 = time.perf_counter()
            resumed = await store.resume(name)
            t2 = time.perf_counter()
            assert len(events) == 50 and len(resumed.events) == 50
            reads.append(t1 - t0)
            resumes.append(t2 - t1)
    return {
        "fill_events_per_s": fill_rate,
        "read_since_p50_us": _pct(reads, 50),
        "read_since_p99_us": _pct(reads, 99),
        "resume_p50_us": _pct(resumes, 50),
        "resume_p99_us": _pct(resumes, 99),
    }


def _pct(values: list[float], pct: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, len(ordered) * pct // 100)] * 1e6


@contextlib.contextmanager
def server_url(url: str | None, fsync: bool) -> Iterator[str]:
    if url is not None:
        yield url
        return
    with running_cluster(fsync=fsync) as cluster:
        yield cluster.url()


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    server = Server(url)
    texts = sentences(8192, seed=1)
    n, e = args.conversations, args.events
    results: dict[str, Any] = {"conversations": n, "events_per_conversation": e}
    results["single_events_per_s"] = await single_appender(server, texts[: args.single])
    results["group_1_writer"] = await concurrent(server, n, e, texts)
    results["group_2_writers"] = await concurrent(server, n, e, texts, writers=2)
    results["per_append_16_connections"] = await concurrent(
        server, n, e, texts, writers=16, max_batch=1
    )
    results["raw_events_per_s"] = await raw_reference(server, n, e, texts, rows=1000)
    results["reads"] = await read_latency(
        server, args.read_conversations, args.read_events, args.samples
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", type=int, default=2000, help="events for one appender")
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--events", type=int, default=20, help="events per conversation")
    parser.add_argument("--read-conversations", type=int, default=10_000)
    parser.add_argument("--read-events", type=int, default=100)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--url", default=None, help="a server to use instead of a throwaway one")
    parser.add_argument("--no-fsync", action="store_true", help="throwaway cluster without fsync")
    args = parser.parse_args()
    began = time.perf_counter()
    with server_url(args.url, fsync=not args.no_fsync) as url:
        results = asyncio.run(run(args, url))
    results["fsync"] = args.url is None and not args.no_fsync
    results["seconds"] = time.perf_counter() - began
    g1, g2, pa = (results[k] for k in ("group_1_writer", "group_2_writers",
                                       "per_append_16_connections"))  # fmt: skip
    reads = results["reads"]
    rows = [
        ("one appender", f"{results['single_events_per_s']:,.0f} events/s"),
        (f"{args.conversations} convs, group commit, 1 writer",
         f"{g1['events_per_s']:,.0f} events/s "
         f"({g1['batches']} batches, largest {g1['largest_batch']})"),
        (f"{args.conversations} convs, group commit, 2 writers",
         f"{g2['events_per_s']:,.0f} events/s ({g2['batches']} batches)"),
        (f"{args.conversations} convs, 1 txn per append, 16 conns",
         f"{pa['events_per_s']:,.0f} events/s"),
        ("raw unnest inserts, 1,000 rows/txn", f"{results['raw_events_per_s']:,.0f} events/s"),
        ("group commit / raw", f"{g1['events_per_s'] / results['raw_events_per_s']:.0%}"),
        (f"fill {args.read_conversations} x {args.read_events}",
         f"{reads['fill_events_per_s']:,.0f} events/s"),
        ("read_since last 50", f"p50 {reads['read_since_p50_us']:.0f} µs, "
                               f"p99 {reads['read_since_p99_us']:.0f} µs"),
        ("resume (checkpoint + 50)", f"p50 {reads['resume_p50_us']:.0f} µs, "
                                     f"p99 {reads['resume_p99_us']:.0f} µs"),
    ]  # fmt: skip
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
