"""Shared test setup: quiet structured logs (torpor logs nothing below warning in tests),
store fixtures, the one throwaway PostgreSQL cluster of the session, and real disk
faults (a tiny tmpfs that fills up, the immutable attribute)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from pg_cluster import PgCluster, fresh_schema, pg_cluster  # noqa: F401 - the session fixture
from store_backends import AnyStore, Backend

from torpor.store import SQLiteStore

structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL),
    cache_logger_on_first_use=False,
)


@pytest.fixture(params=["memory", "file"])
def sqlite_path(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    """Store tests run against a private in-memory database and against a WAL file."""
    return None if request.param == "memory" else str(tmp_path / "log.db")


@pytest.fixture
async def sqlite_store(sqlite_path: str | None) -> AsyncIterator[SQLiteStore]:
    async with SQLiteStore(sqlite_path) as store:
        yield store


@pytest.fixture(scope="session")
def pg_database(pg_cluster: PgCluster) -> str:  # noqa: F811
    """One database for the backend tests of the session; each test gets a schema in it.

    A schema costs a millisecond where ``CREATE DATABASE`` costs a few hundred.
    (Created on a thread of its own: this fixture is first asked for from inside
    an async fixture, whose event loop is running.)
    """
    asyncpg = pytest.importorskip("asyncpg")
    name = "torpor_" + uuid.uuid4().hex[:12]

    async def create() -> None:
        admin = await asyncpg.connect(pg_cluster.url())
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, create()).result()
    return pg_cluster.url(name)


@pytest.fixture
async def pg_url(pg_database: str) -> str:
    """A fresh schema of the session's test database (see :func:`fresh_schema`)."""
    return await fresh_schema(pg_database)


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """The same test on a real SQLite file and on a fresh schema of the real cluster."""
    return await _backend(request, request.param, tmp_path)


@pytest.fixture(params=["sqlite-memory", "sqlite-file", "postgres"])
async def any_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """Every backend a store runs on: SQLite in memory and in a file, and PostgreSQL."""
    if request.param == "sqlite-memory":
        return Backend("sqlite", None)
    return await _backend(request, request.param.removesuffix("-file"), tmp_path)


@pytest.fixture
async def store(any_backend: Backend) -> AsyncIterator[AnyStore]:
    """An open store with default options, on each backend (the contract suite's fixture)."""
    async with any_backend.open() as opened:
        yield opened


async def _backend(request: pytest.FixtureRequest, name: str, tmp_path: Path) -> Backend:
    if name == "sqlite":
        return Backend("sqlite", str(tmp_path / "log.db"))
    pytest.importorskip("asyncpg")
    database: str = request.getfixturevalue("pg_database")
    return Backend("postgres", await fresh_schema(database))


# -- real disk faults -----------------------------------------------------------------


@pytest.fixture
def immutable(tmp_path: Path) -> Iterator[Any]:
    """``set(paths, on)``: the immutable attribute, which the kernel enforces even for root
    and even on files already open for writing (chmod stops neither). Skips the test
    where the filesystem or the process cannot set it."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", probe], capture_output=True).returncode:
        pytest.skip("cannot set the immutable attribute here (chattr, ext4 and root needed)")
    subprocess.run([chattr, "-i", probe], check=True)
    touched: set[Path] = set()

    def set_(paths: list[Path], on: bool) -> None:
        touched.update(paths)
        subprocess.run([chattr, "+i" if on else "-i", *map(str, paths)], check=True)

    try:
        yield set_
    finally:
        for path in touched:
            subprocess.run([chattr, "-i", str(path)], capture_output=True)


@pytest.fixture
def tiny_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (a real filesystem that fills up); skips where mounting is not allowed."""
    mount = tmp_path / "fs"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    )
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)
