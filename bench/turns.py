"""Turns per second, and the runtime's own cost per turn, with a zero-latency model.

Question: with a model that answers instantly, how many turns a second does
one process sustain, and how much of each turn is the runtime (log appends,
context assembly, audit record, fan-out), for 1, 100 and 10,000 conversations
taking turns concurrently?

Each conversation takes one turn first (activation, not timed), then turns
back to back for ``--duration`` seconds, or (``--turns N``) until the level has taken
N turns, each of its C conversations ceil(N / C). A duration makes a faster host do
more turns per conversation, so longer tails and more folds, and a slower one fewer;
``--turns`` makes every host do the same work (the tails' lengths and the collector's
runs come out the same), which is what ``run_all.py`` runs. The EchoModel (delay 0) is wrapped to
time the model's own work, which is subtracted: *overhead per turn* is event
loop time per turn minus model time; *CPU per turn* is process CPU time (the
store's writer thread included) per turn. Each concurrency level runs on a
fresh runtime and a fresh SQLite file (WAL, synchronous=NORMAL).

Every turn renders the conversation's whole working set, so the cost per turn
follows the tail's length (reported at the end): a single conversation taking
turns back to back for seconds accumulates thousands of short messages before
its first fold, which is why it costs more per turn than many short ones.

The floor: at the concurrency levels named by ``--naive`` (default 1 and 100)
a hand-rolled loop runs first, in the same process and on the same disk: one
shared aiosqlite connection with the same PRAGMAs (WAL, synchronous=NORMAL)
doing the same two durable commits per turn (INSERT the user message, COMMIT;
INSERT the echoed reply, COMMIT) and nothing else. ``torpor_over_naive`` is
how many times longer a torpor turn takes (naive turns/s over torpor's), the
issue's target being at most 2.

The WAL file's size is sampled every 20 ms while a level runs (``max_wal_bytes``).
``--soak SECONDS`` runs one level for that long instead, reporting latency and
the largest WAL file per minute: is the WAL bounded over a long run? (Only run
by hand: neither CI nor ``run_all.py`` passes it.)

Usage: ``python bench/turns.py [--concurrency 1 100 10000] [--naive 1 100] [--duration 5 |
--turns 15000] [--gc-off] [--gc-freeze] [--json FILE]``;
``python bench/turns.py --concurrency 1 --soak 600``.

What moves these figures besides torpor's code (measured on two hosts of one workplace,
the same code, the same work): the host, since the µs per turn scale with its speed
(105 µs of CPU a turn at 100 conversations on one host, 175 on another, whose pure-Python
benchmarks were 1.5-1.7x slower too; the output's ``host_gauge_ms`` tells hosts apart),
and, for the floor alone, how its aiosqlite thread is scheduled: its hand-offs cost the
most CPU when the other core is idle, so the floor's turn took 43 to 92 µs of CPU back to
back on one host, and torpor/naive moves with it. ``bench/instructions.py`` counts
instructions per turn instead, which neither changes.

``--trace`` (a diagnostic) runs one conversation for ``--duration`` seconds with
timestamps on every step of every turn, every group-commit batch, checkpoint,
fold and GC run (see ``_turn_trace.py``), and prints what the slowest 1% of
turns were made of and what overlapped them.

Each level also reports the cyclic GC's collections per generation and their seconds
(``gc_collections``, ``gc_seconds``, timed part only); ``--gc-off`` runs every level
again with the GC disabled (``cpu_us_per_turn_gc_off``): the difference is what
collecting costs, which is what grows between 100 and 10,000 conversations in flight.
``--gc-freeze`` runs every level again as a host could set it up: ``gc.freeze()`` once
the agents are live (``cpu_us_per_turn_gc_frozen``), so full collections no longer walk
what was alive by then (torpor leaves the collector's settings to the host).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiosqlite
from _common import emit, fresh_db, quiet, ratio, table
from _turn_trace import Tracer

import torpor
from torpor.llm.protocol import ContextMessage, StreamEvent, ToolSpec
from torpor.runtime.stats import percentile


class TimedModel:
    """EchoModel with a stopwatch around every step of its stream."""

    def __init__(self, tracer: Tracer | None = None) -> None:
        self._echo = torpor.EchoModel(delay=0)
        self.name = "echo"
        self.seconds = 0.0
        self._tracer = tracer

    async def stream(
        self, context: Sequence[ContextMessage], tools: Sequence[ToolSpec]
    ) -> AsyncIterator[StreamEvent]:
        if self._tracer is not None:
            self._tracer.model_called()
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


class WalGauge:
    """The WAL file's size, sampled every ``every`` seconds while a level runs: its maximum."""

    def __init__(self, db: Path, every: float = 0.02) -> None:
        self.path = Path(f"{db}-wal")
        self.every = every
        self.largest = 0
        self.window = 0  # largest since the last window() call

    def sample(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = 0
        self.largest = max(self.largest, size)
        self.window = max(self.window, size)

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.every)

    def take_window(self) -> int:
        largest, self.window = self.window, 0
        return largest


