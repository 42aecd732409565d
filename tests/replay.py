"""A local HTTP server that replays provider responses in their documented wire formats.

The adapters under test run through the official SDK clients pointed at this
server's ``base_url``: a real client, a real socket, a real SSE stream. Each
request takes the next scripted :class:`Reply`; its body is written chunk by
chunk (one ``write`` + ``drain`` per SSE event, HTTP/1.1 chunked encoding), and a
reply can cut the connection after some chunks or hold it open until the
client goes away (what a cancel must cause). Every request is recorded with
its raw body bytes, so a test can compare payloads byte for byte.

The wire formats follow the providers' documentation: OpenAI Chat Completions
``chat.completion.chunk`` events (``data: {...}`` lines, tool-call argument
fragments, usage in a last chunk with empty ``choices`` when
``stream_options.include_usage`` is set, ``data: [DONE]``), and Anthropic
Messages events (``message_start``, ``content_block_start``, ``content_block_delta``
with ``text_delta`` / ``input_json_delta``, ``content_block_stop``,
``message_delta`` with usage, ``message_stop``, ``ping``, ``error``).

Only loopback: the server binds 127.0.0.1. Run as a script (``python
tests/replay.py``) it serves a fixed text reply forever and prints its port,
for the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Recorded",
    "Reply",
    "ReplayServer",
    "anthropic_error",
    "anthropic_stream",
    "json_reply",
    "openai_error",
    "openai_stream",
]


@dataclass
class Reply:
    """One scripted response. ``chunks`` are written one by one (chunked encoding).

    ``cut_after``: drop the connection after that many chunks (no terminating
    chunk: the body is cut short). ``hold_after``: after that many chunks, stop
    writing and wait for the client to close the connection.
    """

    chunks: Sequence[bytes]
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "text/event-stream"
    cut_after: int | None = None
    hold_after: int | None = None


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    started: float = 0.0  # perf_counter when the request was read
    finished: float = 0.0  # when the last byte of the reply was written

    def json(self) -> Any:
        return json.loads(self.body)


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 413: "Payload Too Large",
            429: "Too Many Requests", 500: "Internal Server Error", 529: "Overloaded"}


class ReplayServer:
    """``async with ReplayServer() as server``: ``server.url``, ``server.add(reply)``."""

    def __init__(self, default: Callable[[Recorded], Reply] | None = None) -> None:
        self.replies: deque[Reply] = deque()
        self.requests: list[Recorded] = []
        self.default = default
        self.holding = asyncio.Event()  # a reply reached its hold point
        self.disconnected = asyncio.Event()  # the client closed a held stream
        self.cut = asyncio.Event()  # a reply cut its connection
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    async def __aenter__(self) -> ReplayServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        # Closing each connection ends its task through EOF (cancelling the tasks instead
        # would make asyncio log their cancellation as an error).
        for writer in list(self._connections.values()):
            writer.transport.abort()
        for task in list(self._connections):
            with contextlib.suppress(Exception):
                await task
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                self.requests.append(request)
                reply = self.replies.popleft() if self.replies else None
                if reply is None:
                    if self.default is None:
                        reply = json_reply(500, {"error": {"message": "no reply scripted",
                                                           "type": "server_error"}})
                    else:
                        reply = self.default(request)
                if not await self._respond(reply, reader, writer):
                    return
                request.finished = time.perf_counter()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._connections.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _respond(
        self, reply: Reply, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Write one reply; False when the connection is over."""
        head = [f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Status')}",
                f"content-type: {reply.content_type}"]
        head += [f"{k}: {v}" for k, v in reply.headers.items()]
        streamed = reply.content_type == "text/event-stream"
        if streamed:
            head.append("transfer-encoding: chunked")
            head.append("cache-control: no-cache")
        else:
            head.append(f"content-length: {sum(len(c) for c in reply.chunks)}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        if not streamed:
            writer.write(b"".join(reply.chunks))
            await writer.drain()
            return True
        for index, chunk in enumerate(reply.chunks):
            if reply.cut_after is not None and index == reply.cut_after:
                await writer.drain()
                writer.transport.abort()
                self.cut.set()
                return False
            if reply.hold_after is not None and index == reply.hold_after:
                await writer.drain()
                await self._hold(reader)
                return False
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        if reply.cut_after is not None and reply.cut_after >= len(reply.chunks):
            writer.transport.abort()
            self.cut.set()
            return False
        if reply.hold_after is not None and reply.hold_after >= len(reply.chunks):
            await self._hold(reader)
            return False
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    async def _hold(self, reader: asyncio.StreamReader) -> None:
        """Keep the stream open, writing nothing, until the client closes the connection."""
        self.holding.set()
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
        self.disconnected.set()


async def _read_request(reader: asyncio.StreamReader) -> Recorded | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    started = time.perf_counter()
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return Recorded(method, path, headers, body, started)


def json_reply(status: int, body: Any, headers: dict[str, str] | None = None) -> Reply:
    return Reply([json.dumps(body).encode()], status=status, headers=dict(headers or {}),
                 content_type="application/json")


# -- OpenAI Chat Completions -------------------------------------------------------------


def _sse_data(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def openai_stream(
    text: Sequence[str] = (),
    *,
    calls: Sequence[tuple[str, str, Sequence[str]]] = (),
    usage: tuple[int, int, int] | None = (12, 5, 0),
    finish: str | None = None,
    model: str = "gpt-test",
    error: dict[str, Any] | None = None,
    done: bool = True,
) -> list[bytes]:
    """SSE chunks of one streamed chat completion.

    ``text``: content deltas; ``calls``: (id, name, argument fragments) streamed as
    ``delta.tool_calls`` (each call's first chunk carries id, type and name, the
    rest only ``index`` and an ``arguments`` fragment); ``usage``: (prompt,
    completion, cached prompt) tokens in a last chunk with no choices; ``error``:
    an error object sent as a data line after the text (a failure mid-stream).
    """
    base = {"id": "chatcmpl-replay", "object": "chat.completion.chunk", "created": 1_700_000_000,
            "model": model, "system_fingerprint": "fp_replay"}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        extra = {"usage": None} if usage is not None else {}
        return _sse_data({**base, "choices": [choice], **extra})

    out = [chunk({"role": "assistant", "content": "", "refusal": None})]
    out += [chunk({"content": piece}) for piece in text]
    if error is not None:
        out.append(_sse_data({"error": error}))
        return out
    for index, (call_id, name, fragments) in enumerate(calls):
        out.append(chunk({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                          "function": {"name": name, "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                for piece in fragments]
    out.append(chunk({}, finish or ("tool_calls" if calls else "stop")))
    if usage is not None:
        prompt, completion, cached = usage
        out.append(_sse_data({**base, "choices": [], "usage": {
            "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                          "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0},
        }}))
    if done:
        out.append(b"data: [DONE]\n\n")
    return out


def openai_error(status: int, message: str, *, kind: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> Reply:
    return json_reply(status, {"error": {"message": message, "type": kind, "param": param,
                                         "code": code}}, headers)


# -- Anthropic Messages ------------------------------------------------------------------


def _event(name: str, payload: Any) -> bytes:
    return (f"event: {name}\n".encode() + b"data: "
            + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


def anthropic_stream(
    text: Sequence[str] = (),
    *,
    calls: Sequence[tuple[str, str, Sequence[str]]] = (),
    usage: tuple[int, int, int, int] = (12, 5, 0, 0),
    stop_reason: str | None = None,
    model: str = "claude-test",
    error: dict[str, Any] | None = None,
) -> list[bytes]:
    """SSE events of one streamed message.

    ``text``: text deltas of a first text block; ``calls``: (id, name, partial
    JSON fragments) as ``tool_use`` blocks; ``usage``: (input, output, cache
    read, cache write) tokens, input and cache figures in ``message_start``,
    the output count in ``message_delta``; ``error``: an ``error`` event sent
    after the text (a failure mid-stream: the stream's status stays 200).
    """
    fresh, output, read, write = usage
    out = [_event("message_start", {"type": "message_start", "message": {
        "id": "msg_replay", "type": "message", "role": "assistant", "content": [],
        "model": model, "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": fresh, "cache_creation_input_tokens": write,
                  "cache_read_input_tokens": read, "output_tokens": 1}}})]
    index = 0
    if text:
        out.append(_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                  "content_block": {"type": "text", "text": ""}}))
        out.append(_event("ping", {"type": "ping"}))
        out += [_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "text_delta", "text": piece}})
                for piece in text]
        if error is not None:
            out.append(_event("error", {"type": "error", "error": error}))
            return out
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
        index = 1
    elif error is not None:
        out.append(_event("error", {"type": "error", "error": error}))
        return out
    for offset, (call_id, name, fragments) in enumerate(calls):
        at = index + offset
        out.append(_event("content_block_start", {"type": "content_block_start", "index": at,
                                                  "content_block": {"type": "tool_use",
                                                                    "id": call_id, "name": name,
                                                                    "input": {}}}))
        out += [_event("content_block_delta", {"type": "content_block_delta", "index": at,
                                               "delta": {"type": "input_json_delta",
                                                         "partial_json": piece}})
                for piece in ["", *fragments]]
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": at}))
    reason = stop_reason or ("tool_use" if calls else "end_turn")
    out.append(_event("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": reason, "stop_sequence": None},
                                        "usage": {"output_tokens": output}}))
    out.append(_event("message_stop", {"type": "message_stop"}))
    return out


