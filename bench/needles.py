"""Needle benchmark (the design source's Table 2): pointer folding vs truncation.

Setup, as in the source: 50 needles (hashes, file paths, parameters) at evenly
spaced events of a 200-event conversation (all seeded before event 150), ~80
flood tokens per turn (a turn is a user message and an answer, ~40 tokens
each), a 4,000-token working budget of which 200 are headroom (so a fold
starts above 3,800 tokens of tail), a 3-turn hot tail, up to 5 compaction
attempts. Everything goes through a real SQLite store (``sqlite://``) with the
tiktoken counter, a WorkingSet, ``plan_fold``/``build_checkpoint`` and
``recall``.

Reported:

* recall@10 of the needles through ``recall(needle)`` (full-text search over
  the log), and needle loss; the truncation baseline keeps only the last
  max(events in torpor's context, 10) events, and "recalls" a needle only if
  it is still in that window;
* events, turns and markers in context after compaction; compaction cycles;
* compaction latency = plan_fold + build_checkpoint + apply (no store I/O),
  for a live working set (events appended one turn at a time, as an agent
  does) and a revived one (built at once from what ``store.resume()`` read,
  never folded), side by side; both read each event's topic hints as the store
  kept them at append. Also the revived working set's build time (byte
  accounting and cut points over the whole tail), and put_checkpoint separately;
* the same at 100 / 200 / 1,000 / 10,000 events (scaling), and an
  incremental run that checks for a fold after every turn, as an agent does;
* through the runtime, at the largest size: the first turn of conversations
  whose history was imported through the store and never folded (revival,
  the fold, the model call), and the longest the event loop went without
  running another task meanwhile (what every other conversation waits).

Usage: ``python bench/needles.py [--sizes 100,200,1000,10000] [--json FILE]``.

``--table1`` runs the end-to-end benchmark in the shape of the source's Table 1
instead (exact-match recall, 1-hop and 2-hop, after 1, 3, 5 and 50 folds:
truncation, narrative compaction, torpor pull-only and torpor with push; see
``bench/_recall_table1.py``); ``--table1 --quick`` a small version in seconds.
``--generator honest`` (or ``both``, the default) adds the needles people write: prose
facts in words common in the conversation, prose corrections, numbers and names written
differently, asked with the question's own words (``bench/_recall_honest.py``);
``--levels 1,50`` picks the fold counts.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from torpor.compaction import (
    CompactionPolicy,
    WorkingSet,
    build_checkpoint,
    make_token_counter,
    plan_fold,
    recall,
)
from torpor.compaction.markers import encode_hints
from torpor.events import AssistantMessage, Body, Event, UserMessage
from torpor.store import open_store

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

BUDGET = 4_000
HEADROOM = 200
TAIL_TURNS = 3
ATTEMPTS = 5
NEEDLES = 50
FLOOD_PER_TURN = 80
K = 10

POLICY = CompactionPolicy(
    context_window=8_192,
    max_output_tokens=1_024,
    safety_margin=HEADROOM,
    working_budget=BUDGET - HEADROOM,
    tail_turns=TAIL_TURNS,
)


def _words(text: str) -> list[str]:
    return text.split()


FLOOD_WORDS = _words(
    "the service restarted after the nightly batch and the queue drained slowly while we "
    "watched the dashboards for errors then someone asked whether the retry policy was "
    "still too aggressive for the upstream and we agreed to look again tomorrow morning"
)
SERVICES = ("billing", "ledger", "search", "gateway", "ingest", "auth", "mailer", "report")
PARAMS = ("pool_size", "retry_backoff_ms", "max_inflight", "cache_ttl_s", "shard_count")


@dataclass
class Trace:
    turns: list[tuple[int, list[Body]]]  # (turn number, bodies)
    needles: list[tuple[str, int]]  # (needle, position of its event)
    events: int


def needle(i: int) -> str:
    kind = i % 3
    if kind == 0:
        return hashlib.sha1(f"needle-{i}".encode()).hexdigest()
    if kind == 1:
        return f"/srv/{SERVICES[i % len(SERVICES)]}/conf/override_{i}.yaml"
    return f"{PARAMS[i % len(PARAMS)]}_{i}={(i * 37) % 1000 + 1}"


def flood(rng: random.Random, tokens: int) -> str:
    """Filler prose; every flood word is one cl100k token (with its leading space)."""
    return " ".join(rng.choice(FLOOD_WORDS) for _ in range(tokens))


def make_trace(events: int, seed: int = 7) -> Trace:
    """``events`` events as user/assistant turns; needles evenly spaced over the first 75%."""
    rng = random.Random(seed)
    span = max(NEEDLES, events * 3 // 4)
    spacing = span / NEEDLES
    needle_at = {int(i * spacing): needle(i) for i in range(NEEDLES)}
    half = FLOOD_PER_TURN // 2
    turns: list[tuple[int, list[Body]]] = []
    needles: list[tuple[str, int]] = []
    position = 0
    turn = 0
    while position < events:
        turn += 1
        bodies: list[Body] = []
        for role in ("user", "assistant"):
            if position >= events:
                break
            text = flood(rng, half)
            hidden = needle_at.get(position)
            if hidden is not None:
                text = f"{text}. For the record: {hidden} is the value to remember."
                needles.append((hidden, position))
            bodies.append(UserMessage(text) if role == "user" else AssistantMessage(text))
            position += 1
        turns.append((turn, bodies))
    return Trace(turns, needles, events)


@dataclass
class Timing:
    samples_us: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        s = sorted(self.samples_us)
        return {
            "median_us": round(statistics.median(s), 1),
            "p90_us": round(s[int(0.9 * (len(s) - 1))], 1),
            "min_us": round(s[0], 1),
            "runs": len(s),
        }


def fold_once(ws: WorkingSet) -> tuple[float, Any]:
    started = time.perf_counter_ns()
    plan = plan_fold(ws, POLICY)
    checkpoint = None
    if plan is not None:
        checkpoint = build_checkpoint(plan, ws.checkpoint, created_at=0)
        ws.apply(checkpoint)
    return (time.perf_counter_ns() - started) / 1000.0, checkpoint


def live_ws(events: Sequence[Event]) -> WorkingSet:
    ws = WorkingSet("needles", None, [])
    turn: list[Event] = []
    for event in events:  # as an agent appends: a turn at a time
        if turn and event.turn != turn[-1].turn:
            ws.append(turn)
            turn = []
        turn.append(event)
    ws.append(turn)
    return ws


def fold_latency(events: Sequence[Event], runs: int) -> dict[str, Any]:
    live, cold, build = Timing(), Timing(), Timing()
    for _ in range(runs):
        ws = live_ws(events)
        elapsed, checkpoint = fold_once(ws)
        assert checkpoint is not None
        live.samples_us.append(elapsed)
        started = time.perf_counter_ns()
        ws = WorkingSet("needles", None, events)  # revived: built at once, never folded
        build.samples_us.append((time.perf_counter_ns() - started) / 1000.0)
        elapsed, revived = fold_once(ws)
        assert revived == checkpoint  # the same fold, however the working set was built
        cold.samples_us.append(elapsed)
    return {"live": live.summary(), "revived": cold.summary(), "revived_build": build.summary()}


async def run_size(n: int, *, table2: bool) -> dict[str, Any]:
    trace = make_trace(n)
    async with open_store(
        "sqlite://", token_counter=make_token_counter(), hint_extractor=encode_hints
    ) as store:
        logged: list[Event] = []
        for turn, bodies in trace.turns:
            logged.extend(await store.append_events("needles", bodies, turn=turn))
        tail_tokens = sum(e.tokens for e in logged)

        # Up to five compaction attempts on the full trace, as in the source.
        ws = live_ws(logged)
        cycles = 0
        io = Timing()
        for _ in range(ATTEMPTS):
            _, checkpoint = fold_once(ws)
            if checkpoint is None:
                break
            started = time.perf_counter_ns()
            await store.put_checkpoint(checkpoint)
            io.samples_us.append((time.perf_counter_ns() - started) / 1000.0)
            cycles += 1
        assert ws.checkpoint is not None, "the trace never went over budget"
        rendered = ws.render("You are a helpful assistant.", POLICY)
        context = "\n".join(
            getattr(m, "text", "") or getattr(m, "content", "") for m in rendered.messages
        )

        found = 0
        for text, position in trace.needles:
            hits = await recall(store, "needles", text, k=K)
            found += position in [h.position for h in hits]

        cache_events = len(ws.tail)
        window = logged[-max(cache_events, 10) :]
        window_text = "\n".join(getattr(e.body, "text", "") for e in window)
        truncation_found = sum(text in window_text for text, _ in trace.needles)

        runs = 200 if n <= 200 else 40 if n <= 1_000 else 6
        latency = fold_latency(logged, runs)
        latency["revived_over_live"] = round(
            latency["revived"]["median_us"] / latency["live"]["median_us"], 2
        )
        marker_names = sum(
            text in topic
            for text, _ in trace.needles
            for m in ws.checkpoint.markers
            for topic in m.topics
        )
        result: dict[str, Any] = {
            "events": n,
            "turns": len(trace.turns),
            "log_tokens": tail_tokens,
            "needles": len(trace.needles),
            "torpor": {
                "recall_at_10": found / len(trace.needles),
                "needle_loss": 1 - found / len(trace.needles),
                "events_in_context": cache_events,
                "turns_in_context": len({e.turn for e in ws.tail}),
                "markers_in_context": len(ws.checkpoint.markers),
                "needles_verbatim_in_context": sum(t in context for t, _ in trace.needles),
                "needles_named_in_markers": marker_names,
                "compaction_cycles": cycles,
                "compaction_attempts": min(ATTEMPTS, cycles + 1),
                "context_tokens": rendered.estimated_tokens,
                "checkpoint_position": ws.checkpoint.position,
            },
            "truncation": {
                "recall_at_10": truncation_found / len(trace.needles),
                "needle_loss": 1 - truncation_found / len(trace.needles),
                "events_in_context": len(window),
            },
            "compaction_latency": latency,
            "put_checkpoint_us": io.summary() if io.samples_us else None,
        }
        if table2:
            result["incremental"] = await incremental(trace)
        return result


async def incremental(trace: Trace) -> dict[str, Any]:
    """Fold checks after every turn (what an agent does); recall measured at the end."""
    async with open_store(
        "sqlite://", token_counter=make_token_counter(), hint_extractor=encode_hints
    ) as store:
        ws = WorkingSet("needles", None, [])
        cycles = 0
        latencies = Timing()
        for turn, bodies in trace.turns:
            ws.append(await store.append_events("needles", bodies, turn=turn))
            elapsed, checkpoint = fold_once(ws)
            if checkpoint is not None:
                await store.put_checkpoint(checkpoint)
                latencies.samples_us.append(elapsed)
                cycles += 1
        found = 0
        for text, position in trace.needles:
            hits = await recall(store, "needles", text, k=K)
            found += position in [h.position for h in hits]
        checkpoint = ws.checkpoint
        return {
            "compaction_cycles": cycles,
            "fold_latency": latencies.summary() if latencies.samples_us else None,
            "recall_at_10": found / len(trace.needles),
            "events_in_context": len(ws.tail),
            "markers_in_context": len(checkpoint.markers) if checkpoint else 0,
            "tail_tokens": ws.tail_tokens,
        }


def table(results: list[dict[str, Any]]) -> str:
    t2 = (
        next(r for r in results if r["events"] == 200)
        if any(r["events"] == 200 for r in results)
        else results[0]
    )
    tor, trunc = t2["torpor"], t2["truncation"]
    lat = t2["compaction_latency"]
    lines = [
        f"Table 2 ({t2['events']} events, {t2['needles']} needles, budget {BUDGET} "
        f"(headroom {HEADROOM}), {TAIL_TURNS}-turn tail, K={K})",
        f"{'metric':<38}{'torpor (pointer folds)':>24}{'truncation':>14}",
        f"{'recall@10':<38}{tor['recall_at_10']:>24.0%}{trunc['recall_at_10']:>14.0%}",
        f"{'needle loss':<38}{tor['needle_loss']:>24.0%}{trunc['needle_loss']:>14.0%}",
        f"{'events in context':<38}{tor['events_in_context']:>24}{trunc['events_in_context']:>14}",
        f"{'markers in context':<38}{tor['markers_in_context']:>24}{'-':>14}",
        f"{'compaction cycles (of 5 attempted)':<38}{tor['compaction_cycles']:>24}{'-':>14}",
        f"{'compaction latency, live (median)':<38}"
        f"{lat['live']['median_us'] / 1000:>21.3f} ms{'-':>14}",
        f"{'compaction latency, revived (median)':<38}"
        f"{lat['revived']['median_us'] / 1000:>21.3f} ms{'-':>14}",
        "",
        f"{'events':>8}{'recall@10':>11}{'trunc':>7}{'live fold ms':>14}"
        f"{'revived ms':>12}{'rev/live':>10}{'build ms':>10}{'put_ckpt ms':>13}{'markers':>9}",
    ]
    for r in results:
        lat = r["compaction_latency"]
        put = r["put_checkpoint_us"]
        lines.append(
            f"{r['events']:>8}{r['torpor']['recall_at_10']:>11.0%}"
            f"{r['truncation']['recall_at_10']:>7.0%}"
            f"{lat['live']['median_us'] / 1000:>14.3f}{lat['revived']['median_us'] / 1000:>12.3f}"
            f"{lat['revived_over_live']:>10.2f}"
            f"{lat['revived_build']['median_us'] / 1000:>10.3f}"
            f"{(put['median_us'] / 1000 if put else float('nan')):>13.3f}"
            f"{r['torpor']['markers_in_context']:>9}"
        )
    biggest = max(results, key=lambda r: r["events"])
    lat = biggest["compaction_latency"]
    lines.append(
        f"targets at {biggest['events']:,} events: revived fold <= 5 ms: "
        f"{'yes' if lat['revived']['median_us'] <= 5_000 else 'no'}; within 2x of live: "
        f"{'yes' if lat['revived_over_live'] <= 2 else 'no'}"
    )
    inc = t2.get("incremental")
    if inc:
        lines.append("")
        lines.append(
            f"incremental ({t2['events']} events, fold check after every turn): "
            f"{inc['compaction_cycles']} cycles, recall@10 {inc['recall_at_10']:.0%}, "
            f"{inc['events_in_context']} events + {inc['markers_in_context']} marker(s) in "
            f"context, fold median {inc['fold_latency']['median_us'] / 1000:.3f} ms"
        )
    return "\n".join(lines)


class LoopWatch:
    """The longest the event loop took to come back to a task that only yields."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.done = False

    async def run(self) -> None:
        while not self.done:
            started = time.perf_counter()
            await asyncio.sleep(0)
            self.longest = max(self.longest, time.perf_counter() - started)


