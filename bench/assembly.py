"""Assembly cost per model call, and what one agent's working set weighs in memory.

A ~32K-token working set of ~160 messages (the design source's sizing:
~200 tokens a message), logged through a real SQLite store and read back the
way a reviving agent reads it (``store.resume()``), so the objects measured are
the ones an agent would hold. Two shapes:

* ``chat``: 160 user/assistant messages of ~200 tokens;
* ``tools``: tool-heavy turns (a question, a call, a ~600-token result, an
  answer); all but the 3 newest results render as ~10-token stubs.

Reported: render time per call (median/p90 µs over many calls; includes the
sha256 of the payload), split into planning and materializing; the rendered
size; and per-agent memory measured with tracemalloc (events, bodies, strings,
topic candidates, the WorkingSet itself) next to ``WorkingSet.estimated_bytes()``.
Target from the source: <= 200 KB for ~160 messages.

The per-turn case is what the actor does on every model call: two events are
appended to the ~32K-token set (a user message and an answer; in the tool shape
a call and its result, so a result leaves the keep window and becomes a stub),
then it renders. ``render`` extends the cached rendered tail;
``render_from_scratch`` (the full path, also the audit's) plans and materializes
the whole tail. ``estimated_bytes`` (after every turn) is timed next to a walk
over every object. Memory is read with and without the render cache (the
cache lives between calls; the full path keeps nothing).

Usage: ``python bench/assembly.py [--runs 2000] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import structlog

from torpor.compaction import (
    EXPAND_TOOL,
    RECALL_TOOL,
    CompactionPolicy,
    WorkingSet,
    make_token_counter,
)
from torpor.compaction.recipe import payload_hash
from torpor.compaction.render import materialize, plan
from torpor.compaction.tokens import count_body
from torpor.events import AssistantMessage, Body, Event, ToolCall, ToolResult, UserMessage
from torpor.store import open_store

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

POLICY = CompactionPolicy()  # 128K window, 32K working budget, 3 whole tool results
SYSTEM = (
    "You are a careful assistant for an operations team. Answer precisely, cite the "
    "files and commands you rely on, and say when you are unsure."
)
TOOLS = (RECALL_TOOL, EXPAND_TOOL)


def _words(text: str) -> list[str]:
    return text.split()


VOCABULARY = _words(
    "about above across after again against along already although always among another "
    "answer anything around asked because become before began behind being below between "
    "both brought build called cannot change check client common config could current "
    "database deploy different during each early either enough error every example "
    "failed few field figure files first following found from further given going group "
    "happened having health however important include instead issue itself just keep "
    "known large later least likely little logs looked machine making maybe memory might "
    "minutes moment morning needed network never next nothing notice number often order "
    "other output over people perhaps place point possible problem process queue quite "
    "rather really reason release request restart result retry right running second "
    "server service should since small something sometimes still storage such system "
    "table taken than that their there these thing think those though through timeout "
    "together tomorrow toward traffic under until update upstream usually value version "
    "very wanted watched week well were what when where whether which while whole within "
    "without worked would yesterday"
)


FUNCTION_WORDS = _words(
    "the a to of and is it we in that for on was with as at be this have not are but or "
    "by from an they you so if its can do no our all has one out up there what when"
)


def prose(rng: random.Random, words: int) -> str:
    """English-like text (~4 bytes a token, like real chat); every message its own string."""
    picked = [
        rng.choice(FUNCTION_WORDS) if rng.random() < 0.55 else rng.choice(VOCABULARY)
        for _ in range(words)
    ]
    return " ".join(picked).capitalize() + "."


def chat_turns(rng: random.Random, messages: int) -> list[tuple[int, list[Body]]]:
    turns: list[tuple[int, list[Body]]] = []
    for turn in range(1, messages // 2 + 1):
        turns.append((turn, [UserMessage(prose(rng, 196)), AssistantMessage(prose(rng, 196))]))
    return turns


def tool_turns(rng: random.Random, turns_wanted: int) -> list[tuple[int, list[Body]]]:
    turns: list[tuple[int, list[Body]]] = []
    for turn in range(1, turns_wanted + 1):
        call = ToolCall(f"call-{turn}", "search_logs", {"query": prose(rng, 4), "limit": 20})
        turns.append(
            (
                turn,
                [
                    UserMessage(prose(rng, 120)),
                    AssistantMessage("", (call,)),
                    ToolResult(call.id, call.name, prose(rng, 560)),
                    AssistantMessage(prose(rng, 160)),
                ],
            )
        )
    return turns


async def load(turns: list[tuple[int, list[Body]]]) -> tuple[int, int, WorkingSet]:
    """Log the turns, then read them back as a reviving agent does.

    Returns the bytes retained by the working set without and with its render
    cache (after one render, the rendered context itself dropped), and the set.
    """
    async with open_store("sqlite://", token_counter=make_token_counter()) as store:
        for turn, bodies in turns:
            await store.append_events("bench", bodies, turn=turn)
        # Warm the process-wide caches (the encoding, token counts of stub texts and
        # clip notes) on a throwaway copy, so the reading holds only this agent's objects.
        ws_render(WorkingSet("warm", None, (await store.resume("bench")).events))
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        resume = await store.resume("bench")
        ws = WorkingSet("bench", resume.checkpoint, [])
        ws.append(resume.events)  # live path: topic candidates extracted too
        del resume
        gc.collect()
        bare = tracemalloc.take_snapshot()
        ws_render(ws)
        gc.collect()
        cached = tracemalloc.take_snapshot()
        tracemalloc.stop()
        retained = sum(s.size_diff for s in bare.compare_to(before, "filename"))
        with_cache = sum(s.size_diff for s in cached.compare_to(before, "filename"))
        return retained, with_cache, ws


def ws_render(ws: WorkingSet) -> None:
    ws.render(SYSTEM, POLICY, TOOLS)


def next_events(tail: Sequence[Event], shape: str) -> list[Event]:
    """The next step's two events, numbered after the tail (tokens counted as the store does)."""
    last = tail[-1]
    rng = random.Random(5)
    bodies: list[Body]
    if shape == "chat":
        bodies = [UserMessage(prose(rng, 196)), AssistantMessage(prose(rng, 196))]
    else:
        call = ToolCall("call-next", "search_logs", {"query": prose(rng, 4), "limit": 20})
        bodies = [AssistantMessage("", (call,)), ToolResult(call.id, call.name, prose(rng, 560))]
    return [
        Event("bench", last.position + 1 + i, last.turn + 1, count_body(b), last.created_at, b)
        for i, b in enumerate(bodies)
    ]


