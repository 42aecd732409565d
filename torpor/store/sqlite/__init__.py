"""The SQLite backend: group-commit writer, WAL readers, FTS5 search."""

from torpor.store.sqlite.store import SQLiteStore

__all__ = ["SQLiteStore"]
