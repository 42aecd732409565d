"""RuntimeConfig: lifecycle policy, supervision and bounds for the whole runtime."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import msgspec

from torpor.llm.embedding import check_embedder
from torpor.validation import (
    Relation,
    Rule,
    check_fields,
    choice,
    custom,
    integer,
    optional,
    seconds,
)

__all__ = ["RuntimeConfig"]


def _embedder(value: object) -> str | None:
    if value is None:
        return None
    problem = check_embedder(value)
    return None if problem is None else f" ({type(value).__name__}: {problem})"


def _clock(value: object) -> str | None:
    return None if value is None or callable(value) else " (not callable)"


def _evict_before_hibernate(c: Any) -> str | None:
    if c.evict_after >= c.hibernate_after:
        return None
    return f"must be >= hibernate_after ({c.hibernate_after:g}), got {c.evict_after:g}"


class RuntimeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Defaults suit a chat backend; invalid values fail at construction, naming the field.

    Lifecycle: an idle agent hibernates (drops its working set, keeps ids and
    positions) after ``hibernate_after`` seconds and is evicted (forgotten; the log
    keeps everything) after ``evict_after`` seconds. ``max_live_agents`` caps the
    agents in memory, ``max_working_set_bytes`` the estimated working sets (both
    least recently used first). ``max_concurrent_revivals`` bounds how many agents
    read their working set back at once, so an activation storm degrades gracefully.

    Supervision: an agent that crashes more than ``max_restarts`` times within
    ``restart_window`` seconds is parked (durably, with the cause); before that it
    restarts from the log after an exponential backoff from ``backoff_initial`` up
    to ``backoff_max`` seconds.

    Store faults: while the store cannot write, a caller learns it (``StoreUnavailable``,
    nothing written) within ``store_retry_deadline`` seconds whatever its agent is doing;
    the runtime keeps retrying behind it and serves again once writes succeed.

    Hybrid recall: ``embedder`` (None: off) and ``embed_interval``, see README
    "Hybrid recall".

    Retention: ``retention`` seconds without activity and a conversation is deleted
    (None, the default: kept forever); see README "Conversations as owned data".
    """

    hibernate_after: float = 30.0
    evict_after: float = 300.0
    sweep_interval: float | None = None  # default: a quarter of hibernate_after, 50 ms to 5 s
    max_live_agents: int = 1_000_000
    max_working_set_bytes: int = 2 * 1024**3
    max_concurrent_revivals: int = 64
    max_restarts: int = 3
    restart_window: float = 60.0
    backoff_initial: float = 0.05
    backoff_max: float = 5.0
    mailbox_bound: int = 16
    durability: Literal["normal", "full"] = "normal"
    # Leaving the Runtime waits this long for agents to log how their turns ended; a task
    # still running then (a tool ignoring cancellation) is abandoned and reported.
    shutdown_deadline: float = 10.0
    # While the store cannot write, callers learn it (StoreUnavailable) within this many
    # seconds, whatever the agent is doing; the runtime keeps retrying behind them.
    store_retry_deadline: float = 5.0
    # Seconds between consolidation sweeps of idle conversations that folded since their
    # last one (torpor.memory: the ledger's UPDATE/DELETE); None (default): only on demand.
    consolidate_interval: float | None = None
    # Hybrid recall (off by default): an Embedder (torpor.llm.embedding) whose vectors of
    # the logged events are fused with full-text search in recall. A background task embeds
    # what is new every embed_interval seconds; turns never wait for it.
    embedder: Any = None
    embed_interval: float = 1.0
    # Retention (None: keep forever): conversations with no activity for this many seconds
    # are deleted by a background sweep (torpor.runtime.retention), audited by="retention".
    retention: float | None = None
    # Schedules (Runtime.schedule): the clock they are due by, a function returning epoch
    # seconds (None: time.time). A test gives its own to move time without waiting.
    clock: Any = None

    # One rule per field (check_fields refuses a field without one); then the relations.
    RULES: ClassVar[Mapping[str, Rule]] = {
        "hibernate_after": seconds(),
        "evict_after": seconds(),
        "sweep_interval": optional(seconds()),
        "max_live_agents": integer(1),
        "max_working_set_bytes": integer(1),
        "max_concurrent_revivals": integer(1),
        "max_restarts": integer(0),
        "restart_window": seconds(),
        "backoff_initial": seconds(zero=True),
        "backoff_max": seconds(),
        "mailbox_bound": integer(1),
        "durability": choice("normal", "full"),
        "shutdown_deadline": seconds(),
        "store_retry_deadline": seconds(),
        "consolidate_interval": optional(seconds()),
        "embedder": custom("None or an Embedder (name, dimensions, async embed)", _embedder),
        "embed_interval": seconds(),
        "retention": optional(seconds()),
        "clock": custom("None or a function returning epoch seconds", _clock),
    }
    RELATIONS: ClassVar[tuple[Relation, ...]] = (
        Relation(("evict_after", "hibernate_after"), _evict_before_hibernate),
    )

    def __post_init__(self) -> None:
        check_fields(self, self.RULES, self.RELATIONS)

    @property
    def sweep_every(self) -> float:
        if self.sweep_interval is not None:
            return self.sweep_interval
        return min(5.0, max(0.05, self.hibernate_after / 4))
