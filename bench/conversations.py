"""The conversations index and delete on SQLite (issue 23's cost targets).

* ``list``: ``Runtime.conversations`` pages (50 per page, newest activity first)
  over N conversations (default 100,000): p50/p99 ms per page, first page and deep
  pages (by cursor), and a prefix page;
* ``redact``: ``Runtime.redact`` of one event of that conversation (its agent woken
  from the log first, as a redaction of a dormant conversation does), then of a
  second one with the agent live: seconds each;
* ``delete``: ``Runtime.delete`` of one conversation of E events (default 10,000,
  user messages and assistant answers, every one in the full-text index) in that
  same database, with every conversation's messages in the full-text index proper
  (not waiting in its backlog: on SQLite before 3.42 a delete merges the whole
  index, so its size counts): seconds, and the rows it removed.

Usage: ``python bench/conversations.py [--conversations 100000] [--events 10000]
[--dir DIR]``. Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import structlog

from torpor import Runtime
from torpor.events import AssistantMessage, UserMessage

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))


async def _fill(rt: Runtime, conversations: int, events: int) -> None:
    store = rt.store
    batch = 2000
    for start in range(0, conversations, batch):
        await asyncio.gather(*(
            store.append(f"user{i % 1000:04d}/chat{i}", [UserMessage(f"hello number {i}")])
            for i in range(start, min(start + batch, conversations))
        ))
    for start in range(0, events, 200):
        bodies: list[UserMessage | AssistantMessage] = []
        for i in range(start, min(start + 200, events)):
            text = f"message {i} about topic{i % 97} and words{i % 13}"
            bodies.append(UserMessage(text) if i % 2 == 0 else AssistantMessage(text))
        await store.append("big", bodies)


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3),
        "max_ms": round(ordered[-1] * 1000, 3),
    }


async def main(conversations: int, events: int, directory: Path) -> dict[str, object]:
    path = directory / "conversations.db"
    async with Runtime(f"sqlite:///{path}") as rt:
        started = time.perf_counter()
        await _fill(rt, conversations, events)
        fill_s = time.perf_counter() - started
        first: list[float] = []
        deep: list[float] = []
        after = None
        pages = 0
        while pages < 200:  # 200 pages deep, by cursor
            t = time.perf_counter()
            page = await rt.conversations(after=after, limit=50)
            (first if after is None else deep).append(time.perf_counter() - t)
            pages += 1
            after = page.next
            if after is None:
                break
        for _ in range(50):
            t = time.perf_counter()
            await rt.conversations(limit=50)
            first.append(time.perf_counter() - t)
        prefix: list[float] = []
        for i in range(100):
            t = time.perf_counter()
            await rt.conversations(prefix=f"user{i:04d}/", limit=50)
            prefix.append(time.perf_counter() - t)
        await rt.store.search("big", "topic1")  # the backlog into the index proper
        t = time.perf_counter()
        await rt.redact("big", events // 2, reason="bench")
        redact_cold_s = time.perf_counter() - t
        t = time.perf_counter()
        await rt.redact("big", events // 2 + 1, reason="bench")
        redact_live_s = time.perf_counter() - t
        t = time.perf_counter()
        deleted = await rt.delete("big")
        delete_s = time.perf_counter() - t
        audit = (await rt.store.deletions())[-1]
    return {
        "conversations": conversations,
        "events": events,
        "fill_s": round(fill_s, 2),
        "list_first_page": _ms(first),
        "list_deep_pages": _ms(deep),
        "list_prefix_page": _ms(prefix),
        "redact_cold_s": round(redact_cold_s, 3),
        "redact_live_s": round(redact_live_s, 3),
        "delete_s": round(delete_s, 3),
        "deleted": deleted,
        "deleted_rows": audit.rows,
        "db_bytes": path.stat().st_size,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(main(args.conversations, args.events, args.dir or Path(tmp)))
    print(f"{'measure':<28}{'value':>40}")
    for name in ("list_first_page", "list_deep_pages", "list_prefix_page"):
        print(f"{name:<28}{json.dumps(result[name]):>40}")
    for name in ("redact_cold_s", "redact_live_s"):
        print(f"{name.removesuffix('_s'):<28}{str(result[name]) + ' s':>40}")
    print(f"{'delete of ' + str(args.events) + ' events':<28}{str(result['delete_s']) + ' s':>40}")
    print(f"{'fill':<28}{str(result['fill_s']) + ' s':>40}")
    print(json.dumps(result))
