"""Bytes per agent: torpor active / hibernated / evicted against a floor and a naive runtime.

Question: what does an idle conversation cost in memory, at 10k and 100k of
them, and does it depend on how long the conversation is?

Scenarios, each measured in a fresh subprocess (so one scenario's freed heap
does not sit in the next one's RSS), each reporting the RSS growth per agent
and, in a second traced run, the tracemalloc growth per agent:

* ``torpor-active``: every agent has taken a turn and holds its working set
  (~2K tokens of history by default: 8 events of ~1,000 characters);
* ``torpor-hibernated``: activated in batches of 1,000, each batch
  hibernated before the next (a hibernated agent is reached from an active
  one; batching keeps the transient working sets from inflating RSS);
* ``torpor-burst-hibernated``: every agent active at once, then all
  hibernated (a storm that passed); its process RSS is compared with
  ``torpor-hibernated``'s (``burst/gradual``): what the allocator keeps of
  the burst's heap, once only the same hibernated agents are left;
* ``torpor-evicted``: the same, evicted instead (what is left is the store's
  bounded caches);
* ``floor``: a bare asyncio task awaiting a Future per agent (the least any
  actor-per-conversation design can pay);
* ``naive``: each conversation's full history in a dict of lists of
  ``{"role", "content"}`` dicts (the in-process design of the design source
  ``003``), nothing else.

Then footprint vs conversation length (100, 1,000, 10,000 events; working
budget 2,000 tokens, conversations folded once beforehand as the runtime
would have): torpor active and hibernated must be flat, naive grows.

History is bulk-written through the store with token counts estimated at
four characters a token (tokenizing 100k conversations would dominate the
run); the runtime budgets with those stored counts.

Usage: ``python bench/idle_agents.py [--agents 10000 100000] [--lengths 100 1000
10000] [--length-agents 100] [--trace-agents 10000] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sqlite3
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from _common import emit, fresh_db, peak_rss_bytes, quiet, ratio, rss_bytes, run_json, settle, table

import torpor
from torpor.events import AssistantMessage, Body, UserMessage

HERE = Path(__file__).resolve()
WORDS = (
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma",
    "omega", "river", "stone", "cloud", "market", "ledger", "invoice", "parcel", "harbor", "signal",
)


# -- synthetic history -------------------------------------------------------------------


def text(i: int, k: int, chars: int) -> str:
    """Distinct text per conversation and event, ``chars`` long."""
    words = [WORDS[(i * 7 + k * 3 + j) % len(WORDS)] for j in range(chars // 6 + 1)]
    return f"conv {i} event {k}: " + " ".join(words)[:chars]


def turns(i: int, events: int, chars: int) -> Iterator[list[Body]]:
    for k in range(0, events - 1, 2):
        yield [UserMessage(text(i, k, chars)), AssistantMessage(text(i, k + 1, chars))]
    if events % 2:
        yield [UserMessage(text(i, events - 1, chars)), AssistantMessage("noted")]


WARM = 20
"""Extra conversations a torpor worker activates and evicts before its baseline, so one-time
costs (the tokenizer, caches, prepared statements) are not charged to the measured agents."""


def ids(n: int) -> list[str]:
    return [f"idle-{i:06d}" for i in range(n)]


async def build(url: str, n: int, events: int, chars: int) -> None:
    async with torpor.open_store(url) as store:
        names = ids(n)
        queue = iter(range(n))

        async def worker() -> None:
            for i in queue:
                for t, bodies in enumerate(turns(i, events, chars), start=1):
                    await store.append(names[i], bodies, turn=t)

        await asyncio.gather(*(worker() for _ in range(min(512, n))))


async def fold_once(url: str, n: int, working_budget: int) -> None:
    """One turn per conversation, so long ones get the checkpoint the runtime would write."""
    agent = torpor.AgentConfig(working_budget=working_budget)
    async with torpor.Runtime(url, model=torpor.EchoModel(), agent=agent) as rt:
        sem = asyncio.Semaphore(16)

        async def one(c: str) -> None:
            async with sem:
                await (await rt.send(c, "fold please")).result()

        await asyncio.gather(*(one(c) for c in ids(n)))


def copy_db(url: str, directory: Path, name: str) -> str:
    source = Path(url.removeprefix("sqlite:///"))
    with sqlite3.connect(source) as conn:  # fold the WAL in, so one file is the database
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    target = fresh_db(directory, name)
    shutil.copyfile(source, target.removeprefix("sqlite:///"))
    return target


# -- measurements in the worker process ---------------------------------------------------


def reading(trace: bool) -> tuple[int, int | None]:
    settle()
    return rss_bytes(), tracemalloc.get_traced_memory()[0] if trace else None


BATCH = 200
"""Agents activated at once before being hibernated or evicted: their transient working
sets (BATCH x ~15 KB) are the only thing that can inflate those scenarios' RSS."""


