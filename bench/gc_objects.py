"""GC-tracked objects per live idle agent and per turn waiting on its final commit.

Question: how many objects does the cyclic GC see per idle agent holding its working set,
and per turn in flight, and of which types? Each full collection walks all of them, so
at 10,000 conversations this is the collection's cost (bench/turns.py reports the
collections themselves). Turns are parked at their final commit (the answer and its
audit row) by holding the SQLite writer while the model (EchoModel with a delay) runs:
at 10,000 conversations that is where most turns wait.

Usage: ``python bench/gc_objects.py [--agents 1000] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _common import emit, fresh_db, quiet, table

import torpor


def census() -> Counter[str]:
    gc.collect()
    return Counter(type(o).__name__ for o in gc.get_objects())


def per_agent(before: Counter[str], after: Counter[str], n: int) -> tuple[float, dict[str, float]]:
    by_type = {k: round((after[k] - before[k]) / n, 2) for k in after
               if abs(after[k] - before[k]) >= n // 10}
    total = round((sum(after.values()) - sum(before.values())) / n, 2)
    return total, dict(sorted(by_type.items(), key=lambda kv: -kv[1]))


DELAY = 1.0
"""EchoModel's delay: long enough to hold the writer before any answer is queued."""


async def measure(url: str, n: int) -> dict[str, Any]:
    config = torpor.RuntimeConfig(hibernate_after=3600, evict_after=7200, sweep_interval=3600)
    model = torpor.EchoModel(delay=DELAY)
    async with torpor.Runtime(url, model=model, config=config) as rt:
        await (await rt.send("warm", "hello")).result()
        before = census()
        names = [f"gc-{i}" for i in range(n)]
        async def one(c: str) -> None:
            await (await rt.send(c, "hello")).result()

        tasks = [asyncio.create_task(one(c)) for c in names]
        await asyncio.wait(tasks)
        del tasks  # not counted as the agents' own
        idle = census()
        writer = rt._store._writer  # type: ignore[attr-defined]
        # send returns once the user message is logged: every turn is in the model now
        sending = [asyncio.create_task(rt.send(c, "again")) for c in names]
        await asyncio.wait(sending)
        turns = [t.result() for t in sending]
        del sending
        writer.hold()
        try:
            deadline = time.monotonic() + 60
            while len(writer._queue) < 2 * n and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(DELAY / 4)
            parked = census()
        finally:
            writer.release()
        await asyncio.gather(*(t.result() for t in turns))
    idle_total, idle_types = per_agent(before, idle, n)
    turn_total, turn_types = per_agent(idle, parked, n)
    return {"benchmark": "gc_objects", "agents": n, "tracked_per_idle_agent": idle_total,
            "idle_by_type": idle_types, "tracked_per_turn_in_flight": turn_total,
            "turn_by_type": turn_types}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    quiet()
    with tempfile.TemporaryDirectory() as d:
        result = asyncio.run(measure(fresh_db(Path(d), "gc.db"), args.agents))
    rows = [(k, v) for k, v in result["idle_by_type"].items()]
    rows.append(("total", result["tracked_per_idle_agent"]))
    more = [(k, v) for k, v in result["turn_by_type"].items()]
    more.append(("total", result["tracked_per_turn_in_flight"]))
    emit(result, [
        table("GC-tracked objects per live idle agent", ("type", "per agent"), rows),
        table("more per turn waiting on its final commit", ("type", "per turn"), more),
    ], args.json)


if __name__ == "__main__":
    main()