def time_per_turn(tail: Sequence[Event], shape: str, runs: int) -> dict[str, Any]:
    """Render after appending two events to a rendered ~32K-token set; also the byte estimate."""
    extra = next_events(tail, shape)
    incremental, scratch, estimate, walk = [], [], [], []
    for _ in range(runs):
        ws = WorkingSet("bench", None, tail)
        ws.render(SYSTEM, POLICY, TOOLS)  # the previous call: the cache is warm
        ws.append(extra)
        t0 = time.perf_counter_ns()
        fast = ws.render(SYSTEM, POLICY, TOOLS)
        t1 = time.perf_counter_ns()
        full = ws.render_from_scratch(SYSTEM, POLICY, TOOLS)
        t2 = time.perf_counter_ns()
        ws.estimated_bytes()
        t3 = time.perf_counter_ns()
        ws.walk_bytes()
        t4 = time.perf_counter_ns()
        assert fast == full
        incremental.append((t1 - t0) / 1000)
        scratch.append((t2 - t1) / 1000)
        estimate.append((t3 - t2) / 1000)
        walk.append((t4 - t3) / 1000)
    return {
        "render": stats(incremental),
        "render_from_scratch": stats(scratch),
        "estimated_bytes": stats(estimate),
        "walk_bytes": stats(walk),
    }


