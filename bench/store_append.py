"""Append throughput and read latency of the SQLite event store, against raw sqlite3.

Measures, in one run, on fresh database files:

* ``single``: one appender, one event per ``append``, events/s;
* ``group``: N conversations (default 1,000) appending concurrently, one event per
  ``append``, through group commit (FTS indexing included), events/s;
* ``raw``: the physical reference: ``sqlite3`` ``executemany`` of the same rows
  (pre-encoded bodies, same interleaving) into the same schema, in 256-row
  transactions, events + FTS rows (and events alone, for context);
* ``read_since``: p50/p99 latency of ``read_since`` for the last 50 events of one
  conversation among C conversations x E events (default 10,000 x 100), with the
  raw sqlite3 query as reference.

Usage: ``python bench/store_append.py [--conversations 1000] [--events 50]
[--read-conversations 10000] [--read-events 100] [--dir DIR]``. Prints a table
and a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from torpor.events import UserMessage, encode_body, searchable_text
from torpor.store import SQLiteStore
from torpor.store.prepare import estimate_tokens

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))

WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "ru", "sa", "te", "vo") for b in range(400)]
WEIGHTS = [1 / (rank + 1) for rank in range(len(WORDS))]


def sentences(count: int, seed: int, words: int = 30) -> list[str]:
    """Zipf-distributed words, like prose: a few common, many rare."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, WEIGHTS, k=words)) for _ in range(count)]


def fresh(directory: Path, name: str) -> Path:
    path = directory / name
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return path


async def single_appender(path: Path, texts: Sequence[str]) -> float:
    async with SQLiteStore(str(path)) as store:
        start = time.perf_counter()
        for text in texts:
            await store.append("solo", [UserMessage(text)])
        return len(texts) / (time.perf_counter() - start)


async def group_commit(
    path: Path, conversations: int, per_conversation: int, texts: Sequence[str]
) -> tuple[float, int, int]:
    async with SQLiteStore(str(path)) as store:

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
        batches, largest = writer.batches, writer.largest_batch
    return conversations * per_conversation / elapsed, batches, largest


def raw_reference(
    path: Path,
    schema_from: Path,
    conversations: int,
    per_conversation: int,
    texts: Sequence[str],
    fts: bool,
    txn_rows: int = 256,
) -> float:
    """executemany of the same rows into the same schema: the physical ceiling."""
    source = sqlite3.connect(schema_from)
    ddl = [
        sql
        for (sql,) in source.execute(
            "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'events_fts_%'"
        )
    ]
    source.close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA cache_size = -32768")
    for statement in ddl:
        conn.execute(statement)
    conn.execute("INSERT INTO events_fts(events_fts, rank) VALUES ('automerge', 8)")
    conn.executemany(
        "INSERT INTO conversations (key, external_id, created_at, updated_at) VALUES (?, ?, 0, 0)",
        [(key, f"conv-{key:06d}") for key in range(1, conversations + 1)],
    )
    rows = []
    for step in range(per_conversation):
        for index in range(conversations):
            body = UserMessage(texts[(step * conversations + index) % len(texts)])
            rows.append(
                (
                    index + 1,
                    step,
                    0,
                    "user",
                    estimate_tokens(body),
                    0,
                    encode_body(body),
                    searchable_text(body),
                )
            )
    start = time.perf_counter()
    for offset in range(0, len(rows), txn_rows):
        chunk = rows[offset : offset + txn_rows]
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO events (conversation_id, position, turn, kind, tokens, created_at, body)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            [row[:7] for row in chunk],
        )
        if fts:
            conn.executemany(
                "INSERT INTO events_fts (rowid, text) VALUES (?, ?)",
                sorted(((row[0] << 32) | row[1], row[7]) for row in chunk),
            )
        conn.execute("COMMIT")
    rate = len(rows) / (time.perf_counter() - start)
    conn.close()
    return rate


async def read_latency(
    path: Path, conversations: int, per_conversation: int, samples: int
) -> dict[str, float]:
    texts = sentences(4096, seed=3)
    async with SQLiteStore(str(path)) as store:
        start = time.perf_counter()

        async def filler(index: int) -> None:
            name = f"conv-{index:06d}"
            for step in range(0, per_conversation, 10):
                bodies = [
                    UserMessage(texts[(index * 7 + step + j) % len(texts)]) for j in range(10)
                ]
                await store.append(name, bodies[: per_conversation - step])

        async with asyncio.TaskGroup() as group:
            for index in range(conversations):
                group.create_task(filler(index))
        fill_rate = conversations * per_conversation / (time.perf_counter() - start)

        rng = random.Random(7)
        since = per_conversation - 50
        timings = []
        for _ in range(samples):
            name = f"conv-{rng.randrange(conversations):06d}"
            t0 = time.perf_counter()
            events = await store.read_since(name, since)
            timings.append(time.perf_counter() - t0)
            assert len(events) == 50
    raw = sqlite3.connect(path)
    raw_timings = []
    for _ in range(samples):
        name = f"conv-{rng.randrange(conversations):06d}"
        t0 = time.perf_counter()
        raw.execute(
            "SELECT position, turn, tokens, created_at, body FROM events WHERE conversation_id ="
            " (SELECT key FROM conversations WHERE external_id = ?) AND position >= ?"
            " ORDER BY position",
            (name, since),
        ).fetchall()
        raw_timings.append(time.perf_counter() - t0)
    raw.close()
    return {
        "fill_events_per_s": fill_rate,
        "p50_us": _pct(timings, 50),
        "p99_us": _pct(timings, 99),
        "raw_p50_us": _pct(raw_timings, 50),
        "raw_p99_us": _pct(raw_timings, 99),
    }


