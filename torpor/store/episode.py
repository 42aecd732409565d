"""A failure that repeats, logged at a bounded rate: one record when it starts, a count after.

A store that cannot write fails every write, and a background task (the WAL
checkpointer) fails every attempt, for as long as the disk is full: a record
per failure would flood the host's logs (hundreds of thousands of lines once,
from a checkpointer that retried at once). An :class:`Episode` logs the first
failure of an episode with its error, counts the rest, logs a summary at most
every ``every`` seconds while it lasts, and one record with the count and the
duration when the first success ends it.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["Episode"]


class Episode:
    """Bounded logging of one kind of repeated failure.

    ``failed``/``ongoing``/``ended``: the records' event names (the first failure,
    the periodic summary, the recovery). ``level``: the failures' level; the
    recovery is logged at info. Not thread-safe: call it from one thread (the
    event loop's).
    """

    __slots__ = ("_ended", "_every", "_failed", "_level", "_log", "_next", "_ongoing",
                 "failures", "since", "total")

    def __init__(
        self,
        log: Any,
        failed: str,
        *,
        ongoing: str,
        ended: str,
        level: str = "warning",
        every: float = 60.0,
    ) -> None:
        self._log = log
        self._failed = failed
        self._ongoing = ongoing
        self._ended = ended
        self._level = level
        self._every = every
        self._next = 0.0  # when the next summary may be logged
        self.since: float | None = None  # time.monotonic() of the episode's first failure
        self.failures = 0  # in the current episode
        self.total = 0  # over the object's life, for stats

    @property
    def active(self) -> bool:
        return self.since is not None

    def fail(self, **fields: Any) -> None:
        """One more failure: logged if it starts an episode or a summary is due."""
        now = time.monotonic()
        self.total += 1
        self.failures += 1
        emit = getattr(self._log, self._level)
        if self.since is None:
            self.since = now
            self._next = now + self._every
            emit(self._failed, **fields)
        elif now >= self._next:
            self._next = now + self._every
            emit(self._ongoing, failures=self.failures, seconds=round(now - self.since, 3),
                 **fields)

    def succeed(self, **fields: Any) -> None:
        """A success: ends the episode, if one is under way, with its count (cheap otherwise)."""
        if self.since is None:
            return
        seconds = time.monotonic() - self.since
        self._log.info(self._ended, failures=self.failures, seconds=round(seconds, 3), **fields)
        self.since = None
        self.failures = 0
