"""Crash safety: SIGKILL a process mid-stream of appends; every acknowledged append survives.

A contract: runs on a SQLite file and on PostgreSQL (see store_backends.py).
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import sys

import pytest
from store_backends import Backend

from torpor.events import UserMessage

# The child appends forever from several concurrent writers and prints each
# position only after its append returned (i.e. after the commit containing it).
CHILD = r"""
import asyncio, logging, sys, structlog
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
from torpor.events import UserMessage
from torpor.store import SQLiteStore

async def writer(store, conv):
    step = 0
    while True:
        bodies = [UserMessage(f"{conv} {step} {i}") for i in range(1 + step % 3)]
        positions = await store.append(conv, bodies)
        print("ack", conv, *positions, flush=True)
        step += 1

async def main(backend, location):
    if backend == "sqlite":
        opened = SQLiteStore(location)
    else:
        from torpor.store.postgres import PostgresStore
        opened = PostgresStore(location)
    async with opened as store:
        await asyncio.gather(*(writer(store, f"conv-{n}") for n in range(8)))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""

ACKNOWLEDGED_BEFORE_KILL = 400


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_sigkill_mid_stream_loses_no_acknowledged_append(backend: Backend) -> None:
    assert backend.location is not None
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, backend.name, backend.location],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    acknowledged: dict[str, set[int]] = {}
    try:
        assert child.stdout is not None
        lines = 0
        while lines < ACKNOWLEDGED_BEFORE_KILL:
            line = child.stdout.readline()
            assert line, f"child died early: {child.stderr.read() if child.stderr else ''}"
            parts = line.split()
            if not parts or parts[0] != "ack":  # a log line
                continue
            _, conv, *positions = parts
            acknowledged.setdefault(conv, set()).update(int(p) for p in positions)
            lines += 1
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL

    if backend.name == "sqlite":
        raw = sqlite3.connect(backend.location)
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        raw.close()
    asyncio.run(_check(backend, acknowledged))


async def _check(backend: Backend, acknowledged: dict[str, set[int]]) -> None:
    async with backend.open() as store:
        for conv, positions in acknowledged.items():
            events = await store.read_since(conv, 0)  # every row decodes
            stored = [e.position for e in events]
            assert stored == list(range(len(stored)))  # no gaps
            assert positions <= set(stored)  # nothing acknowledged is missing
            assert await store.head(conv) == stored[-1]
        # and the log goes on where it stopped
        head = await store.head("conv-0")
        assert head is not None
        assert await store.append("conv-0", [UserMessage("after the crash")]) == [head + 1]
