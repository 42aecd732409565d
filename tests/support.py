"""Test helpers: wait for lifecycle transitions through the admin watch, never by sleeping."""

from __future__ import annotations

import anyio

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
