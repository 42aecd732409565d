"""The chat API over a real loopback socket: SSE turns, resumption, errors, the admin, metrics."""

from __future__ import annotations

import asyncio
import logging
import os

import anyio
import pytest
from serve_support import ADMIN, TOKEN, events_until, kinds, post_message, served, text_of
from support import until

from torpor import AgentConfig, EchoModel, ExternalTool, Runtime, RuntimeConfig, ScriptedModel
from torpor.llm.scripted import Call, Signal, Text, Wait
from torpor.serve.client import HTTPStatusError

APPROVE = ExternalTool("approve", "Ask a person.", {"type": "object", "properties": {}})


def ends(turn_kinds: tuple[str, ...] = ("assistant",)):  # type: ignore[no-untyped-def]
    def stop(event):  # type: ignore[no-untyped-def]
        return event.event in turn_kinds or event.event in ("aborted", "suspended")

    return stop


async def test_a_message_streams_its_turn_with_ids() -> None:
    async with Runtime("sqlite://", model=EchoModel(chunk_size=3)) as rt, served(rt) as (
        _, client, _app
    ):
        conn, response = await post_message(client, "c1", "hello there")
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"]
        events = [e async for e in response.events()]  # the stream ends with the turn
        await conn.close()
        assert kinds(events)[0] == "user" and kinds(events)[-1] == "assistant"
        assert text_of(events) == "echo: hello there" == events[-1].json()["body"]["text"]
        assert events[0].id == "0" and events[-1].id == "1"
        assert [e.id for e in events if e.event == "delta"][-1] == "0.17"


async def test_request_ids_are_a_process_prefix_and_a_counter() -> None:
    async with Runtime("sqlite://") as rt, served(rt) as (_, client, _app):
        ids = []
        conn = client.connection()
        for _ in range(5):
            _, response = await client.open("GET", "/healthz", conn=conn)
            await response.read()
            ids.append(response.headers["x-request-id"])
        _, response = await client.open("GET", "/healthz", conn=conn,
                                        headers={"X-Request-ID": "mine-1"})
        await response.read()
        await conn.close()
    assert len(set(ids)) == 5 and len({i[:8] for i in ids}) == 1
    assert [int(i[8:], 16) for i in ids] == sorted(int(i[8:], 16) for i in ids)
    assert response.headers["x-request-id"] == "mine-1"


