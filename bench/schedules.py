"""Schedules at scale: N schedules due within a window fire on time, each once.

Question (issue 26): do 10,000 schedules due within one minute fire with p99
lateness under 200 ms and no duplicate? One runtime on a fresh SQLite file
(WAL, synchronous=NORMAL) with the local echo model. N conversations are written
to the store first (a message and its answer each, straight through the store:
setup, not measured), then one schedule each is set through ``Runtime.schedule``,
due at a random time spread evenly over the next ``--window`` seconds (starting
``--lead`` seconds out, so the setup is done before the first comes due). Each
firing revives its (evicted) agent, logs the scheduled message and runs its turn.

Lateness of a firing: the scheduled message's ``created_at`` (the time its append
was stamped) minus the schedule's due time, both epoch ms. Duplicates: scheduled
messages logged per schedule id, read back from every conversation's log (a
schedule fired twice would show twice). Also reported: how many fired, whether
every turn was answered, and the process's peak RSS.

Usage: ``python bench/schedules.py [--schedules 10000] [--window 60] [--lead 8]
[--quick] [--json FILE]`` (``--quick``: 1,000 schedules over 10 s).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import emit, fresh_db, quiet, table

import torpor
from torpor.events import AssistantMessage, UserMessage
from torpor.runtime.stats import percentile

SETUP_BATCH = 500


async def _setup(url: str, n: int) -> list[str]:
    """N settled conversations (a message and its answer), straight through the store."""
    names = [f"conv-{i:06d}" for i in range(n)]
    async with torpor.open_store(url) as store:
        for start in range(0, n, SETUP_BATCH):
            await asyncio.gather(*(
                store.append(name, [UserMessage("hello"), AssistantMessage("hi")], turn=1)
                for name in names[start:start + SETUP_BATCH]
            ))
    return names


async def run(n: int, window: float, lead: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        url = fresh_db(Path(tmp), "schedules.db")
        names = await _setup(url, n)
        config = torpor.RuntimeConfig(hibernate_after=5.0, evict_after=10.0)
        async with torpor.Runtime(url, config=config) as rt:
            start = time.time() + lead
            dues: dict[str, int] = {}
            rng = random.Random(26)
            set_at = time.perf_counter()
            for offset in range(0, n, SETUP_BATCH):
                batch = names[offset:offset + SETUP_BATCH]
                made = await asyncio.gather(*(
                    rt.schedule(name, f"reminder for {name}", at=start + rng.random() * window)
                    for name in batch
                ))
                for schedule in made:
                    assert schedule.due is not None
                    dues[schedule.id] = schedule.due
            set_seconds = time.perf_counter() - set_at
            if time.time() > start:
                print("warning: scheduling took longer than --lead", file=sys.stderr)
            deadline = start + window + 60
            while rt._scheduler.fired < n and time.time() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
            settle = time.time() + 30  # the last turns answer
            answered = 0
            lateness: list[float] = []
            per_schedule: dict[str, int] = {}
            while True:
                answered = 0
                lateness.clear()
                per_schedule.clear()
                for name in names:
                    events = await rt.store.read_since(name, 2)
                    for event in events:
                        body = event.body
                        if isinstance(body, UserMessage) and body.scheduled is not None:
                            per_schedule[body.scheduled] = per_schedule.get(body.scheduled, 0) + 1
                            lateness.append(event.created_at - dues[body.scheduled])
                        elif isinstance(body, AssistantMessage):
                            answered += 1
                if answered >= len(per_schedule) or time.time() > settle:
                    break
                await asyncio.sleep(0.5)
            pending = len((await rt.admin.schedules(limit=10)).schedules)
    lateness.sort()
    duplicates = sum(count - 1 for count in per_schedule.values() if count > 1)
    return {
        "schedules": n,
        "window_s": window,
        "schedule_seconds": round(set_seconds, 2),
        "fired": len(per_schedule),
        "duplicates": duplicates,
        "answered": answered,
        "still_pending": pending,
        "lateness_ms": {
            "p50": percentile(lateness, 50),
            "p99": percentile(lateness, 99),
            "max": lateness[-1] if lateness else None,
            "min": lateness[0] if lateness else None,
        },
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "target": {"p99_lateness_ms_below": 200, "duplicates": 0},
        "ok": (len(per_schedule) == n and duplicates == 0 and bool(lateness)
               and percentile(lateness, 99) < 200),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--lead", type=float, default=8.0)
    parser.add_argument("--quick", action="store_true", help="1,000 schedules over 10 s")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.schedules, args.window, args.lead = 1_000, 10.0, 3.0
    quiet()
    result = asyncio.run(run(args.schedules, args.window, args.lead))
    late = result["lateness_ms"]
    rows = [[f"{result['schedules']:,} over {result['window_s']:g} s", result["fired"],
             result["duplicates"], result["answered"], late["p50"], late["p99"], late["max"],
             result["peak_rss_mb"], "yes" if result["ok"] else "NO"]]
    emit({"schedules": result}, [table(
        "Schedules fired (lateness: logged at - due, ms)",
        ["run", "fired", "duplicates", "answered", "p50 ms", "p99 ms", "max ms", "RSS MB",
         "p99 < 200 ms, no dup"], rows,
    )], args.json)


if __name__ == "__main__":
    main()
