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
  UPDATE of its own row (:data:`sql.RENEW`). Liveness lives there alone.
* Leases. ``shard_leases(shard, owner, owner_incarnation, epoch)``. A lease is
  live while its owner's node row, of the same incarnation, is (as
  CockroachDB's epoch-based range leases): renewing touches no lease row, so
  no append holding one can delay it. Every node computes the same desired
  owner per shard by rendezvous hashing over the live nodes; the lease row is
  the truth. Acquiring increments the epoch, only where the lease is free, its
  owner's row expired, or it is held by this node id (an older incarnation
  after a restart, or this one after it stopped serving the shard); a row an
  append holds is skipped and taken on the next pass. Every row a node owns
  but does not serve is released on its next pass, so a release that failed
  orphans nothing. Joins, leaves and releases are announced
  (``NOTIFY torpor_leases``): the others act at once, not on their next read.
* Fencing. The node's store presents ``(shard, epoch)`` with every append; the
  group-commit batch reads the shards' lease rows ``FOR SHARE`` in the same
  statement that locks the conversation rows, and an op whose epoch is not
  current fails alone with :class:`~torpor.errors.FencedError` (the rest of the
  batch commits). A takeover therefore never changes a row under an append in
  flight (it skips that row until the batch commits), and every later append
  sees the new epoch. Each event row records its epoch.
  Checkpoints, model-call rows and artifacts go through the same batch and are
  fenced the same way; derived-memory writes check the epoch ``FOR SHARE`` in
  their own transaction (a stale checkpoint would otherwise become the latest).
  Connections set ``idle_in_transaction_session_timeout`` (``lease_ttl / 2``)
  and TCP keepalives, so a stopped node cannot hold a share lock through a
  takeover.
* Losing a shard (FencedError, or a renewal or table read that no longer
  returns it): the node stops serving it at once, evicts its agents and fails
  their waiting requests with :class:`~torpor.errors.ShardMoved`. A node that
  has not renewed for ``lease_ttl - margin`` (monotonic clock) stops serving
  everything but keeps its agents until a renewal says which shards went (the
  fence refuses whatever they write meanwhile if a takeover happened); back
  from such an outage it waits about one TTL before taking shards of nodes
  whose rows expired meanwhile, so each keeps its own. The new owner revives
  from the log; a turn cut off mid-stream is logged ``Aborted(interrupted)`` by it,
  exactly as after a crash.
* Hand-off (graceful leave, rebalancing on join): stop admitting the shard's
  requests, let its turns finish up to ``handoff_deadline``, evict, release
  the lease, shard by shard as each one's turns end (an idle shard moves at
  once); the next owner, woken by the announcement, acquires it.
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
from torpor.cluster.view import ClusterView, LeaseInfo, MemberInfo, ShardRoute

__all__ = [
    "ClusterView",
    "LeaseInfo",
    "MemberInfo",
    "NodeConfig",
    "ShardRoute",
    "desired_owner",
    "routing_key",
    "shard_of",
]
