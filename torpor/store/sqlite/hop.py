"""Run a whole Python function on an aiosqlite connection's thread: one hop.

Why this module exists: aiosqlite's public API crosses from the event loop to
the connection's thread once per ``execute``/``fetchall``/``commit``. A
thread hop costs ~170 µs on the 2-core target machine, so resume (checkpoint +
events since) or a group-commit batch (BEGIN, hundreds of inserts, COMMIT)
would pay it dozens of times. aiosqlite's ``Connection._execute(fn, *args)`` is
the primitive its own public methods are built on: it queues ``fn`` for the
connection's worker thread and resolves a future with its result. It is private,
so this is the only place in torpor that touches it (and ``_conn``, the
underlying :class:`sqlite3.Connection`, which is only ever used from inside
``fn``, i.e. on the connection's own thread). aiosqlite still owns the
connection's lifecycle (thread start, connect, close).

The commit path uses :func:`post` instead: it puts the function on the
thread's queue (``_tx``, the queue ``_execute`` feeds) without a future, and
the function reports back itself, once, with ``call_soon_threadsafe``. That
saves aiosqlite's own future and its second wake-up of the event loop per
batch; the group-commit writer needs only the one callback that resolves its
callers.

If aiosqlite ever drops ``_execute`` or ``_tx``, replace this with a
single-thread executor per connection; nothing else in torpor needs to change.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import aiosqlite

__all__ = ["hop", "post"]

T = TypeVar("T")


async def hop(conn: aiosqlite.Connection, fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn(sqlite3_connection, *args)`` on ``conn``'s thread and await the result.

    The result travels in a box emptied here: aiosqlite's thread keeps its last call's
    result until the next call arrives, and a burst's last reads (a revival's events)
    would otherwise stay, pinning the heap freed around them.
    """

    def call() -> list[T]:
        raw: sqlite3.Connection = conn._conn
        return [fn(raw, *args)]

    execute: Callable[[Callable[[], list[T]]], Awaitable[Any]] = conn._execute
    box = cast(list[T], await execute(call))
    return box.pop()


def post(
    conn: aiosqlite.Connection,
    fn: Callable[[sqlite3.Connection], None],
    lost: Callable[[BaseException], None],
) -> None:
    """Queue ``fn(sqlite3_connection)`` on ``conn``'s thread and return at once.

    Nobody is told when ``fn`` has run or what it raised (aiosqlite drops
    both when there is no future): ``fn`` must catch everything and report
    its outcome itself. If the connection is gone by the time the thread gets
    to it, ``lost(error)`` is called there instead. Raises ValueError if the
    connection is closed already.
    """
    if not conn._running or conn._connection is None:
        raise ValueError("Connection closed")

    def call() -> None:
        try:
            raw: sqlite3.Connection = conn._conn
        except BaseException as exc:
            lost(exc)
            return
        fn(raw)

    conn._tx.put_nowait((None, call))
