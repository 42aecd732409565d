"""torpor's own SSE response: the wire format, pings from the shared timer, a client
that leaves, HEAD, draining, and nothing per stream but the request's own task."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from serve_support import ADMIN, TOKEN, serving

from torpor import Runtime, ScriptedModel
from torpor.llm.scripted import Signal, Text, Wait
from torpor.serve import app, bearer_token, service_of
from torpor.serve.client import Client
from torpor.serve.sse_response import EventStream, Streams, encode_event

PING = re.compile(rb": ping - \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\+00:00\r\n\r\n")


class Stream:
    """A raw HTTP/1.1 GET of an event stream: its head, then its body chunk by chunk."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.head = b""

    @classmethod
    async def open(cls, url: str, path: str, method: str = "GET") -> Stream:
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n"
                     "Accept: text/event-stream\r\n\r\n".encode())
        stream = cls(reader, writer)
        stream.head = await reader.readuntil(b"\r\n\r\n")
        return stream

    async def chunk(self) -> bytes:
        """The next chunk of the body (b"" at its end)."""
        size = int(await self.reader.readuntil(b"\r\n"), 16)
        data = await self.reader.readexactly(size + 2)
        return data[:-2]

    async def events_to_end(self) -> list[bytes]:
        out = []
        while chunk := await self.chunk():
            if not chunk.startswith(b":"):
                out.append(chunk)
        return out

    def close(self) -> None:
        self.writer.transport.abort()


def kind(frame: bytes) -> str:
    return re.search(rb"^event: (\w+)", frame, re.M).group(1).decode()  # type: ignore[union-attr]


def is_request(task: asyncio.Task[object]) -> bool:
    """A server's request task (uvicorn runs one per request)."""
    return getattr(task.get_coro(), "__qualname__", "") == "RequestResponseCycle.run_asgi"


@asynccontextmanager
async def hosted(rt: Runtime, **kwargs: object) -> AsyncIterator[tuple[str, Client, object]]:
    application = app(rt, authorize=bearer_token(TOKEN), admin_token=ADMIN, **kwargs)  # type: ignore[arg-type]
    async with serving(application) as url:
        yield url, Client(url, TOKEN), application


def test_events_are_framed_as_sse_starlette_framed_them() -> None:
    assert encode_event(b'{"a":1}', event="user", id="0", retry=1000) == (
        b'id: 0\r\nevent: user\r\ndata: {"a":1}\r\nretry: 1000\r\n\r\n')
    assert encode_event(b"x", event="delta", id="3.12") == (
        b"id: 3.12\r\nevent: delta\r\ndata: x\r\n\r\n")
    assert encode_event(b"one\ntwo\r\nthree\rfour", event="e") == (
        b"event: e\r\ndata: one\r\ndata: two\r\ndata: three\r\ndata: four\r\n\r\n")
    assert encode_event(b"{}", event="a\nb", id="1\r\n") == (
        b"id: 1\r\nevent: ab\r\ndata: {}\r\n\r\n")


async def test_an_idle_stream_gets_pings_from_the_shared_timer() -> None:
    async with Runtime("sqlite://") as rt, hosted(rt, ping_interval=0.05) as (url, _, _app):
        stream = await Stream.open(url, "/v1/conversations/quiet/stream")
        head = stream.head.lower()
        assert head.startswith(b"http/1.1 200 ")
        for header in (b"cache-control: no-store\r\n", b"connection: keep-alive\r\n",
                       b"x-accel-buffering: no\r\n", b"transfer-encoding: chunked\r\n",
                       b"content-type: text/event-stream; charset=utf-8\r\n"):
            assert header in head
        with anyio.fail_after(10):
            pings = [await stream.chunk() for _ in range(3)]
        assert all(PING.fullmatch(p) for p in pings), pings
        stream.close()


async def test_a_client_that_leaves_an_idle_stream_frees_its_follower_and_its_task() -> None:
    async with Runtime("sqlite://") as rt, hosted(rt, ping_interval=0.05) as (
        url, client, application
    ):
        service = service_of(application)
        await client.call("GET", "/healthz")  # the server has started (its own tasks too)
        before = asyncio.all_tasks()
        stream = await Stream.open(url, "/v1/conversations/left/stream")
        with anyio.fail_after(10):
            assert PING.fullmatch(await stream.chunk())  # the stream waits: it pings
        # one task for the open stream, the request's own: no watcher, no ping task
        tasks = asyncio.all_tasks() - before
        assert len(tasks) == 1 and is_request(next(iter(tasks))), tasks
        assert len(service.streams) == 1 and list(rt._host.followers_by_id) == ["left"]
        stream.close()  # uvicorn's send to it would return quietly: receive() must tell
        done, _ = await asyncio.wait(tasks, timeout=10)
        assert done == tasks
        assert len(service.streams) == 0
        assert service.server_stats()["open_streams"] == 0
        assert rt._host.followers_by_id == {}