def anthropic_error(status: int, message: str, *, kind: str,
                    headers: dict[str, str] | None = None) -> Reply:
    return json_reply(status, {"type": "error", "error": {"type": kind, "message": message}},
                      {"request-id": "req_replay", **(headers or {})})


# -- as a script: the benchmark's server, in a process of its own --------------------------


def _serve_forever() -> None:
    """Serve both APIs until killed; print the port.

    The path picks the wire format (``/v1/chat/completions`` or ``/v1/messages``);
    a model named ``replay-N`` streams N text deltas. ``GET /stats`` returns, and
    forgets, the server's own time per request (from the request read to the
    last byte written), in order, so a client can subtract it from its own.
    """
    server: ReplayServer

    def reply(request: Recorded) -> Reply:
        if request.path == "/stats":
            done = [r for r in server.requests if r.path != "/stats"]
            server.requests.clear()
            return json_reply(200, {"server_seconds": [r.finished - r.started for r in done]})
        model = str(request.json().get("model", "replay-20"))
        deltas = int(model.rpartition("-")[2]) if model.startswith("replay-") else 20
        pieces = [f"w{i} " for i in range(deltas)]
        if request.path.endswith("/messages"):
            return Reply(anthropic_stream(pieces, usage=(100, deltas, 0, 0)))
        return Reply(openai_stream(pieces, usage=(100, deltas, 0)))

    async def main() -> None:
        nonlocal server
        async with ReplayServer(default=reply) as running:
            server = running
            print(running.port, flush=True)
            await asyncio.Event().wait()

    asyncio.run(main())


if __name__ == "__main__":
    _serve_forever()
