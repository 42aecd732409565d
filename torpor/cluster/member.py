"""ClusterMember: one node's membership and leases, run for as long as its runtime runs.

Two tasks, owned here and stopped on exit:

* the renewer, every ``lease_ttl / 4``: one statement renews the node row and
  every lease the node holds; a lease missing from its answer was taken over;
  a node that has not renewed for ``lease_ttl - margin`` (monotonic clock)
  stops serving everything;
* the manager, about every second (sooner when something was lost): reads the
  lease table (the routing cache), evicts the agents of lost shards, acquires
  the shards rendezvous hashing gives this node that are free or expired, and
  hands off the ones it gives to another live node.

The runtime supplies a :class:`ShardHost` (what to do with the agents of a
shard that leaves); this package never imports the runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Protocol, TypeVar

import asyncpg

from torpor._logging import get_logger
from torpor.cluster import sql
from torpor.cluster.config import DEFAULT_SHARDS, NodeConfig
from torpor.cluster.leases import Leases
from torpor.cluster.shards import desired_owner
from torpor.cluster.table import read_table
from torpor.cluster.view import ClusterView
from torpor.errors import ConfigError, StoreUnavailable
from torpor.store.postgres.errors import DRIVER_ERRORS
from torpor.store.postgres.store import node_session_settings

__all__ = ["ClusterMember", "ShardHost"]

log = get_logger(__name__)

T = TypeVar("T")

_DB_ERRORS = DRIVER_ERRORS


class ShardHost(Protocol):
    async def shards_lost(self, shards: frozenset[int]) -> None:
        """The leases are gone: evict the agents now and fail their waiting requests."""
        ...

    async def shards_leaving(self, shards: frozenset[int], deadline: float) -> None:
        """Hand-off: let turns of ``shards`` finish (up to ``deadline`` seconds), then
        evict their agents. New requests for them are already refused."""
        ...

    def shards_gained(self, shards: frozenset[int]) -> None:
        """The leases are ours now: pick up what their conversations left waiting."""
        ...


class ClusterMember:
    def __init__(self, dsn: str, config: NodeConfig, host: ShardHost) -> None:
        self.dsn = dsn
        self.config = config
        self.leases = Leases(config)
        self._host = host
        self._renew_conn: asyncpg.Connection | None = None
        self._conn: asyncpg.Connection | None = None
        self._conn_lock = asyncio.Lock()  # the manager and admin views share one connection
        self._tasks: list[asyncio.Task[None]] = []
        self._log = log.bind(node=config.node_id)

    # -- lifecycle --------------------------------------------------------------------
    async def __aenter__(self) -> ClusterMember:
        config = self.config
        try:
            self._conn = await self._connect("torpor-node")
            self._renew_conn = await self._connect("torpor-node-renew")
            shards = await self._conn.fetchval(
                sql.CREATE_CLUSTER, config.shards or DEFAULT_SHARDS
            )
            if config.shards is not None and shards != config.shards:
                raise ConfigError(
                    "shards", f"the cluster was created with {shards} shards, not {config.shards}"
                )
            self.leases.shards = shards  # shards=None adopts the cluster's count
            await self._conn.execute(sql.CREATE_LEASES, shards)
            started = time.monotonic()
            self.leases.incarnation = await self._conn.fetchval(
                sql.REGISTER, config.node_id, config.address, config.lease_ttl
            )
            self.leases.valid_until = started + config.lease_ttl - config.margin
            await self._manage_once()
        except BaseException as exc:
            await self._close()
            if isinstance(exc, _DB_ERRORS):
                raise StoreUnavailable(f"cannot join the cluster: {exc!r}") from exc
            raise
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._renewer(), name=f"torpor-renew-{config.node_id}"),
            loop.create_task(self._manager(), name=f"torpor-leases-{config.node_id}"),
        ]
        self._log.info("node_joined", incarnation=self.leases.incarnation,
                       shards=len(self.leases.held))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.leave()

    async def leave(self) -> None:
        """Graceful leave: hand every shard off (turns finish up to the deadline), release
        the leases and expire the node row, so other nodes take over at once."""
        renewer, manager = self._tasks or (None, None)
        self._tasks = []
        self.leases.departing = True  # refused requests point at the nodes that stay
        try:
            if manager is not None:
                await _cancel(manager)
            held = set(self.leases.held)
            if held:
                await self._hand_off(held)
            await self._evict_lost()
            with contextlib.suppress(*_DB_ERRORS):
                await self._run(lambda c: c.execute(
                    sql.LEAVE, self.config.node_id, self.leases.incarnation
                ))
        finally:
            if renewer is not None:
                await _cancel(renewer)
            await self._close()
            self._log.info("node_left")

    async def _connect(self, name: str) -> asyncpg.Connection:
        settings = node_session_settings(self.leases.idle_timeout)
        settings["application_name"] = name
        settings["lock_timeout"] = str(int(self.config.lock_timeout * 1000))
        return await asyncpg.connect(self.dsn, server_settings=settings)

    async def _close(self) -> None:
        for conn in (self._conn, self._renew_conn):
            if conn is not None and not conn.is_closed():
                try:
                    await conn.close(timeout=2)
                except Exception:  # broken: drop it
                    conn.terminate()
        self._conn = self._renew_conn = None

    async def _run(self, fn: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        async with self._conn_lock:
            if self._conn is None or self._conn.is_closed():
                self._conn = await self._connect("torpor-node")
            return await fn(self._conn)

    # -- renewal ------------------------------------------------------------------------
    async def _renewer(self) -> None:
        config = self.config
        leases = self.leases
        while True:
            started = time.monotonic()
            try:
                await self._renew(started)
            except _DB_ERRORS as exc:
                self._log.warning("lease_renewal_failed", error=repr(exc))
                if self._renew_conn is not None and self._renew_conn.is_closed():
                    self._renew_conn = None
            if leases.held and time.monotonic() >= leases.valid_until:
                self._log.warning("leases_expired_locally", shards=len(leases.held))
                leases.drop(set(leases.held))
            await asyncio.sleep(max(0.0, config.renew_every - (time.monotonic() - started)))

    async def _renew(self, started: float) -> None:
        config = self.config
        leases = self.leases
        if self._renew_conn is None:
            self._renew_conn = await self._connect("torpor-node-renew")
        # Judged against what was held when the statement was sent: a shard the manager
        # acquires meanwhile is not in its answer and must not count as taken over.
        before = {s: leases.epochs[s] for s in leases.held}
        alive, shards, epochs = await self._renew_conn.fetchrow(
            sql.RENEW, config.node_id, leases.incarnation, config.lease_ttl
        )
        if not alive:  # another process registered under this node id: we are fenced
            self._log.error("node_superseded", incarnation=leases.incarnation)
            leases.drop(set(leases.held))
            return
        renewed = dict(zip(shards, epochs, strict=True))
        gone = {s for s, e in before.items() if renewed.get(s) != e and s in leases.held
                and leases.epochs.get(s) == e}
        if gone:
            self._log.warning("leases_taken_over", shards=sorted(gone))
            leases.drop(gone)
        leases.valid_until = started + config.lease_ttl - config.margin

    # -- the lease table ------------------------------------------------------------------
    async def _manager(self) -> None:
        leases = self.leases
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that
            # lands as the event fires (a takeover as the node leaves), and leave() would
            # then wait for this loop forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.refresh_every):
                    await leases.changed.wait()
            try:
                await self._manage_once()
            except _DB_ERRORS as exc:
                self._log.warning("lease_refresh_failed", error=repr(exc))
            finally:
                leases.notify()

    async def _manage_once(self) -> None:
        leases = self.leases
        me = self.config.node_id
        await self._evict_lost()
        members, rows = await self._run(read_table)
        live = {m.node_id: m.address for m in members if m.live}
        leases.live = live
        leases.owners = {r.shard: (r.owner, r.address) for r in rows if r.owner and r.live}
        leases.notify()
        if me not in live:
            return  # our own row expired: the renewer finds out and drops everything
        incarnation = leases.incarnation
        gone = {
            r.shard for r in rows
            if r.shard in leases.held
            and (r.owner != me or r.owner_incarnation != incarnation
                 or r.epoch != leases.epochs.get(r.shard))
        }
        if gone:
            leases.drop(gone)
        # A lost shard's agents are gone before it may be acquired again: none of them
        # may write under the new epoch.
        await self._evict_lost()
        want = [
            r.shard for r in rows
            if r.shard not in leases.held
            and r.shard not in leases.lost
            and desired_owner(r.shard, live) == me
            # free, expired, or ours without our knowing (an older incarnation, or dropped
            # here when renewals failed): taking it again moves the epoch on
            and (r.owner is None or not r.live
                 or (r.owner == me and (r.owner_incarnation or 0) <= incarnation))
        ]
        if want:
            await self._acquire(want)
        away = {s for s in leases.held if desired_owner(s, live) != me}
        if away:
            await self._hand_off(away)

    async def _evict_lost(self) -> None:
        lost = self.leases.take_lost()
        if lost:
            await self._host.shards_lost(frozenset(lost))

    async def _acquire(self, shards: list[int]) -> None:
        leases = self.leases
        config = self.config
        acquired = await self._run(lambda c: c.fetch(
            sql.ACQUIRE, config.node_id, leases.incarnation, shards, config.lease_ttl
        ))
        for shard, epoch, previous in acquired:
            leases.epochs[shard] = epoch
            leases.held.add(shard)
            leases.owners[shard] = (config.node_id, config.address)
            if previous is not None and previous != config.node_id:
                leases.takeovers += 1
        if acquired:
            self._log.info("shards_acquired", count=len(acquired))
            self._host.shards_gained(frozenset(shard for shard, _, _ in acquired))

    async def _hand_off(self, shards: set[int]) -> None:
        leases = self.leases
        config = self.config
        leases.leaving |= shards
        leases.notify()
        try:
            await self._host.shards_leaving(frozenset(shards), config.handoff_deadline)
        finally:
            leases.held -= shards
            leases.leaving -= shards
            for shard in shards:
                leases.epochs.pop(shard, None)  # nothing more is written under these leases
                leases.owners.pop(shard, None)
            try:
                await self._run(lambda c: c.execute(
                    sql.RELEASE, config.node_id, leases.incarnation, sorted(shards)
                ))
            except _DB_ERRORS as exc:  # they expire by themselves then
                self._log.warning("lease_release_failed", error=repr(exc))
            self._log.info("shards_handed_off", count=len(shards))

    # -- admin --------------------------------------------------------------------------
    async def view(self) -> ClusterView:
        """This node's shards and the cluster as the database sees it now."""
        members, table = await self._run(read_table)
        leases = self.leases
        return ClusterView(
            node_id=self.config.node_id,
            incarnation=leases.incarnation,
            address=self.config.address,
            shard_count=leases.shards,
            shards={s: leases.epochs[s] for s in sorted(leases.held)},
            leaving=tuple(sorted(leases.leaving)),
            serving=time.monotonic() < leases.valid_until,
            fenced_appends=leases.fenced_appends,
            takeovers=leases.takeovers,
            members=members,
            leases=table,
        )


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
