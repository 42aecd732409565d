"""Resume a conversation and append one turn: torpor against the persistence layers users pick.

Question: how long does it take to pick a conversation of E events back up
(the process holds nothing of it) and add one exchange, for E = 100, 1,000,
10,000 and 100,000?

* ``torpor``: the agent is evicted; ``rt.send`` revives it (latest
  checkpoint + events since, one store trip), appends the user message, runs
  the zero-delay EchoModel, appends the answer and the model-call record;
  timed until ``turn.result()``. Its cost follows the tail since the checkpoint
  ("torpor tail"), which the working budget (32K tokens) bounds: a
  conversation just under the budget is torpor's slowest case. The history is
  bulk-written through the store, then one turn through the runtime folds it into the checkpoint the
  runtime would have written during the conversation.
* ``openai-agents``: the OpenAI Agents SDK's ``SQLiteSession`` (file
  database): ``get_items()`` (what ``Runner`` loads every turn; full history
  by default) then ``add_items([user, assistant])``.
* ``langgraph``: LangGraph's ``AsyncSqliteSaver``: ``aget_tuple`` of the
  thread's latest checkpoint (a ``messages`` channel of langchain messages),
  then ``aput`` of the next checkpoint with the two new messages (saver kept open). Only one
  checkpoint is stored before timing (a real thread stores one per step, each
  with the full history), which favours LangGraph.

Peers absent from the environment (install the ``bench`` extra) are reported
as skipped. Times are medians of ``--repeats`` runs per size (fewer above
10,000 events).

Usage: ``python bench/resume.py [--sizes 100 1000 10000 100000] [--repeats 5] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _common import emit, fresh_db, quiet, ratio, table

import torpor
from torpor.events import AssistantMessage, UserMessage

Timer = Callable[[], Awaitable[float]]


def message(k: int) -> str:
    return f"message {k}: a note about order {k % 97} and the delivery window for parcel {k % 31}"


def repeats_for(events: int, repeats: int) -> int:
    return repeats if events <= 10_000 else max(2, repeats // 2)


async def median_of(timer: Timer, n: int) -> dict[str, float]:
    samples = [await timer() for _ in range(n)]
    return {"p50_ms": round(statistics.median(samples) * 1000, 3),
            "min_ms": round(min(samples) * 1000, 3), "runs": n}


# -- torpor ------------------------------------------------------------------------------


async def torpor_case(url: str, events: int, repeats: int) -> dict[str, Any]:
    conv = "resume-bench"
    started = time.perf_counter()
    async with torpor.open_store(url) as store:
        for k in range(0, events, 2):
            await store.append(conv, [UserMessage(message(k)), AssistantMessage(message(k + 1))],
                               turn=k // 2 + 1)
    build = time.perf_counter() - started
    config = torpor.RuntimeConfig(hibernate_after=3600, evict_after=7200, sweep_interval=3600)
    async with torpor.Runtime(url, model=torpor.EchoModel(), config=config) as rt:
        await (await rt.send(conv, "fold what came before")).result()  # writes the checkpoint

        async def once() -> float:
            (await rt.admin.evict(conv))
            while (await rt.admin.stats()).tasks:  # noqa: ASYNC110 (the agent's task exits on its own)
                await asyncio.sleep(0.001)
            t0 = time.perf_counter()
            await (await rt.send(conv, "and one more thing")).result()
            return time.perf_counter() - t0

        await once()  # warm: tokenizer, statements
        figures = await median_of(once, repeats_for(events, repeats))
        info = await rt.admin.inspect(conv)
        stats = (await rt.admin.stats())
    return {**figures, "build_seconds": round(build, 2),
            "checkpoint_position": info.checkpoint_position, "tail_events": info.tail_length,
            "revival_p50_ms": stats.revival_p50_ms}


# -- OpenAI Agents SDK -------------------------------------------------------------------


async def agents_case(path: Path, events: int, repeats: int) -> dict[str, Any]:
    from agents.memory import SQLiteSession

    # One session object for the whole run, as a server would keep: its connection stays
    # open and it holds no history in memory (get_items reads the database every time).
    session = SQLiteSession("resume-bench", db_path=path)
    items: list[Any] = [
        {"role": "user" if k % 2 == 0 else "assistant", "content": message(k)}
        for k in range(events)
    ]
    await session.add_items(items)
    n = 0

    async def once() -> float:
        nonlocal n
        n += 1
        t0 = time.perf_counter()
        history = await session.get_items()
        await session.add_items([{"role": "user", "content": f"and one more thing {n}"},
                                 {"role": "assistant", "content": f"echo {len(history)}"}])
        return time.perf_counter() - t0

    try:
        await once()
        return await median_of(once, repeats_for(events, repeats))
    finally:
        session.close()


# -- LangGraph ---------------------------------------------------------------------------


async def langgraph_case(path: Path, events: int, repeats: int) -> dict[str, Any]:
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.checkpoint.base import empty_checkpoint
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    thread: dict[str, Any] = {"configurable": {"thread_id": "resume-bench", "checkpoint_ns": ""}}

    def checkpoint(messages: list[Any], version: int) -> Any:
        ckpt = empty_checkpoint()
        ckpt["channel_values"] = {"messages": messages}
        ckpt["channel_versions"] = {"messages": version}
        return ckpt

    async with AsyncSqliteSaver.from_conn_string(str(path)) as saver:  # open for the run
        history = [HumanMessage(message(k)) if k % 2 == 0 else AIMessage(message(k))
                   for k in range(events)]
        await saver.aput(thread, checkpoint(history, 1), {"source": "input", "step": 0},
                         {"messages": 1})
        del history
        step = 1

        async def once() -> float:
            nonlocal step
            step += 1
            t0 = time.perf_counter()
            latest = await saver.aget_tuple(thread)
            assert latest is not None
            messages = list(latest.checkpoint["channel_values"]["messages"])
            messages += [HumanMessage(f"and one more thing {step}"),
                         AIMessage(f"echo {len(messages)}")]
            await saver.aput(latest.config, checkpoint(messages, step),
                             {"source": "loop", "step": step}, {"messages": step})
            return time.perf_counter() - t0

        await once()
        return await median_of(once, repeats_for(events, repeats))


def available(module: str) -> str | None:
    try:
        __import__(module)
    except ImportError as exc:
        return f"not installed ({exc.name}); pip install 'torpor[bench]'"
    return None


async def run(sizes: list[int], repeats: int, directory: Path) -> dict[str, Any]:
    peers = {"openai-agents": available("agents.memory"),
             "langgraph": available("langgraph.checkpoint.sqlite.aio")}
    rows: list[dict[str, Any]] = []
    for events in sizes:
        row: dict[str, Any] = {"events": events}
        url = fresh_db(directory, f"torpor-{events}.db")
        row["torpor"] = await torpor_case(url, events, repeats)
        print(f"  {events:,} torpor {row['torpor']['p50_ms']} ms", file=sys.stderr)
        if peers["openai-agents"] is None:
            path = Path(fresh_db(directory, f"agents-{events}.db").removeprefix("sqlite:///"))
            row["openai-agents"] = await agents_case(path, events, repeats)
            print(f"  {events:,} openai-agents {row['openai-agents']['p50_ms']} ms",
                  file=sys.stderr)
        if peers["langgraph"] is None:
            path = Path(fresh_db(directory, f"langgraph-{events}.db").removeprefix("sqlite:///"))
            row["langgraph"] = await langgraph_case(path, events, repeats)
            print(f"  {events:,} langgraph {row['langgraph']['p50_ms']} ms", file=sys.stderr)
        for peer in ("openai-agents", "langgraph"):
            if peer in row:
                row[f"{peer}/torpor"] = ratio(row[peer]["p50_ms"], row["torpor"]["p50_ms"])
        rows.append(row)
    return {"rows": rows, "peers_skipped": {k: v for k, v in peers.items() if v}}


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["events"]: r for r in rows}
    out: dict[str, Any] = {}
    if 10_000 in by:
        r = by[10_000]
        peers = [r[p]["p50_ms"] for p in ("openai-agents", "langgraph") if p in r]
        if peers:
            out["speedup_vs_fastest_peer@10000"] = ratio(min(peers), r["torpor"]["p50_ms"])
            out["at_least_10x@10000"] = (out["speedup_vs_fastest_peer@10000"] or 0) >= 10
        if 100 in by:
            out["torpor_10000_over_100"] = ratio(r["torpor"]["p50_ms"],
                                                 by[100]["torpor"]["p50_ms"])
            out["within_20pct"] = (out["torpor_10000_over_100"] or 99) <= 1.2
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 1_000, 10_000, 100_000])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dir", default=None, help="where temporary databases go")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    quiet()
    with tempfile.TemporaryDirectory(prefix="torpor-resume-", dir=args.dir) as tmp:
        result = asyncio.run(run(args.sizes, args.repeats, Path(tmp)))
    result = {"benchmark": "resume", "params": {"sizes": args.sizes, "repeats": args.repeats},
              **result, "targets": targets(result["rows"])}
    columns = ["events", "torpor tail", "torpor ms", "openai-agents ms", "langgraph ms",
               "agents/torpor", "langgraph/torpor"]
    rows = [(r["events"], r["torpor"]["tail_events"], r["torpor"]["p50_ms"],
             r.get("openai-agents", {}).get("p50_ms"), r.get("langgraph", {}).get("p50_ms"),
             r.get("openai-agents/torpor"), r.get("langgraph/torpor")) for r in result["rows"]]
    tables = [table("resume + append one turn (median ms)", columns, rows)]
    emit(result, tables, args.json)


if __name__ == "__main__":
    main()
