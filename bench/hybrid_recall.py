"""Hybrid recall benchmark: full-text vs full-text fused with vectors, on paraphrased queries.

Setup: one conversation of 200 events (100 turns; a user message and an
answer each), then one of 1,000, on a real SQLite file. 50 of the user messages
are needles: a
fact about one of 10 systems and one of 5 actions, with a unique ticket id
("We rolled back the billing deploy, see OPS-1234."). The other turns are
flood that names the same systems doing other things. Each needle is asked
for with a paraphrase that keeps the system's name but rewords the action
("billing deployment rollback"): the words share stems with the fact, not
tokens, except the system's name, which full-text search then finds in every
flood turn about that system too.

Compared in the same run, on the same store:

* ``full-text``: ``recall`` as without an embedder (FTS5, bm25);
* ``hybrid``: ``recall`` with the HashingEmbedder's vectors fused by a weighted
  sum of the two 0-1 scores (the default), as ``RuntimeConfig(embedder=HashingEmbedder())``;
* ``hybrid-rrf``: the same fused by reciprocal rank fusion (k=60), the default before
  issue 25 (it dilutes a hit only the vectors find);
* ``vectors``: the vector side alone (what the fusion adds).

Reported: recall@1 and recall@10 (the needle's event among the first 1 / 10
hits), query latency (p50, ms) for each; the ratio hybrid / full-text. Then the
embedding worker: the time to embed a backlog of 10,000 events (events per
second; the HashingEmbedder costs little, so this is torpor's own overhead:
reads, batches, writes), and the lag of a live conversation (time from
``send`` returning to the event's vector being stored, with
``embed_interval`` at its default of 1 s and at 0.1 s).

Usage: ``python bench/hybrid_recall.py [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import emit, fresh_db, quiet, ratio, table

from torpor import Runtime, RuntimeConfig
from torpor.compaction.fusion import HybridRecall
from torpor.compaction.recall import recall
from torpor.events import AssistantMessage, UserMessage
from torpor.llm.embedding import HashingEmbedder, space_of
from torpor.store import open_store
from torpor.store.vectors import vector_index

SYSTEMS = ["billing", "search", "checkout", "auth", "payments", "inventory", "email",
           "reporting", "analytics", "gateway"]
# (how the fact says it, how the question paraphrases it)
ACTIONS = [
    ("We rolled back the {s} deploy", "{s} deployment rollback"),
    ("We migrated the {s} database to the new cluster", "{s} db migration to clustered storage"),
    ("We throttled {s} requests after it failed over", "{s} request throttling failover"),
    ("We rotated the {s} credentials that leaked", "{s} credential rotation leak"),
    ("We reindexed the {s} tables that were corrupted", "{s} table index corruption"),
]
FLOOD = [
    "The {s} team met to talk about the roadmap for next quarter.",
    "Dashboards for {s} looked normal all afternoon.",
    "Someone asked who owns the {s} runbook now.",
    "The {s} on-call shift was quiet, nothing to report.",
    "We should write more documentation for {s} someday.",
]
K = 10


def build(turns: int) -> tuple[list[UserMessage | AssistantMessage], list[tuple[int, str]]]:
    """The conversation's events and (needle position, paraphrased question) pairs: the
    50 needles spread evenly over ``turns`` turns."""
    rng = random.Random(13)
    needles = [(s, a) for s in SYSTEMS for a in range(len(ACTIONS))]
    rng.shuffle(needles)
    events: list[UserMessage | AssistantMessage] = []
    asks: list[tuple[int, str]] = []
    every = turns // len(needles)
    for turn in range(turns):
        if turn % every == 0 and turn // every < len(needles):
            system, action = needles[turn // every]
            fact, question = ACTIONS[action]
            ticket = f"OPS-{1000 + turn}"
            events.append(UserMessage(f"{fact.format(s=system)}, see {ticket}."))
            asks.append((len(events) - 1, question.format(s=system)))
        else:
            events.append(UserMessage(rng.choice(FLOOD).format(s=rng.choice(SYSTEMS))))
        events.append(AssistantMessage("Noted."))
    return events, asks


async def recall_quality(directory: Path, turns: int) -> dict[str, Any]:
    events, asks = build(turns)
    url = fresh_db(directory, f"hybrid-{turns}.db")
    embedder = HashingEmbedder()
    async with open_store(url) as store:
        for i in range(0, len(events), 2):
            await store.append("c", events[i : i + 2], turn=i // 2 + 1)
        index = vector_index(store)
        texts = [e.text for e in events]
        vectors = await embedder.embed(texts)
        await index.put("c", space_of(embedder), list(enumerate(vectors)), len(events) - 1)
        hybrid = HybridRecall(embedder, index)  # weighted fusion, the default
        rrf = HybridRecall(embedder, index, fusion="rrf")
        out: dict[str, Any] = {}
        for mode in ("full-text", "hybrid", "hybrid-rrf", "vectors"):
            at1 = at10 = 0
            took: list[float] = []
            for position, question in asks:
                started = time.perf_counter()
                if mode == "vectors":
                    query = (await embedder.embed([question]))[0]
                    near = await index.nearest("c", hybrid.space, query, K)
                    found = [p for p, _ in near]
                else:
                    fused = {"hybrid": hybrid, "hybrid-rrf": rrf}.get(mode)
                    hits = await recall(store, "c", question, K, hybrid=fused)
                    found = [h.position for h in hits]
                took.append((time.perf_counter() - started) * 1000)
                at1 += found[:1] == [position]
                at10 += position in found
            out[mode] = {
                "recall_at_1": at1 / len(asks),
                "recall_at_10": at10 / len(asks),
                "query_ms_p50": round(statistics.median(took), 3),
            }
        out["vector_backend"] = index.backend
        out["events"] = len(events)
    return out


async def backlog_rate(directory: Path, count: int = 10_000) -> dict[str, Any]:
    """Embed ``count`` events already in the log (a runtime started over an old log)."""
    url = fresh_db(directory, "backlog.db")
    rng = random.Random(7)
    async with open_store(url) as store:
        for c in range(20):
            batch = [UserMessage(rng.choice(FLOOD).format(s=rng.choice(SYSTEMS)))
                     for _ in range(count // 20)]
            for i in range(0, len(batch), 100):
                await store.append(f"c{c}", batch[i : i + 100])
    config = RuntimeConfig(embedder=HashingEmbedder(), embed_interval=3600)
    async with Runtime(url, config=config) as rt:
        started = time.perf_counter()
        stats = await rt.admin.embed()
        seconds = time.perf_counter() - started
    assert stats is not None
    return {"events": stats.embedded, "seconds": round(seconds, 3),
            "events_per_second": round(stats.embedded / seconds)}


async def live_lag(directory: Path, interval: float, sends: int = 20) -> dict[str, Any]:
    """Seconds from ``send`` returning to the message's vector being stored."""
    url = fresh_db(directory, f"lag-{interval}.db")
    embedder = HashingEmbedder()
    config = RuntimeConfig(embedder=embedder, embed_interval=interval)
    lags: list[float] = []
    async with Runtime(url, config=config) as rt:
        index = vector_index(rt.store)
        space = space_of(embedder)
        for i in range(sends):
            turn = await rt.send("live", f"message {i} about the billing deploy")
            sent = time.perf_counter()
            position = turn.user_position
            # A probe of the store every 5 ms: what is measured is when the worker gets there.
            while await index.progress("live", space) < position:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - sent)
            await turn.result()
    return {"interval_s": interval, "sends": sends,
            "lag_p50_s": round(statistics.median(lags), 3), "lag_max_s": round(max(lags), 3)}


