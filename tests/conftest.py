"""Shared test setup: quiet structured logs (torpor logs nothing below warning in tests)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog

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
