"""What tracing costs a turn: OpenTelemetry off (installed, no provider) against not there.

Question: a host that has ``opentelemetry-api`` installed and loaded, but no tracer
provider configured, must pay nothing per turn (target: under 1%). And what does a
turn cost with tracing on (the SDK, an in-memory exporter), for reference?

Modes, in one process, back to back:

* ``absent``: as if OpenTelemetry were not installed: its modules (and torpor.otel)
  are hidden from ``sys.modules`` while the round runs, so the Runtime's and the HTTP
  routes' checks find nothing (the first round runs before anything imported it).
* ``off``: ``opentelemetry.trace`` loaded, no tracer provider: the Runtime checks at
  ``__aenter__`` and adds no observer; every send also goes through the HTTP routes'
  trace-context hook (``torpor.serve.traces.joined``) with a ``traceparent`` header.
* ``on``: a ``TracingObserver`` on an SDK ``TracerProvider`` with a
  ``SimpleSpanProcessor`` and an ``InMemorySpanExporter`` (4 spans a turn).

Each round is a fresh runtime on ``sqlite://`` (in memory) taking ``--turns`` turns,
one after another, over 10 conversations; every turn is a model call asking for a
tool, the tool, and a model call answering (a ScriptedModel: no model time). The
``absent`` and ``off`` rounds alternate (ABBA) for ``--rounds`` pairs; ``on`` runs
after them (it turns the trace-context hook on for the process). Per turn: process
CPU time (the store's writer thread included; other processes' load does not count)
and wall time, the median over rounds; ``off/absent`` is the ratio of the medians.
Times on a shared machine move by several percent from round to round, more than the
difference sought, so each mode also counts the function calls a turn makes on the
event loop's thread (``sys.setprofile``, 200 turns): a figure no load changes; and
``http_hook_ns`` times the one thing an ``off`` turn runs that an ``absent`` one does
not, the HTTP routes' hook finding tracing off.

Usage: ``python bench/otel_overhead.py [--turns 2000] [--rounds 8] [--quick] [--json FILE]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
import timeit
from collections.abc import Iterator
from typing import Any

from _common import emit, quiet, table

import torpor
from torpor import AgentConfig, Runtime, ScriptedModel
from torpor.llm.scripted import Call, Report, Text
from torpor.serve import traces

HEADERS = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


@torpor.tool
async def lookup(order: str) -> str:
    """Look an order up."""
    return f"order {order}: shipped"


def model() -> ScriptedModel:
    return ScriptedModel([[Call("lookup", {"order": "A1"}), Report(100, 7)],
                          [Text("it shipped"), Report(120, 3)]], loop=True)


@contextlib.contextmanager
def hidden() -> Iterator[None]:
    """OpenTelemetry (and torpor.otel) out of ``sys.modules`` for a while: not installed,
    as far as torpor's checks can tell."""
    names = [n for n in sys.modules
             if n == "opentelemetry" or n.startswith(("opentelemetry.", "torpor.otel"))]
    kept = {n: sys.modules.pop(n) for n in names}
    try:
        yield
    finally:
        sys.modules.update(kept)


async def one_round(turns: int, observer: Any = None) -> dict[str, float]:
    async with Runtime("sqlite://", model=model(), agent=AgentConfig(tools=[lookup])) as rt:
        if observer is not None:
            rt.observe(observer)
        for i in range(10):  # activation, not timed
            await (await rt.send(f"c{i}", "hi")).result()
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(turns):
            with traces.joined(HEADERS):  # what the HTTP route does around rt.send
                turn = await rt.send(f"c{i % 10}", "where is A1?")
            await turn.result()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"cpu_us": cpu / turns * 1e6, "wall_us": wall / turns * 1e6}


async def calls_per_turn(turns: int, observer: Any = None) -> float:
    """Python and C function calls per turn on the event loop's thread: the same count
    on any host under any load, unlike times (a timed difference under 1% drowns in the
    noise of a shared machine)."""
    counted = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            counted[0] += 1

    async def measured() -> None:
        sys.setprofile(count)
        try:
            for i in range(turns):
                with traces.joined(HEADERS):
                    turn = await rt.send(f"c{i % 10}", "where is A1?")
                await turn.result()
        finally:
            sys.setprofile(None)

    async with Runtime("sqlite://", model=model(), agent=AgentConfig(tools=[lookup])) as rt:
        if observer is not None:
            rt.observe(observer)
        for i in range(10):
            await (await rt.send(f"c{i}", "hi")).result()
        await measured()
    return counted[0] / turns


