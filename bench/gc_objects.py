"""GC-tracked objects per live idle agent (what each full collection walks per agent).

Question: how many objects does the cyclic GC see per idle agent holding its working set,
and of which types? Each full collection walks all of them, so at 10,000 live agents
this is the collection's cost (bench/turns.py reports the collections themselves).

Usage: ``python bench/gc_objects.py [--agents 1000] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from _common import emit, fresh_db, quiet, table

import torpor


def census() -> Counter[str]:
    gc.collect()
    return Counter(type(o).__name__ for o in gc.get_objects())


async def measure(url: str, n: int) -> dict[str, Any]:
    config = torpor.RuntimeConfig(hibernate_after=3600, evict_after=7200, sweep_interval=3600)
    async with torpor.Runtime(url, model=torpor.EchoModel(), config=config) as rt:
        await (await rt.send("warm", "hello")).result()
        before = census()
        for i in range(n):
            await (await rt.send(f"gc-{i}", "hello")).result()
        await asyncio.sleep(0)
        after = census()
        by_type = {k: round((after[k] - before[k]) / n, 2) for k in after
                   if abs(after[k] - before[k]) >= n // 10}
        total = round((sum(after.values()) - sum(before.values())) / n, 2)
    return {"benchmark": "gc_objects", "agents": n, "tracked_per_idle_agent": total,
            "by_type": dict(sorted(by_type.items(), key=lambda kv: -kv[1]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    quiet()
    with tempfile.TemporaryDirectory() as d:
        result = asyncio.run(measure(fresh_db(Path(d), "gc.db"), args.agents))
    rows = [(k, v) for k, v in result["by_type"].items()]
    rows.append(("total", result["tracked_per_idle_agent"]))
    emit(result, [table("GC-tracked objects per live idle agent", ("type", "per agent"), rows)],
         args.json)


if __name__ == "__main__":
    main()
