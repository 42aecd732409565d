"""The statements of cluster membership and shard leases (schema: torpor.store.postgres.schema v4).

Every time is the database's ``now()``; nodes never compare their own clocks.
A lease row's liveness is its owner's node row's (``shard_leases.lease_until``
is no longer written). Append batches hold lease rows ``FOR SHARE`` until they
commit; the statements that change lease rows skip a row so held
(``SKIP LOCKED``) and leave it for a later pass, and renewals touch no lease
row at all, so no append can hold up a node's liveness. Each statement runs alone
(autocommit) under the connection's ``lock_timeout``.
"""

from __future__ import annotations

__all__ = [
    "ACQUIRE",
    "ANNOUNCE",
    "CHANNEL",
    "CREATE_CLUSTER",
    "CREATE_LEASES",
    "DEPART",
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
    address = excluded.address, lease_until = excluded.lease_until, departing = false
RETURNING incarnation
"""

# Liveness lives in the node row alone (as CockroachDB's epoch-based leases do): a shard's
# lease is live while its owner's node row, of the same incarnation, is. Renewing is one
# UPDATE of that row; it never locks shard_leases, so no append (which holds lease rows
# FOR SHARE until it commits) can delay it, and a slow batch on one shard cannot cost the
# node its other shards. Returns whether the row was still this incarnation's and the
# (shard, epoch) pairs it holds, read without a lock. A takeover committing while this
# runs (it judged the node expired a moment before) may still be missing from the answer;
# the database's fence refuses the node's appends to that shard meanwhile, and the next
# renewal or table read drops it.
RENEW = """
WITH n AS (
    UPDATE nodes SET lease_until = now() + make_interval(secs => $3)
    WHERE node_id = $1 AND incarnation = $2
    RETURNING node_id
),
mine AS (
    SELECT shard, epoch FROM shard_leases
    WHERE owner = $1 AND owner_incarnation = $2 AND EXISTS (SELECT 1 FROM n)
)
SELECT EXISTS (SELECT 1 FROM n), array(SELECT shard FROM mine ORDER BY shard),
    array(SELECT epoch FROM mine ORDER BY shard)
"""

# Take shards that are free, whose owner's node row has expired (or names another
# incarnation), or held by this node itself (an older incarnation, or this one after it
# stopped serving them); the epoch moves on, so every append of the previous holder is
# refused from now on. SKIP LOCKED: a row an append in flight holds FOR SHARE is left for
# the next pass instead of holding up every other shard of the statement.
ACQUIRE = """
WITH w AS (
    SELECT s.shard, s.owner FROM shard_leases AS s
    WHERE s.shard = ANY($3::int[])
      AND EXISTS (
          SELECT 1 FROM nodes WHERE node_id = $1 AND incarnation = $2 AND lease_until > now()
      )
      AND (s.owner IS NULL
           OR (s.owner = $1 AND s.owner_incarnation <= $2)
           OR NOT EXISTS (
               SELECT 1 FROM nodes AS o
               WHERE o.node_id = s.owner AND o.incarnation = s.owner_incarnation
                 AND o.lease_until > now()
           ))
    ORDER BY s.shard FOR UPDATE SKIP LOCKED
)
UPDATE shard_leases AS s
SET owner = $1, owner_incarnation = $2, epoch = s.epoch + 1, lease_until = NULL
FROM w WHERE s.shard = w.shard
RETURNING s.shard, s.epoch, w.owner
"""

# Hand shards back (graceful leave, rebalancing, or rows this node no longer serves): free
# at once, the epoch kept; the next owner's acquisition moves it on. SKIP LOCKED: a row
# an append holds is released on a later pass (the manager retries every row this node
# owns but does not serve); the rows released are returned.
RELEASE = """
WITH w AS (
    SELECT shard FROM shard_leases
    WHERE shard = ANY($3::int[]) AND owner = $1 AND owner_incarnation <= $2
    ORDER BY shard FOR UPDATE SKIP LOCKED
)
UPDATE shard_leases AS s SET owner = NULL, owner_incarnation = NULL, lease_until = NULL
FROM w WHERE s.shard = w.shard
RETURNING s.shard
"""

# Wakes every node's manager (LISTEN torpor_leases): a node joined, left or let shards go,
# so the others act now instead of on their next periodic read.
CHANNEL = "torpor_leases"
ANNOUNCE = f"SELECT pg_notify('{CHANNEL}', $1)"

# A graceful leave begins: the others stop counting this node as a desired owner, so
# they take each shard as it is released; its row, and every lease it still holds, stays
# live until LEAVE.
DEPART = """
UPDATE nodes SET departing = true WHERE node_id = $1 AND incarnation = $2
"""

LEAVE = """
UPDATE nodes SET lease_until = now() WHERE node_id = $1 AND incarnation = $2
"""

# A lease row's end is its owner's node row's (same incarnation): live while that is.
LEASES = """
SELECT s.shard, s.owner, s.owner_incarnation, s.epoch, n.lease_until,
    coalesce(n.lease_until > now(), false), n.address
FROM shard_leases AS s
LEFT JOIN nodes AS n ON n.node_id = s.owner AND n.incarnation = s.owner_incarnation
ORDER BY s.shard
"""

NODES = """
SELECT node_id, incarnation, address, lease_until, lease_until > now(), departing FROM nodes
ORDER BY node_id
"""
