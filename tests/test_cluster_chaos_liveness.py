"""The chaos harness of issue 20 (``bench/cluster_chaos.py``) as a test: its safety and liveness.

One run per module: three ``torpor serve --node-id`` processes on a throwaway PostgreSQL
of their own (the run stops and restarts it), a bounded client load with idempotency
keys and retries, and the fault windows kill -9 (and restart under the same id),
SIGSTOP past the TTL, a join, a graceful leave, ``pg_ctl stop`` for 5 s and
``pg_ctl restart``. Before the kill and the stop, a few of the victim's conversations
get a long turn and a postponed message and are left alone. The tests below read that
run's figures: the log in PostgreSQL (nothing acknowledged lost or doubled, positions
dense, epochs never going back, nothing parked), no response with status 500, every
shard served again after every window with none orphaned, every turn ended with no new
request (work re-driven after a takeover), every conversation answering at the end.

CI-sized by default (about a minute); ``TORPOR_CHAOS_LONG=1`` runs the long mode (more
clients and conversations, three rounds of the schedule, then the joins and leaves under
5 s turns). Timings are the benchmark's to print, never asserted here; the waits in the
harness are hang guards.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("asyncpg")
pytest.importorskip("uvicorn")

from pg_cluster import ClusterUnavailable, find_bindir

from torpor import Aborted, AssistantMessage, Parked, UserMessage
from torpor.store.postgres import PostgresStore

LONG = os.environ.get("TORPOR_CHAOS_LONG") == "1"
BENCH = Path(__file__).resolve().parents[1] / "bench"
pytestmark = pytest.mark.timeout(7200 if LONG else 600)


@pytest.fixture(scope="module")
def harness() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))  # the benchmark imports its siblings
    try:
        import cluster_chaos

        yield cluster_chaos
    finally:
        sys.path.remove(str(BENCH))


def _settings(harness: ModuleType, mode: str) -> Any:
    s = harness.Settings(mode=mode, ttl=1.5, clients=8, conversations=60, steady=2.0,
                         tail=1.0, grace=5.0, limit=30.0, fsync=False)
    if LONG:
        s.ttl, s.clients, s.conversations, s.rounds, s.limit = 2.0, 20, 200, 3, 60.0
        s.steady, s.tail = 5.0, 2.0
        if mode == "handover":
            s.turn_seconds, s.text_chars, s.think, s.rounds, s.grace = 5.0, 90, 0.2, 2, 10.0
            s.clients, s.steady, s.tail, s.json_share = 60, 10.0, 5.0, 0.1
    return s


@pytest.fixture(scope="module", params=["chaos", "handover"] if LONG else ["chaos"])
def run(request: pytest.FixtureRequest, harness: ModuleType) -> dict[str, Any]:
    if find_bindir() is None:
        pytest.skip("no PostgreSQL binaries for a throwaway cluster")
    try:
        result: dict[str, Any] = asyncio.run(harness.run(_settings(harness, request.param)))
    except ClusterUnavailable as exc:
        pytest.skip(f"no throwaway PostgreSQL cluster: {exc}")
    brief = {k: result[k] for k in ("mode", "totals", "quiet", "final_round", "check")}
    brief["windows"] = [{k: w.get(k) for k in ("window", "node", "requests", "errors",
                                                "status_500", "served_s", "balanced_s",
                                                "takeovers", "orphaned", "unserved")}
                        for w in result["windows"]]
    print(json.dumps(brief, default=str))  # the figures, for the log of a failing run
    return result


def test_every_acknowledged_send_is_in_the_log_exactly_once(run: dict[str, Any]) -> None:
    check = run["check"]
    assert check["lost"] == 0, check["examples"]["lost"]
    assert check["duplicated"] == 0, check["examples"]["duplicated"]
    # The load ran: far more sends acknowledged than conversations.
    assert check["found"] == check["acknowledged"] > 2 * check["conversations"]


def test_positions_are_dense_and_epochs_never_go_back(run: dict[str, Any]) -> None:
    check = run["check"]
    assert check["not_dense"] == 0, check["examples"]["not_dense"]
    assert check["epoch_regressions"] == 0, check["examples"]["epoch_regressions"]
    assert check["null_epochs"] == 0
    assert check["epochs_above_lease"] == 0
    assert check["wrong_shard"] == 0


def test_no_conversation_is_parked(run: dict[str, Any]) -> None:
    assert run["check"]["parked"] == 0, run["check"]["examples"]["parked"]


def test_no_response_has_status_500(run: dict[str, Any]) -> None:
    totals = run["totals"]
    assert totals["status_500"] == 0, {
        f"{i} {w['window']}": w["errors_by_kind"]
        for i, w in enumerate(run["windows"]) if w["status_500"]}


def test_the_faults_happened(run: dict[str, Any]) -> None:
    """The run is not vacuous: each victim held shards, and they moved."""
    for w in run["windows"]:
        if w["window"] in ("kill9", "sigstop"):
            assert w["shards_lost"] > 0 and w["epoch_moves"] >= w["shards_lost"], w
        if w["window"] == "leave":
            assert w["shards_moved"] > 0 and w["epoch_moves"] >= w["shards_moved"], w
        if w["window"] == "join":
            assert w["registered_s"] is not None, w
    if run["mode"] == "chaos":
        assert run["quiet"]["planted"] > 0


def test_every_window_ends_with_every_shard_served_and_none_orphaned(
    run: dict[str, Any],
) -> None:
    """Liveness after each fault: the lease table served and balanced again (within the
    hang guard), each joining node got a shard, each live lease's owner serves it, and no
    node exited on its own."""
    for w in run["windows"]:
        assert w.get("served_s", 0) is not None, w
        assert w["balanced_s"] is not None, w
        if w["window"] == "join":
            assert w["first_shard_after_registering_s"] is not None, w
        assert (w["orphaned"], w["unserved"]) == (0, 0), w
        assert w["crashed"] == [], w


def test_work_cut_by_a_takeover_is_redriven_without_a_new_request(
    run: dict[str, Any],
) -> None:
    quiet = run["quiet"]
    assert quiet["unended_turns"] == 0, quiet


def test_every_client_send_ended_and_every_conversation_answers_at_the_end(
    run: dict[str, Any],
) -> None:
    totals, final = run["totals"], run["final_round"]
    assert (totals["gave_up"], totals["failed"]) == (0, 0), totals["errors_by_kind"]
    assert final["answered"] == final["conversations"], final
    assert run["check"]["unended_turns"] == 0


# -- the checker itself sees each violation --------------------------------------------


async def test_the_checker_finds_a_lost_a_duplicated_a_parked_and_an_unended(
    pg_url: str, harness: ModuleType,
) -> None:
    import asyncpg
    from _chaos_check import check

    async with PostgresStore(pg_url) as store:
        await store.append("a", [UserMessage("hi"), AssistantMessage("echo: hi")], turn=1)
        await store.append("b", [UserMessage("once"), AssistantMessage("echo: once")], turn=1)
        await store.append("b", [UserMessage("once"), Aborted("interrupted")], turn=2)
        await store.append("c", [UserMessage("open")], turn=1)
        await store.append("d", [UserMessage("x"), Aborted("crashed"), Parked("crash")],
                           turn=1)
        await store.append("e", [UserMessage("y"), AssistantMessage("echo: y")], turn=1)
    conn = await asyncpg.connect(pg_url)
    try:  # a hole in e's positions; in a's, an epoch that goes back
        await conn.execute("DELETE FROM events WHERE position = 0 AND conversation_id = "
                           "(SELECT key FROM conversations WHERE external_id = 'e')")
        await conn.execute("UPDATE events SET epoch = 2 - position WHERE conversation_id = "
                           "(SELECT key FROM conversations WHERE external_id = 'a')")
    finally:
        await conn.close()
    found = await check(pg_url, {"hi": "a", "lost": "a", "once": "b"}, 64)
    assert (found["lost"], found["duplicated"], found["parked"]) == (1, 1, 1)
    assert (found["not_dense"], found["epoch_regressions"]) == (1, 1)
    assert (found["unended_turns"], found["unended_last_turns"]) == (1, 1)
    assert found["examples"]["unended"] == {"c": [1]}
