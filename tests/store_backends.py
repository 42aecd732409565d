"""Run one store test on both backends: a real SQLite file and a real PostgreSQL database.

The ``backend`` fixture (conftest.py, parametrized ``sqlite`` / ``postgres``)
gives a :class:`Backend`: it opens stores on a fresh database and runs raw SQL
behind the store's back (to delete a row, downgrade a schema, inspect a table).

SQL is written once, with ``?`` placeholders; for PostgreSQL they become
``$1, $2, …``. Both schemas name the same tables and columns.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from torpor.store import EventStore, SQLiteStore

__all__ = ["Backend"]


@dataclass
class Backend:
    name: str  # "sqlite" or "postgres"
    location: str  # the SQLite file, or the PostgreSQL URL

    @contextlib.asynccontextmanager
    async def open(self, **options: Any) -> AsyncIterator[EventStore]:
        if self.name == "sqlite":
            async with SQLiteStore(self.location, **options) as store:
                yield store
        else:
            from torpor.store.postgres import PostgresStore

            async with PostgresStore(self.location, **options) as pg_store:
                yield pg_store

    async def sql(self, statement: str, *args: Any) -> list[tuple[Any, ...]]:
        """One statement behind the store's back, committed; its rows."""
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
