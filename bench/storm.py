"""Activation storm: N evicted conversations each receive one message at the same moment.

Question: when every user comes back at once (a deploy, a push notification),
does every message get answered, how long does it take, and what does memory
do, with and without the runtime's caps?

Variants, each in a fresh process on a copy of the same database (N
conversations with H events of history, nothing in memory):

* ``revival-cap``: the default ``max_concurrent_revivals`` (64);
* ``no-cap``: revivals unbounded (``max_concurrent_revivals`` = 1,000,000);
* ``revival+live-cap``: the default revival cap and ``max_live_agents`` (default
  1,000), so idle agents are evicted least-recently-used first as others revive.

Reported per variant: seconds until every message was answered, answers/s,
revivals/s, answer latency p50/p99, errors, peak RSS (sampled every 20 ms, and
the process high-water mark), peak live agents.

Usage: ``python bench/storm.py [--agents 10000] [--history 20] [--live-cap 1000] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _common import (
    emit,
    fresh_db,
    peak_rss_bytes,
    quiet,
    rss_bytes,
    run_json,
    settle,
    table,
)

import torpor
from torpor.cli.history import build_history
from torpor.runtime.stats import percentile

HERE = Path(__file__).resolve()
VARIANTS = ("revival-cap", "no-cap", "revival+live-cap")


def ids(n: int) -> list[str]:
    return [f"storm-{i:06d}" for i in range(n)]


async def storm(url: str, n: int, variant: str, live_cap: int) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if variant == "no-cap":
        extra["max_concurrent_revivals"] = 1_000_000
    if variant == "revival+live-cap":
        extra["max_live_agents"] = live_cap
    config = torpor.RuntimeConfig(hibernate_after=3600, evict_after=7200, sweep_interval=3600,
                                  **extra)
    names = ids(n)
    errors: Counter[str] = Counter()
    latencies: list[float] = []
    async with torpor.Runtime(url, model=torpor.EchoModel(), config=config) as rt:
        settle()
        rss0 = rss_bytes()
        peak = {"rss": rss0, "live": 0}

        async def sample() -> None:
            while True:
                peak["rss"] = max(peak["rss"], rss_bytes())
                peak["live"] = max(peak["live"], (await rt.admin.stats()).live)
                await asyncio.sleep(0.02)

        async def one(conversation_id: str) -> None:
            t0 = time.perf_counter()
            try:
                answer = await (await rt.send(conversation_id, "I'm back!")).result()
            except torpor.TorporError as exc:
                errors[type(exc).__name__] += 1
                return
            if answer.text != "echo: I'm back!":
                errors["wrong answer"] += 1
                return
            latencies.append(time.perf_counter() - t0)

        sampler = asyncio.create_task(sample())
        started = time.perf_counter()
        await asyncio.gather(*(one(c) for c in names))
        seconds = time.perf_counter() - started
        sampler.cancel()
        stats = (await rt.admin.stats())
    return {
        "variant": variant,
        "agents": n,
        "answered": len(latencies),
        "errors": dict(errors),
        "seconds": round(seconds, 3),
        "answers_per_second": round(len(latencies) / seconds, 1),
        "revivals": stats.revivals,
        "revivals_per_second": round(stats.revivals / seconds, 1),
        "evictions": stats.evictions,
        "answer_p50_ms": round((percentile(latencies, 50) or 0) * 1000, 1),
        "answer_p99_ms": round((percentile(latencies, 99) or 0) * 1000, 1),
        "revival_p50_ms": stats.revival_p50_ms,
        "revival_p99_ms": stats.revival_p99_ms,
        "queue_wait_p50_ms": stats.queue_wait_p50_ms,
        "queue_wait_p99_ms": stats.queue_wait_p99_ms,
        "rss_before_bytes": rss0,
        "peak_rss_sampled_bytes": peak["rss"],
        "peak_rss_growth_bytes": peak["rss"] - rss0,
        "peak_rss_process_bytes": peak_rss_bytes(),
        "peak_live_agents": peak["live"],
        "max_concurrent_revivals": config.max_concurrent_revivals,
        "max_live_agents": config.max_live_agents,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=10_000)
    p.add_argument("--history", type=int, default=20)
    p.add_argument("--live-cap", type=int, default=1_000)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--dir", default=None)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    args = p.parse_args()
    quiet()
    if args.worker:
        emit(asyncio.run(storm(args.db, args.agents, args.worker, args.live_cap)), [], args.json)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="torpor-storm-", dir=args.dir) as tmp:
        template = fresh_db(Path(tmp), "template.db")
        build = asyncio.run(build_history(template, ids(args.agents), args.history))
        source = Path(template.removeprefix("sqlite:///"))
        with sqlite3.connect(source) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        print(f"built {build.events:,} events in {build.seconds:.1f} s", file=sys.stderr)
        for variant in args.variants:
            db = fresh_db(Path(tmp), f"{variant}.db")
            shutil.copyfile(source, db.removeprefix("sqlite:///"))
            row = run_json([str(HERE), "--worker", variant, "--db", db,
                            "--agents", str(args.agents), "--live-cap", str(args.live_cap)])
            rows.append(row)
            print(f"  {variant}: {row['seconds']} s, {len(row['errors'])} error kinds",
                  file=sys.stderr)
    result = {
        "benchmark": "storm",
        "params": {"agents": args.agents, "history": args.history, "live_cap": args.live_cap},
        "variants": rows,
        "targets": {
            "every_message_answered": all(r["answered"] == r["agents"] for r in rows),
            "no_errors": all(not r["errors"] for r in rows),
            # The target: peak memory bounded by the live-agent cap.
            "live_cap_held": all(r["peak_live_agents"] <= r["max_live_agents"] for r in rows),
        },
    }
    by = {r["variant"]: r for r in rows}
    capped, uncapped = by.get("revival+live-cap"), by.get("revival-cap")
    if capped is not None and uncapped is not None:
        # Admission (issue 9.1): against the run without a live cap, in the same invocation.
        growth = capped["peak_rss_growth_bytes"] / max(1, uncapped["peak_rss_growth_bytes"])
        slower = capped["seconds"] / uncapped["seconds"]
        result["ratios"] = {"capped/uncapped_peak_rss_growth": round(growth, 2),
                            "capped/uncapped_seconds": round(slower, 2)}
        result["targets"]["capped_rss_growth_le_half"] = growth <= 0.5
        result["targets"]["capped_time_within_1_5x"] = slower <= 1.5
    columns = ("variant", "seconds", "answers/s", "p50 ms", "p99 ms", "errors",
               "peak RSS +MB", "peak live", "queue wait p50/p99 ms")
    tab = [(r["variant"], r["seconds"], r["answers_per_second"],
            r["answer_p50_ms"], r["answer_p99_ms"], sum(r["errors"].values()),
            round(r["peak_rss_growth_bytes"] / 1e6, 1), r["peak_live_agents"],
            "-" if r["queue_wait_p50_ms"] is None
            else f"{r['queue_wait_p50_ms']:.0f} / {r['queue_wait_p99_ms']:.0f}") for r in rows]
    emit(result, [table(f"activation storm: {args.agents:,} evicted conversations, one message "
                        "each", columns, tab)], args.json)


if __name__ == "__main__":
    main()