def test_a_forked_process_takes_another_request_id_prefix() -> None:
    from torpor.serve.app import _request_ids

    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its first id, then gone
        os.write(write, _request_ids.next().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    theirs = os.read(read, 64).decode()
    os.close(read)
    ours = _request_ids.next()
    assert len(theirs) == len(ours) == 16 and theirs[:8] != ours[:8]


async def test_json_accept_returns_202_and_idempotency_key_replays() -> None:
    async with Runtime("sqlite://") as rt, served(rt) as (_, client, _app):
        path = "/v1/conversations/c/messages"
        headers = {"Accept": "application/json", "Idempotency-Key": "k1"}
        first = await client.call("POST", path, json_body={"text": "once"}, headers=headers,
                                  expect=(202,))
        again = await client.call("POST", path, json_body={"text": "once"}, headers=headers,
                                  expect=(202,))
        assert first["position"] == again["position"] == 0
        assert again["replayed"] is True
        with pytest.raises(HTTPStatusError) as info:
            await client.call("POST", path, json_body={"text": "other"}, headers=headers)
        assert info.value.status == 409
        assert info.value.problem["error"] == "IdempotencyConflict"
        assert info.value.problem["type"] == "urn:torpor:error:IdempotencyConflict"
        # the replayed turn's stream comes from the log
        conn, response = await post_message(client, "c", "once", {"Idempotency-Key": "k1"})
        events = [e async for e in response.events()]
        await conn.close()
        assert kinds(events) == ["user", "assistant"]


async def test_errors_are_problem_json() -> None:
    config = RuntimeConfig(mailbox_bound=1)
    gate = anyio.Event()
    model = ScriptedModel([[Wait(gate), Text("done")]], loop=True)
    async with Runtime("sqlite://", model=model, config=config) as rt, served(rt) as (
        url, client, _app
    ):
        cases = [
            ("GET", "/v1/conversations/nobody/history", None, 404, "UnknownConversation"),
            ("POST", "/v1/conversations/c/messages", {"text": "a\u0000b"}, 422, "InvalidInput"),
            ("POST", "/v1/conversations/c/messages", {"txt": "x"}, 422, "InvalidInput"),
            ("POST", "/v1/conversations/c/messages", {"text": "x" * 1_100_000}, 413,
             "EventTooLarge"),
            ("POST", "/v1/conversations/c/calls/nope", {"result": "x"}, 404,
             "UnknownConversation"),
            ("GET", "/v1/conversations/c/history?limit=zero", None, 422, "InvalidInput"),
            ("GET", "/nowhere", None, 404, "NotFound"),
        ]
        for method, path, body, status, error in cases:
            with pytest.raises(HTTPStatusError) as info:
                await client.call(method, path, json_body=body,
                                  headers={"Accept": "application/json"})
            assert info.value.status == status, path
            assert info.value.problem.get("error") == error, path
            assert info.value.problem["type"] == f"urn:torpor:error:{error}"
            assert info.value.problem["status"] == status
            assert info.value.problem["instance"] == path.split("?")[0]
        # 429 Busy with Retry-After: one turn streams, one message waits, the next is refused
        json_headers = {"Accept": "application/json"}
        await client.call("POST", "/v1/conversations/b/messages", json_body={"text": "1"},
                          headers=json_headers, expect=(202,))
        await client.call("POST", "/v1/conversations/b/messages", json_body={"text": "2"},
                          headers=json_headers, expect=(202,))
        conn, response = await client.open("POST", "/v1/conversations/b/messages",
                                           json_body={"text": "3"}, headers=json_headers)
        problem = await response.json()
        await conn.close()
        assert response.status == 429 and problem["error"] == "Busy"
        assert response.headers["content-type"] == "application/problem+json"
        assert response.headers["retry-after"] == "1"
        gate.set()
        metrics = (await client.open("GET", "/metrics", token=ADMIN))
        text = (await metrics[1].read()).decode()
        await metrics[0].close()
        assert "torpor_mailbox_refusals_total 1.0" in text
        assert url


async def test_reconnect_mid_stream_loses_and_repeats_nothing() -> None:
    """A real drop after the first delta; the resume skips what the client holds."""
    reached, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("first half, "), Signal(reached), Wait(go),
                            Text("second half.")]])
    async with Runtime("sqlite://", model=model) as rt, served(rt) as (_, client, _app):
        conn, response = await post_message(client, "c", "go")
        seen = await events_until(response, lambda e: e.event == "delta")
        conn.abort()  # the network drops mid-stream
        await reached.wait()
        resume = client.connection()
        _, again = await client.open("GET", "/v1/conversations/c/stream", conn=resume,
                                     headers={"Last-Event-ID": seen[-1].id or ""})
        assert again.status == 200
        go.set()
        rest = await events_until(again, ends())
        resume.abort()
        final = rest[-1].json()["body"]["text"]
        assert final == "first half, second half."
        assert text_of(seen) + text_of(rest) == final
        assert [e.id for e in rest if e.event == "delta"] == ["0.24"]


async def test_reconnect_after_the_answer_was_logged_gets_the_rest() -> None:
    reached, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("abc"), Signal(reached), Wait(go), Text("def")]])
    async with Runtime("sqlite://", model=model) as rt, served(rt) as (_, client, _app):
        with rt.admin.watch() as watcher:
            conn, response = await post_message(client, "c", "go")
            seen = await events_until(response, lambda e: e.event == "delta")
            conn.abort()
            await reached.wait()
            go.set()
            await until(watcher, "c", "awaiting_input", old="streaming")
        resume = client.connection()
        _, again = await client.open("GET", "/v1/conversations/c/stream", conn=resume,
                                     headers={"Last-Event-ID": seen[-1].id or ""})
        rest = await events_until(again, ends())
        resume.abort()
        assert kinds(rest) == ["delta", "assistant"]
        assert text_of(seen) + text_of(rest) == "abcdef"


