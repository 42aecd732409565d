"""The store contract suite: one test, every backend.

Fixtures (conftest.py):

* ``store``: an open store on a private in-memory SQLite database, on a SQLite
  WAL file, and on a fresh schema of the throwaway PostgreSQL cluster
  (``sqlite-memory`` / ``sqlite-file`` / ``postgres``);
* ``any_backend``: the same three, as a :class:`Backend` to open stores with
  options (a token counter, a threshold);
* ``backend``: the two that outlive a store (``sqlite`` file / ``postgres``), for
  tests that reopen the database or run raw SQL behind the store's back (to
  delete a row, downgrade a schema, inspect a table).

PostgreSQL cases skip, saying why, only where this machine has no PostgreSQL
binaries to run a throwaway cluster (or no asyncpg).

SQL is written once, with ``?`` placeholders; for PostgreSQL they become
``$1, $2, …``. Both schemas name the same tables and columns.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torpor.store import SQLiteStore

if TYPE_CHECKING:
    from torpor.store.postgres import PostgresStore

    AnyStore = SQLiteStore | PostgresStore
else:
    AnyStore = Any

__all__ = ["MEMORY_TABLES", "AnyStore", "Backend"]

# The derived-memory tables (SQLite version 5): a test that downgrades a schema drops them.
MEMORY_TABLES = ("memory_episodes", "memory_facts", "memory_ledger", "memory_turns")


@dataclass
class Backend:
    name: str  # "sqlite" or "postgres"
    location: str | None  # the SQLite file (None: in memory), or the PostgreSQL URL

    @property
    def postgres(self) -> bool:
        return self.name == "postgres"

    @contextlib.asynccontextmanager
    async def open(self, **options: Any) -> AsyncIterator[AnyStore]:
        if self.name == "sqlite":
            async with SQLiteStore(self.location, **options) as store:
                yield store
        else:
            from torpor.store.postgres import PostgresStore

            async with PostgresStore(self.location, **options) as pg_store:
                yield pg_store

    async def sql(self, statement: str, *args: Any) -> list[tuple[Any, ...]]:
        """One statement behind the store's back, committed; its rows."""
        assert self.location is not None, "an in-memory database has no back to go behind"
        if self.name == "sqlite":
            raw = sqlite3.connect(self.location)
            try:
                rows = raw.execute(statement, args).fetchall()
                raw.commit()
                return rows
            finally:
                raw.close()
        import asyncpg

        numbered = iter(range(1, 1000))
        pg_statement = re.sub(r"\?", lambda _: f"${next(numbered)}", statement)
        conn = await asyncpg.connect(self.location)
        try:
            return [tuple(row) for row in await conn.fetch(pg_statement, *args)]
        finally:
            await conn.close()

    async def delete_event(self, conversation_id: str, position: int) -> None:
        await self.sql(
            "DELETE FROM events WHERE position = ? AND conversation_id = "
            "(SELECT key FROM conversations WHERE external_id = ?)",
            position,
            conversation_id,
        )
