"""RuntimeConfig: lifecycle policy, supervision and bounds for the whole runtime."""

from __future__ import annotations

from typing import Literal

import msgspec

from torpor.errors import ConfigError

__all__ = ["RuntimeConfig"]


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

    def __post_init__(self) -> None:
        positive = {
            "hibernate_after": self.hibernate_after,
            "evict_after": self.evict_after,
            "restart_window": self.restart_window,
            "backoff_max": self.backoff_max,
            "shutdown_deadline": self.shutdown_deadline,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(name, f"must be > 0, got {value!r}")
        if self.backoff_initial < 0:
            raise ConfigError("backoff_initial", "must be >= 0")
        if self.evict_after < self.hibernate_after:
            raise ConfigError("evict_after", "must be >= hibernate_after")
        if self.sweep_interval is not None and not self.sweep_interval > 0:
            raise ConfigError("sweep_interval", "must be > 0")
        for name in ("max_live_agents", "max_working_set_bytes", "max_concurrent_revivals",
                     "mailbox_bound"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", "must be >= 0")
        if self.durability not in ("normal", "full"):
            raise ConfigError("durability", "must be 'normal' or 'full'")

    @property
    def sweep_every(self) -> float:
        if self.sweep_interval is not None:
            return self.sweep_interval
        return min(5.0, max(0.05, self.hibernate_after / 4))