def _pct(values: list[float], pct: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, len(ordered) * pct // 100)] * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", type=int, default=5000, help="events for one appender")
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--events", type=int, default=50, help="events per conversation")
    parser.add_argument("--read-conversations", type=int, default=10_000)
    parser.add_argument("--read-events", type=int, default=100)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--dir", default=None, help="where the database files go")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        texts = sentences(8192, seed=1)
        began = time.perf_counter()
        single = await single_appender(fresh(directory, "single.db"), texts[: args.single])
        group_path = fresh(directory, "group.db")
        group, batches, largest = await group_commit(
            group_path, args.conversations, args.events, texts
        )
        raw_fts = raw_reference(
            fresh(directory, "raw.db"), group_path, args.conversations, args.events, texts, True
        )
        same_batch = max(1, round(args.conversations * args.events / max(batches, 1)))
        raw_same = raw_reference(
            fresh(directory, "raw_same.db"),
            group_path,
            args.conversations,
            args.events,
            texts,
            True,
            txn_rows=same_batch,
        )
        raw_plain = raw_reference(
            fresh(directory, "raw_plain.db"),
            group_path,
            args.conversations,
            args.events,
            texts,
            False,
        )
        reads = await read_latency(
            fresh(directory, "read.db"), args.read_conversations, args.read_events, args.samples
        )
        elapsed = time.perf_counter() - began
    result = {
        "machine_cpus": os.cpu_count(),
        "sqlite": sqlite3.sqlite_version,
        "single_appender_events_per_s": round(single),
        "group_commit_events_per_s": round(group),
        "group_commit_conversations": args.conversations,
        "group_commit_batches": batches,
        "group_commit_mean_batch": round(args.conversations * args.events / max(batches, 1), 1),
        "group_commit_largest_batch": largest,
        "raw_executemany_fts_events_per_s": round(raw_fts),
        "raw_executemany_fts_same_batch_events_per_s": round(raw_same),
        "raw_executemany_no_fts_events_per_s": round(raw_plain),
        "group_vs_raw_fts": round(group / raw_fts, 3),
        "group_vs_raw_fts_same_batch": round(group / raw_same, 3),
        "read_setup": f"{args.read_conversations} conversations x {args.read_events} events",
        "read_fill_events_per_s": round(reads["fill_events_per_s"]),
        "read_since_last50_p50_us": round(reads["p50_us"], 1),
        "read_since_last50_p99_us": round(reads["p99_us"], 1),
        "raw_read_last50_p50_us": round(reads["raw_p50_us"], 1),
        "raw_read_last50_p99_us": round(reads["raw_p99_us"], 1),
        "elapsed_s": round(elapsed, 1),
    }
    rows = [
        ("one appender", f"{single:,.0f} events/s", ""),
        (
            f"group commit, {args.conversations} conversations",
            f"{group:,.0f} events/s",
            f"{result['group_vs_raw_fts']:.0%} of raw (target >= 50%)",
        ),
        ("raw executemany + FTS (256-row txns)", f"{raw_fts:,.0f} events/s", "reference"),
        (
            f"raw executemany + FTS ({same_batch}-row txns)",
            f"{raw_same:,.0f} events/s",
            f"group commit is {result['group_vs_raw_fts_same_batch']:.0%} of it",
        ),
        ("raw executemany, no FTS (256-row txns)", f"{raw_plain:,.0f} events/s", "context"),
        (
            f"read_since last 50 ({result['read_setup']})",
            f"p50 {reads['p50_us']:.0f} µs, p99 {reads['p99_us']:.0f} µs",
            "target p99 <= 1000 µs",
        ),
        (
            "raw sqlite3 same query",
            f"p50 {reads['raw_p50_us']:.0f} µs, p99 {reads['raw_p99_us']:.0f} µs",
            "",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    for label, figure, note in rows:
        print(f"{label:<{width}}  {figure:<28} {note}")
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