async def first_turns(events: int, conversations: int = 5) -> dict[str, Any]:
    """The first turn after importing ``events`` events, never folded, through a Runtime."""
    import tempfile

    import torpor
    from torpor.cli.history import build_history

    with tempfile.TemporaryDirectory(prefix="torpor-needles-") as tmp:
        url = f"sqlite:///{tmp}/imported.db"
        names = [f"imported-{i}" for i in range(conversations)]
        await build_history(url, names, events)
        config = torpor.RuntimeConfig(hibernate_after=3600, evict_after=7200, sweep_interval=3600)
        turn, stall = Timing(), Timing()
        folded = 0  # conversations whose first turn folded (all, when over the budget)
        async with torpor.Runtime(url, model=torpor.EchoModel(delay=0), config=config) as rt:
            for name in names:
                watch = LoopWatch()
                task = asyncio.create_task(watch.run())
                await asyncio.sleep(0.01)
                watch.longest = 0.0
                started = time.perf_counter()
                await (await rt.send(name, "Where were we?")).result()
                turn.samples_us.append((time.perf_counter() - started) * 1e6)
                watch.done = True
                await task
                stall.samples_us.append(watch.longest * 1e6)
                if (await rt.admin.inspect(name)).checkpoint_position is not None:
                    folded += 1
    return {"events": events, "folded": folded, "first_turn": turn.summary(),
            "longest_stall": stall.summary()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,200,1000,10000")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--no-runtime", action="store_true",
                        help="skip the first turns through the runtime")
    parser.add_argument("--table1", action="store_true",
                        help="end-to-end 1-hop/2-hop recall by method (Table 1's shape)")
    parser.add_argument("--quick", action="store_true",
                        help="with --table1: 2 traces of 10 needles, 1 and 3 folds")
    parser.add_argument("--generator", choices=("today", "honest", "both"), default="both",
                        help="with --table1: today's needles, the honest ones "
                        "(bench/_recall_honest.py), or both, side by side (the default)")
    parser.add_argument("--levels", default=None,
                        help="with --table1: fold counts, comma-separated (default 1,3,5,50)")
    args = parser.parse_args(argv)
    if args.table1:
        levels = tuple(int(v) for v in args.levels.split(",")) if args.levels else None
        table1(args.quick, args.json_path, args.generator, levels)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    results = [asyncio.run(run_size(n, table2=(n == 200))) for n in sizes]
    big = max(sizes)  # a history under the working budget would not fold
    runtime = asyncio.run(first_turns(big)) if big >= 5_000 and not args.no_runtime else None
    report = {
        "benchmark": "needles",
        "python": sys.version.split()[0],
        "policy": {
            "working_budget": POLICY.working_budget,
            "headroom": HEADROOM,
            "tail_turns": TAIL_TURNS,
            "encoding": POLICY.encoding,
        },
        "results": results,
        "runtime_first_turn": runtime,
    }
    print(json.dumps(report))
    print(table(results))
    if runtime is not None:
        t, st = runtime["first_turn"], runtime["longest_stall"]
        print(f"runtime, {runtime['events']:,} imported events never folded: first turn "
              f"{t['median_us'] / 1000:.1f} ms (median of {t['runs']}, {runtime['folded']} "
              f"folded), longest event-loop stall {st['median_us'] / 1000:.1f} ms")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(report, fh, indent=2)


def table1(
    quick: bool, json_path: str | None, generator: str = "both",
    levels: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Run the Table 1 benchmark with today's generator, the honest one (issue 25), or
    both; print the JSON and the tables; the report."""
    from _recall_honest import run as run_honest
    from _recall_honest import table as honest_text
    from _recall_table1 import run
    from _recall_table1 import table as table1_text

    options: dict[str, Any] = {"traces": 2, "needles": 10, "levels": (1, 3)} if quick else {}
    if levels is not None:
        options["levels"] = levels
    report: dict[str, Any] = {"python": sys.version.split()[0], "quick": quick}
    if generator in ("today", "both"):
        report["today"] = {**asyncio.run(run(**options)), "quick": quick}
    if generator in ("honest", "both"):
        report["honest"] = {**asyncio.run(run_honest(**options)), "quick": quick}
    print(json.dumps(report))
    if "today" in report:
        print(table1_text(report["today"]))
    if "honest" in report:
        print(honest_text(report["honest"]))
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
