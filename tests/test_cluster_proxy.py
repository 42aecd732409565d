"""Routing through any node (issue 12): the HTTP server proxies a request for a conversation
another node owns to the owner, streams included, on a real throwaway PostgreSQL with real
HTTP on 127.0.0.1 and the real httpx client.

In-process nodes (uvicorn in the test's loop) for the streaming, reconnect and loop
cases; two ``torpor serve --node-id`` processes for the owner killed mid-proxy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from torpor import NodeConfig, Runtime
from torpor.cluster import shard_of
from torpor.llm.echo import EchoModel

asyncpg = pytest.importorskip("asyncpg")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from test_cluster_chaos import SHARDS as CHAOS_SHARDS  # noqa: E402
from test_cluster_chaos import start_node  # noqa: E402
from test_cluster_leases import (  # noqa: E402
    GateModel,
)

from torpor.serve import Server, app, bearer_token, bind  # noqa: E402
from torpor.serve.proxy import HOP_HEADER, OWNER_HEADER  # noqa: E402
from torpor.store.postgres import PostgresStore  # noqa: E402

SHARDS = 8
TOKEN = "chat-token"
ADMIN = "admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def db(pg_url: str) -> str:
    """A fresh schema of the throwaway cluster, as the lease tests make it."""
    return pg_url


class Node:
    def __init__(self, name: str, rt: Runtime, url: str, application: Any = None) -> None:
        self.name = name
        self.rt = rt
        self.url = url
        self.app = application


@asynccontextmanager
async def node(
    db: str, name: str, model: Any, *, handoff_deadline: float = 5.0, lease_ttl: float = 1.0,
    **options: Any,
) -> AsyncIterator[Node]:
    """A cluster node served on 127.0.0.1; its app's lifespan runs the runtime."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    rt = Runtime(db, model=model, node=NodeConfig(
        node_id=name, address=f"127.0.0.1:{port}", lease_ttl=lease_ttl, shards=SHARDS,
        handoff_deadline=handoff_deadline))
    application = app(rt, authorize=bearer_token(TOKEN), admin_token=ADMIN, page=False,
                      **options)
    server = Server(uvicorn.Config(application, lifespan="on", log_config=None,
                                   access_log=False, timeout_graceful_shutdown=2))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=20) as client:  # answered once the runtime runs
            assert (await client.get(f"{url}/healthz")).status_code == 200
        yield Node(name, rt, url, application)
    finally:
        server.should_exit = True
        await task


async def split(*nodes: Node) -> dict[str, set[int]]:
    """Until every shard is served by one of ``nodes`` and each serves some."""
    with anyio.fail_after(20):
        while True:
            views = [await n.rt.admin.cluster() for n in nodes]
            held = {n.name: set(v.shards) for n, v in zip(nodes, views, strict=True) if v}
            if all(held.values()) and sum(map(len, held.values())) == SHARDS and not any(
                v.leaving for v in views if v
            ):
                return held
            assert nodes[0].rt._cluster is not None
            await nodes[0].rt._cluster.member.leases.next_change()


def owned_by(shards: set[int], prefix: str = "c") -> str:
    return next(c for c in (f"{prefix}{i}" for i in range(999)) if shard_of(c, SHARDS) in shards)


async def sse(response: Any) -> AsyncIterator[tuple[str, str, str | None]]:
    """(event, data, id) of each event of an httpx streaming response."""
    event, data, ident = "message", "", None
    async for line in response.aiter_lines():
        if line == "":
            if data or event != "message":
                yield event, data, ident
            event, data, ident = "message", "", None
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif line.startswith("id:"):
            ident = line[3:].strip()


async def turn_events(client: Any, url: str, cid: str, text: str) -> tuple[Any, list[Any]]:
    """Send ``text``; the response and its events (minus timestamps) until the answer."""
    out = []
    async with client.stream("POST", f"{url}/v1/conversations/{cid}/messages", headers={
        **AUTH, "Accept": "text/event-stream"}, json={"text": text}) as response:
        assert response.status_code == 200, await response.aread()
        async for event, data, ident in sse(response):
            body = json.loads(data)
            body.pop("created_at", None)
            out.append((event, body, ident))
            if event == "assistant":
                break
    return response, out


