"""Test helpers: wait for lifecycle transitions through the admin watch, never by sleeping;
make a SQLite store's writes fail and succeed again."""

from __future__ import annotations

from typing import Any

import anyio

from torpor import StoreUnavailable, UserMessage
from torpor.runtime.stats import Watcher


async def until(
    watcher: Watcher,
    conversation_id: str,
    new: str,
    *,
    old: str | None = None,
) -> None:
    """Consume transitions until ``conversation_id`` goes (from ``old``) to ``new``."""
    with anyio.fail_after(10):  # a hang fails the test instead of stalling CI
        async for t in watcher:
            if t.conversation_id == conversation_id and t.new == new and old in (None, t.old):
                return
    raise AssertionError(f"watch ended before {conversation_id} reached {new}")


async def writes_fail(store: Any) -> None:
    """Make every append of a SQLite store fail with StoreUnavailable (SQLITE_FULL).

    The database may not grow (``max_page_count``), and the room left in its
    last pages is taken by filler rows, so even a small append finds none.
    Reads go on working. Undo with :func:`writes_succeed`.
    """
    pages = await store._on_writer(lambda c: c.execute("PRAGMA page_count").fetchone()[0])
    await store._on_writer(lambda c: c.execute(f"PRAGMA max_page_count = {pages}").fetchone())
    for size in (4000, 400, 40, 4, 0):
        for _ in range(200):
            try:
                await store.append("~filler", [UserMessage("f" * size)])
            except StoreUnavailable:
                break


async def writes_succeed(store: Any) -> None:
    await store._on_writer(lambda c: c.execute("PRAGMA max_page_count = 1073741823").fetchone())