async def test_a_message_sent_mid_stream_keeps_the_resume_exact() -> None:
    """A user message logged while the answer streams does not restart the draft."""
    reached, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("one "), Signal(reached), Wait(go), Text("two")], "next"])
    async with Runtime("sqlite://", model=model) as rt, served(rt) as (_, client, _app):
        _, follow = await client.open("GET", "/v1/conversations/c/stream?after=-1",
                                      conn=(watch := client.connection()))
        conn, _ = await post_message(client, "c", "go")
        await reached.wait()
        await client.call("POST", "/v1/conversations/c/messages", json_body={"text": "later"},
                          headers={"Accept": "application/json"}, expect=(202,))
        seen = await events_until(follow, lambda e: e.event == "user" and e.json()["turn"] == 2)
        watch.abort()
        assert kinds(seen) == ["user", "delta", "user"]
        assert seen[-1].id == "1.4"  # position 1, four characters of the draft held
        resume = client.connection()
        _, again = await client.open("GET", "/v1/conversations/c/stream", conn=resume,
                                     headers={"Last-Event-ID": seen[-1].id or ""})
        go.set()
        rest = await events_until(again, lambda e: e.event == "assistant"
                                  and e.json()["turn"] == 2)
        resume.abort()
        await conn.close()
        assert kinds(rest) == ["delta", "assistant", "delta", "assistant"]
        assert text_of(seen) + text_of(rest[:1]) == "one two" == rest[1].json()["body"]["text"]
        assert [e.json()["position"] for e in rest if e.event != "delta"] == [2, 3]


async def test_history_recall_and_cancel() -> None:
    reached = anyio.Event()
    model = ScriptedModel(["alpha answer", "beta answer", [Text("partial"), Signal(reached),
                                                          Wait(anyio.Event())]])
    async with Runtime("sqlite://", model=model) as rt, served(rt) as (_, client, _app):
        for text in ("alpha", "beta"):
            conn, response = await post_message(client, "h", text)
            [e async for e in response.events()]
            await conn.close()
        page = await client.call("GET", "/v1/conversations/h/history?limit=3")
        assert [e["position"] for e in page["events"]] == [3, 2, 1]
        older = await client.call("GET", f"/v1/conversations/h/history?before={page['before']}")
        assert [e["position"] for e in older["events"]] == [0] and older["before"] is None
        hits = await client.call("GET", "/v1/conversations/h/recall?q=beta")
        assert {h["position"] for h in hits["hits"]} >= {2}
        conn, response = await post_message(client, "h", "gamma")
        await reached.wait()
        cancelled = await client.call("POST", "/v1/conversations/h/cancel")
        assert cancelled == {"cancelled": True}
        events = [e async for e in response.events()]
        await conn.close()
        assert events[-1].event == "aborted"
        assert events[-1].json()["body"]["reason"] == "cancelled"
        assert await client.call("POST", "/v1/conversations/h/cancel") == {"cancelled": False}


async def test_a_suspended_call_is_resolved_and_its_continuation_streams() -> None:
    model = ScriptedModel([[Text("asking"), Call("approve", {}, id="call-1")], "approved, done"])
    agent = AgentConfig(tools=[APPROVE])
    async with Runtime("sqlite://", model=model, agent=agent) as rt, served(rt) as (
        _, client, _app
    ):
        conn, response = await post_message(client, "s", "deploy?")
        events = [e async for e in response.events()]
        await conn.close()
        assert kinds(events)[-1] == "suspended"
        assert events[-1].json()["body"]["call_ids"] == ["call-1"]
        pending = await client.call("GET", "/admin/pending", token=ADMIN)
        assert pending[0]["conversation_id"] == "s"
        _, answer = await client.open("POST", "/v1/conversations/s/calls/call-1",
                                      json_body={"result": "yes"},
                                      headers={"Accept": "text/event-stream"})
        rest = [e async for e in answer.events()]
        assert kinds(rest) == ["tool_result", "resolved", "delta", "assistant"]
        assert rest[-1].json()["body"]["text"] == "approved, done"
        with pytest.raises(HTTPStatusError) as info:
            await client.call("POST", "/v1/conversations/s/calls/call-1",
                              json_body={"result": "again"})
        assert info.value.status == 404 and info.value.problem["error"] == "UnknownCall"


