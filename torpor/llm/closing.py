"""Closing a model's stream so the provider sees the connection go, whatever is unwinding."""

from __future__ import annotations

import contextlib
from typing import Any

import anyio

__all__ = ["CLOSE_DEADLINE", "close_quietly"]

CLOSE_DEADLINE = 5.0
"""Seconds a close may take before it is given up (the socket is dropped by then anyway)."""


async def close_quietly(resource: Any, method: str = "close") -> None:
    """Call ``resource.<method>()`` shielded from the cancel that may be unwinding the
    caller (a cancelled turn must still close its HTTP response) and within a deadline;
    a broken stream may fail to close again, which changes nothing."""
    close = getattr(resource, method, None)
    if close is None:
        return
    with (
        anyio.CancelScope(shield=True),
        anyio.move_on_after(CLOSE_DEADLINE),
        contextlib.suppress(Exception),
    ):
        await close()