async def no_tasks(rt: torpor.Runtime) -> None:
    """Poll until agent tasks have acted on hibernate/evict (they do so asynchronously)."""
    deadline = time.monotonic() + 120
    while (await rt.admin.stats()).tasks and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)


async def torpor_state(state: str, url: str, n: int, trace: bool,
                       working_budget: int) -> dict[str, Any]:
    config = torpor.RuntimeConfig(hibernate_after=3600, evict_after=7200, sweep_interval=3600)
    agent = torpor.AgentConfig(working_budget=working_budget)
    everyone = ids(n + WARM)
    warm, names = everyone[:WARM], everyone[WARM:]
    async with torpor.Runtime(url, model=torpor.EchoModel(), config=config, agent=agent) as rt:
        sem = asyncio.Semaphore(1000)

        async def one(c: str) -> None:
            async with sem:
                await (await rt.send(c, "hello again")).result()

        await asyncio.gather(*(one(c) for c in warm))
        for c in warm:
            (await rt.admin.evict(c))
        await no_tasks(rt)
        if trace:
            tracemalloc.start()
        rss0, traced0 = reading(trace)
        started = time.perf_counter()
        # "burst-hibernated": every agent active at once, then all hibernated (a storm
        # that passed); "hibernated": reached in batches, so little was ever live at once.
        batch = n if state in ("active", "burst-hibernated") else BATCH

        # One number, not a list of 200 ints read mid-burst: kept, they would pin the heap
        # the burst scenario measures.
        ws_tokens: float | None = None
        ws_chunk = names[:200]
        for offset in range(0, n, batch):
            chunk = names[offset : offset + batch]
            await asyncio.gather(*(one(c) for c in chunk))
            if offset == 0:
                total = 0
                for c in ws_chunk:
                    total += (await rt.admin.inspect(c)).working_set_tokens
                ws_tokens = total / len(ws_chunk)
                del total
            if state in ("hibernated", "burst-hibernated"):
                for c in chunk:
                    (await rt.admin.hibernate(c))
                await no_tasks(rt)
            elif state == "evicted":
                for c in chunk:
                    (await rt.admin.evict(c))
                await no_tasks(rt)
        seconds = time.perf_counter() - started
        rss1, traced1 = reading(trace)
        stats = (await rt.admin.stats())
        if trace:
            tracemalloc.stop()
    expected = {"active": stats.with_working_set, "hibernated": stats.hibernated,
                "burst-hibernated": stats.hibernated, "evicted": n - stats.live}[state]
    return {
        "rss_bytes_per_agent": round((rss1 - rss0) / n),
        "traced_bytes_per_agent": None if traced0 is None else round((traced1 - traced0) / n),
        "rss_total_bytes": rss1,
        "peak_rss_bytes": peak_rss_bytes(),
        "agents_in_state": expected,
        "working_set_tokens_avg": None if ws_tokens is None else round(ws_tokens),
        "working_set_bytes_estimated_avg": (
            round(stats.working_set_bytes / stats.with_working_set)
            if stats.with_working_set else None
        ),
        "seconds": round(seconds, 2),
    }


