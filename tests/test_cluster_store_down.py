"""PostgreSQL stopped under a cluster (issue 20, item 5): no request answers 500.

Two nodes serve on 127.0.0.1 (real HTTP, the real httpx client) over a PostgreSQL server of
the test's own (``pg_ctl stop`` would take the session's server from every other test).
While it is down, every route of both nodes, for conversations each owns, answers a typed
503 with ``Retry-After`` (or what a node can answer from memory), and nothing is logged
with a traceback at error level: before, the proxy's fresh lease lookup let asyncpg's
connection errors escape as 500 ``InternalError``. Once the server is back, both nodes
serve again.
"""

from __future__ import annotations

import logging
from collections import Counter

import anyio
import pytest
from pg_cluster import ClusterUnavailable, running_cluster

from torpor.errors import StoreUnavailable
from torpor.llm.echo import EchoModel

asyncpg = pytest.importorskip("asyncpg")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_cluster_proxy import ADMIN, AUTH, SHARDS, Node, node, owned_by, split  # noqa: E402

from torpor.store.postgres import PostgresStore  # noqa: E402

JSON = {**AUTH, "Accept": "application/json"}


async def every_route(client: httpx.AsyncClient, nodes: list[Node], cids: list[str],
                      round_: int) -> list[tuple[str, httpx.Response]]:
    """One request of each kind to each node for each conversation."""
    out = []
    for n in nodes:
        for cid in cids:
            base = f"{n.url}/v1/conversations/{cid}"
            key = {"Idempotency-Key": f"{n.name}-{cid}-{round_}"}
            for what, call in [
                ("send", client.post(f"{base}/messages", json={"text": "down?"},
                                     headers={**JSON, **key})),
                ("history", client.get(f"{base}/history", headers=AUTH)),
                ("resolve", client.post(f"{base}/calls/nope", json={"result": "x"},
                                        headers=JSON)),
                ("cancel", client.post(f"{base}/cancel", headers=AUTH)),
            ]:
                out.append((f"{what} {cid} via {n.name}", await call))
        out.append((f"cluster of {n.name}", await client.get(
            f"{n.url}/admin/cluster", headers={"Authorization": f"Bearer {ADMIN}"})))
    return out


async def until_cut_off(*nodes: Node) -> None:
    """Until no node serves anything: each stopped trusting its leases (no renewal)."""
    for n in nodes:
        assert n.rt._cluster is not None
        leases = n.rt._cluster.member.leases
        with anyio.fail_after(20):
            while any(leases.serving(s) for s in leases.held):
                await leases.next_change()


async def until_serving(*nodes: Node) -> None:
    """Until the nodes renewed again and serve every shard between them."""
    assert nodes[0].rt._cluster is not None
    leases = nodes[0].rt._cluster.member.leases
    with anyio.fail_after(30):
        while True:
            try:
                views = [await n.rt.admin.cluster() for n in nodes]
            except StoreUnavailable:  # until the nodes reconnect
                views = []
            if views and all(v is not None and v.serving for v in views) and sum(
                len(v.shards) for v in views if v is not None
            ) == SHARDS:
                return
            await leases.next_change()


async def test_no_request_answers_500_while_postgresql_is_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    try:
        server = running_cluster()
        pg = server.__enter__()
    except ClusterUnavailable as exc:
        pytest.skip(f"no throwaway PostgreSQL cluster: {exc}")
    try:
        db = pg.url()
        async with PostgresStore(db):  # the schema first, so the nodes do not race on it
            pass
        model = EchoModel()
        async with node(db, "a", model) as a, node(db, "b", model) as b, \
                httpx.AsyncClient(timeout=30) as client:
            held = await split(a, b)
            cids = [owned_by(held["a"], "a"), owned_by(held["b"], "b")]
            for cid in cids:  # known conversations: history and resolve reach the store
                sent = await client.post(f"{b.url}/v1/conversations/{cid}/messages",
                                         json={"text": "hello"}, headers=JSON)
                assert sent.status_code == 202

            await anyio.to_thread.run_sync(pg.stop)
            answers = await every_route(client, [a, b], cids, 1)  # leases maybe still trusted
            await until_cut_off(a, b)
            answers += await every_route(client, [a, b], cids, 2)  # nobody serves anything

            print("while down:", sorted(Counter(  # printed for the record, not asserted
                (r.status_code, r.json().get("error", "")) if r.status_code >= 400
                else (r.status_code, "") for _, r in answers).items()))
            server_errors = [(what, r.status_code, r.text[:200]) for what, r in answers
                             if r.status_code >= 500 and r.status_code != 503]
            assert server_errors == []
            unavailable = [(what, r) for what, r in answers if r.status_code == 503]
            assert len(unavailable) >= len(answers) // 2, [
                (what, r.status_code) for what, r in answers]
            for what, r in unavailable:
                assert r.headers.get("retry-after"), what
                assert r.json()["error"] in ("StoreUnavailable", "OwnerUnreachable"), what

            await anyio.to_thread.run_sync(lambda: pg.start(fsync=False))
            await until_serving(a, b)
            for n in (a, b):
                for cid in cids:
                    sent = await client.post(f"{n.url}/v1/conversations/{cid}/messages",
                                             json={"text": "back"}, headers=JSON)
                    assert sent.status_code == 202, sent.text
    finally:
        server.__exit__(None, None, None)
    tracebacks = [f"{r.name}: {r.getMessage()[:200]}" for r in caplog.records
                  if r.levelno >= logging.ERROR and r.exc_info]
    assert tracebacks == []
    assert not [r for r in caplog.records if r.getMessage().startswith("unexpected_error")]