async def test_one_user_never_reads_another_users_conversation() -> None:
    from torpor.serve import bearer_tokens

    authorize = bearer_tokens({"tok-a": "alice", "tok-b": "bob"})
    async with Runtime("sqlite://") as rt, served(rt, authorize=authorize) as (
        url, client, _app
    ):
        alice = client.__class__(url, "tok-a")
        bob = client.__class__(url, "tok-b")
        await alice.call("POST", "/v1/conversations/alice:1/messages", json_body={"text": "hi"},
                         headers={"Accept": "application/json"}, expect=(202,))
        attempts = [
            ("GET", "/v1/conversations/alice:1/history", None),
            ("GET", "/v1/conversations/alice:1/recall?q=hi", None),
            ("GET", "/v1/conversations/alice:1/stream", None),
            ("POST", "/v1/conversations/alice:1/messages", {"text": "mine now"}),
            ("POST", "/v1/conversations/alice:1/calls/x", {"result": "y"}),
            ("POST", "/v1/conversations/alice:1/cancel", None),
        ]
        for method, path, body in attempts:
            with pytest.raises(HTTPStatusError) as info:
                await bob.call(method, path, json_body=body)
            assert info.value.status == 403, path
        for token in (None, "tok-zzz"):
            with pytest.raises(HTTPStatusError) as info:
                await client.__class__(url, token).call(
                    "GET", "/v1/conversations/alice:1/history")
            assert info.value.status == 401
        # the chat tokens are not admin tokens: no reading it through the admin either
        for path in ("/admin/agents", "/admin/agents/alice:1", "/admin/calls/alice:1/0",
                     "/admin/stats", "/metrics"):
            with pytest.raises(HTTPStatusError) as info:
                await bob.call("GET", path)
            assert info.value.status == 401, path
        assert (await alice.call("GET", "/v1/conversations/alice:1/history"))["events"]
        assert (await bob.call("GET", "/v1/conversations/alice:1/history", token="tok-a"))


async def test_every_problem_the_http_layer_makes_names_its_error() -> None:
    """Problems raised by the HTTP layer itself (not by a torpor error) name theirs too."""
    httpx = pytest.importorskip("httpx")
    async with Runtime("sqlite://", model=EchoModel()) as rt, served(rt) as (url, _, _app):
        cases = [
            ("GET", "/admin/cluster", ADMIN, None, 404, "NotClusterNode"),
            ("POST", "/v1/conversations/c/messages", TOKEN, b"{not json", 400, "MalformedBody"),
            ("POST", "/v1/conversations/c/messages", TOKEN, b"x" * 5_000_000, 413,
             "BodyTooLarge"),
            ("PUT", "/v1/conversations/c/messages", TOKEN, None, 405, "MethodNotAllowed"),
        ]
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            for method, path, token, body, status, error in cases:
                response = await client.request(
                    method, path, content=body,
                    headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
                )
                assert response.status_code == status, path
                assert response.headers["content-type"] == "application/problem+json"
                problem = response.json()
                assert (problem["error"], problem["type"]) == (
                    error, f"urn:torpor:error:{error}"
                ), path
                assert problem["status"] == status and problem["instance"] == path


async def test_the_admin_over_http() -> None:
    async with Runtime("sqlite://", model=EchoModel()) as rt, served(rt) as (_, client, app):
        # the host hands torpor's fold and commit loggers to the metrics (torpor serve does)
        tap = app.state.torpor.metrics.tap
        tap.install([logging.getLogger(name) for name in tap.LOGGERS])
        admin = client.__class__(client_url(client), ADMIN)
        _, watch = await admin.open("GET", "/admin/watch", conn=(wconn := admin.connection()))
        for cid in ("a1", "a2"):
            conn, response = await post_message(client, cid, "hi")
            [e async for e in response.events()]
            await conn.close()
        transitions = await events_until(
            watch, lambda e: e.json()["conversation_id"] == "a2"
            and e.json()["new"] == "awaiting_input" and e.json()["old"] == "streaming")
        wconn.abort()
        assert {e.event for e in transitions} == {"transition"}
        agents = await admin.call("GET", "/admin/agents")
        assert {a["conversation_id"] for a in agents} == {"a1", "a2"}
        assert await admin.call("GET", "/admin/agents?state=streaming") == []
        assert (await admin.call("GET", "/admin/agents/a1"))["state"] == "awaiting_input"
        assert (await admin.call("POST", "/admin/agents/a1/hibernate")) == {"done": True}
        assert (await admin.call("POST", "/admin/agents/a1/evict")) == {"done": True}
        inspected = await admin.call("GET", "/admin/agents/a1")
        assert inspected["state"] == "evicted" and inspected["live"] is False
        assert {a["conversation_id"] for a in await admin.call("GET", "/admin/agents")} == {"a2"}
        assert (await admin.call("POST", "/admin/agents/a2/unpark")) == {"done": False}
        stats = await admin.call("GET", "/admin/stats")
        assert stats["evictions"] == 1 and stats["server"]["turns"] >= 2
        call = await admin.call("GET", "/admin/calls/a2/0")
        assert call["matches"] is True
        with pytest.raises(HTTPStatusError) as info:
            await admin.call("GET", "/admin/agents/never")
        assert info.value.status == 404
        _, metrics = await admin.open("GET", "/metrics")
        text = (await metrics.read()).decode()
        for name in ("torpor_agents{state=", "torpor_activations_total", "torpor_revivals_total",
                     "torpor_revival_seconds_bucket", "torpor_evictions_total 1.0",
                     "torpor_turns_total", "torpor_turn_seconds_bucket",
                     "torpor_time_to_first_token_seconds", "torpor_model_errors",
                     "torpor_tokens", "torpor_folds_total", "torpor_fold_seconds",
                     "torpor_group_commit_batch_size_count", "torpor_group_commit_seconds",
                     "torpor_mailbox_refusals_total", "torpor_http_requests_total",
                     "process_resident_memory_bytes"):
            assert name in text, name
        commits = [line for line in text.splitlines()
                   if line.startswith("torpor_group_commit_batch_size_count")]
        assert float(commits[0].split()[-1]) > 0