async def test_a_send_to_a_non_owner_streams_the_owners_answer_with_the_same_events(
    db: str,
) -> None:
    model = GateModel()
    async with node(db, "a", model) as a, node(db, "b", model) as b:
        held = await split(a, b)
        direct_cid = owned_by(held["a"], "d")
        proxied_cid = owned_by(held["a"], "p")
        async with httpx.AsyncClient(timeout=20) as client:
            direct, want = await turn_events(client, a.url, direct_cid, "same words here")
            proxied, got = await turn_events(client, b.url, proxied_cid, "same words here")
            assert OWNER_HEADER not in direct.headers
            assert proxied.headers[OWNER_HEADER] == a.url.removeprefix("http://")
            assert proxied.headers["content-type"].startswith("text/event-stream")
            assert [e for e, _, _ in want] == ["user", "delta", "assistant"]
            assert got == want  # names, ids and bodies (timestamps aside)

            # Relayed as it arrives: the first delta comes through while the owner's turn is
            # still held (a buffering proxy would deliver nothing until it ends).
            async with client.stream("POST", f"{b.url}/v1/conversations/{proxied_cid}/messages",
                                     headers={**AUTH, "Accept": "text/event-stream"},
                                     json={"text": "hold on"}) as response:
                events = sse(response)
                kinds = []
                async for event, data, _ in events:
                    kinds.append(event)
                    if event == "delta":
                        assert json.loads(data)["text"] == "partial "
                        break
                assert not model.release.is_set()
                model.release.set()
                async for event, data, _ in events:
                    kinds.append(event)
                    if event == "assistant":
                        assert json.loads(data)["body"]["text"] == "partial re: hold on"
                        break
                assert kinds[0] == "user" and kinds[-1] == "assistant"
        # The owner served it: its log, written under a's epoch.
        view = await a.rt.admin.cluster()
        assert view is not None and shard_of(proxied_cid, SHARDS) in view.shards


async def test_a_follow_through_a_non_owner_resumes_after_last_event_id(db: str) -> None:
    model = GateModel()
    async with node(db, "a", model) as a, node(db, "b", model) as b:
        held = await split(a, b)
        cid = owned_by(held["a"])
        async with httpx.AsyncClient(timeout=20) as client:
            ack = await client.post(f"{b.url}/v1/conversations/{cid}/messages", json={
                "text": "hold this"}, headers={**AUTH, "Accept": "application/json"})
            assert ack.status_code == 202 and ack.headers[OWNER_HEADER]
            position = ack.json()["position"]
            with anyio.fail_after(10):
                await model.streaming.wait()
            # The client had the user message and 3 characters of the draft ("par").
            async with client.stream("GET", f"{b.url}/v1/conversations/{cid}/stream", headers={
                    **AUTH, "Last-Event-ID": f"{position}.3"}) as response:
                assert response.status_code == 200
                deltas = []
                async for event, data, ident in sse(response):
                    if event == "delta":
                        deltas.append(json.loads(data)["text"])
                        if len(deltas) == 1:
                            assert json.loads(data)["offset"] == 3
                            model.release.set()
                    if event == "assistant":
                        assert "".join(deltas) == "partial re: hold this"[3:]
                        assert ident == str(position + 1)
                        break