async def floor(n: int, trace: bool) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    if trace:
        tracemalloc.start()
    rss0, traced0 = reading(trace)
    futures = [loop.create_future() for _ in range(n)]

    async def waiter(f: asyncio.Future[None]) -> None:
        await f

    tasks = [asyncio.create_task(waiter(f)) for f in futures]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    rss1, traced1 = reading(trace)
    for f in futures:
        f.set_result(None)
    await asyncio.gather(*tasks)
    return {
        "rss_bytes_per_agent": round((rss1 - rss0) / n),
        "traced_bytes_per_agent": None if traced0 is None else round((traced1 - traced0) / n),
        "rss_total_bytes": rss1,
    }


def naive(n: int, events: int, chars: int, trace: bool) -> dict[str, Any]:
    if trace:
        tracemalloc.start()
    rss0, traced0 = reading(trace)
    history: dict[str, list[dict[str, str]]] = {}
    for i, name in enumerate(ids(n)):
        messages = history.setdefault(name, [])
        for bodies in turns(i, events, chars):
            for body in bodies:
                role = "user" if isinstance(body, UserMessage) else "assistant"
                messages.append({"role": role, "content": body.text})
        messages.append({"role": "user", "content": "hello again"})
        messages.append({"role": "assistant", "content": "echo: hello again"})
    rss1, traced1 = reading(trace)
    return {
        "rss_bytes_per_agent": round((rss1 - rss0) / n),
        "traced_bytes_per_agent": None if traced0 is None else round((traced1 - traced0) / n),
        "rss_total_bytes": rss1,
        "kept": len(history),
    }


def worker(args: argparse.Namespace) -> dict[str, Any]:
    quiet()
    if args.worker == "build":
        asyncio.run(build(args.db, args.n + WARM, args.events, args.chars))
        if args.fold:
            asyncio.run(fold_once(args.db, args.n + WARM, args.working_budget))
        return {}
    if args.worker == "floor":
        return asyncio.run(floor(args.n, args.trace))
    if args.worker == "naive":
        return naive(args.n, args.events, args.chars, args.trace)
    state = args.worker.removeprefix("torpor-")
    return asyncio.run(torpor_state(state, args.db, args.n, args.trace, args.working_budget))


# -- the orchestrating parent ------------------------------------------------------------


def sub(worker_name: str, n: int, **extra: Any) -> dict[str, Any]:
    args = [str(HERE), "--worker", worker_name, "--n", str(n)]
    for key, value in extra.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False and value is not None:
            args += [flag, str(value)]
    started = time.perf_counter()
    result = run_json(args)
    trace = " traced" if extra.get("trace") else ""
    print(f"    {worker_name}{trace} x {n:,}: {time.perf_counter() - started:.1f} s",
          file=sys.stderr)
    return result


