"""Warnings and errors a client can cause, rate-limited so no client can fill a disk.

A server out of file descriptors gets asyncio's ``socket.accept() out of system
resource`` error, with its traceback, for every connection it cannot accept
(106,000 lines in 20 s were measured); uvicorn warns once per malformed request.
:class:`RateLimit` on such a logger lets at most ``burst`` records of warning level
or above through per ``interval`` seconds, counts the rest, and reports the count
(``log_records_suppressed``) with the first record of the next interval, or when
it is removed. Lower levels always pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from torpor._logging import EVENT_ATTRIBUTE, foreign_logger

__all__ = ["LIMITED_LOGGERS", "RateLimit", "rate_limited"]

LIMITED_LOGGERS = ("asyncio", "uvicorn.error", "torpor.serve")
BURST = 20
INTERVAL = 10.0


class RateLimit(logging.Filter):
    """At most ``burst`` records at ``level`` or above per ``interval`` s through ``logger``."""

    def __init__(self, logger: logging.Logger, *, burst: int = BURST,
                 interval: float = INTERVAL, level: int = logging.WARNING) -> None:
        super().__init__()
        self.logger = logger
        self.burst = burst
        self.interval = interval
        self.level = level
        self.window = time.monotonic()
        self.passed = 0
        self.suppressed = 0  # in the current window, not yet reported
        self.total_suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level or getattr(record, "_torpor_summary", False):
            return True
        now = time.monotonic()
        if now - self.window >= self.interval:
            self.window = now
            self.passed = 0
            self.report()
        if self.passed < self.burst:
            self.passed += 1
            return True
        self.suppressed += 1
        self.total_suppressed += 1
        return False

    def report(self) -> None:
        """Log how many records were held back since the last report (if any were)."""
        count, self.suppressed = self.suppressed, 0
        if not count:
            return
        record = self.logger.makeRecord(
            self.logger.name, logging.WARNING, __file__, 0,
            "log_records_suppressed suppressed=%d interval=%s", (count, self.interval), None,
            extra={"suppressed": count, "interval": self.interval, "_torpor_summary": True,
                   EVENT_ATTRIBUTE: "log_records_suppressed"},
        )
        self.logger.handle(record)


@contextmanager
def rate_limited(names: tuple[str, ...] = LIMITED_LOGGERS, *, burst: int = BURST,
                 interval: float = INTERVAL) -> Iterator[list[RateLimit]]:
    """A :class:`RateLimit` on each named logger while the block runs; at its end what
    was held back last is reported and the filters are removed."""
    limits = []
    for name in names:
        logger = foreign_logger(name)
        limit = RateLimit(logger, burst=burst, interval=interval)
        logger.addFilter(limit)
        limits.append(limit)
    try:
        yield limits
    finally:
        for limit in limits:
            limit.logger.removeFilter(limit)
            limit.report()
