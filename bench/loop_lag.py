"""How long a megabyte of text stalls the event loop, and the other conversations on it.

Question: while one conversation logs a very large text, do the others stay
responsive? One runtime on a fresh SQLite file (WAL, synchronous=NORMAL) and a
model scripted by rule (it answers ``pong``, or a large text when asked to);
one conversation, *busy*, takes turns back to back the whole time, while
another conversation is sent, in turn:

* ``user_nospace``: a 1 MB user message without spaces (random ASCII letters:
  one tiktoken piece, the costliest text there is to count);
* ``user_natural``: a 1 MB user message of words and spaces;
* ``answer_nospace``: a short message whose answer, streamed by the model in
  64 KiB deltas, is 1 MB without spaces.

Each scenario runs ``--repeat`` times (a new large conversation each time).
Reported per scenario, over the window from the large send until its turn has
ended: the loop's longest stall (a ticker asks to wake every millisecond; a
stall is how late it woke), and the busy conversation's turn latency (max and
p99 of the turns that overlapped the window; p50 of those before it, for
reference).

Before/after: run the same script on another checkout and hand its JSON over::

    git archive main | tar -x -C /tmp/torpor-main
    cp bench/loop_lag.py /tmp/torpor-main/bench/
    python /tmp/torpor-main/bench/loop_lag.py --json /tmp/before.json
    python bench/loop_lag.py --before /tmp/before.json

Usage: ``python bench/loop_lag.py [--repeat 3] [--size 1000000] [--before FILE]
[--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from _common import emit, fresh_db, quiet, table

import torpor
from torpor.events import UserMessage
from torpor.llm.protocol import ContextMessage, StreamEvent, TextDelta, ToolSpec
from torpor.runtime.stats import percentile

ASK_FOR_ANSWER = "please answer at length"
DELTA = 64 * 1024


class RuleModel:
    """Answers ``pong``, or ``answer`` (in ``DELTA``-character deltas) when asked for it."""

    name = "rule"

    def __init__(self, answer: str) -> None:
        self.answer = answer

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        last = next((m.text for m in reversed(context) if isinstance(m, UserMessage)), "")
        if last != ASK_FOR_ANSWER:
            yield TextDelta("pong")
            return
        for start in range(0, len(self.answer), DELTA):
            yield TextDelta(self.answer[start : start + DELTA])
            await asyncio.sleep(0)  # as a provider's stream: the loop runs between deltas


def texts(size: int, seed: int = 19) -> dict[str, str]:
    rng = random.Random(seed)
    nospace = "".join(rng.choices(string.ascii_letters, k=size))
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(5000)]
    natural = " ".join(rng.choices(words, k=size // 4))[:size]
    return {"nospace": nospace, "natural": natural}


class Ticker:
    """Wakes every ``every`` seconds; records how late each wake-up was (the loop's stalls)."""

    def __init__(self, every: float = 0.001) -> None:
        self.every = every
        self.stalls: list[tuple[float, float]] = []  # (when, seconds late)

    async def run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.every)
            now = time.perf_counter()
            self.stalls.append((now, now - t0 - self.every))

    def worst(self, start: float, end: float) -> float:
        return max((late for at, late in self.stalls if start <= at <= end), default=0.0)


async def scenario(
    rt: torpor.Runtime, name: str, text: str, busy: str, big: str, settle: float
) -> dict[str, Any]:
    """Busy turns before, during and after one large turn; the figures of the window."""
    turns: list[tuple[float, float]] = []  # (start, end) of each busy turn
    stop = asyncio.Event()

    async def run_busy() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await (await rt.send(busy, "ping")).result()
            turns.append((t0, time.perf_counter()))

    ticker = Ticker()
    tick = asyncio.ensure_future(ticker.run())
    runner = asyncio.ensure_future(run_busy())
    try:
        await asyncio.sleep(settle)
        start = time.perf_counter()
        turn = await rt.send(big, text)
        await turn.result()
        end = time.perf_counter()
        await asyncio.sleep(settle)
    finally:
        stop.set()
        await runner
        tick.cancel()
        await asyncio.gather(tick, return_exceptions=True)
    before = [e - s for s, e in turns if e < start]
    during = [e - s for s, e in turns if e >= start and s <= end]
    return {
        "scenario": name,
        "large_turn_seconds": round(end - start, 3),
        "max_loop_stall_ms": round(ticker.worst(start, end) * 1000, 1),
        "other_turns_during": len(during),
        "other_turn_max_ms": round(max(during, default=0.0) * 1000, 1),
        "other_turn_p99_ms": round((percentile(during, 99) or 0.0) * 1000, 1),
        "other_turn_p50_before_ms": round((percentile(before, 50) or 0.0) * 1000, 2),
    }


async def run(size: int, repeat: int, settle: float, directory: Path) -> list[dict[str, Any]]:
    made = texts(size)
    model = RuleModel(made["nospace"])
    plan = [
        ("user_nospace", made["nospace"]),
        ("user_natural", made["natural"]),
        ("answer_nospace", ASK_FOR_ANSWER),
    ]
    config = torpor.RuntimeConfig(hibernate_after=3600, evict_after=7200, sweep_interval=3600)
    results: list[dict[str, Any]] = []
    async with torpor.Runtime(fresh_db(directory, "loop_lag.db"), model=model, config=config) as rt:
        busy = "busy"
        await (await rt.send(busy, "ping")).result()  # activated before anything is timed
        for round_ in range(repeat):
            for name, text in plan:
                big = f"{name}-{round_}"
                await (await rt.send(big, "hello")).result()  # active, as the busy one is
                result = await scenario(rt, name, text, busy, big, settle)
                result["round"] = round_
                results.append(result)
                print(f"  {result}", file=sys.stderr)
    return results


def summarise(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per scenario: the worst of every figure over the rounds."""
    out: dict[str, dict[str, float]] = {}
    for r in results:
        row = out.setdefault(r["scenario"], {})
        for key in ("max_loop_stall_ms", "other_turn_max_ms", "other_turn_p99_ms",
                    "large_turn_seconds"):
            row[key] = max(row.get(key, 0.0), r[key])
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=1_000_000, help="characters of large text")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--settle", type=float, default=0.3,
                        help="seconds of busy turns before and after each large turn")
    parser.add_argument("--before", help="JSON of this script run on the code before")
    parser.add_argument("--json", help="also write the JSON here ('-': JSON on stdout only)")
    args = parser.parse_args(argv)
    quiet()
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(run(args.size, args.repeat, args.settle, Path(tmp)))
    summary = summarise(results)
    data: dict[str, Any] = {"size": args.size, "repeat": args.repeat, "summary": summary,
                            "results": results}
    columns = ["scenario", "loop stall max ms", "other turn max ms", "other turn p99 ms",
               "large turn s"]
    rows: list[list[Any]] = [
        [name, s["max_loop_stall_ms"], s["other_turn_max_ms"], s["other_turn_p99_ms"],
         s["large_turn_seconds"]]
        for name, s in summary.items()
    ]
    label = "after" if args.before else "this checkout"
    tables = [table(f"{label} ({args.size:,} characters, worst of {args.repeat})", columns, rows)]
    if args.before:
        before = json.loads(Path(args.before).read_text())["summary"]
        data["before"] = before
        rows = [
            [name, s["max_loop_stall_ms"], s["other_turn_max_ms"], s["other_turn_p99_ms"],
             s["large_turn_seconds"]]
            for name, s in before.items()
        ]
        tables.insert(0, table("before", columns, rows))
    emit(data, tables, args.json)


if __name__ == "__main__":
    main()
