"""SQLite's errors, sorted into torpor's: whose fault is it, and can it heal by itself?

* The database cannot write *now* (disk or quota full, a read-only file or
  filesystem, an I/O error, another process holding the lock past the busy
  timeout, the file gone): :class:`~torpor.errors.StoreUnavailable`. It is
  the infrastructure's fault, the write was rolled back, and the same call may
  succeed once the condition clears.
* The file is not a database or is damaged: :class:`~torpor.errors.CorruptStore`.
* Anything else (a constraint, a misuse): a plain :class:`~torpor.errors.StoreError`,
  which means a bug or someone writing the file behind torpor's back.

Python's ``sqlite3`` exposes the extended result code as ``sqlite_errorcode``;
its low byte is the primary code.
"""

from __future__ import annotations

import sqlite3

from torpor.errors import CorruptStore, StoreError, StoreUnavailable

__all__ = ["RECONNECT", "UNAVAILABLE", "primary_code", "store_error"]

SQLITE_PERM = 3
SQLITE_BUSY = 5
SQLITE_LOCKED = 6
SQLITE_NOMEM = 7
SQLITE_READONLY = 8
SQLITE_IOERR = 10
SQLITE_CORRUPT = 11
SQLITE_FULL = 13
SQLITE_CANTOPEN = 14
SQLITE_PROTOCOL = 15
SQLITE_NOTADB = 26

UNAVAILABLE = frozenset(
    {
        SQLITE_PERM,
        SQLITE_BUSY,
        SQLITE_LOCKED,
        SQLITE_NOMEM,
        SQLITE_READONLY,
        SQLITE_IOERR,
        SQLITE_FULL,
        SQLITE_CANTOPEN,
        SQLITE_PROTOCOL,
    }
)

RECONNECT = frozenset({SQLITE_READONLY, SQLITE_IOERR, SQLITE_CANTOPEN, SQLITE_PERM})
"""Codes after which the writer connection is replaced before the next write.

A connection opened while its file was read-only stays read-only for life,
and one that hit an I/O error may hold a broken file handle; a fresh one
sees the file as it is now. (A full disk or a busy lock heals on the same
connection.)
"""

_CORRUPT = frozenset({SQLITE_CORRUPT, SQLITE_NOTADB})


def primary_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else int(code) & 0xFF


def store_error(exc: sqlite3.Error, doing: str) -> StoreError:
    """The torpor error for ``exc``, raised while ``doing`` (for the message), chained to it."""
    code = primary_code(exc)
    name = getattr(exc, "sqlite_errorname", type(exc).__name__)
    message = f"{doing}: {exc} ({name})"
    error: StoreError
    if code in UNAVAILABLE:
        error = StoreUnavailable(message)
    elif code in _CORRUPT:
        error = CorruptStore(message)
    else:
        error = StoreError(message)
    error.__cause__ = exc
    return error
