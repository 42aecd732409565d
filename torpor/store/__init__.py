"""The log: the EventStore protocol, its records, and :func:`open_store`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from torpor.errors import ConfigError
from torpor.store.fence import Fence
from torpor.store.prepare import estimate_tokens
from torpor.store.protocol import (
    Checkpoint,
    ConversationInfo,
    EventStore,
    HintExtractor,
    Marker,
    ModelCall,
    OpenCall,
    PendingApproval,
    PendingCall,
    PendingSummary,
    Resume,
    SearchHit,
    TokenCounter,
)
from torpor.store.sqlite import SQLiteStore
from torpor.store.sqlite.schema import Durability
from torpor.store.url import UnsupportedStoreURL, parse_store_url

__all__ = [
    "Checkpoint",
    "ConversationInfo",
    "Durability",
    "EventStore",
    "Fence",
    "HintExtractor",
    "Marker",
    "ModelCall",
    "OpenCall",
    "PendingApproval",
    "PendingCall",
    "PendingSummary",
    "Resume",
    "SQLiteStore",
    "SearchHit",
    "TokenCounter",
    "UnsupportedStoreURL",
    "estimate_tokens",
    "open_store",
]


@asynccontextmanager
async def open_store(
    url: str,
    *,
    token_counter: TokenCounter | None = None,
    hint_extractor: HintExtractor | None = None,
    durability: Durability = "normal",
    artifact_threshold: int = 16 * 1024,
    max_event_bytes: int = 1024 * 1024,
    fence: Fence | None = None,
) -> AsyncIterator[EventStore]:
    """Open the store a URL names; close it (committing queued writes) on exit.

    ``sqlite://`` is a private in-memory database, ``sqlite:///rel.db`` a path
    relative to the working directory, ``sqlite:////abs.db`` an absolute path.
    ``postgresql://user@host:port/db`` (or ``postgres://``) is a PostgreSQL
    database (needs the ``postgres`` extra).
    Other schemes raise :class:`UnsupportedStoreURL` (a StoreError and ValueError).
    ``token_counter`` and ``hint_extractor`` are called once per appended event and
    their results stored with it (the runtime passes compaction's).
    ``fence`` (PostgreSQL only) makes every append present a shard lease epoch;
    :mod:`torpor.cluster` passes it for a node of a cluster.
    """
    location = parse_store_url(url)
    if fence is not None and location.backend != "postgres":
        raise ConfigError("node", "a cluster of nodes needs a postgresql:// store")
    if location.backend == "postgres":
        try:
            from torpor.store.postgres import PostgresStore
        except ImportError as exc:
            raise UnsupportedStoreURL(
                f"store URL {url!r} needs asyncpg: pip install 'torpor[postgres]'"
            ) from exc
        async with PostgresStore(
            url,
            token_counter=token_counter,
            hint_extractor=hint_extractor,
            durability=durability,
            artifact_threshold=artifact_threshold,
            max_event_bytes=max_event_bytes,
            fence=fence,
        ) as pg_store:
            yield pg_store
        return
    async with SQLiteStore(
        location.path,
        token_counter=token_counter,
        hint_extractor=hint_extractor,
        durability=durability,
        artifact_threshold=artifact_threshold,
        max_event_bytes=max_event_bytes,
    ) as store:
        yield store
