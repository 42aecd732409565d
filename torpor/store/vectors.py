"""Vectors beside the events: derived from the log, for hybrid recall.

A vector belongs to one event (conversation, position) in one vector *space*
(the embedder's name and dimensions, :func:`torpor.llm.embedding.space_of`), so
vectors of two embedders are never compared. Each conversation also has a
*progress* mark per space: every event up to it has been considered (embedded,
or skipped for having no text), so the embedding worker finds what lags
behind the log without scanning it.

Vectors are unit-normalised float32 before they are stored, so cosine
similarity is a dot product. Nearest-neighbour search is exact and confined to
one conversation's vectors of one space (thousands, not millions: no
approximate index is needed). The backends:

* SQLite (:mod:`torpor.store.sqlite.vectors`): ``sqlite-vec``'s
  ``vec_distance_cosine`` computes the distances inside SQLite when the
  extension loads (``pip install 'torpor[vec]'``, and a Python whose sqlite3
  can load extensions); otherwise the same search runs in Python on the
  reader's thread (brute-force cosine; the event loop is not held).
* PostgreSQL (:mod:`torpor.store.postgres.vectors`): pgvector's ``<=>``
  operator where the ``vector`` extension is installed in the database,
  otherwise a brute-force dot product over ``real[]`` in SQL.

The log never depends on this: vectors can be dropped and rebuilt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torpor.errors import ConfigError
from torpor.store.protocol import EventStore
from torpor.store.vector_format import Vectors, from_blob, to_blob, unit

__all__ = ["VectorIndex", "Vectors", "from_blob", "to_blob", "unit", "vector_index"]


class VectorIndex(Protocol):
    """Vectors of one store. Every method is a coroutine and one trip to the backend."""

    backend: str  # how nearest() computes: "sqlite-vec", "python", "pgvector", "sql"

    async def lagging(self, space: str, limit: int) -> list[tuple[str, int]]:
        """Conversations whose log goes beyond their progress mark in ``space``:
        (conversation id, the mark: -1 when none was set), at most ``limit``."""
        ...

    async def put(self, conversation_id: str, space: str, vectors: Vectors, through: int) -> None:
        """Store (position, vector) pairs and move the progress mark to ``through``
        (never back). Idempotent: a vector already stored is kept."""
        ...

    async def progress(self, conversation_id: str, space: str) -> int:
        """The conversation's progress mark in ``space`` (-1: none)."""
        ...

    async def nearest(
        self, conversation_id: str, space: str, query: Sequence[float], k: int
    ) -> list[tuple[int, float]]:
        """(position, cosine similarity) of the ``k`` nearest vectors, nearest first."""
        ...


def vector_index(store: EventStore) -> VectorIndex:
    """The vector index of a store torpor opened (SQLite or PostgreSQL)."""
    from torpor.store.sqlite.store import SQLiteStore

    if isinstance(store, SQLiteStore):
        from torpor.store.sqlite.vectors import SQLiteVectors

        return SQLiteVectors(store)
    if type(store).__module__.startswith("torpor.store.postgres"):
        from torpor.store.postgres.store import PostgresStore
        from torpor.store.postgres.vectors import PostgresVectors

        assert isinstance(store, PostgresStore)
        return PostgresVectors(store)
    raise ConfigError("embedder", f"{type(store).__name__} keeps no vectors")
