"""The statements of cluster membership and shard leases (schema: torpor.store.postgres.schema v4).

Every time is the database's ``now()``; nodes never compare their own clocks.
Statements that lock lease rows lock them in shard order, as the append
batches do (``FOR SHARE``), so they can wait for each other but never
deadlock. Each runs alone (autocommit) under the connection's ``lock_timeout``.
"""

from __future__ import annotations

__all__ = [
    "ACQUIRE",
    "CREATE_CLUSTER",
    "CREATE_LEASES",
    "LEASES",
    "LEAVE",
    "NODES",
    "REGISTER",
    "RELEASE",
    "RENEW",
]

# The shard count is fixed by whoever creates the cluster row first; later nodes read it.
CREATE_CLUSTER = """
WITH c AS (
    INSERT INTO cluster (shards) VALUES ($1) ON CONFLICT (singleton) DO NOTHING RETURNING shards
)
SELECT shards FROM c UNION ALL SELECT shards FROM cluster LIMIT 1
"""

CREATE_LEASES = """
INSERT INTO shard_leases (shard) SELECT generate_series(0, $1 - 1) ON CONFLICT DO NOTHING
"""

# A new incarnation on every start: the leases of an older one are fenced.
REGISTER = """
INSERT INTO nodes (node_id, incarnation, address, lease_until)
VALUES ($1, 1, $2, now() + make_interval(secs => $3))
ON CONFLICT (node_id) DO UPDATE SET incarnation = nodes.incarnation + 1,
    address = excluded.address, lease_until = excluded.lease_until
RETURNING incarnation
"""

# The one renewal statement per node and period: the node row and every lease it holds.
# Returns whether the node row was still ours and the (shard, epoch) pairs still held.
RENEW = """
WITH n AS (
    UPDATE nodes SET lease_until = now() + make_interval(secs => $3)
    WHERE node_id = $1 AND incarnation = $2
    RETURNING node_id
),
mine AS (
    SELECT shard FROM shard_leases
    WHERE owner = $1 AND owner_incarnation = $2 AND EXISTS (SELECT 1 FROM n)
    ORDER BY shard FOR UPDATE
),
r AS (
    UPDATE shard_leases AS s SET lease_until = now() + make_interval(secs => $3)
    FROM mine WHERE s.shard = mine.shard
    RETURNING s.shard, s.epoch
)
SELECT EXISTS (SELECT 1 FROM n), array(SELECT shard FROM r), array(SELECT epoch FROM r)
"""

# Take shards that are free, expired, or held by this node itself (an older incarnation,
# or this one after it stopped serving them); the epoch moves on, so every append of the
# previous holder is refused from now on. Waits (up to lock_timeout) for appends in
# flight, which hold the rows FOR SHARE.
ACQUIRE = """
WITH w AS (
    SELECT shard, owner FROM shard_leases
    WHERE shard = ANY($3::int[])
      AND (owner IS NULL OR lease_until < now() OR (owner = $1 AND owner_incarnation <= $2))
      AND EXISTS (
          SELECT 1 FROM nodes WHERE node_id = $1 AND incarnation = $2 AND lease_until > now()
      )
    ORDER BY shard FOR UPDATE
)
UPDATE shard_leases AS s
SET owner = $1, owner_incarnation = $2, epoch = s.epoch + 1,
    lease_until = now() + make_interval(secs => $4)
FROM w WHERE s.shard = w.shard
RETURNING s.shard, s.epoch, w.owner
"""

# Hand shards back (graceful leave, rebalancing): free at once, the epoch kept; the next
# owner's acquisition moves it on.
RELEASE = """
WITH w AS (
    SELECT shard FROM shard_leases
    WHERE shard = ANY($3::int[]) AND owner = $1 AND owner_incarnation = $2
    ORDER BY shard FOR UPDATE
)
UPDATE shard_leases AS s SET owner = NULL, owner_incarnation = NULL, lease_until = NULL
FROM w WHERE s.shard = w.shard
"""

LEAVE = """
UPDATE nodes SET lease_until = now() WHERE node_id = $1 AND incarnation = $2
"""

LEASES = """
SELECT s.shard, s.owner, s.owner_incarnation, s.epoch, s.lease_until,
    coalesce(s.lease_until > now(), false), n.address
FROM shard_leases AS s
LEFT JOIN nodes AS n ON n.node_id = s.owner AND n.incarnation = s.owner_incarnation
ORDER BY s.shard
"""

NODES = """
SELECT node_id, incarnation, address, lease_until, lease_until > now() FROM nodes
ORDER BY node_id
"""
