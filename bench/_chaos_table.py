"""The lease table as a chaos run watches it: who serves each shard, read from PostgreSQL.

A lease is live while its owner's node row, of the same incarnation, is live and the
row's own ``lease_until`` (where the schema still writes one) has not passed: that
holds for the renew-every-row scheme and for liveness kept in the node row alone.
The connection survives PostgreSQL going away (it reconnects on the next read).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import asyncpg

from torpor.cluster import desired_owner

__all__ = ["Lease", "Table"]

_LEASES = """
SELECT s.shard, s.owner, s.owner_incarnation, s.epoch,
       s.owner IS NOT NULL
       AND (s.lease_until IS NULL OR s.lease_until > now())
       AND EXISTS (SELECT 1 FROM nodes n WHERE n.node_id = s.owner
                   AND n.incarnation = s.owner_incarnation AND n.lease_until > now())
FROM shard_leases s ORDER BY s.shard
"""
_NODES = "SELECT node_id, incarnation, lease_until > now() FROM nodes"
_POLL = 0.02


@dataclass(frozen=True)
class Lease:
    shard: int
    owner: str | None
    incarnation: int | None
    epoch: int
    live: bool


class Table:
    def __init__(self, db: str, shards: int) -> None:
        self.db = db
        self.shards = shards
        self._conn: asyncpg.Connection | None = None

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close(timeout=2)
            self._conn = None

    async def _fetch(self, query: str) -> list[asyncpg.Record]:
        """Rows, or an exception when PostgreSQL cannot answer now (the caller polls on)."""
        try:
            if self._conn is None or self._conn.is_closed():
                self._conn = await asyncpg.connect(self.db, timeout=3)
            async with asyncio.timeout(5):
                rows: list[asyncpg.Record] = await self._conn.fetch(query)
                return rows
        except BaseException:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.terminate()
            raise

    async def leases(self) -> dict[int, Lease]:
        return {r[0]: Lease(r[0], r[1], r[2], r[3], bool(r[4])) for r in await self._fetch(_LEASES)}

    async def nodes(self) -> dict[str, tuple[int, bool]]:
        return {r[0]: (r[1], bool(r[2])) for r in await self._fetch(_NODES)}

    async def try_leases(self) -> dict[int, Lease] | None:
        try:
            return await self.leases()
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
            return None

    def served(self, table: dict[int, Lease], live: set[str]) -> bool:
        """Every shard held by a live lease of a node in ``live``."""
        return len(table) == self.shards and all(
            lease.live and lease.owner in live for lease in table.values())

    def balanced(self, table: dict[int, Lease], live: set[str]) -> bool:
        """Every shard held, live, by the node rendezvous hashing gives it among ``live``."""
        return len(table) == self.shards and all(
            lease.live and lease.owner == desired_owner(lease.shard, live)
            for lease in table.values())

    async def until(self, what: str, live: set[str], since: float,
                    limit: float) -> float | None:
        """Seconds from ``since`` until the table is ``what`` ("served" or "balanced") for
        ``live``; None if it was not within ``limit`` seconds of now (a hang guard)."""
        check = self.served if what == "served" else self.balanced
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            table = await self.try_leases()
            if table is not None and check(table, live):
                return round(time.monotonic() - since, 3)
            await asyncio.sleep(_POLL)
        return None

    async def first_shard(self, name: str, since: float, limit: float) -> dict[str, float | None]:
        """A node joining as ``name``: seconds from ``since`` until its node row shows a new
        incarnation (it registered), and from then until it holds its first live shard."""
        before = await self.nodes()
        old = before[name][0] if name in before else 0
        registered: float | None = None
        incarnation = None
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                if registered is None:
                    row = (await self.nodes()).get(name)
                    if row is not None and row[0] > old:
                        registered, incarnation = time.monotonic(), row[0]
                if registered is not None:
                    table = await self.leases()
                    if any(lease.live and lease.owner == name
                           and lease.incarnation == incarnation for lease in table.values()):
                        now = time.monotonic()
                        return {"registered_s": round(registered - since, 3),
                                "first_shard_after_registering_s": round(now - registered, 3)}
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
                pass
            await asyncio.sleep(_POLL / 2)
        return {"registered_s": None if registered is None else round(registered - since, 3),
                "first_shard_after_registering_s": None}
