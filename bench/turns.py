"""Turns per second, and the runtime's own cost per turn, with a zero-latency model.

Question: with a model that answers instantly, how many turns a second does
one process sustain, and how much of each turn is the runtime (log appends,
context assembly, audit record, fan-out), for 1, 100 and 10,000 conversations
taking turns concurrently?

Each conversation takes one turn first (activation, not timed), then turns
back to back for ``--duration`` seconds. The EchoModel (delay 0) is wrapped to
time the model's own work, which is subtracted: *overhead per turn* is event
loop time per turn minus model time; *CPU per turn* is process CPU time (the
store's writer thread included) per turn. Each concurrency level runs on a
fresh runtime and a fresh SQLite file (WAL, synchronous=NORMAL).

Every turn renders the conversation's whole working set, so the cost per turn
follows the tail's length (reported at the end): a single conversation taking
turns back to back for seconds accumulates thousands of short messages before
its first fold, which is why it costs more per turn than many short ones.

Usage: ``python bench/turns.py [--concurrency 1 100 10000] [--duration 5] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from _common import emit, fresh_db, quiet, table

import torpor
from torpor.llm.protocol import ContextMessage, StreamEvent, ToolSpec
from torpor.runtime.stats import percentile


class TimedModel:
    """EchoModel with a stopwatch around every step of its stream."""

    def __init__(self) -> None:
        self._echo = torpor.EchoModel(delay=0)
        self.name = "echo"
        self.seconds = 0.0

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        inner = self._echo.stream(context, tools).__aiter__()
        while True:
            t0 = time.perf_counter()
            try:
                event = await inner.__anext__()
            except StopAsyncIteration:
                self.seconds += time.perf_counter() - t0
                return
            self.seconds += time.perf_counter() - t0
            yield event


async def level(url: str, conversations: int, duration: float) -> dict[str, Any]:
    model = TimedModel()
    config = torpor.RuntimeConfig(hibernate_after=3600, evict_after=7200, sweep_interval=3600)
    names = [f"turns-{i:06d}" for i in range(conversations)]
    latencies: list[float] = []
    errors = 0
    async with torpor.Runtime(url, model=model, config=config) as rt:
        await asyncio.gather(*(_turn(rt, c) for c in names))  # activation, untimed
        model.seconds = 0.0
        deadline = time.perf_counter() + duration

        async def loop(c: str) -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    await _turn(rt, c)
                except torpor.TorporError:
                    errors += 1
                else:
                    latencies.append(time.perf_counter() - t0)

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(loop(c) for c in names))
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        sample = await rt.admin.inspect(names[0])
    turns = len(latencies)
    return {
        "conversations": conversations,
        "turns": turns,
        "seconds": round(elapsed, 3),
        "turns_per_second": round(turns / elapsed, 1),
        "overhead_us_per_turn": round((elapsed - model.seconds) / turns * 1e6, 1),
        "model_us_per_turn": round(model.seconds / turns * 1e6, 1),
        "cpu_us_per_turn": round(cpu / turns * 1e6, 1),
        "latency_p50_ms": round((percentile(latencies, 50) or 0) * 1000, 3),
        "latency_p99_ms": round((percentile(latencies, 99) or 0) * 1000, 3),
        "errors": errors,
        "tail_events_at_end": sample.tail_length,
        "working_set_tokens_at_end": sample.working_set_tokens,
    }


async def _turn(rt: torpor.Runtime, conversation_id: str) -> None:
    await (await rt.send(conversation_id, "ping")).result()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 100, 10_000])
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    quiet()
    rows = []
    with tempfile.TemporaryDirectory(prefix="torpor-turns-", dir=args.dir) as tmp:
        for c in args.concurrency:
            url = fresh_db(Path(tmp), f"turns-{c}.db")
            rows.append(asyncio.run(level(url, c, args.duration)))
            print(f"  {c:,} conversations: {rows[-1]['turns_per_second']:,} turns/s",
                  file=sys.stderr)
    result = {"benchmark": "turns", "params": {"concurrency": args.concurrency,
                                               "duration": args.duration}, "levels": rows}
    columns = ("conversations", "turns/s", "overhead µs/turn", "model µs/turn", "CPU µs/turn",
               "p50 ms", "p99 ms", "tail events", "errors")
    tab = [(r["conversations"], r["turns_per_second"], r["overhead_us_per_turn"],
            r["model_us_per_turn"], r["cpu_us_per_turn"], r["latency_p50_ms"],
            r["latency_p99_ms"], r["tail_events_at_end"], r["errors"]) for r in rows]
    emit(result, [table("turns with a zero-latency model", columns, tab)], args.json)


if __name__ == "__main__":
    main()