def client_url(client: object) -> str:
    return f"http://{client.host}:{client.port}"  # type: ignore[attr-defined]


def test_the_admin_answers_loopback_clients_only_unless_told() -> None:
    from starlette.requests import Request

    from torpor.serve.access import check_admin
    from torpor.serve.problems import Forbidden, Unauthorized

    def request(host: str, token: str | None) -> Request:
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        return Request({"type": "http", "client": (host, 5000), "headers": headers})

    check_admin(request("127.0.0.1", "t"), "t", remote=False)
    check_admin(request("::1", "t"), "t", remote=False)
    with pytest.raises(Forbidden):
        check_admin(request("10.1.2.3", "t"), "t", remote=False)
    check_admin(request("10.1.2.3", "t"), "t", remote=True)
    with pytest.raises(Unauthorized):
        check_admin(request("127.0.0.1", "wrong"), "t", remote=False)
    with pytest.raises(Forbidden):
        check_admin(request("127.0.0.1", "t"), None, remote=False)


async def test_a_model_still_wrapped_in_instrument_is_counted_once() -> None:
    """The deprecated wrapper keeps working, and measures nothing while the app's observer
    does: each call is counted once."""
    from torpor.serve import Metrics

    metrics = Metrics(process=False)
    model = metrics.instrument(ScriptedModel(["fine", [Text("oh"), Call("nope", {})]], loop=True))
    async with Runtime("sqlite://", model=model) as rt, served(rt, metrics=metrics) as (
        _, client, _app
    ):
        for text in ("one", "two"):
            conn, response = await post_message(client, "m", text)
            [e async for e in response.events()]
            await conn.close()
        _, scrape = await client.open("GET", "/metrics", token=ADMIN)
        text = (await scrape.read()).decode()
        assert 'torpor_time_to_first_token_seconds_count{model="scripted"} 3.0' in text
        assert 'torpor_model_call_seconds_count{model="scripted"} 3.0' in text
        assert 'torpor_tokens_total{direction="out",model="scripted"}' in text


async def test_tokens_in_are_what_the_runtime_counted_for_each_context() -> None:
    """A model that reports no prompt tokens: the metric takes the count the runtime made
    when it assembled the context (the audit's estimate), without walking the context."""
    from torpor.serve import Metrics
    from torpor.serve.observer import observe_runtime

    for wrapped in (False, True):  # the app's observer, the deprecated wrapper
        metrics = Metrics(process=False)
        model = metrics.instrument(EchoModel()) if wrapped else EchoModel()
        async with Runtime("sqlite://", model=model,
                           agent=AgentConfig(system_prompt="Be brief. " * 20)) as rt:
            if not wrapped:
                observe_runtime(rt, metrics)
            for text in ("one", "two", "three"):
                await (await rt.send("m", text)).result()
            calls = await rt.store.model_calls("m")
        counted = metrics.registry.get_sample_value(
            "torpor_tokens_total", {"model": "echo", "direction": "in"})
        assert len(calls) == 3 and all(c.reported_prompt_tokens is None for c in calls)
        assert counted == sum(c.estimated_prompt_tokens for c in calls) > 0


