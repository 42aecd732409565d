"""NodeConfig: how one runtime process joins a cluster of nodes on one PostgreSQL."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import msgspec

from torpor.validation import (
    Relation,
    Rule,
    check_fields,
    custom,
    integer,
    optional,
    seconds,
    text,
)

__all__ = ["DEFAULT_SHARDS", "NodeConfig"]

MAX_SHARDS = 65_536
DEFAULT_SHARDS = 512
"""The count the first node creates the cluster with when its ``shards`` is None."""


def _address_problem(value: object) -> str | None:
    if not isinstance(value, str):
        return f" ({type(value).__name__})"
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65_536:
        return ""
    return None


class NodeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One node of a cluster: ``Runtime("postgresql://…", node=NodeConfig(...))``.

    ``node_id`` names the node (stable across restarts: a restarted node takes
    its own old leases back at once instead of waiting for them to expire);
    ``address`` (``"host:port"``) is where other nodes send this node's
    requests (``NotOwner.owner``). ``lease_ttl``: a node not heard from for this
    long loses its shards to the others; it renews every quarter of it, and
    stops serving on its own once it has not renewed for three quarters of it.
    ``shards`` is fixed when the first node creates the cluster (None, the
    default: :data:`DEFAULT_SHARDS`); a node with ``shards=None`` adopts the
    cluster's count, and one asking for another count is refused.
    ``handoff_deadline``: on a rebalance (another node joined) or a leave, how
    long in-flight turns of a shard may run before they are cut off (and logged
    ``Aborted``) so the shard can move. Nothing presses a rebalance, and the
    shards without a turn move at once, so the default lets a long turn finish
    (a drain's leave allows its own grace: ``rt.admin.depart(deadline)``).
    """

    node_id: str
    address: str
    lease_ttl: float = 10.0
    shards: int | None = None
    handoff_deadline: float = 30.0

    RULES: ClassVar[Mapping[str, Rule]] = {
        "node_id": text(empty=False),
        "address": custom('a "host:port" string', _address_problem),
        "lease_ttl": seconds(),
        "shards": optional(integer(1, MAX_SHARDS)),
        "handoff_deadline": seconds(zero=True),
    }
    RELATIONS: ClassVar[tuple[Relation, ...]] = (
        Relation(
            ("lease_ttl",),
            lambda c: None if c.lease_ttl >= 0.2 else f"must be >= 0.2, got {c.lease_ttl:g}",
        ),
    )

    def __post_init__(self) -> None:
        check_fields(self, self.RULES, self.RELATIONS)

    @property
    def renew_every(self) -> float:
        """Seconds between renewals (one statement each)."""
        return self.lease_ttl / 4

    @property
    def margin(self) -> float:
        """How long before the database's lease end this node stops trusting its lease."""
        return self.lease_ttl / 4

    @property
    def refresh_every(self) -> float:
        """Seconds between reads of the lease table (routing cache, acquisitions)."""
        return min(1.0, self.renew_every)

    @property
    def lock_timeout(self) -> float:
        """A lease statement waiting longer than this on a row lock gives up and retries."""
        return min(1.0, self.renew_every)