async def test_a_forwarded_request_is_never_forwarded_again_and_redirect_mode_answers_421(
    db: str,
) -> None:
    model = EchoModel()
    async with node(db, "a", model) as a, node(db, "b", model,
                                                     cluster_routing="redirect") as b:
        held = await split(a, b)
        on_b, on_a = owned_by(held["b"]), owned_by(held["a"])
        async with httpx.AsyncClient(timeout=20) as client:
            # A request already forwarded once (the hop header) that lands on a non-owner.
            looped = await client.post(f"{a.url}/v1/conversations/{on_b}/messages", json={
                "text": "x"}, headers={**AUTH, HOP_HEADER: "b", "Accept": "application/json"})
            assert looped.status_code == 421
            assert looped.json()["error"] == "NotOwner"
            assert looped.json()["owner"] == b.url.removeprefix("http://")
            # b redirects instead of proxying; a proxies.
            redirected = await client.post(f"{b.url}/v1/conversations/{on_a}/cancel",
                                           headers=AUTH)
            assert redirected.status_code == 421
            assert redirected.json()["owner"] == a.url.removeprefix("http://")
            proxied = await client.post(f"{a.url}/v1/conversations/{on_b}/cancel", headers=AUTH)
            assert proxied.status_code == 200 and proxied.json() == {"cancelled": False}
            assert proxied.headers[OWNER_HEADER] == b.url.removeprefix("http://")
        async with PostgresStore(db) as store:
            assert await store.head(on_b) is None  # the looped send was written nowhere


@pytest.mark.parametrize("stale", ["another node", "a closed port"])
async def test_a_stale_lease_cache_gets_one_retry_after_a_fresh_lookup(
    db: str, stale: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = EchoModel()
    async with node(db, "a", model) as a, node(db, "b", model) as b, \
            node(db, "c", model) as c:
        held = await split(a, b, c)
        cid = owned_by(held["a"])
        if stale == "another node":  # c answers 421 (it is not the owner either)
            wrong = c.url.removeprefix("http://")
        else:
            sock = bind("127.0.0.1", 0)
            wrong = f"127.0.0.1:{sock.getsockname()[1]}"
            sock.close()  # nothing listens there: the connection is refused
        assert b.rt._cluster is not None
        # b's routing cache names the wrong node for every shard it does not serve.
        monkeypatch.setattr(b.rt._cluster.member.leases, "owner_address", lambda shard: wrong)
        async with httpx.AsyncClient(timeout=20) as client:
            response, events = await turn_events(client, b.url, cid, "still there?")
        assert response.headers[OWNER_HEADER] == a.url.removeprefix("http://")
        assert events[-1][1]["body"]["text"] == "echo: still there?"


# -- the owner killed mid-proxy: two `torpor serve` processes ------------------------------

async def shards_of(client: Any, url: str) -> set[int]:
    view = await client.get(f"{url}/admin/cluster",
                            headers={"Authorization": f"Bearer {ADMIN}"})
    return {int(s) for s in view.json()["shards"]}


async def until_held(client: Any, urls: list[str], *, each: bool = False) -> None:
    """Until the nodes at ``urls`` serve every shard between them (and each some, with
    ``each``). Polls: other processes change the lease table."""
    with anyio.fail_after(20):
        while True:
            held = [await shards_of(client, url) for url in urls]
            if len(set().union(*held)) == CHAOS_SHARDS and (not each or all(held)):
                return
            await asyncio.sleep(0.05)


async def test_owner_killed_mid_proxy_ends_the_stream_with_a_typed_error_then_takeover_serves(
    db: str, tmp_path: Path
) -> None:
    async with PostgresStore(db):  # the schema first, so the nodes do not race on it
        pass
    async with AsyncExitStack() as stack:
        # `torpor serve --node-id` with the chaos test's settings; n1 will own the
        # conversation, n2 is the way in.
        n1 = await start_node("n1", db, tmp_path)
        stack.push_async_callback(_stop, n1.proc)
        n2 = await start_node("n2", db, tmp_path)
        stack.push_async_callback(_stop, n2.proc)
        owner, owner_url, via = n1.proc, f"http://{n1.address}", f"http://{n2.address}"
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=20))
        await until_held(client, [owner_url, via], each=True)
        held = await shards_of(client, owner_url)
        cid = next(c for c in (f"k{i}" for i in range(9999)) if shard_of(c, CHAOS_SHARDS) in held)
        long = " ".join(f"w{i}" for i in range(300))
        async with client.stream("POST", f"{via}/v1/conversations/{cid}/messages", json={
                "text": long}, headers={**AUTH, "Accept": "text/event-stream",
                                        "Idempotency-Key": "k1"}) as response:
            assert response.status_code == 200
            assert response.headers[OWNER_HEADER] == owner_url.removeprefix("http://")
            kinds = []
            async for event, data, _ in sse(response):
                kinds.append(event)
                if event == "delta" and kinds.count("delta") == 2:
                    owner.kill()  # SIGKILL mid-stream
                if event == "error":
                    error = json.loads(data)
                    break
            else:
                raise AssertionError(f"the stream ended without an error event: {kinds}")
        assert error["error"] == "OwnerUnreachable" and error["status"] == 503
        assert "assistant" not in kinds

        # Until the lease expires nobody serves it: a typed, retryable refusal.
        refused = await client.post(f"{via}/v1/conversations/{cid}/messages", json={
            "text": "again"}, headers={**AUTH, "Accept": "application/json",
                                       "Idempotency-Key": "k2"})
        if refused.status_code != 202:  # (202: the takeover already happened)
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert refused.json()["error"] == "OwnerUnreachable"

        await until_held(client, [via])
        answer = await client.post(f"{via}/v1/conversations/{cid}/messages", json={
            "text": "after takeover"}, headers={**AUTH, "Accept": "text/event-stream"})
        assert answer.status_code == 200 and "echo: after takeover" in answer.text


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    with anyio.fail_after(30):
        await proc.wait()