async def test_graceful_shutdown_ends_open_streams_with_the_logged_abort() -> None:
    from torpor.serve import app, bearer_token, service_of
    from torpor.serve.client import Client
    from torpor.store import open_store

    reached = anyio.Event()
    model = ScriptedModel([[Text("half"), Signal(reached), Wait(anyio.Event())]])
    import tempfile
    from pathlib import Path

    from serve_support import serving

    with tempfile.TemporaryDirectory() as tmp:
        url_db = f"sqlite:///{Path(tmp) / 'log.db'}"
        rt = Runtime(url_db, model=model)  # not entered: the app owns it
        application = app(rt, authorize=bearer_token(TOKEN), admin_token=ADMIN)
        async with serving(application) as url:
            client = Client(url, TOKEN)
            conn, response = await post_message(client, "g", "long one")
            await reached.wait()
            draining = service_of(application).shutdown(0.0)  # no time to finish
            with pytest.raises(HTTPStatusError) as info:
                await client.call("POST", "/v1/conversations/g/messages",
                                  json_body={"text": "more"})
            assert info.value.status == 503
            events = [e async for e in response.events()]
            await conn.close()
            await draining
        assert kinds(events) == ["user", "delta", "aborted"]
        assert events[-1].json()["body"] == {
            "reason": "shutdown", "partial_text": "half", "detail": "runtime stopped",
            "error": None, "retryable": True, "retry_after": None, "status": None,
            "message": "The service stopped before the answer was complete; try again shortly.",
        }
        async with open_store(url_db) as store:
            logged = await store.read_since("g", 0)
        assert logged[-1].kind == "aborted" and logged[-1].body.partial_text == "half"


async def test_a_tracked_turn_costs_no_task_and_ended_ones_are_let_go() -> None:
    from torpor.serve import Metrics, Service

    gate = anyio.Event()
    model = ScriptedModel([[Wait(gate), Text("done")]], loop=True)
    async with Runtime("sqlite://", model=model) as rt:
        service = Service(rt, Metrics(process=False), shutdown_grace=5)
        turn = await rt.send("c", "hello")
        tasks = len(asyncio.all_tasks())
        assert service.track(turn) is False
        assert len(asyncio.all_tasks()) == tasks  # its done() is read, not waited on
        assert service.track(turn) is True  # a keyed retry handed the same running turn
        assert service.turns_in_flight == 1
        gate.set()
        await turn.result()
        assert service.turns_in_flight == 0 and service.track(turn) is False
        for n in range(200):  # ended turns do not pile up
            ended = await rt.send(f"c{n}", "hi")
            service.track(ended)
            await ended.result()
        assert len(service._inflight) <= 64


async def test_shutdown_lets_turns_in_flight_finish_within_the_grace() -> None:
    from torpor.serve import app, bearer_token, service_of
    from torpor.serve.client import Client

    reached, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("start "), Signal(reached), Wait(go), Text("end")]])
    rt = Runtime("sqlite://", model=model)
    application = app(rt, authorize=bearer_token(TOKEN), admin_token=ADMIN)
    from serve_support import serving

    async with serving(application) as url:
        client = Client(url, TOKEN)
        conn, response = await post_message(client, "f", "go")
        await reached.wait()
        draining = service_of(application).shutdown(30.0)
        go.set()
        events = [e async for e in response.events()]
        await conn.close()
        await draining
    assert kinds(events)[-1] == "assistant"
    assert events[-1].json()["body"]["text"] == "start end"


async def test_mounted_in_a_host_app() -> None:
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.routing import Mount

    from torpor.serve import app, bearer_token
    from torpor.serve.client import Client

    rt = Runtime("sqlite://")
    chat = app(rt, authorize=bearer_token(TOKEN), admin_token=ADMIN, page=False)

    @asynccontextmanager
    async def lifespan(host: Starlette):  # type: ignore[no-untyped-def]
        async with chat.router.lifespan_context(chat):
            yield

    host = Starlette(routes=[Mount("/chat", chat)], lifespan=lifespan)
    from serve_support import serving

    async with serving(host) as url:
        client = Client(url + "/chat", TOKEN)
        conn, response = await post_message(client, "m", "mounted")
        events = [e async for e in response.events()]
        await conn.close()
        assert events[-1].json()["body"]["text"] == "echo: mounted"