def stats(xs: Sequence[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "median_us": round(statistics.median(s), 1),
        "p90_us": round(s[int(0.9 * len(s))], 1),
    }


def hint_bytes(ws: WorkingSet) -> int:
    """What the per-event topic candidates (for the next fold's marker) cost."""
    size = 0
    for flat in ws.hints(0, len(ws.tail)):
        if flat:
            size += sys.getsizeof(flat) + sum(sys.getsizeof(x) for x in flat if isinstance(x, str))
    return size


def time_render(ws: WorkingSet, runs: int) -> dict[str, Any]:
    """Renders of an unchanged set: the full path split into plan, materialize and hash."""
    for _ in range(20):  # warm caches (encoding, counts of invented texts)
        ws.render(SYSTEM, POLICY, TOOLS)
    total, planning, making, hashing = [], [], [], []
    handoff_tokens = 0
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        ws.render(SYSTEM, POLICY, TOOLS)
        t1 = time.perf_counter_ns()
        decisions = plan(ws.tail, SYSTEM, handoff_tokens, POLICY, TOOLS)
        t2 = time.perf_counter_ns()
        rendered = materialize(ws.tail, None, "", 0, SYSTEM, TOOLS, decisions, POLICY.encoding)
        t3 = time.perf_counter_ns()
        payload_hash(rendered.messages, TOOLS)
        t4 = time.perf_counter_ns()
        total.append((t1 - t0) / 1000)
        planning.append((t2 - t1) / 1000)
        making.append((t3 - t2) / 1000)
        hashing.append((t4 - t3) / 1000)
    return {
        "render": stats(total),
        "plan": stats(planning),
        "materialize_incl_hash": stats(making),
        "hash_only": stats(hashing),
    }


async def measure(name: str, turns: list[tuple[int, list[Body]]], runs: int) -> dict[str, Any]:
    retained, with_cache, ws = await load(turns)
    rendered = ws.render(SYSTEM, POLICY, TOOLS)
    timing = time_render(ws, runs)
    per_turn = time_per_turn(ws.tail, name, max(50, runs // 4))
    messages = len(ws.tail)
    text_bytes = sum(
        len(getattr(e.body, "text", "") or getattr(e.body, "content", "")) for e in ws.tail
    )
    return {
        "shape": name,
        "messages": messages,
        "tail_tokens": ws.tail_tokens,
        "rendered_messages": len(rendered.messages),
        "rendered_tokens": rendered.estimated_tokens,
        "stubbed": len(rendered.recipe.stubbed),
        "sections": rendered.sections,
        "timing": timing,
        "per_turn": per_turn,
        "memory": {
            "tracemalloc_bytes": retained,
            "tracemalloc_with_render_cache_bytes": with_cache,
            "render_cache_bytes": with_cache - retained,
            "estimated_bytes": ws.estimated_bytes(),
            "bytes_per_message": round(retained / messages),
            "text_bytes": text_bytes,
            "bytes_per_token": round(text_bytes / ws.tail_tokens, 2),
            "overhead_bytes": retained - text_bytes,
            "overhead_per_message": round((retained - text_bytes) / messages),
            "topic_hint_bytes": hint_bytes(ws),
        },
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2_000)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    rng = random.Random(11)
    results = [
        asyncio.run(measure("chat", chat_turns(rng, 160), args.runs)),
        asyncio.run(measure("tools", tool_turns(rng, 40), args.runs)),
    ]
    report = {"benchmark": "assembly", "python": sys.version.split()[0], "results": results}
    print(json.dumps(report))
    print(
        f"{'shape':<7}{'msgs':>6}{'tail tok':>10}{'sent tok':>10}{'stubs':>7}"
        f"{'render µs':>11}{'p90 µs':>9}{'memory KB':>11}{'+cache KB':>11}{'est. KB':>9}"
        f"{'B/msg':>7}"
    )
    for r in results:
        mem, timing = r["memory"], r["timing"]["render"]
        print(
            f"{r['shape']:<7}{r['messages']:>6}{r['tail_tokens']:>10}{r['rendered_tokens']:>10}"
            f"{r['stubbed']:>7}{timing['median_us']:>11.1f}{timing['p90_us']:>9.1f}"
            f"{mem['tracemalloc_bytes'] / 1024:>11.1f}"
            f"{mem['tracemalloc_with_render_cache_bytes'] / 1024:>11.1f}"
            f"{mem['estimated_bytes'] / 1024:>9.1f}{mem['bytes_per_message']:>7}"
        )
    print("per turn (append 2 events, then render), median / p90 µs:")
    print(f"{'shape':<7}{'render':>16}{'from scratch':>16}{'estimated_bytes':>18}{'walk':>14}")
    for r in results:
        t = r["per_turn"]
        cells = [
            f"{t[k]['median_us']:.1f} / {t[k]['p90_us']:.1f}"
            for k in ("render", "render_from_scratch", "estimated_bytes", "walk_bytes")
        ]
        print(f"{r['shape']:<7}{cells[0]:>16}{cells[1]:>16}{cells[2]:>18}{cells[3]:>14}")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
