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

Prompt caching: a provider caches the prompt's prefix, so what matters between two
calls is whether the previous prompt is a prefix of the next one. The cache runs
drive a working set through 100 model calls as the actor does (fold check, render,
log the answer; in the tool shape two calls a turn, one that asks for a tool and
one after its ~700-token result) and count *prefix breaks* (the previous prompt
is not a prefix of the next), what caused each (a fold, a batch of tool-result
stubs, anything else), and the tokens a prefix cache would not cover: per call,
everything after the common prefix; and of it, the *re-sent* tokens (the part of
the previous prompt after the break, sent again uncached). Both policies run in
the same process: tool results stubbed one by one as they leave the keep window
(``clear_at_least=0``, the behaviour before batching) and in batches (the default).

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

import msgspec
import structlog

from torpor.compaction import (
    EXPAND_TOOL,
    RECALL_TOOL,
    CompactionPolicy,
    WorkingSet,
    build_checkpoint,
    make_token_counter,
    plan_fold,
)
from torpor.compaction.markers import encode_hints
from torpor.compaction.recipe import payload_hash
from torpor.compaction.render import materialize, plan
from torpor.compaction.tokens import MESSAGE_OVERHEAD, count_body, count_text
from torpor.events import AssistantMessage, Body, Event, ToolCall, ToolResult, UserMessage
from torpor.llm.protocol import ContextMessage, SystemMessage
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
    async with open_store(
        "sqlite://", token_counter=make_token_counter(), hint_extractor=encode_hints
    ) as store:
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
    """What the per-event topic candidates (for the next fold's marker) cost: the bytes
    the store kept at append, held by the events (one-byte ones are shared objects)."""
    return sum(sys.getsizeof(e.hints) for e in ws.tail if e.hints and len(e.hints) > 1)


# --- prompt caching -------------------------------------------------------------------