def scale_run(n: int, events: int, chars: int, budget: int, trace_n: int, work: Path,
              states: Sequence[str]) -> list[dict[str, Any]]:
    template = fresh_db(work, f"template-{n}.db")
    t0 = time.perf_counter()
    sub("build", n, db=template, events=events, chars=chars)
    print(f"  built {n:,} x {events} events in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    trace_template = template
    if trace_n != n:
        trace_template = fresh_db(work, f"template-trace-{trace_n}.db")
        sub("build", trace_n, db=trace_template, events=events, chars=chars)
    rows = []
    for state in states:
        db = copy_db(template, work, f"run-{state}.db")
        measured = sub(f"torpor-{state}", n, db=db, working_budget=budget)
        db = copy_db(trace_template, work, f"run-{state}-trace.db")
        traced = sub(f"torpor-{state}", trace_n, db=db, working_budget=budget, trace=True)
        measured["traced_bytes_per_agent"] = traced["traced_bytes_per_agent"]
        measured["traced_agents"] = trace_n
        rows.append({"name": f"torpor-{state}", "agents": n, "events": events, **measured})
        print(f"  torpor-{state} {n:,}: {measured['rss_bytes_per_agent']:,} B/agent RSS",
              file=sys.stderr)
    for name in ("floor", "naive"):
        measured = sub(name, n, events=events, chars=chars)
        traced = sub(name, trace_n, events=events, chars=chars, trace=True)
        measured["traced_bytes_per_agent"] = traced["traced_bytes_per_agent"]
        measured["traced_agents"] = trace_n
        rows.append({"name": name, "agents": n, "events": events, **measured})
    return rows


def length_sweep(lengths: Sequence[int], n: int, chars: int, budget: int,
                 work: Path) -> list[dict[str, Any]]:
    rows = []
    for events in lengths:
        template = fresh_db(work, f"length-{events}.db")
        t0 = time.perf_counter()
        sub("build", n, db=template, events=events, chars=chars, fold=True,
            working_budget=budget)
        print(f"  built and folded {n} x {events:,} events in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
        row: dict[str, Any] = {"events": events, "agents": n}
        for state in ("active", "hibernated"):
            db = copy_db(template, work, f"length-run-{state}.db")
            measured = sub(f"torpor-{state}", n, db=db, working_budget=budget, trace=True)
            row[f"torpor_{state}_traced"] = measured["traced_bytes_per_agent"]
            row[f"torpor_{state}_rss"] = measured["rss_bytes_per_agent"]
            if state == "active":
                row["working_set_tokens_avg"] = measured["working_set_tokens_avg"]
        measured = sub("naive", n, events=events, chars=chars, trace=True)
        row["naive_traced"] = measured["traced_bytes_per_agent"]
        row["naive_rss"] = measured["rss_bytes_per_agent"]
        rows.append(row)
    return rows


def summarise(scales: list[dict[str, Any]], sweep: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["name"], r["agents"]): r for r in scales}
    ratios: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    for (name, n), row in by.items():
        if not name.startswith("torpor-"):
            continue
        for base in ("floor", "naive"):
            other = by.get((base, n))
            if other is not None:
                ratios[f"{name}/{base}@{n}"] = {
                    "rss": ratio(row["rss_bytes_per_agent"], other["rss_bytes_per_agent"]),
                    "traced": ratio(row["traced_bytes_per_agent"], other["traced_bytes_per_agent"]),
                }
        if name == "torpor-hibernated":
            evicted = by.get(("torpor-evicted", n))
            if evicted is not None:
                # Both read the same history through the same caches (SQLite's page cache,
                # untraced); the difference is what the hibernated records themselves cost.
                row["rss_bytes_per_agent_net_of_evicted"] = (
                    row["rss_bytes_per_agent"] - evicted["rss_bytes_per_agent"]
                )
            targets[f"hibernated_traced_le_1536_bytes@{n}"] = (
                row["traced_bytes_per_agent"] is not None
                and row["traced_bytes_per_agent"] <= 1536
            )
            targets[f"hibernated_process_rss_mb@{n}"] = round(row["rss_total_bytes"] / 1e6, 1)
            if n >= 100_000:
                targets[f"hibernated_{n}_under_300MB"] = row["rss_total_bytes"] < 300e6
        if name == "torpor-burst-hibernated":
            gradual = by.get(("torpor-hibernated", n))
            if gradual is not None:
                # Same agents, same final state; the difference is heap the allocator kept
                # from the moment every working set was live at once.
                ratios[f"burst/gradual_hibernated_process_rss@{n}"] = ratio(
                    row["rss_total_bytes"], gradual["rss_total_bytes"]
                )
    if sweep:
        for key in ("torpor_active_traced", "torpor_hibernated_traced", "naive_traced"):
            values = [r[key] for r in sweep if r[key] is not None]
            if values and min(values) > 0:
                ratios[f"length_growth_{key}"] = ratio(max(values), min(values))
    return {"ratios": ratios, "targets": targets}


def parent(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="torpor-idle-", dir=args.dir))
    try:
        scales: list[dict[str, Any]] = []
        for n in args.agents:
            states = ["active", "hibernated", "burst-hibernated", "evicted"]
            if args.active_up_to is not None and n > args.active_up_to:
                states = ["hibernated", "evicted"]
            print(f"scale {n:,}", file=sys.stderr)
            scales += scale_run(n, args.events, args.chars, args.working_budget,
                                min(n, args.trace_agents), work, states)
        print("length sweep", file=sys.stderr)
        sweep = length_sweep(args.lengths, args.length_agents, args.length_chars,
                             args.length_budget, work) if args.lengths else []
    finally:
        shutil.rmtree(work, ignore_errors=True)
    notes = ["token counts of bulk history estimated at 4 characters a token"]
    if args.active_up_to is not None and any(n > args.active_up_to for n in args.agents):
        notes.append(f"torpor-active measured only up to {args.active_up_to:,} agents (time)")
    return {
        "benchmark": "idle_agents",
        "params": {k: v for k, v in vars(args).items() if k not in ("json", "worker", "dir")},
        "scenarios": scales,
        "length_sweep": sweep,
        **summarise(scales, sweep),
        "notes": notes,
    }


