"""The PostgreSQL backend (asyncpg): the same log, shared by several runtime processes.

Needs the ``postgres`` extra (``pip install 'torpor[postgres]'``); importing
this package without asyncpg raises ImportError, which :func:`open_store`
turns into a clear error.
"""

from torpor.store.postgres.store import PostgresStore

__all__ = ["PostgresStore"]
