"""Stream tickets over real HTTP: a browser's EventSource follows a conversation with one
(``POST …/stream-tickets``, then ``GET …/stream?ticket=``), and nothing else takes it.

Expired, forged and other-conversation tickets are refused (401, 401, 403); a ticket
reads the stream only (history, pending, messages, answers and cancels ignore it);
minting one needs read permission; the access record never holds it."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import pytest
from serve_support import ADMIN, TOKEN, served

from torpor import Runtime, ScriptedModel
from torpor.serve import app, bearer_tokens
from torpor.serve.tickets import StreamTickets

SECRET = "a shared secret of the cluster's nodes"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


async def mint(http: httpx.AsyncClient, url: str, cid: str, **headers: str) -> httpx.Response:
    return await http.post(f"{url}/v1/conversations/{cid}/stream-tickets",
                           headers=headers or BEARER)


async def first_event(http: httpx.AsyncClient, url: str, cid: str, **params: str) -> str:
    """Open the stream (no bearer token) and return its status, or its first event's name."""
    async with http.stream("GET", f"{url}/v1/conversations/{cid}/stream",
                           params={"after": "-1", **params}) as response:
        if response.status_code != 200:
            await response.aread()
            return f"{response.status_code} {response.json()['detail']}"
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                return line[7:]
    return "ended"


async def test_a_ticket_opens_its_conversations_stream_and_nothing_else(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = ScriptedModel(["hello 👋"])
    caplog.set_level(logging.INFO, logger="torpor")
    async with Runtime("sqlite://", model=model) as rt:
        await (await rt.send("t", "hi")).result()
        async with served(rt, ticket_secret=SECRET) as (url, _, _), httpx.AsyncClient() as http:
            assert (await first_event(http, url, "t")).startswith("401")  # no credentials
            minted = await mint(http, url, "t")
            assert minted.status_code == 201, minted.text
            body = minted.json()
            ticket = body["ticket"]
            assert body["ttl"] == 60.0
            assert body["expires_at"] > time.time() * 1000
            assert await first_event(http, url, "t", ticket=ticket) == "user"
            # another conversation's stream: 403, even one the token could read
            refused = await first_event(http, url, "other", ticket=ticket)
            assert refused.startswith("403") and "another conversation" in refused
            # not a credential anywhere else
            for method, path in [("GET", "history"), ("GET", "pending"), ("GET", "recall"),
                                 ("POST", "messages"), ("POST", "calls/x"),
                                 ("POST", "cancel"), ("POST", "stream-tickets")]:
                answer = await http.request(method, f"{url}/v1/conversations/t/{path}",
                                            params={"ticket": ticket, "q": "hi"},
                                            json={"text": "x", "result": "x"})
                assert answer.status_code == 401, (path, answer.text)
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "/v1/conversations/t/stream" in logged  # the stream's access record is there
    assert ticket not in logged and ticket.rsplit(".", 1)[1] not in logged


async def test_expired_and_forged_tickets_get_401() -> None:
    model = ScriptedModel(["hello"])
    async with Runtime("sqlite://", model=model) as rt:
        await (await rt.send("t", "hi")).result()
        async with served(rt, ticket_secret=SECRET) as (url, _, _), httpx.AsyncClient() as http:
            # minted by a node with the same secret (a cluster's nodes share it): accepted
            ours = StreamTickets(SECRET).issue("t")[0]
            assert await first_event(http, url, "t", ticket=ours) == "user"
            expired = StreamTickets(SECRET, clock=lambda: time.time() - 3600).issue("t")[0]
            refused = await first_event(http, url, "t", ticket=expired)
            assert refused.startswith("401") and "expired" in refused
            forged = StreamTickets("another secret of 16+ bytes").issue("t")[0]
            assert (await first_event(http, url, "t", ticket=forged)).startswith("401")
            expiry, named, signature = ours.split(".")
            later = f"{int(expiry) + 3_600_000}.{named}.{signature}"  # a longer life, unsigned
            assert (await first_event(http, url, "t", ticket=later)).startswith("401")
            for junk in ("x", "1.2", "1.2.3.4", "é.é.é", "9" * 5000):
                assert (await first_event(http, url, "t", ticket=junk)).startswith("401")


async def test_a_ticket_needs_read_permission_and_another_apps_secret_refuses_it() -> None:
    users = bearer_tokens({"alice-token": "alice", "bob-token": "bob"})
    async with Runtime("sqlite://", model=ScriptedModel(["hi", "hi"])) as rt:
        await (await rt.send("alice:1", "hi")).result()
        async with served(rt, authorize=users) as (url, _, _), httpx.AsyncClient() as http:
            alice = {"Authorization": "Bearer alice-token"}
            assert (await mint(http, url, "bob:1", **alice)).status_code == 403
            assert (await mint(http, url, "alice:1", Authorization="Bearer nope")).status_code \
                == 401
            ticket = (await mint(http, url, "alice:1", **alice)).json()["ticket"]
            assert await first_event(http, url, "alice:1", ticket=ticket) == "user"
            # another app (no shared secret given: a random one of its own) refuses it
            other = app(rt, authorize=users, admin_token=ADMIN)
            transport = httpx.ASGITransport(app=other)
            async with httpx.AsyncClient(transport=transport, base_url="http://o") as there:
                refused = await there.get("/v1/conversations/alice:1/stream",
                                          params={"ticket": ticket, "after": "-1"})
            assert refused.status_code == 401


def test_the_secret_and_ttl_are_checked() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        StreamTickets("short")
    with pytest.raises(ValueError, match="ticket_ttl"):
        StreamTickets(SECRET, 0)
    tickets: Any = StreamTickets(SECRET, 5, clock=lambda: 1_000.0)
    ticket, expires = tickets.issue("c/with.dots:and ünïcode")
    tickets.check(ticket, "c/with.dots:and ünïcode")  # ids of any shape round-trip
    assert expires == 1_005_000  # the ttl's 5 s past the clock, in milliseconds