async def main(json_target: str | None) -> None:
    quiet()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        qualities = [await recall_quality(directory, turns) for turns in (100, 500)]
        backlog = await backlog_rate(directory)
        lags = [await live_lag(directory, interval) for interval in (1.0, 0.1)]
    for quality in qualities:
        full, hyb = quality["full-text"], quality["hybrid"]
        quality["hybrid_over_full_text_recall_at_10"] = ratio(
            hyb["recall_at_10"], full["recall_at_10"]
        )
    data = {
        "benchmark": "hybrid_recall",
        "needles": len(SYSTEMS) * len(ACTIONS),
        "recall": qualities,
        "backlog": backlog,
        "lag": lags,
    }
    rows = [(f"{q['events']} events: {mode}", q[mode]["recall_at_1"], q[mode]["recall_at_10"],
             q[mode]["query_ms_p50"])
            for q in qualities for mode in ("full-text", "hybrid", "hybrid-rrf", "vectors")]
    tables = [
        table(f"Paraphrased recall, 50 needles (vectors: {qualities[0]['vector_backend']})",
              ["conversation: mode", "recall@1", "recall@10", "query p50 ms"], rows),
        table("Embedding lag", ["what", "value"], [
            ("backlog events/s", backlog["events_per_second"]),
            *[(f"live lag p50 s (interval {lag['interval_s']} s)", lag["lag_p50_s"])
              for lag in lags],
            *[(f"live lag max s (interval {lag['interval_s']} s)", lag["lag_max_s"])
              for lag in lags],
        ]),
    ]
    emit(data, tables, json_target)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the JSON here ('-': stdout)")
    asyncio.run(main(parser.parse_args().json))
