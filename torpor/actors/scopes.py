"""Cancel scopes for the actor's hot path, without anyio's per-scope backend lookup.

``anyio.CancelScope()`` asks which async library runs (a context variable, then
the current task) each time one is made, and a turn makes four. Actors run on
asyncio only (their futures are asyncio's), so the backend's own scope class is
looked up once, from the first scope made, and made directly after that.
"""

from __future__ import annotations

import anyio

__all__ = ["scope"]

_scope_class: type[anyio.CancelScope] | None = None


def scope(*, shield: bool = False) -> anyio.CancelScope:
    """``anyio.CancelScope(shield=shield)``, made by the running backend's class."""
    global _scope_class
    cls = _scope_class
    if cls is None:
        made = anyio.CancelScope(shield=shield)
        _scope_class = type(made)
        return made
    return cls(shield=shield)
