"""torpor.client over real HTTP: a server on uvicorn on 127.0.0.1, and between the two a TCP
proxy (tests/cut_proxy.py) that cuts connections mid-stream or drops a response."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from cut_proxy import CutProxy
from serve_support import TOKEN, served, service_of

import torpor.client as tc
from torpor import (
    AgentConfig,
    Busy,
    EchoModel,
    ExternalTool,
    InvalidInput,
    ModelRateLimited,
    Runtime,
    RuntimeConfig,
    ScriptedModel,
    TorporError,
    TurnAborted,
    UnknownCall,
    UnknownConversation,
)
from torpor.client.sse import SSEParser
from torpor.client.turn import TurnFilter
from torpor.events import (
    AssistantMessage,
    Event,
    Suspended,
    ToolResult,
    UserMessage,
)
from torpor.llm.scripted import Call, Fail, Text, Wait

APPROVE = ExternalTool("approve", "Ask a person.", {"type": "object", "properties": {}})
# Astral characters, a ZWJ family, a flag, skin tones and combining marks: what offsets in
# code points and UTF-16 units disagree on, and what a cut inside a character breaks.
PIECES = ["Hé 👋🏽 ", "la famille 👨‍👩‍👧 ", "e\u0301t\u0301é 🇫🇷 ",
          "\U0001d518\U0001d52b\U0001d526 ",
          "mi\u0308d 🎉", " done 🧪."]


@asynccontextmanager
async def through_proxy(rt: Runtime, **kwargs: Any) -> AsyncIterator[
        tuple[CutProxy, tc.Client, str, Any]]:
    """The app served, a proxy in front of it and a client of the proxy (no reconnect wait:
    the tests wait on nothing but events)."""
    async with served(rt, **kwargs) as (url, _, application), CutProxy(url) as proxy, \
            tc.Client(proxy.url, token=TOKEN, reconnect_delay=0) as client:
        yield proxy, client, url, application


def gated(*turns: list[str]) -> tuple[ScriptedModel, list[anyio.Event]]:
    """A model whose answers stream piece by piece, each piece after the test lets it."""
    gates: list[anyio.Event] = []
    scripts = []
    for pieces in turns:
        script: list[Any] = []
        for piece in pieces[:-1]:
            gates.append(anyio.Event())
            script += [Text(piece), Wait(gates[-1])]
        scripts.append([*script, Text(pieces[-1])])
    return ScriptedModel(scripts), gates


def release_next(gates: list[anyio.Event]) -> None:
    for gate in gates:
        if not gate.is_set():
            gate.set()
            return


def deltas(items: list[Any]) -> str:
    return "".join(i.text for i in items if isinstance(i, tc.Delta))


@pytest.mark.parametrize("mid_char", [False, True], ids=["after-event", "inside-an-emoji"])
async def test_a_turn_rebuilds_its_answer_through_three_cuts(mid_char: bool) -> None:
    model, gates = gated(PIECES)
    async with Runtime("sqlite://", model=model) as rt, through_proxy(rt) as (proxy, c, _, _a):
        proxy.cut_deltas, proxy.mid_char = 3, mid_char
        turn = await c.send("cut", "go")
        items = []
        async for item in turn:
            items.append(item)
            if isinstance(item, tc.Delta):
                release_next(gates)  # one more piece only once this one came through
        answer = await turn.result()
        logged = await rt.history("cut")
    assert proxy.cuts == 3
    assert isinstance(answer, AssistantMessage) and answer.text == "".join(PIECES)
    assert deltas(items) == answer.text  # no character twice, none missing
    events = [i for i in items if isinstance(i, Event)]
    assert [(e.position, e.kind) for e in events] == [(0, "user"), (1, "assistant")]
    assert [e.body for e in events] == [e.body for e in reversed(logged)]
    assert all(e.turn == turn.number == 1 for e in events)
    sent = bytes(proxy.sent).lower()
    assert sent.count(b"get /v1/conversations/cut/stream?turn=1 ") == 3  # resumed, turn only
    if mid_char:  # every cut event was lost whole: each resume is from the user message
        assert sent.count(b"last-event-id: 0\r\n") == 3
    else:
        assert b"last-event-id: 0." in sent  # from within the draft


async def test_send_is_retried_with_its_key_when_the_response_is_lost() -> None:
    async with Runtime("sqlite://", model=EchoModel()) as rt, \
            through_proxy(rt) as (proxy, c, _, _a):
        proxy.drop_responses = 1  # the server logs the message; the client hears nothing
        turn = await c.send("k", "hello 👋🏽")
        answer = await turn.result()
        logged = await rt.history("k")
    assert proxy.drops == 1
    assert isinstance(answer, AssistantMessage) and answer.text.endswith("hello 👋🏽")
    assert turn.key is not None  # made by the client, sent with both attempts
    assert bytes(proxy.sent).count(f"Idempotency-Key: {turn.key}".encode()) == 2
    assert [e.kind for e in logged] == ["assistant", "user"]  # the key dedup'd the retry


async def test_follow_resumes_through_cuts_and_sees_each_event_once() -> None:
    first, second = PIECES[:3], PIECES[3:]
    model, gates = gated(first, second)
    async with Runtime("sqlite://", model=model) as rt, \
            through_proxy(rt) as (proxy, c, url, _a), tc.Client(url, token=TOKEN) as direct:
        proxy.cut_deltas = 3
        follow = c.follow("f", after=-1)  # a conversation that has not begun yet
        turns = [await direct.send("f", "one")]
        items: list[Any] = []
        async for item in follow:
            items.append(item)
            if isinstance(item, tc.Delta):
                release_next(gates)
            elif isinstance(item, Event) and item.kind == "assistant":
                if item.turn == 2:
                    break
                turns.append(await direct.send("f", "two"))
        await follow.aclose()
        for turn in turns:
            await turn.aclose()
        logged = list(reversed(await rt.history("f")))
    assert proxy.cuts == 3
    events = [i for i in items if isinstance(i, Event)]
    assert [e.position for e in events] == [0, 1, 2, 3]  # each once, in order
    assert [e.body for e in events] == [e.body for e in logged]
    # each answer's deltas add up to its logged text
    texts, draft = [], ""
    for item in items:
        if isinstance(item, tc.Delta):
            draft += item.text
        elif isinstance(item, Event) and item.kind == "assistant":
            texts.append(draft)
            draft = ""
    assert texts == ["".join(first), "".join(second)]
    assert follow.last_id == "3"


async def test_a_reconnect_waits_the_servers_retry(caplog: pytest.LogCaptureFixture) -> None:
    model, gates = gated(PIECES[:3])
    async with Runtime("sqlite://", model=model) as rt, served(rt) as (url, _, _a), \
            CutProxy(url) as proxy, tc.Client(proxy.url, token=TOKEN) as c:
        proxy.rewrite = (b"retry: 1000", b"retry: 0007")  # same length: chunk sizes hold
        proxy.cut_deltas = 1
        caplog.set_level(logging.DEBUG, logger="torpor.client")
        turn = await c.send("r", "go")
        async for item in turn:
            if isinstance(item, tc.Delta):
                release_next(gates)
        await turn.result()
        await c.turn("r", 1, after="-1").result()  # a first connection: no wait at all
    delays = [r.delay for r in caplog.records if r.getMessage().startswith("stream_reconnect")]
    assert proxy.cuts == 1 and delays == [0.007]


async def test_errors_are_the_runtimes_types() -> None:
    config = RuntimeConfig(mailbox_bound=1)
    gate = anyio.Event()
    model = ScriptedModel([[Wait(gate), Text("done")]], loop=True)
    async with Runtime("sqlite://", model=model, config=config) as rt, \
            through_proxy(rt) as (_p, c, url, application):
        with pytest.raises(UnknownConversation) as unknown:
            await c.history("nobody")
        assert (problem := tc.problem_of(unknown.value)) is not None and problem.status == 404
        with pytest.raises(UnknownConversation):
            await c.resolve("nobody", "call-1", "x")
        with pytest.raises(InvalidInput) as invalid:
            await c.send("b", "a\x00b")
        assert invalid.value.what == "text"
        async with tc.Client(url, token="wrong") as stranger:
            with pytest.raises(tc.Unauthorized) as denied:
                await stranger.send("b", "hi")
            assert denied.value.status == 401 and isinstance(denied.value, TorporError)
            with pytest.raises(tc.Unauthorized):
                await anext(stranger.follow("b", after=-1))
        # 429 Busy with Retry-After: one turn runs, one message waits, the next is refused
        running = await c.send("b", "1")
        waiting = await c.send("b", "2")
        with pytest.raises(Busy) as busy:
            await c.send("b", "3")
        assert (problem := tc.problem_of(busy.value)) is not None
        assert (problem.status, problem.retry_after) == (429, 1.0)
        with pytest.raises(UnknownCall):
            await c.resolve("b", "no-such-call", "x")
        gate.set()
        assert (await running.result()).text == "done"
        # the second POST's stream: only its own turn's items, whatever the server sends
        items = [item async for item in waiting]
        assert [(e.turn, e.kind) for e in items if isinstance(e, Event)] == [
            (2, "user"), (2, "assistant")]
        if all(d.turn is not None for d in items if isinstance(d, tc.Delta)):
            assert deltas(items) == "done"  # a server that tags deltas with their turn
        assert isinstance(await waiting.result(), AssistantMessage)
        assert (running.number, waiting.number) == (1, 2)
        # 503 Draining with Retry-After, while the server shuts down
        draining = service_of(application).shutdown(5.0)
        with pytest.raises(tc.Draining) as drained:
            await c.send("b", "4")
        assert (drained.value.status, drained.value.retry_after) == (503, 5.0)
        await draining


async def test_a_forbidden_conversation_is_forbidden() -> None:
    from torpor.serve import bearer_tokens

    authorize = bearer_tokens({"tok-alice": "alice"})
    async with Runtime("sqlite://", model=EchoModel()) as rt, \
            served(rt, authorize=authorize) as (url, _, _a), \
            tc.Client(url, token="tok-alice") as alice:
        assert isinstance(await (await alice.send("alice:1", "hi")).result(), AssistantMessage)
        with pytest.raises(tc.Forbidden) as forbidden:
            await alice.send("bob:1", "hi")
        assert forbidden.value.status == 403
        with pytest.raises(tc.Forbidden):
            await alice.history("bob:1")


async def test_an_aborted_turn_raises_turn_aborted_with_its_fields() -> None:
    error = ModelRateLimited("upstream said slow down", status=429, retry_after=3)
    model = ScriptedModel([[Text("parti"), Fail(error)]])
    async with Runtime("sqlite://", model=model) as rt, through_proxy(rt) as (_p, c, _u, _a):
        turn = await c.send("a", "go")
        with pytest.raises(TurnAborted) as aborted:
            await turn.result()
    fields = aborted.value
    assert (fields.reason, fields.partial_text) == ("model_error", "parti")
    assert (fields.error_type, fields.retryable, fields.retry_after, fields.status) == (
        "ModelRateLimited", True, 3.0, 429)
    assert fields.message == "The model provider is rate limiting requests; try again in a moment."


async def test_resolve_cancel_and_history() -> None:
    model = ScriptedModel([[Text("asking"), Call("approve", {}, id="call-1")],
                           "approved, done", [Text("long"), Wait(anyio.Event())]])
    agent = AgentConfig(tools=[APPROVE])
    async with Runtime("sqlite://", model=model, agent=agent) as rt, \
            through_proxy(rt) as (_p, c, _u, _a):
        asked = await c.send("s", "deploy?")
        suspended = await asked.result()
        assert isinstance(suspended, Suspended) and suspended.call_ids == ("call-1",)
        continuation = await c.resolve("s", "call-1", "yes")
        assert continuation is not None
        items = [item async for item in continuation]
        assert isinstance(items[0], Event) and isinstance(items[0].body, ToolResult)
        answer = await continuation.result()
        assert isinstance(answer, AssistantMessage) and answer.text == "approved, done"
        # the same key again: the first answer's outcome, not UnknownCall
        again = await c.resolve("s", "call-1", "yes", key=continuation.key)
        assert again is not None and (await again.result()) == answer
        # cancel a turn mid-answer
        long = await c.send("s", "more")
        assert isinstance(await anext(long), Event)  # its user message
        assert isinstance(await anext(long), tc.Delta)
        assert await c.cancel("s") is True
        with pytest.raises(TurnAborted) as cancelled:
            await long.result()
        assert cancelled.value.reason == "cancelled" and cancelled.value.partial_text == "long"
        assert await c.cancel("s") is False
        # history, a page at a time, newest first
        page = await c.history("s", limit=2)
        logged = await rt.history("s", limit=100)
        assert [e.position for e in page.events] == [logged[0].position, logged[1].position]
        assert page.before == logged[1].position
        every = [e async for e in c.scroll("s", limit=3)]
        assert [(e.position, e.turn, e.body) for e in every if isinstance(e, Event)] == [
            (e.position, e.turn, e.body) for e in logged]
        assert len(every) == len(logged)
        assert isinstance(every[-1], Event) and every[-1].body == UserMessage("deploy?")


async def test_a_turn_is_picked_up_by_its_number() -> None:
    model = ScriptedModel(["first answer 👋🏽", "second answer"])
    async with Runtime("sqlite://", model=model) as rt, through_proxy(rt) as (_p, c, _u, _a):
        sent = await c.send("p", "one")
        items = [item async for item in sent]
        await (await c.send("p", "two")).result()
        again = c.turn("p", 1, after="-1")  # another process, from the conversation's start
        replayed = [item async for item in again]
        assert [(e.position, e.kind) for e in replayed if isinstance(e, Event)] == [
            (0, "user"), (1, "assistant")]
        assert (await again.result()).text == "first answer 👋🏽"  # logged: no deltas again
        tagged = [d for d in items if isinstance(d, tc.Delta)]
        if tagged and tagged[0].turn is not None:  # a server with turn-scoped streams
            # from the turn's start without an id; and from past its end: the log's end
            assert (await c.turn("p", 1).result()).text == "first answer 👋🏽"
            over = c.turn("p", 1, after="1")
            assert [item async for item in over] == []
            assert (await over.result()).text == "first answer 👋🏽"


async def test_follow_from_now_starts_at_the_head() -> None:
    async with Runtime("sqlite://", model=EchoModel()) as rt, \
            through_proxy(rt) as (_p, c, _u, _a):
        await (await c.send("n", "before")).result()
        async with c.follow("n") as follow:  # from now: what is logged from here on
            turn = await c.send("n", "after")
            first = await anext(follow)
            await turn.aclose()
    assert isinstance(first, Event) and (first.position, first.body) == (
        2, UserMessage("after"))


async def test_an_unreachable_server_raises_after_the_retries() -> None:
    from torpor.serve import bind

    sock = bind("127.0.0.1", 0)  # a port nobody listens on once closed
    port = sock.getsockname()[1]
    sock.close()
    async with tc.Client(f"http://127.0.0.1:{port}", retries=2, reconnect_delay=0) as c:
        with pytest.raises(tc.ServerUnreachable) as unreachable:
            await c.send("u", "hello")
        with pytest.raises(tc.ServerUnreachable):
            await anext(c.follow("u", after=-1))
    assert isinstance(unreachable.value.__cause__, httpx.ConnectError)


def test_turn_filter_keeps_its_own_items_only() -> None:
    def ev(position: int, turn: int, body: Any) -> Event:
        return Event("c", position, turn, 1, 0, body)

    mine = TurnFilter(2)
    stream = [
        ev(3, 2, UserMessage("second")),
        tc.Delta("first's rest", turn=1),  # a server that tags deltas
        ev(4, 1, AssistantMessage("first")),
        tc.Delta("sec", turn=2),
        ev(2, 1, UserMessage("late replay")),  # seen before: positions only grow
        ev(5, 2, AssistantMessage("sec")),
    ]
    assert [x for x in stream if mine.mine(x)] == [stream[0], stream[3], stream[5]]
    untagged = TurnFilter(2)  # an older server: deltas go to the turn whose events surround
    stream = [
        ev(3, 1, AssistantMessage("", tool_calls=())),  # turn 1 ended
        ev(4, 2, UserMessage("second")),
        tc.Delta("two"),
        ev(5, 3, ToolResult("x", "t", "r")),  # turn 3 runs (its tool result)
        tc.Delta("three"),
    ]
    assert [x for x in stream if untagged.mine(x)] == [stream[1], stream[2]]


def test_an_event_cut_off_never_moves_the_last_id() -> None:
    parser = SSEParser()
    assert parser.feed("id: 0.3") is None and parser.feed("event: delta") is None
    assert parser.feed('data: {"text": "abc"}') is None
    event = parser.feed("")
    assert event is not None and event.id == parser.last_id == "0.3"
    for line in ("id: 0.5", "event: delta", 'data: {"text": "de"'):
        parser.feed(line)
    parser.reset()  # the connection dropped before the blank line
    assert parser.last_id == "0.3"
    parser.feed("retry: 250")
    parser.feed(": ping")
    assert parser.retry_ms == 250 and parser.feed("") is None


def test_the_client_imports_without_starlette_or_uvicorn() -> None:
    code = ("import sys, torpor.client; "
            "print(sorted(m for m in ('starlette', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


# -- a server that is not torpor (a proxy's page, a redirect, a stream without end) ----------

@asynccontextmanager
async def answering(answer: bytes, tail: bytes = b"", repeat: int = 0) -> AsyncIterator[str]:
    """A loopback HTTP server that reads a request and writes ``answer``, then ``tail``
    ``repeat`` times, then closes; yields its base URL."""
    import asyncio

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                           if h.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(answer)
            for _ in range(repeat):
                writer.write(tail)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client gave up on us: what the test wants
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


def _head(status: str, content_type: str, extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\nconnection: close\r\n"
            f"{extra}\r\n").encode()


@pytest.mark.parametrize("answer", [
    _head("200 OK", "text/html") + b"<html>sign in</html>",
    _head("302 Found", "text/html", "location: /login\r\n"),
    _head("202 Accepted", "application/json") + b'{"queued": true}',
], ids=["html-page", "redirect", "json-202"])
async def test_a_send_answered_without_a_stream_is_a_typed_error(answer: bytes) -> None:
    """Not an AssertionError: the send was answered by something that is not torpor."""
    async with answering(answer) as url, tc.Client(url, retries=0) as c:
        with pytest.raises(tc.HTTPError) as refused:
            await c.send("a", "hi")
        assert refused.value.problem.error == "NotAnEventStream"
        with pytest.raises(tc.HTTPError):
            await c.resolve("a", "call", "ok")  # resolve's only stream-less answer is 202 JSON


async def test_a_resolve_answered_202_has_no_continuation() -> None:
    answer = _head("202 Accepted", "application/json") + \
        b'{"resolved": "call", "continuation": false, "replayed": false}'
    async with answering(answer) as url, tc.Client(url, retries=0) as c:
        assert await c.resolve("a", "call", "ok") is None


@pytest.mark.parametrize("tail", [b"x" * 4096, b"data: " + b"x" * 1000 + b"\n"],
                         ids=["a-line-without-end", "an-event-without-end"])
async def test_a_stream_without_end_of_line_or_event_raises_instead_of_growing(
        tail: bytes) -> None:
    """A server that never ends a line (or an event) costs the client at most its cap."""
    head = _head("200 OK", "text/event-stream")
    async with answering(head, tail, repeat=10_000) as url, \
            tc.Client(url, retries=0, max_event_chars=100_000) as c:
        with pytest.raises(tc.EventTooLong):
            await anext(c.follow("a", after=-1))
        with pytest.raises(tc.EventTooLong):
            await c.send("a", "hi")


async def test_a_history_page_of_the_wrong_shape_is_an_empty_page() -> None:
    answer = _head("200 OK", "application/json") + b'{"events": 5, "before": "x"}'
    async with answering(answer) as url, tc.Client(url, retries=0) as c:
        page = await c.history("a")
        assert page.events == [] and page.before is None


async def test_lines_end_at_crlf_lf_or_cr_split_anywhere() -> None:
    from torpor.client.sse import lines

    async def chunks(*parts: str) -> AsyncIterator[str]:
        for part in parts:
            yield part

    got = [line async for line in lines(chunks("a\r", "\nb\n", "\r", "\n", "\r", "c\rd",
                                               "e\r\n\n", "cut off"))]
    # "\r" then "\n" is one end; the lone "\n" after the CRLF is an empty line; the text
    # after the last end never completes
    assert got == ["a", "b", "", "", "c", "de", ""]
    with pytest.raises(tc.EventTooLong):
        [line async for line in lines(chunks("ab", "cd", "e\n"), limit=4)]
    assert [line async for line in lines(chunks("ab", "cd\n"), limit=4)] == ["abcd"]