def awaiting(task: asyncio.Task[object]) -> list[str]:
    """Where each coroutine a task waits in was defined, outermost first."""
    where, coro = [], task.get_coro()
    while hasattr(coro, "cr_code"):
        where.append(f"{coro.cr_code.co_filename}:{coro.cr_code.co_qualname}")
        coro = coro.cr_await
    return where


async def test_an_open_stream_holds_none_of_the_routing_layers() -> None:
    async with Runtime("sqlite://") as rt, hosted(rt, ping_interval=0.05) as (
        url, client, _app
    ):
        await client.call("GET", "/healthz")
        before = asyncio.all_tasks()
        stream = await Stream.open(url, "/v1/conversations/r/stream")
        with anyio.fail_after(10):
            assert PING.fullmatch(await stream.chunk())  # it waits for events
        (task,) = asyncio.all_tasks() - before
        stack = awaiting(task)
        assert stack[-1].endswith("EventStream.__call__"), stack
        assert not [f for f in stack if "starlette/routing" in f or "_exception_handler" in f
                    or "Deferred" in f], stack
        stream.close()


async def test_head_of_a_stream_answers_its_headers_and_keeps_no_follower() -> None:
    async with Runtime("sqlite://") as rt, hosted(rt) as (url, _, application):
        stream = await Stream.open(url, "/v1/conversations/h/stream", method="HEAD")
        assert stream.head.lower().startswith(b"http/1.1 200 ")
        assert b"content-type: text/event-stream; charset=utf-8" in stream.head.lower()
        # no body: the response is complete and the connection serves the next request
        stream.writer.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        with anyio.fail_after(10):
            after = await stream.reader.readuntil(b"\r\n\r\n")
        assert after.startswith(b"HTTP/1.1 200 "), after
        assert rt._host.followers_by_id == {}
        assert len(service_of(application).streams) == 0
        stream.close()


async def test_draining_ends_a_follower_stream_after_its_final_event() -> None:
    # The host runs the runtime, so draining does not stop it: the open stream ends
    # because the app ends it, once it has sent the answer the log holds.
    reached, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("start "), Signal(reached), Wait(go), Text("end")]])
    async with Runtime("sqlite://", model=model) as rt, hosted(rt) as (url, client, application):
        stream = await Stream.open(url, "/v1/conversations/d/stream")
        await client.call("POST", "/v1/conversations/d/messages", json_body={"text": "go"},
                          headers={"Accept": "application/json"}, expect=(202,))
        await reached.wait()
        draining = service_of(application).shutdown(30.0)
        go.set()
        with anyio.fail_after(10):
            frames = await stream.events_to_end()
            await draining
        assert [kind(f) for f in frames] == ["user", "delta", "delta", "assistant"]
        assert b'"text":"start end"' in frames[-1]
        assert rt._host.followers_by_id == {}
        stream.close()


async def test_draining_an_owned_runtime_ends_an_idle_follower_with_the_logged_abort() -> None:
    reached = anyio.Event()
    model = ScriptedModel([[Text("half"), Signal(reached), Wait(anyio.Event())]])
    rt = Runtime("sqlite://", model=model)  # not entered: the app owns it
    async with hosted(rt) as (url, client, application):
        stream = await Stream.open(url, "/v1/conversations/o/stream")
        await client.call("POST", "/v1/conversations/o/messages", json_body={"text": "go"},
                          headers={"Accept": "application/json"}, expect=(202,))
        await reached.wait()
        with anyio.fail_after(10):
            await service_of(application).shutdown(0.0)
            frames = await stream.events_to_end()
        assert [kind(f) for f in frames] == ["user", "delta", "aborted"]
        assert b'"reason":"shutdown","partial_text":"half"' in frames[-1]
        stream.close()


class Held:
    """A source holding frames; closing it does not end it (only the stream's stop can)."""

    def __init__(self, *frames: bytes) -> None:
        self.frames = list(frames)
        self.closed = 0

    async def open(self) -> None:
        pass

    def take(self) -> bytes | None:
        return self.frames.pop(0) if self.frames else None

    def wake_on(self, future: asyncio.Future[None] | None) -> None:
        pass

    def close(self) -> None:
        self.closed += 1


async def test_a_stopped_stream_sends_what_its_source_holds_then_ends() -> None:
    source = Held(b"one", b"two")
    stream = EventStream(source, Streams(60.0))
    stream.stop()  # the server drained before the stream got to run
    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    async def receive() -> dict[str, object]:
        await asyncio.get_running_loop().create_future()  # the client never leaves
        raise AssertionError

    with anyio.fail_after(10):
        await stream({"type": "http", "method": "GET"}, receive, send)  # type: ignore[arg-type]
    assert sent[0]["type"] == "http.response.start"
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"one", True), (b"two", True), (b"", False)]
    assert source.closed >= 1  # released