def show(result: dict[str, Any], target: str | None) -> None:
    rows = [
        (r["name"], r["agents"], r["rss_bytes_per_agent"], r["traced_bytes_per_agent"],
         r.get("working_set_tokens_avg"), round(r["rss_total_bytes"] / 1e6, 1))
        for r in result["scenarios"]
    ]
    tables = [table("bytes per agent (RSS growth / N; tracemalloc / N)",
                    ("scenario", "agents", "RSS B/agent", "traced B/agent", "ws tokens",
                     "process RSS MB"), rows)]
    burst = [(key.split("@")[1], value) for key, value in result["ratios"].items()
             if key.startswith("burst/gradual")]
    if burst:
        by = {(r["name"], r["agents"]): r for r in result["scenarios"]}
        tables.append(table(
            "after a burst vs gradual hibernation (process RSS MB)",
            ("agents", "gradual", "burst", "burst/gradual"),
            [(n, round(by[("torpor-hibernated", int(n))]["rss_total_bytes"] / 1e6, 1),
              round(by[("torpor-burst-hibernated", int(n))]["rss_total_bytes"] / 1e6, 1), r)
             for n, r in burst],
        ))
    if result["length_sweep"]:
        tables.append(table(
            "footprint vs conversation length (traced bytes per agent)",
            ("events", "torpor active", "torpor hibernated", "naive", "ws tokens"),
            [(r["events"], r["torpor_active_traced"], r["torpor_hibernated_traced"],
              r["naive_traced"], r["working_set_tokens_avg"]) for r in result["length_sweep"]],
        ))
    emit(result, tables, target)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, nargs="*", default=[10_000, 100_000])
    p.add_argument("--events", type=int, default=8, help="history events per conversation")
    p.add_argument("--chars", type=int, default=1000, help="characters per history event")
    p.add_argument("--working-budget", type=int, default=32_000)
    p.add_argument("--trace-agents", type=int, default=10_000,
                   help="agents in the tracemalloc runs (per-agent cost is flat in N)")
    p.add_argument("--active-up-to", type=int, default=None,
                   help="skip torpor-active above this many agents")
    p.add_argument("--lengths", type=int, nargs="*", default=[100, 1_000, 10_000])
    p.add_argument("--length-agents", type=int, default=100)
    p.add_argument("--length-chars", type=int, default=100)
    p.add_argument("--length-budget", type=int, default=2_000)
    p.add_argument("--dir", default=None, help="where temporary databases go")
    p.add_argument("--json", metavar="FILE")
    # worker mode (internal): one scenario in this fresh process
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    p.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fold", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        result = worker(args)
        if args.json:
            emit({"worker": args.worker, **result}, [], args.json)
        return
    show(parent(args), args.json)


if __name__ == "__main__":
    main()
