"""What one node knows about its leases: the shards it serves, their epochs, who owns the rest.

This is the :class:`~torpor.store.fence.Fence` the node's store asks for the
epoch of every append, and what the runtime asks before serving a request.
Serving needs the shard held *and* the last successful renewal recent enough
(monotonic clock: ``valid_until``), so a node cut off from the database stops
serving on its own before the database lets another node take over. Writing
only needs an epoch: the database, not this cache, decides whether it is
still current (an append of a turn cut off by a lost lease is refused there).
"""

from __future__ import annotations

import asyncio
import time

from torpor._logging import get_logger
from torpor.cluster.config import DEFAULT_SHARDS, NodeConfig
from torpor.cluster.shards import desired_owner, shard_of
from torpor.errors import FencedError

__all__ = ["Leases", "Owner"]

log = get_logger(__name__)

Owner = tuple[str, str | None]
"""A shard's owner in the routing cache: node id, advertised address."""


class Leases:
    """The node's lease state; mutated only by its :class:`~torpor.cluster.member.ClusterMember`."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        # The cluster's count; the member sets it from the cluster row when it joins.
        self.shards = config.shards or DEFAULT_SHARDS
        self.incarnation = 0
        self.epochs: dict[int, int] = {}  # shard -> epoch this node presents when writing
        self.held: set[int] = set()  # shards this node serves
        self.leaving: set[int] = set()  # held, being handed off: no new requests
        self.departing = False  # graceful leave under way: every shard goes to another node
        self.valid_until = 0.0  # monotonic: serve nothing after this without a renewal
        self.owners: dict[int, Owner] = {}  # routing cache, refreshed about every second
        self.live: dict[str, str] = {}  # live node id -> address, from the same refresh
        # The live nodes that take shards (not leaving): desired owners are among these.
        self.takers: dict[str, str] = {}
        self.lost: set[int] = set()  # dropped, agents not yet evicted (the member does it)
        self.changed = asyncio.Event()  # wakes the member: something was lost
        self.fenced_appends = 0  # appends the database refused (stale epoch)
        self.takeovers = 0  # shards acquired from another node's expired lease
        self._refreshed: asyncio.Future[None] | None = None

    # -- the store's fence ----------------------------------------------------------
    @property
    def idle_timeout(self) -> float:
        # Well inside the TTL: by the time a stopped owner's lease expires, the server
        # has ended its idle transaction and its locks are gone.
        return self.config.lease_ttl / 2

    def hold(self, conversation_id: str) -> tuple[int, int]:
        shard = shard_of(conversation_id, self.shards)
        epoch = self.epochs.get(shard)
        if epoch is None:
            raise FencedError(conversation_id, shard, None)
        return shard, epoch

    def fenced(self, shard: int, epoch: int) -> None:
        self.fenced_appends += 1
        log.warning("append_fenced", node=self.config.node_id, shard=shard, epoch=epoch)
        if self.epochs.get(shard) == epoch:
            self.drop({shard})

    # -- serving --------------------------------------------------------------------
    def serving(self, shard: int) -> bool:
        return (
            shard in self.held
            and shard not in self.leaving
            and not self.departing
            and time.monotonic() < self.valid_until
        )

    def moving(self, shard: int) -> bool:
        """``shard`` is in hand-off through this node: leaving it, or this node is its
        desired owner among the live nodes but does not hold it yet (it acquires it once
        the holder lets go or its lease expires). False while this node's own lease is
        not current: cut off from the database, it acquires nothing."""
        if time.monotonic() >= self.valid_until:
            return False
        if shard in self.leaving or (self.departing and shard in self.held):
            return True
        if shard in self.held or self.departing:
            return False
        return desired_owner(shard, self.takers) == self.config.node_id

    def owner_address(self, shard: int) -> str | None:
        """Where to send a request for ``shard`` (None: nobody known to hold it now)."""
        me = self.config.node_id
        owner = self.owners.get(shard)
        if owner is not None and owner[0] != me and shard not in self.leaving:
            return owner[1]
        # Free, handed off or lost (the cache may not show the new owner yet): the node
        # every node computes as its owner, which acquires it on its next refresh.
        target = desired_owner(shard, self.takers)
        if target is None or target == me:
            return None
        return self.live.get(target)

    def drop(self, shards: set[int]) -> None:
        """Stop serving ``shards`` now; the member evicts their agents next."""
        shards = shards & self.held
        if not shards:
            return
        self.held -= shards
        self.leaving -= shards
        self.lost |= shards
        self.changed.set()

    async def next_change(self) -> None:
        """Until the member next reads the lease table or changes what this node holds
        (for tests and tools that wait for the shards to settle without sleeping)."""
        if self._refreshed is None:
            self._refreshed = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._refreshed)

    def notify(self) -> None:
        waiter, self._refreshed = self._refreshed, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take_lost(self) -> set[int]:
        lost, self.lost = self.lost, set()
        return lost
