"""asyncpg's errors, sorted into torpor's: whose fault is it, and can it heal by itself?

* The database cannot serve *now*: the connection is lost or refused, the
  server is shutting down or refusing connections (SQLSTATE classes 08 and
  57), out of disk, memory or connection slots (class 53), an I/O error
  (class 58), a read-only transaction (25006: a standby, or
  ``default_transaction_read_only``), an idle session killed (25P03):
  :class:`~torpor.errors.StoreUnavailable`. The transaction was rolled back
  and the same call may succeed once the condition clears.
* Damaged data (XX001, XX002): :class:`~torpor.errors.CorruptStore`.
* Anything else: a plain :class:`~torpor.errors.StoreError` (a bug, or a
  schema changed behind torpor's back).
"""

from __future__ import annotations

import asyncio

import asyncpg
from asyncpg import exceptions as pg

from torpor.errors import CorruptStore, StoreError, StoreUnavailable

__all__ = ["DRIVER_ERRORS", "is_unavailable", "store_error"]

DRIVER_ERRORS = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
    TimeoutError,
)
"""What talking to PostgreSQL can raise (the server, the driver, the socket)."""

_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,  # refused, reset, unreachable (ConnectionError is one)
    asyncio.TimeoutError,  # connecting timed out
    pg.PostgresConnectionError,  # 08: connection lost or refused
    pg.InsufficientResourcesError,  # 53: disk full, out of memory, too many connections
    pg.OperatorInterventionError,  # 57: shutdown, cannot connect now, cancelled
    pg.PostgresSystemError,  # 58: I/O error
    pg.ReadOnlySQLTransactionError,  # 25006
    pg.IdleInTransactionSessionTimeoutError,  # 25P03
)
_CORRUPT: tuple[type[BaseException], ...] = (pg.DataCorruptedError, pg.IndexCorruptedError)


def is_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, _UNAVAILABLE):
        return True
    if isinstance(exc, pg.InternalClientError):
        # What asyncpg raises when the server ended an idle session (a terminated
        # backend) and the connection is used before it noticed: it cannot be used
        # again, and a new one will do.
        return True
    # A closed connection used again. (Its subclasses are not: a bad argument, a misuse.)
    return type(exc) is asyncpg.InterfaceError


def store_error(exc: BaseException, doing: str) -> StoreError:
    """The torpor error for ``exc``, raised while ``doing`` (for the message), chained to it."""
    if isinstance(exc, StoreError):
        return exc
    sqlstate = getattr(exc, "sqlstate", None)
    message = f"{doing}: {exc!r}" + (f" (SQLSTATE {sqlstate})" if sqlstate else "")
    error: StoreError
    if is_unavailable(exc):
        error = StoreUnavailable(message)
    elif isinstance(exc, _CORRUPT):
        error = CorruptStore(message)
    else:
        error = StoreError(message)
    error.__cause__ = exc
    return error