async def test_a_stream_ticket_minted_on_one_node_opens_the_stream_through_another(
    db: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """The nodes share the ticket secret: a ticket minted on the owner opens the stream
    through a non-owner, which passes it on in a header (httpx logs the URL it requests:
    the ticket is not in it). A node with a secret of its own refuses it."""
    caplog.set_level(logging.INFO)
    secret = "the cluster's ticket secret"
    async with node(db, "a", EchoModel(), ticket_secret=secret) as a, \
            node(db, "b", EchoModel(), ticket_secret=secret) as b:
        held = await split(a, b)
        cid = owned_by(held["a"], "t")
        async with httpx.AsyncClient(timeout=20) as client:
            ack = await client.post(f"{a.url}/v1/conversations/{cid}/messages", json={
                "text": "hello"}, headers={**AUTH, "Accept": "application/json"})
            assert ack.status_code == 202
            minted = await client.post(f"{a.url}/v1/conversations/{cid}/stream-tickets",
                                       headers=AUTH)
            ticket = minted.json()["ticket"]
            async with client.stream("GET", f"{b.url}/v1/conversations/{cid}/stream",
                                     params={"ticket": ticket, "after": "-1"}) as response:
                assert response.status_code == 200, await response.aread()
                assert response.headers[OWNER_HEADER] == a.url.removeprefix("http://")
                kinds = []
                async for event, _, _ in sse(response):
                    kinds.append(event)
                    if event == "assistant":
                        break
            assert kinds[0] == "user" and kinds[-1] == "assistant"
            other = app(b.rt, authorize=bearer_token(TOKEN), admin_token=ADMIN,
                        ticket_secret="a secret of that node's own")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=other),
                                         base_url="http://o") as there:
                refused = await there.get(f"/v1/conversations/{cid}/stream",
                                          params={"ticket": ticket, "after": "-1"})
                assert refused.status_code == 401
    owner = a.url.removeprefix("http://")
    relayed = [m for m in (r.getMessage() for r in caplog.records if r.name == "httpx")
               if f"GET http://{owner}/v1/conversations/{cid}/stream?" in m]  # b's relay
    assert len(relayed) == 1 and "after=-1" in relayed[0], relayed
    assert ticket not in relayed[0] and "ticket=" not in relayed[0], relayed
