"""Where the heap a burst leaves behind sits: pymalloc arenas, and which survivors pin them.

Question: after every agent was active at once and then hibernated, why does the
process keep about twice the RSS of gradual hibernation? Runs one pattern of
bench/idle_agents.py (``burst-hibernated`` or ``hibernated``) on a database it
builds, then reads ``sys._debugmallocstats()`` (arenas, bytes in allocated blocks,
unused pools) and maps each per-agent survivor (the agent record, the fields it
holds, the objects dormant agents' rows refer to, the SQLite writer's head cache
entries, and every GC-tracked object) to its
1 MiB address window. A window holding few survivors is memory one of them pins;
a kind of survivor spread over nearly every window pins them all by itself.

Diagnostic, reads internals (the runtime's registry, the SQLite writer's cache).

Usage: ``python bench/burst_arenas.py [--agents 20000] [--pattern burst-hibernated]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import idle_agents
from _common import emit, fresh_db, quiet, table

import torpor
from torpor.runtime import dormant

SPARSE = 400
"""A 1 MiB window with fewer survivors than this (of any size) is mostly free pools."""


def mallocstats() -> dict[str, int]:
    """The arena figures of ``sys._debugmallocstats()`` (it writes to the C stderr)."""
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        try:
            sys.stderr.flush()
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode()
    numbers = {}
    for key, pattern in (
        ("arenas", r"# arenas allocated current\s*=\s*([\d,]+)"),
        ("allocated_block_bytes", r"# bytes in allocated blocks\s*=\s*([\d,]+)"),
        ("unused_pools", r"(\d+) unused pools"),
    ):
        found = re.search(pattern, text)
        numbers[key] = int(found.group(1).replace(",", "")) if found else -1
    return numbers


def survivors(rt: Any) -> dict[str, list[int]]:
    """Addresses of per-agent survivors, by kind (each object counted once)."""
    kinds: dict[str, list[int]] = defaultdict(list)
    seen: set[int] = set()

    def add(kind: str, obj: object) -> None:
        if id(obj) not in seen:
            seen.add(id(obj))
            kinds[kind].append(id(obj))

    registry = rt._registry
    for agent in registry.held():  # dormant agents are rows, not objects: see below
        add("Agent", agent)
        for name in type(agent).__slots__:
            value = getattr(agent, name, None)
            if value is None or isinstance(value, bool):
                continue
            if isinstance(value, int) and -5 <= value <= 256:  # cached small ints
                continue
            add(f"Agent.{name}", value)
    for name, column in zip(dormant.OBJECTS, registry.dormant._objects, strict=True):
        for value in column:  # shared objects mostly (a state, a profile, an empty tuple)
            if value is not None and not isinstance(value, bool) and value != ():
                add(f"dormant.{name}", value)
    writer = getattr(rt._store, "_writer", None)
    if writer is not None:
        for state in writer._cache._states.values():
            add("head cache: ConvState", state)
            if state.key > 256:
                add("head cache: int key", state.key)
    for obj in gc.get_objects():
        add(f"gc: {type(obj).__name__}", obj)
    return kinds


def windows(kinds: dict[str, list[int]]) -> tuple[int, int, list[tuple[str, int, int, int]]]:
    per_window: Counter[int] = Counter()
    for addresses in kinds.values():
        per_window.update(a >> 20 for a in addresses)
    sparse = {w for w, count in per_window.items() if count < SPARSE}
    rows = []
    for kind, addresses in kinds.items():
        spread = {a >> 20 for a in addresses}
        rows.append((kind, len(addresses), len(spread), len(spread & sparse)))
    rows.sort(key=lambda r: (-r[3], -r[2]))
    return len(per_window), len(sparse), rows


async def run(url: str, n: int, pattern: str) -> dict[str, Any]:
    captured: list[Any] = []
    enter = torpor.Runtime.__aenter__

    async def capture(self: Any) -> Any:
        captured.append(self)
        return await enter(self)

    torpor.Runtime.__aenter__ = capture  # type: ignore[method-assign]
    result: dict[str, Any] = {}
    reading = idle_agents.reading
    calls = 0

    def after(trace: bool) -> tuple[int, int | None]:
        nonlocal calls
        measured = reading(trace)
        calls += 1
        if calls == 2:  # the reading after the pattern ran, runtime still open
            result.update(rss_mb=round(measured[0] / 1e6, 1), **mallocstats())
            total, sparse, rows = windows(survivors(captured[0]))
            result.update(windows=total, sparse_windows=sparse, kinds=rows[:20],
                          held=len(captured[0]._registry.agents),
                          dormant=len(captured[0]._registry.dormant))
        return measured

    idle_agents.reading = after
    await idle_agents.torpor_state(pattern, url, n, False, 32_000)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=20_000)
    p.add_argument("--pattern", default="burst-hibernated",
                   choices=("burst-hibernated", "hibernated"))
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    quiet()
    with tempfile.TemporaryDirectory() as d:
        url = fresh_db(Path(d), "arenas.db")
        asyncio.run(idle_agents.build(url, args.agents + idle_agents.WARM, 8, 1000))
        found = asyncio.run(run(url, args.agents, args.pattern))
    result = {"benchmark": "burst_arenas", "agents": args.agents, "pattern": args.pattern,
              **found}
    emit(result, [
        table("pymalloc after the pattern", ("RSS MB", "arenas", "bytes in blocks",
                                              "unused pools", "windows", "sparse windows",
                                              "agents held", "dormant"),
              [(found["rss_mb"], found["arenas"], found["allocated_block_bytes"],
                found["unused_pools"], found["windows"], found["sparse_windows"],
                found["held"], found["dormant"])]),
        table(f"survivors by kind (sparse: < {SPARSE} survivors in its 1 MiB window)",
              ("kind", "objects", "windows", "sparse windows"), found["kinds"]),
    ], args.json)


if __name__ == "__main__":
    main()