class GcGauge:
    """Cyclic GC collections per generation, and the seconds they took, while installed."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __enter__(self) -> GcGauge:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            generation = info["generation"]
            self.collections[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started


async def level(
    db: Path, conversations: int, duration: float, *, turns: int | None = None,
    window: float | None = None, tracer: Tracer | None = None, freeze: bool = False,
) -> dict[str, Any]:
    """Turns back to back for ``duration`` seconds; with ``window``, figures per window too.

    ``turns``: instead of a duration, each conversation takes exactly that many turns.

    ``tracer``: record what every turn was made of (one conversation only: see --trace).
    """
    model = TimedModel(tracer)
    config = torpor.RuntimeConfig(hibernate_after=3600, evict_after=7200, sweep_interval=3600)
    names = [f"turns-{i:06d}" for i in range(conversations)]
    latencies: list[float] = []
    windows: list[dict[str, Any]] = []
    errors = 0
    gauge = WalGauge(db)
    async with torpor.Runtime(f"sqlite:///{db}", model=model, config=config) as rt:
        await asyncio.gather(*(_turn(rt, c) for c in names))  # activation, untimed
        if freeze:  # what a host may do once its agents are up: the collector skips them
            gc.collect()
            gc.freeze()
        model.seconds = 0.0
        more = _more(duration, turns)

        async def loop(c: str) -> None:
            nonlocal errors
            taken = 0
            while more(taken):
                taken += 1
                if tracer is not None:
                    tracer.turn_start()
                t0 = time.perf_counter()
                try:
                    await _turn(rt, c)
                except torpor.TorporError:
                    errors += 1
                else:
                    latencies.append(time.perf_counter() - t0)
                    if tracer is not None:
                        tracer.turn_end()

        async def report(every: float) -> None:
            start = 0
            while True:
                await asyncio.sleep(every)
                chunk, start = latencies[start:], len(latencies)
                windows.append({
                    "end_seconds": round(every * (len(windows) + 1)),
                    "turns": len(chunk),
                    "latency_p50_ms": round((percentile(chunk, 50) or 0) * 1000, 3),
                    "latency_p99_ms": round((percentile(chunk, 99) or 0) * 1000, 3),
                    "max_wal_bytes": gauge.take_window(),
                })
                print(f"    {windows[-1]}", file=sys.stderr)

        sampler = asyncio.ensure_future(gauge.run())
        reporter = asyncio.ensure_future(report(window)) if window else None
        try:
            with GcGauge() as collected:
                cpu0, t0 = time.process_time(), time.perf_counter()
                await asyncio.gather(*(loop(c) for c in names))
                elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        finally:
            for task in (sampler, reporter):
                if task is not None:
                    task.cancel()
            await asyncio.gather(sampler, *([reporter] if reporter else []),
                                 return_exceptions=True)
        gauge.sample()
        sample = await rt.admin.inspect(names[0])
    turns = len(latencies)
    result: dict[str, Any] = {
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
        "max_wal_bytes": gauge.largest,
        "gc_collections": collected.collections,  # per generation, timed part only
        "gc_seconds": [round(x, 3) for x in collected.seconds],
    }
    if window:
        result["windows"] = windows
    return result


async def _turn(rt: torpor.Runtime, conversation_id: str) -> None:
    await (await rt.send(conversation_id, "ping")).result()


def _more(duration: float, turns: int | None) -> Callable[[int], bool]:
    """Whether a conversation that has taken ``n`` timed turns takes another.

    With ``turns`` every conversation takes that many, whatever the machine's speed, so
    the work (the tails' lengths, the folds) is the same on any host; else it goes on
    until ``duration`` seconds from now.
    """
    if turns is not None:
        return lambda n: n < turns
    deadline = time.perf_counter() + duration
    return lambda n: time.perf_counter() < deadline


NAIVE_SCHEMA = (
    "CREATE TABLE messages (id INTEGER PRIMARY KEY, conversation TEXT NOT NULL, "
    "role TEXT NOT NULL, body TEXT NOT NULL)",
    "CREATE INDEX messages_by_conversation ON messages (conversation, id)",
)


async def naive_level(
    path: Path, conversations: int, duration: float, turns: int | None = None,
) -> dict[str, Any]:
    """The floor: what a hand-rolled chat loop does per turn with aiosqlite, nothing else.

    One shared aiosqlite connection (WAL, synchronous=NORMAL, like torpor's
    default); a turn is INSERT the user message, COMMIT, "call the model" (echo
    the message), INSERT the reply, COMMIT. Both commits are awaited, so each
    message is durable (against a process crash) before the turn goes on, as in
    torpor. No history is read, rendered or audited: torpor's extra work per
    turn is the difference.
    """
    names = [f"naive-{i:06d}" for i in range(conversations)]
    latencies: list[float] = []
    async with aiosqlite.connect(str(path)) as db:
        await db.execute("PRAGMA journal_mode = WAL")
        await db.execute("PRAGMA synchronous = NORMAL")
        for sql in NAIVE_SCHEMA:
            await db.execute(sql)
        await db.commit()

        async def turn(c: str) -> None:
            text = "ping"
            await db.execute(
                "INSERT INTO messages (conversation, role, body) VALUES (?, 'user', ?)",
                (c, text),
            )
            await db.commit()
            await db.execute(
                "INSERT INTO messages (conversation, role, body) VALUES (?, 'assistant', ?)",
                (c, text),
            )
            await db.commit()

        await asyncio.gather(*(turn(c) for c in names))  # same warm-up as torpor's activation
        more = _more(duration, turns)

        async def loop(c: str) -> None:
            taken = 0
            while more(taken):
                taken += 1
                t0 = time.perf_counter()
                await turn(c)
                latencies.append(time.perf_counter() - t0)

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(loop(c) for c in names))
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    turns = len(latencies)
    return {
        "conversations": conversations,
        "turns": turns,
        "seconds": round(elapsed, 3),
        "turns_per_second": round(turns / elapsed, 1),
        "cpu_us_per_turn": round(cpu / turns * 1e6, 1),
        "latency_p50_ms": round((percentile(latencies, 50) or 0) * 1000, 3),
        "latency_p99_ms": round((percentile(latencies, 99) or 0) * 1000, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 100, 10_000])
    p.add_argument("--naive", type=int, nargs="*", default=[1, 100], metavar="N",
                   help="concurrency levels at which the naive aiosqlite loop runs too")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--turns", type=int, default=None, metavar="N",
                   help="instead of --duration: N timed turns per level, each of its C "
                        "conversations taking ceil(N / C), so every host does the same work")
    p.add_argument("--soak", type=float, metavar="SECONDS", default=None,
                   help="instead: one level of --concurrency (first value) for SECONDS, "
                        "reporting latency and the largest WAL file every minute")
    p.add_argument("--gc-off", action="store_true",
                   help="run each level a second time with the cyclic GC disabled and report "
                        "its CPU per turn (what the GC costs at that level)")
    p.add_argument("--gc-freeze", action="store_true",
                   help="run each level a second time with gc.freeze() after the agents are "
                        "live and report its CPU per turn (a host's setting, not torpor's)")
    p.add_argument("--trace", action="store_true",
                   help="instead: one conversation for --duration seconds, printing what the "
                        "slowest 1%% of turns were made of and what overlapped them")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    quiet()
    if args.soak is not None:
        soak(args)
        return
    if args.trace:
        trace(args)
        return
    rows = []
    naive: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="torpor-turns-", dir=args.dir) as tmp:
        for c in args.concurrency:
            each = None if args.turns is None else -(-args.turns // c)  # turns per conversation
            if c in args.naive:  # the floor first, back to back with torpor's run
                path = Path(tmp) / f"naive-{c}.db"
                naive[c] = asyncio.run(naive_level(path, c, args.duration, each))
                print(f"  {c:,} conversations, naive: {naive[c]['turns_per_second']:,} turns/s",
                      file=sys.stderr)
            db = Path(fresh_db(Path(tmp), f"turns-{c}.db").removeprefix("sqlite:///"))
            rows.append(asyncio.run(level(db, c, args.duration, turns=each)))
            if args.gc_off:  # the same level again with the cyclic GC off: what it costs
                db = Path(fresh_db(Path(tmp), f"turns-{c}-nogc.db").removeprefix("sqlite:///"))
                gc.collect()
                gc.disable()
                try:
                    off = asyncio.run(level(db, c, args.duration, turns=each))
                finally:
                    gc.enable()
                rows[-1]["cpu_us_per_turn_gc_off"] = off["cpu_us_per_turn"]
            if args.gc_freeze:  # again, with what was alive after activation frozen
                db = Path(fresh_db(Path(tmp), f"turns-{c}-frozen.db").removeprefix("sqlite:///"))
                try:
                    frozen = asyncio.run(level(db, c, args.duration, turns=each, freeze=True))
                finally:
                    gc.unfreeze()
                rows[-1]["cpu_us_per_turn_gc_frozen"] = frozen["cpu_us_per_turn"]
            print(f"  {c:,} conversations: {rows[-1]['turns_per_second']:,} turns/s",
                  file=sys.stderr)
            floor = naive.get(c)
            if floor is not None:
                rows[-1]["naive"] = floor
                # How many times longer a torpor turn takes than a naive one (<= 2 is the target).
                rows[-1]["torpor_over_naive"] = ratio(floor["turns_per_second"],
                                                      rows[-1]["turns_per_second"])
                rows[-1]["torpor_over_naive_cpu"] = ratio(rows[-1]["cpu_us_per_turn"],
                                                          floor["cpu_us_per_turn"])
            rows[-1]["p99_over_p50"] = ratio(rows[-1]["latency_p99_ms"],
                                             rows[-1]["latency_p50_ms"])
    result = {"benchmark": "turns", "params": {"concurrency": args.concurrency,
                                               "naive": args.naive,
                                               "duration": args.duration,
                                               "turns": args.turns,
                                               "gc_off": args.gc_off,
                                               "gc_freeze": args.gc_freeze}, "levels": rows,
              "targets": {"torpor_over_naive_max": 2.0, "p99_over_p50_max_at_1": 2.0}}
    columns = ("conversations", "turns/s", "overhead µs/turn", "model µs/turn", "CPU µs/turn",
               "p50 ms", "p99 ms", "tail events", "max WAL MB", "errors")
    tab = [(r["conversations"], r["turns_per_second"], r["overhead_us_per_turn"],
            r["model_us_per_turn"], r["cpu_us_per_turn"], r["latency_p50_ms"],
            r["latency_p99_ms"], r["tail_events_at_end"], round(r["max_wal_bytes"] / 1e6, 1),
            r["errors"]) for r in rows]
    tables = [table("turns with a zero-latency model", columns, tab)]
    floors = [(r["conversations"], r["naive"]["turns_per_second"], r["turns_per_second"],
               r["torpor_over_naive"], r["naive"]["cpu_us_per_turn"], r["cpu_us_per_turn"],
               r["torpor_over_naive_cpu"], r["naive"]["latency_p50_ms"],
               r["naive"]["latency_p99_ms"]) for r in rows if "naive" in r]
    if floors:
        tables.append(table(
            "against the naive aiosqlite loop (same two commits per turn, same run)",
            ("conversations", "naive turns/s", "torpor turns/s", "torpor/naive time",
             "naive CPU µs", "torpor CPU µs", "torpor/naive CPU", "naive p50 ms",
             "naive p99 ms"), floors))
    tables.append(table(
        "cyclic GC during the timed part (gen2: full collections)",
        ("conversations", "CPU µs/turn", "CPU µs/turn, GC off", "CPU µs/turn, frozen",
         "collections gen0/1/2", "gen2 seconds"),
        [(r["conversations"], r["cpu_us_per_turn"], r.get("cpu_us_per_turn_gc_off", "-"),
          r.get("cpu_us_per_turn_gc_frozen", "-"),
          "/".join(str(n) for n in r["gc_collections"]), r["gc_seconds"][2]) for r in rows]))
    emit(result, tables, args.json)


def trace(args: argparse.Namespace) -> None:
    """``--trace``: the slowest 1% of turns at one conversation, taken apart (a diagnostic)."""
    tracer = Tracer()
    with tempfile.TemporaryDirectory(prefix="torpor-trace-", dir=args.dir) as tmp:
        db = Path(fresh_db(Path(tmp), "trace.db").removeprefix("sqlite:///"))
        tracer.install()
        try:
            row = asyncio.run(level(db, 1, args.duration, tracer=tracer))
        finally:
            tracer.uninstall()
    row["p99_over_p50"] = ratio(row["latency_p99_ms"], row["latency_p50_ms"])
    report = tracer.report()
    result = {"benchmark": "turns_trace", "params": {"seconds": args.duration},
              "level": row, "trace": report}
    segments = [(name, s["median_turn_us"], s["slow_turn_median_us"], s["slow_turn_max_us"])
                for name, s in report["segments"].items()]
    overlaps = list(report["overlap_counts"].items())
    emit(result, [
        table(f"turn segments, µs (p50 {row['latency_p50_ms']} ms, p99 "
              f"{row['latency_p99_ms']} ms)", ("segment", "median turn", "slow turns: median",
                                               "slow turns: max"), segments),
        table(f"what overlapped the slowest {report['slow_turns']} turns",
              ("overlap", "turns"), overlaps),
        table("checkpoints", ("mode", "runs", "median ms", "max ms"),
              [(mode, n, report["checkpoint_ms_median"][mode], report["checkpoint_ms_max"][mode])
               for mode, n in report["checkpoints"].items()]
              + [("turns > 2x p50 during them / in as long control windows", "-",
                  report["over_2x_p50_in_checkpoints"],
                  report["over_2x_p50_in_control_windows"])]),
        table("every turn by what overlapped it", ("overlap", "turns", "slow", "p50 ms",
                                                   "p99 ms", "loop CPU p50 ms"),
              [(k, v["turns"], v["slow"], v["p50_ms"], v["p99_ms"], v["loop_cpu_p50_ms"])
               for k, v in report["by_overlap"].items()]),
    ], args.json)


def soak(args: argparse.Namespace) -> None:
    """``--soak SECONDS``: is the WAL bounded over a long run? (Never run by CI or run_all.)"""
    conversations = args.concurrency[0]
    with tempfile.TemporaryDirectory(prefix="torpor-soak-", dir=args.dir) as tmp:
        db = Path(fresh_db(Path(tmp), "soak.db").removeprefix("sqlite:///"))
        row = asyncio.run(level(db, conversations, args.soak, window=60.0))
    row["p99_over_p50"] = ratio(row["latency_p99_ms"], row["latency_p50_ms"])
    result = {"benchmark": "turns_soak", "params": {"concurrency": conversations,
                                                    "seconds": args.soak}, "soak": row}
    columns = ("window end s", "turns", "p50 ms", "p99 ms", "max WAL MB")
    tab = [(w["end_seconds"], w["turns"], w["latency_p50_ms"], w["latency_p99_ms"],
            round(w["max_wal_bytes"] / 1e6, 1)) for w in row.get("windows", [])]
    tab.append(("all", row["turns"], row["latency_p50_ms"], row["latency_p99_ms"],
                round(row["max_wal_bytes"] / 1e6, 1)))
    emit(result, [table(f"soak: {conversations} conversation(s) for {args.soak:g} s", columns,
                        tab)], args.json)


if __name__ == "__main__":
    main()
