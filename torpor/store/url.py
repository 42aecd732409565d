"""Parse the store URL a user hands to :func:`torpor.store.open_store`.

One URL names a backend and where its data lives, so moving from a test
in-memory log to a file to PostgreSQL is a configuration change, not a code
change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torpor.errors import UnsupportedStoreURL

__all__ = ["StoreLocation", "UnsupportedStoreURL", "parse_store_url"]



@dataclass(frozen=True, slots=True)
class StoreLocation:
    backend: Literal["sqlite", "postgres"]
    path: str | None  # sqlite: None for a private in-memory database; postgres: the URL


def parse_store_url(url: str) -> StoreLocation:
    """``sqlite://`` (in memory), ``sqlite:///rel.db``, ``sqlite:////abs.db``;
    ``postgresql://user@host:port/db`` or ``postgres://…`` (passed to asyncpg as is).
    """
    if not isinstance(url, str):
        raise UnsupportedStoreURL(f"store URL must be a string, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise UnsupportedStoreURL(
            f"store URL {url!r} has no scheme; use sqlite:///path.db or sqlite:// for memory"
        )
    scheme = scheme.lower()
    if scheme == "sqlite":
        if rest in ("", ":memory:", "/:memory:"):
            return StoreLocation("sqlite", None)
        if not rest.startswith("/"):
            raise UnsupportedStoreURL(
                f"store URL {url!r}: expected sqlite:///relative.db or sqlite:////absolute.db"
            )
        path = rest[1:]  # "/rel.db" -> "rel.db"; "//abs.db" -> "/abs.db"
        if not path:
            raise UnsupportedStoreURL(f"store URL {url!r} names no file")
        return StoreLocation("sqlite", path)
    if scheme in ("postgres", "postgresql"):
        return StoreLocation("postgres", url)
    raise UnsupportedStoreURL(
        f"store URL {url!r}: unknown scheme {scheme!r}; supported: sqlite://, postgresql://"
    )
