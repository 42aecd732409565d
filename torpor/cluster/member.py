"""ClusterMember: one node's membership and leases, run for as long as its runtime runs.

Tasks owned here and stopped on exit:

* the renewer, every ``lease_ttl / 4``: one UPDATE of the node's own row
  renews every lease it holds (a lease is live while its owner's node row is),
  and a plain read in the same statement says which shards this incarnation
  still holds; a lease missing from it was taken over. A node that has not renewed for
  ``lease_ttl - margin`` (monotonic clock) stops serving until it renews again
  (its agents stay: the database's fence refuses anything they write if a
  takeover happened meanwhile, and the next read says which shards went).
* the manager, about every second, and at once when another node announces a
  join, a leave or a release (``LISTEN torpor_leases``): reads the lease table
  (the routing cache), evicts the agents of lost shards, acquires the shards
  rendezvous hashing gives this node that are free or whose owner's node row
  expired, releases rows this node owns but does not serve (a release that
  failed earlier is retried here, so no row is orphaned), and starts handing
  off the shards it gives to another live node.
* one hand-off task per batch of shards leaving: each shard is released as soon
  as its turns have ended (or the hand-off deadline cut them off), not when
  the slowest turn of the batch ends.

After this node could not reach the database for a while (the others likely
could not either), it waits about one TTL before taking shards whose owners'
rows expired meanwhile: they renew and keep their shards instead of having
them taken and handed back.

The runtime supplies a :class:`ShardHost` (what to do with the agents of a
shard that leaves); this package never imports the runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
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

    def shards_leaving(
        self, shards: frozenset[int], deadline: float
    ) -> AsyncIterator[frozenset[int]]:
        """Hand-off (new requests for ``shards`` are already refused): yield them as they
        become free to move, each after its agents were evicted: a shard once its turns
        have ended, all that are left once ``deadline`` seconds have passed (their turns
        cut off)."""
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
        self._conn_lock = asyncio.Lock()  # the manager, hand-offs and admin views share it
        self._tasks: list[asyncio.Task[None]] = []
        self._handoffs: set[asyncio.Task[None]] = set()
        self._renewed_at = 0.0  # monotonic time of the last successful renewal
        self._quiet_until = 0.0  # monotonic: take no expired shard of another node before
        self._paused = False  # serving stopped: no renewal for lease_ttl - margin
        self._departure_written = False  # nodes.departing set for this incarnation
        self._handoff_deadline = config.handoff_deadline  # a leave may allow its turns more
        self._log = log.bind(node=config.node_id)

    # -- lifecycle --------------------------------------------------------------------
    async def __aenter__(self) -> ClusterMember:
        config = self.config
        try:
            conn = await self._manager_conn()
            self._renew_conn = await self._connect("torpor-node-renew")
            shards = await conn.fetchval(sql.CREATE_CLUSTER, config.shards or DEFAULT_SHARDS)
            if config.shards is not None and shards != config.shards:
                raise ConfigError(
                    "shards", f"the cluster was created with {shards} shards, not {config.shards}"
                )
            self.leases.shards = shards  # shards=None adopts the cluster's count
            await conn.execute(sql.CREATE_LEASES, shards)
            started = time.monotonic()
            self.leases.incarnation = await conn.fetchval(
                sql.REGISTER, config.node_id, config.address, config.lease_ttl
            )
            self._renewed_at = started
            self.leases.valid_until = started + config.lease_ttl - config.margin
            await conn.execute(sql.ANNOUNCE, config.node_id)  # the others hand off now
            await self._manage_once()
        except BaseException as exc:
            await self._stop_hand_offs()
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

    async def _depart(self, conn: asyncpg.Connection) -> None:
        await conn.execute(sql.DEPART, self.config.node_id, self.leases.incarnation)
        await conn.execute(sql.ANNOUNCE, self.config.node_id)  # the others stop waiting
        self._departure_written = True

    def depart(self, deadline: float | None = None) -> None:
        """Begin a graceful leave now: serve nothing more, hand every shard off (its turns
        finish up to ``deadline`` seconds, ``NodeConfig.handoff_deadline`` by default),
        take none; :meth:`leave` completes it. A node that drains before it stops calls
        this first (with its drain's grace), so its shards move while it drains."""
        leases = self.leases
        if deadline is not None:
            self._handoff_deadline = deadline
        if not leases.departing:
            leases.departing = True
            leases.takers.pop(self.config.node_id, None)  # routing points at the others now
            leases.changed.set()  # the manager hands everything off now

    async def hand_off_all(self, deadline: float | None = None) -> None:
        """:meth:`depart`, then wait until every shard has been handed off (each as its
        turns end, within the deadline). The node still answers meanwhile: refusals name
        the nodes taking over. :meth:`leave` then has nothing left to wait for."""
        self.depart(deadline)
        rest = self.leases.held - self.leases.leaving
        if rest:
            self._start_hand_off(rest)
        await asyncio.gather(*self._handoffs, return_exceptions=True)

    async def leave(self) -> None:
        """Graceful leave: hand every shard off (turns finish up to the deadline), release
        the leases and expire the node row, so other nodes take over at once."""
        renewer, manager = self._tasks or (None, None)
        self._tasks = []
        self.depart()  # refused requests point at the nodes that stay
        try:
            if manager is not None:
                await _cancel(manager)
            if not self._departure_written:  # the others take each shard as it is released
                with contextlib.suppress(*_DB_ERRORS):
                    await self._run(self._depart)
            rest = self.leases.held - self.leases.leaving
            if rest:
                self._start_hand_off(rest)
            # Each ends by itself: the deadline bounds the turns it waits for.
            await asyncio.gather(*self._handoffs, return_exceptions=True)
            await self._evict_lost()
            if renewer is not None:  # no renewal may bring the row back after LEAVE
                await _cancel(renewer)
                renewer = None
            with contextlib.suppress(*_DB_ERRORS):
                # Expiring the node row frees every lease it still owns (one whose release
                # failed included); the announcement wakes the others to take them now.
                await self._run(self._leave)
        finally:
            await self._stop_hand_offs()
            if renewer is not None:
                await _cancel(renewer)
            await self._close()
            self._log.info("node_left")

    async def _leave(self, conn: asyncpg.Connection) -> None:
        await conn.execute(sql.LEAVE, self.config.node_id, self.leases.incarnation)
        await conn.execute(sql.ANNOUNCE, self.config.node_id)

    async def _stop_hand_offs(self) -> None:
        tasks, self._handoffs = self._handoffs, set()
        for task in tasks:
            await _cancel(task)

    async def _connect(self, name: str) -> asyncpg.Connection:
        settings = node_session_settings(self.leases.idle_timeout)
        settings["application_name"] = name
        settings["lock_timeout"] = str(int(self.config.lock_timeout * 1000))
        return await asyncpg.connect(
            self.dsn, server_settings=settings, timeout=max(2.0, self.config.renew_every),
            command_timeout=max(5.0, 4 * self.config.lock_timeout),
        )

    async def _manager_conn(self) -> asyncpg.Connection:
        """The manager's connection, listening for other nodes' announcements."""
        conn = await self._connect("torpor-node")
        try:
            await conn.add_listener(sql.CHANNEL, self._announced)
        except BaseException:
            conn.terminate()
            raise
        self._conn = conn
        return conn

    def _announced(self, conn: object, pid: int, channel: str, payload: str) -> None:
        if payload != self.config.node_id:
            self.leases.changed.set()  # read the table now, not on the next period

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
            conn = self._conn
            if conn is None or conn.is_closed():
                conn = await self._manager_conn()
            try:
                return await fn(conn)
            except asyncio.CancelledError:
                # A statement cut off mid-flight leaves the connection busy; whoever runs
                # next (leave() after cancelling the manager) gets a fresh one.
                conn.terminate()
                self._conn = None
                raise

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
                conn = self._renew_conn
                if conn is not None and (conn.is_closed() or isinstance(exc, TimeoutError)):
                    conn.terminate()  # a statement that timed out leaves it busy
                    self._renew_conn = None
            except Exception as exc:  # a bug must not stop renewals for good
                self._log.error("lease_renewal_crashed", error=repr(exc), exc_info=True)
            if leases.held and not self._paused and time.monotonic() >= leases.valid_until:
                # Not dropped: nothing here says another node has them. Serving stops
                # (Leases.serving) until a renewal says which are still ours.
                self._paused = True
                self._log.warning("serving_paused", shards=len(leases.held))
            await asyncio.sleep(max(0.0, config.renew_every - (time.monotonic() - started)))

    async def _renew(self, started: float) -> None:
        config = self.config
        leases = self.leases
        if self._renew_conn is None:
            self._renew_conn = await self._connect("torpor-node-renew")
        # Judged against what was held when the statement was sent: a shard the manager
        # acquires meanwhile is not in its answer and must not count as taken over.
        before = {s: leases.epochs[s] for s in leases.held}
        # Bounded on this side too: a reply lost in a partition must not hang renewals.
        alive, shards, epochs = await self._renew_conn.fetchrow(
            sql.RENEW, config.node_id, leases.incarnation, config.lease_ttl,
            timeout=config.renew_every + config.lock_timeout,
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
        now = time.monotonic()
        if now - self._renewed_at > config.lease_ttl / 2:
            # Cut off from the database for a while: so were the others, likely. Their rows
            # may have expired meanwhile; give them about one TTL to renew before taking
            # their shards (each keeps its own instead of a storm of takeovers and returns).
            self._quiet_until = now + config.lease_ttl
            self._log.info("outage_grace", seconds=config.lease_ttl)
        self._renewed_at = now
        leases.valid_until = started + config.lease_ttl - config.margin
        if self._paused:
            self._paused = False
            self._log.info("serving_resumed", shards=len(leases.held))

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
            # Cleared before the pass reads anything: news during the pass (an announcement,
            # a lost shard, a departure) brings the next pass on at once.
            leases.changed.clear()
            try:
                await self._manage_once()
            except _DB_ERRORS as exc:
                self._log.warning("lease_refresh_failed", error=repr(exc))
            except Exception as exc:  # a bug must not stop the passes (rows would orphan)
                self._log.error("lease_manager_failed", error=repr(exc), exc_info=True)
            finally:
                leases.notify()

    async def _manage_once(self) -> None:
        leases = self.leases
        me = self.config.node_id
        await self._evict_lost()
        if leases.departing and not self._departure_written:
            await self._run(self._depart)
        members, rows = await self._run(read_table)
        leases.live = {m.node_id: m.address for m in members if m.live}
        # Desired owners are the live nodes not leaving (this one too, from the moment it
        # decided to, before its row says so).
        live = leases.takers = {
            m.node_id: m.address for m in members
            if m.live and not m.departing and not (m.node_id == me and leases.departing)
        }
        leases.owners = {r.shard: (r.owner, r.address) for r in rows if r.owner and r.live}
        leases.notify()
        if me not in leases.live:
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
        now = time.monotonic()
        # Just back from an outage (the renewer may not have said so yet): the others may be
        # coming back too, so their expired rows are not taken for about one TTL.
        quiet = now < self._quiet_until or now - self._renewed_at > self.config.lease_ttl / 2
        mine = {
            r.shard for r in rows
            if r.owner == me and (r.owner_incarnation or 0) <= incarnation
        }
        want = [
            r.shard for r in rows
            if r.shard not in leases.held
            and r.shard not in leases.lost
            and desired_owner(r.shard, live) == me
            # free, its owner's node row expired (not while other nodes may still be
            # coming back from an outage), or ours without our knowing (an older
            # incarnation, dropped here, or a release that failed): taking it again
            # moves the epoch on
            and (r.owner is None or r.shard in mine or (not r.live and not quiet))
        ]
        if want:
            await self._acquire(want)
        # Rows this node owns but does not serve (a release that failed, a hand-off cut
        # short): released now, or they would stay owned, and refused, for as long as
        # this node lives.
        strays = sorted(
            s for s in mine
            if s not in leases.held and s not in leases.lost and desired_owner(s, live) != me
        )
        if strays:
            await self._release(strays)
        away = {s for s in leases.held - leases.leaving if desired_owner(s, live) != me}
        if away:
            self._start_hand_off(away)

    async def _evict_lost(self) -> None:
        lost = self.leases.take_lost()
        if lost:
            await self._host.shards_lost(frozenset(lost))

    async def _acquire(self, shards: list[int]) -> None:
        leases = self.leases
        config = self.config
        acquired = await self._run(lambda c: c.fetch(
            sql.ACQUIRE, config.node_id, leases.incarnation, shards
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

    async def _release(self, shards: list[int]) -> None:
        """Free the rows (an append holding one defers it to a later pass)."""
        config = self.config
        incarnation = self.leases.incarnation

        async def release(conn: asyncpg.Connection) -> list[int]:
            rows = await conn.fetch(sql.RELEASE, config.node_id, incarnation, shards)
            if rows:
                await conn.execute(sql.ANNOUNCE, config.node_id)  # the new owners take them now
            return [shard for (shard,) in rows]

        try:
            released = await self._run(release)
        except _DB_ERRORS as exc:  # still ours in the table: the manager retries
            self._log.warning("lease_release_failed", shards=shards, error=repr(exc))
            return
        if released:
            self._log.info("shards_released", count=len(released))

    # -- hand-off -----------------------------------------------------------------------
    def _start_hand_off(self, shards: set[int]) -> None:
        leases = self.leases
        leases.leaving |= shards
        leases.notify()
        task = asyncio.get_running_loop().create_task(
            self._hand_off(frozenset(shards)), name=f"torpor-hand-off-{self.config.node_id}"
        )
        self._handoffs.add(task)
        task.add_done_callback(self._handed_off)

    def _handed_off(self, task: asyncio.Task[None]) -> None:
        self._handoffs.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.warning("hand_off_failed", error=repr(task.exception()))

    async def _hand_off(self, shards: frozenset[int]) -> None:
        leases = self.leases
        try:
            async for ready in self._host.shards_leaving(shards, self._handoff_deadline):
                self._let_go(ready)
                await self._release(sorted(ready))
        finally:
            # Cut short (the node stops, or the host failed): stop serving what is left;
            # the manager's next pass evicts it and releases its rows.
            leases.drop({s for s in shards if s in leases.leaving})

    def _let_go(self, shards: frozenset[int]) -> None:
        leases = self.leases
        leases.held -= shards
        leases.leaving -= shards
        for shard in shards:
            leases.epochs.pop(shard, None)  # nothing more is written under these leases
            leases.owners.pop(shard, None)
        leases.notify()
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