class Tokens:
    """Tokens of rendered messages, counted once per message object."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[ContextMessage, int]] = {}

    def __call__(self, message: ContextMessage) -> int:
        known = self._known.get(id(message))
        if known is not None and known[0] is message:
            return known[1]
        if isinstance(message, SystemMessage):
            tokens = count_text(message.text) + MESSAGE_OVERHEAD
        else:
            tokens = count_body(message)
        self._known[id(message)] = (message, tokens)
        return tokens

    def of(self, messages: Sequence[ContextMessage]) -> int:
        return sum(self(m) for m in messages)


def common_prefix(one: Sequence[ContextMessage], two: Sequence[ContextMessage]) -> int:
    n = 0
    for a, b in zip(one, two, strict=False):
        if a is not b and a != b:
            break
        n += 1
    return n


def cache_run(shape: str, policy: CompactionPolicy, calls: int = 100) -> dict[str, Any]:
    """``calls`` model calls of one conversation, as the actor makes them; prefix breaks."""
    rng = random.Random(23)
    tokens = Tokens()
    ws = WorkingSet("cache", None, [])
    position = 0
    previous: list[ContextMessage] = []
    previous_stubbed: tuple[int, ...] = ()
    made = 0
    figures = {"folds": 0, "breaks": 0, "at_fold": 0, "at_clear": 0, "other": 0,
               "prompt_tokens": 0, "uncached_tokens": 0, "resent_tokens": 0,
               "max_rendered_tokens": 0, "max_tail_tokens": 0}

    def log(bodies: list[Body], turn: int) -> None:
        nonlocal position
        events = []
        for body in bodies:
            events.append(Event("cache", position, turn, count_body(body), position, body))
            position += 1
        ws.append(events)

    def call() -> None:
        nonlocal previous, previous_stubbed, made
        folded = False
        fold = plan_fold(ws, policy)
        if fold is not None:
            ws.apply(build_checkpoint(fold, ws.checkpoint, created_at=0))
            figures["folds"] += 1
            folded = True
        figures["max_tail_tokens"] = max(figures["max_tail_tokens"], ws.tail_tokens)
        rendered = ws.render(SYSTEM, policy, TOOLS)
        messages = rendered.messages
        common = common_prefix(previous, messages)
        figures["prompt_tokens"] += tokens.of(messages)
        figures["uncached_tokens"] += tokens.of(messages[common:])
        if previous and common < len(previous):
            figures["breaks"] += 1
            figures["resent_tokens"] += tokens.of(previous[common:])
            stubbed = set(rendered.recipe.stubbed) - set(previous_stubbed)
            cause = "at_fold" if folded else "at_clear" if stubbed else "other"
            figures[cause] += 1
        figures["max_rendered_tokens"] = max(
            figures["max_rendered_tokens"], rendered.estimated_tokens
        )
        previous, previous_stubbed = messages, rendered.recipe.stubbed
        made += 1

    turn = 0
    while made < calls:
        turn += 1
        if shape == "chat":
            log([UserMessage(prose(rng, 196))], turn)
            call()
            log([AssistantMessage(prose(rng, 196))], turn)
            continue
        log([UserMessage(prose(rng, 120))], turn)
        call()  # the model asks for a tool ...
        request = ToolCall(f"call-{turn}", "search_logs", {"query": prose(rng, 4), "limit": 20})
        log([AssistantMessage("", (request,)), ToolResult(request.id, request.name,
                                                          prose(rng, 560))], turn)
        if made < calls:
            call()  # ... and answers once it has the result
        log([AssistantMessage(prose(rng, 160))], turn)
    per_100 = 100 / made
    return {
        "shape": shape,
        "clear_at_least": policy.clear_at_least,
        "keep_tool_results": policy.keep_tool_results,
        "calls": made,
        "turns": turn,
        **figures,
        "breaks_per_100_calls": round(figures["breaks"] * per_100, 1),
        "uncached_tokens_per_call": round(figures["uncached_tokens"] / made),
        "resent_tokens_per_100_calls": round(figures["resent_tokens"] * per_100),
        "cacheable_share": round(1 - figures["uncached_tokens"] / figures["prompt_tokens"], 3),
        "working_budget": policy.working_budget,
    }


def cache_runs(calls: int) -> list[dict[str, Any]]:
    eager = msgspec.structs.replace(POLICY, clear_at_least=0)
    return [cache_run(shape, policy, calls) for shape in ("tools", "chat")
            for policy in (eager, POLICY)]


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
        rendered = materialize(ws.tail, None, (), SYSTEM, TOOLS, decisions, POLICY.encoding)
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
    parser.add_argument("--calls", type=int, default=100, help="model calls per cache run")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    rng = random.Random(11)
    results = [
        asyncio.run(measure("chat", chat_turns(rng, 160), args.runs)),
        asyncio.run(measure("tools", tool_turns(rng, 40), args.runs)),
    ]
    caching = cache_runs(args.calls)
    report = {
        "benchmark": "assembly",
        "python": sys.version.split()[0],
        "results": results,
        "prompt_cache": caching,
    }
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
    print(f"prompt prefix over {args.calls} model calls (breaks: the previous prompt is not a "
          "prefix of the next):")
    print(f"{'shape':<7}{'clear_at_least':>15}{'breaks/100':>11}{'fold':>6}{'clear':>7}"
          f"{'other':>7}{'uncached tok/call':>19}{'re-sent tok/100':>17}{'cacheable':>11}"
          f"{'max sent':>10}{'max tail':>10}")
    for c in caching:
        print(f"{c['shape']:<7}{c['clear_at_least']:>15}{c['breaks_per_100_calls']:>11.1f}"
              f"{c['at_fold']:>6}{c['at_clear']:>7}{c['other']:>7}"
              f"{c['uncached_tokens_per_call']:>19}{c['resent_tokens_per_100_calls']:>17}"
              f"{c['cacheable_share']:>11.1%}{c['max_rendered_tokens']:>10}"
              f"{c['max_tail_tokens']:>10}")
    batched = next(c for c in caching if c["shape"] == "tools" and c["clear_at_least"])
    met = batched["other"] == 0 and batched["breaks_per_100_calls"] <= 10
    print(f"target (tools, batched): breaks only at folds and clears, <= 10 per 100 calls: "
          f"{'yes' if met else 'no'}")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
