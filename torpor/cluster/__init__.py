"""Scale-out: several runtime nodes on one PostgreSQL, each conversation owned by one fenced writer.

Design (issue 12; DESIGN.md "Scale-out"). PostgreSQL is the only authority:
its row locks order writers and its ``now()`` times every lease; no node
compares its own clock with another's.

* Shards. A fixed number (``cluster`` row, default 512, set by the first node).
  A conversation's shard is ``crc32(routing_key(id)) % shards`` (stored once,
  on its ``conversations`` row): the id, or only its ``{hash tag}`` if it has
  one, so a sub-agent ``{p}/call`` shares its parent ``p``'s shard. Shards move
  whole: hibernated and evicted conversations need no bookkeeping of their own.
* Membership. ``nodes(node_id, incarnation, address, lease_until)``: a node
  registers with a new incarnation and renews every ``lease_ttl / 4`` with ONE
  statement that also renews every lease it holds (:data:`sql.RENEW`).
* Leases. ``shard_leases(shard, owner, owner_incarnation, epoch, lease_until)``.
  Every node computes the same desired owner per shard by rendezvous hashing
  over the live nodes; the lease row is the truth. Acquiring increments the
  epoch, only where the lease is free or expired (or still held by this node
  id: an older incarnation after a restart, or this one after it stopped
  serving the shard), under ``lock_timeout``.
* Fencing. The node's store presents ``(shard, epoch)`` with every append; the
  group-commit batch reads the shards' lease rows ``FOR SHARE`` in the same
  statement that locks the conversation rows, and an op whose epoch is not
  current fails alone with :class:`~torpor.errors.FencedError` (the rest of the
  batch commits). A takeover's UPDATE therefore waits for appends in flight,
  and every later append sees the new epoch. Each event row records its epoch.
  Checkpoints, model-call rows and artifacts go through the same batch and are
  fenced the same way; derived-memory writes check the epoch ``FOR SHARE`` in
  their own transaction (a stale checkpoint would otherwise become the latest).
  Connections set ``idle_in_transaction_session_timeout`` (``lease_ttl / 2``)
  and TCP keepalives, so a stopped node cannot hold a share lock through a
  takeover.
* Losing a shard (FencedError, a renewal that no longer returns it, or no
  successful renewal for ``lease_ttl - margin`` by the monotonic clock): the
  node stops serving it at once, evicts its agents and fails their waiting
  requests with :class:`~torpor.errors.ShardMoved`. The new owner revives from
  the log; a turn cut off mid-stream is logged ``Aborted(interrupted)`` by it,
  exactly as after a crash.
* Hand-off (graceful leave, rebalancing on join): stop admitting the shard's
  requests, let turns finish up to ``handoff_deadline``, evict, release the
  lease; the next owner acquires it on its next refresh.
* Routing. A request for a shard this node does not serve raises
  :class:`~torpor.errors.NotOwner` with the owner's advertised address, from a
  cache of the lease table refreshed about every second; the HTTP layer proxies.

Not guaranteed: a tool call made by a turn that is cut off may run again on the
new owner (tools that must run once take an idempotency key).
"""

# Light imports only: the members (asyncpg) live in torpor.cluster.member, imported by the
# runtime when a node joins, so importing torpor never needs the postgres extra.
from torpor.cluster.config import NodeConfig
from torpor.cluster.shards import desired_owner, routing_key, shard_of
from torpor.cluster.view import ClusterView, LeaseInfo, MemberInfo

__all__ = [
    "ClusterView",
    "LeaseInfo",
    "MemberInfo",
    "NodeConfig",
    "desired_owner",
    "routing_key",
    "shard_of",
]