def hook_ns() -> float:
    """ns of the HTTP routes' trace-context hook, entered and left (the best of 5)."""
    def once() -> None:
        with traces.joined(HEADERS):
            pass

    return min(timeit.timeit(once, number=100_000) for _ in range(5)) / 100_000 * 1e9


def summary(rounds: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "cpu_us_per_turn": round(statistics.median(r["cpu_us"] for r in rounds), 1),
        "wall_us_per_turn": round(statistics.median(r["wall_us"] for r in rounds), 1),
        "cpu_us_rounds": [round(r["cpu_us"], 1) for r in rounds],
    }


async def main(turns: int, rounds: int) -> dict[str, Any]:
    first_clean = not any(n.startswith("opentelemetry") for n in sys.modules)
    absent: list[dict[str, float]] = []
    off: list[dict[str, float]] = []

    async def run_absent() -> None:
        with hidden():
            absent.append(await one_round(turns))

    async def run_off() -> None:
        import opentelemetry.trace  # noqa: F401  (loaded, no provider: tracing off)

        off.append(await one_round(turns))

    await one_round(max(200, turns // 10))  # warm up (imports, allocator) untimed
    for pair in range(rounds):
        order = (run_absent, run_off) if pair % 2 == 0 else (run_off, run_absent)
        for run in order:
            await run()

    with hidden():
        calls_absent = await calls_per_turn(200)
        hook_absent = hook_ns()
    calls_off = await calls_per_turn(200)  # the `off` rounds loaded opentelemetry.trace
    hook_off = hook_ns()

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from torpor.otel import TracingObserver, configured

    assert not configured()  # the `off` rounds really had no provider
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    on: list[dict[str, float]] = []
    spans_per_turn = 0.0
    for _ in range(max(2, rounds // 2)):
        exporter.clear()
        on.append(await one_round(turns, TracingObserver(provider)))
        spans_per_turn = len(exporter.get_finished_spans()) / (turns + 10)
    calls_on = await calls_per_turn(200, TracingObserver(provider))
    a, o, t = summary(absent), summary(off), summary(on)
    paired = [x["cpu_us"] / y["cpu_us"] for x, y in zip(off, absent, strict=True)]
    return {
        "turns_per_round": turns,
        "rounds": rounds,
        "first_absent_round_before_any_import": first_clean,
        "absent": a,
        "off": o,
        "on": t,
        "spans_per_turn_on": round(spans_per_turn, 2),
        "off_over_absent_cpu": round(o["cpu_us_per_turn"] / a["cpu_us_per_turn"], 4),
        "off_over_absent_wall": round(o["wall_us_per_turn"] / a["wall_us_per_turn"], 4),
        "off_over_absent_cpu_paired_median": round(statistics.median(paired), 4),
        "on_over_absent_cpu": round(t["cpu_us_per_turn"] / a["cpu_us_per_turn"], 3),
        "calls_per_turn": {"absent": round(calls_absent, 1), "off": round(calls_off, 1),
                           "on": round(calls_on, 1)},
        "off_over_absent_calls": round(calls_off / calls_absent, 5),
        "http_hook_ns": {"absent": round(hook_absent), "off": round(hook_off)},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="300 turns, 3 rounds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.turns, args.rounds = 300, 3
    quiet()
    result = asyncio.run(main(args.turns, args.rounds))
    calls = result["calls_per_turn"]
    rows = [(mode, result[mode]["cpu_us_per_turn"], result[mode]["wall_us_per_turn"],
             ratio, calls[mode], round(calls[mode] / calls["absent"], 4))
            for mode, ratio in (("absent", 1.0), ("off", result["off_over_absent_cpu"]),
                                ("on", result["on_over_absent_cpu"]))]
    emit({"benchmark": "otel_overhead", **result},
         [table(f"Tracing cost per turn (model call, tool, model call; {args.turns} turns x "
                f"{args.rounds} rounds)", ["mode", "CPU µs/turn", "wall µs/turn",
                                           "CPU vs absent", "calls/turn", "calls vs absent"],
                rows)],
         args.json)
