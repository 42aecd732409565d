"""What derived memory costs: the hot-path reconciler per turn, and a fold's memory work.

Questions:

1. Does consulting a reconciler at the append chokepoint slow turns? The same
   turns (``--conversations`` x ``--turns``, EchoModel with no delay, a fresh
   in-memory SQLite store each) run back to back in one process with no
   reconciler, with ``AddEverything`` and with one that says NONE for every
   other turn (which writes a turn decision); the ratio is against no
   reconciler.
2. What does a fold's memory work cost as a conversation's items grow? For
   ``--facts`` semantic items (and one episode per 10), on a SQLite file: one
   ``store.memory`` read, the bundle (``render_bundle``, 600 tokens) and the
   digest (``write_digest``, 40 lines), median of ``--repeat`` runs.

Usage: ``python bench/memory.py [--conversations 20] [--turns 50] [--facts 100 1000 10000]
[--repeat 5] [--rounds 3] [--json FILE]``. The hot-path variants run ``--rounds``
times interleaved, after one warm-up run; the median run of each is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import emit, fresh_db, quiet, ratio, table

from torpor import AddEverything, AgentConfig, EchoModel, Runtime, SemanticItem
from torpor.events import Event, UserMessage
from torpor.memory import render_bundle, surviving, write_digest
from torpor.store import open_store
from torpor.store.memory import EpisodicItem


class EveryOtherNone:
    def decide(self, conversation_id: str, turn: int, events: Sequence[Event]) -> str:
        return "none" if turn % 2 else "add"


async def turns(reconciler: Any, conversations: int, count: int) -> dict[str, Any]:
    agent = AgentConfig(reconciler=reconciler)
    async with Runtime("sqlite://", model=EchoModel(delay=0), agent=agent) as rt:
        async def talk(c: int) -> None:
            for i in range(count):
                await (await rt.send(f"c{c}", f"message {i}")).result()

        started = time.perf_counter()
        await asyncio.gather(*(talk(c) for c in range(conversations)))
        seconds = time.perf_counter() - started
    total = conversations * count
    return {"reconciler": type(reconciler).__name__ if reconciler else "none",
            "turns": total, "seconds": round(seconds, 3),
            "turns_per_second": round(total / seconds, 1)}


async def fold_work(path: Path, facts: int, repeat: int) -> dict[str, Any]:
    url = fresh_db(path.parent, path.name)
    async with open_store(url) as store:
        await store.append("c", [UserMessage("hello")])
        episodes = [EpisodicItem(10 * i + 1, 10 * i, 10 * i + 9, (i,), f"episode {i} " * 8,
                                 salience=0.5) for i in range(max(1, facts // 10))]
        items = [SemanticItem(10 * (i // 10) + 1, i % 10, f"key{i % (facts // 2 or 1)}",
                              "fact", f"fact {i} about something", confidence=(i % 10) / 10)
                 for i in range(facts)]
        for start in range(0, len(items), 500):
            await store.put_memory("c", facts=items[start:start + 500])
        await store.put_memory("c", episodes=episodes)
        reads: list[float] = []
        renders: list[float] = []
        digests: list[float] = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            memory = await store.memory("c")
            t1 = time.perf_counter()
            render_bundle(memory.episodes, memory.facts, memory.ledger, budget=600)
            t2 = time.perf_counter()
            write_digest(surviving(memory.facts, memory.ledger), memory.episodes, 40)
            t3 = time.perf_counter()
            reads.append(t1 - t0)
            renders.append(t2 - t1)
            digests.append(t3 - t2)
    ms = lambda xs: round(statistics.median(xs) * 1000, 2)  # noqa: E731
    return {"facts": facts, "episodes": len(episodes), "read_ms": ms(reads),
            "bundle_ms": ms(renders), "digest_ms": ms(digests),
            "total_ms": round(ms(reads) + ms(renders) + ms(digests), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--facts", type=int, nargs="+", default=[100, 1000, 10_000])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    quiet()
    asyncio.run(turns(None, args.conversations, args.turns))  # warm-up: imports, tokenizer
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.rounds):  # interleaved, so drift hits every variant alike
        for reconciler in (None, AddEverything(), EveryOtherNone()):
            row = asyncio.run(turns(reconciler, args.conversations, args.turns))
            runs.setdefault(row["reconciler"], []).append(row)
    hot = []
    for rows in runs.values():  # the median run of each
        rows.sort(key=lambda r: r["turns_per_second"])
        hot.append(rows[len(rows) // 2])
        print(f"  {hot[-1]['reconciler']}: {hot[-1]['turns_per_second']:,} turns/s",
              file=sys.stderr)
    base = hot[0]["turns_per_second"]
    for row in hot:
        row["time_over_none"] = ratio(base, row["turns_per_second"])
    folds = []
    with tempfile.TemporaryDirectory(prefix="torpor-memory-") as tmp:
        for n in args.facts:
            folds.append(asyncio.run(fold_work(Path(tmp) / f"m{n}.db", n, args.repeat)))
    result = {"benchmark": "memory", "params": vars(args), "hot_path": hot, "fold": folds}
    tables = [
        table("turns with a reconciler at the append chokepoint (same run)",
              ("reconciler", "turns", "turns/s", "time / no reconciler"),
              [(r["reconciler"], r["turns"], r["turns_per_second"], r["time_over_none"])
               for r in hot]),
        table("a fold's memory work (median)",
              ("facts", "episodes", "read ms", "bundle ms", "digest ms", "total ms"),
              [(r["facts"], r["episodes"], r["read_ms"], r["bundle_ms"], r["digest_ms"],
                r["total_ms"]) for r in folds]),
    ]
    emit(result, tables, args.json)


if __name__ == "__main__":
    main()
