"""A lean HTTP/1.1 client for bench/serve.py: keep-alive requests and SSE turns on raw streams.

The client shares a two-core machine with the server it measures, so it does as little
as it can: no HTTP library, chunked bodies read chunk by chunk, SSE events found by
their ``event:`` line only. It speaks to ``torpor serve`` and the minimal app alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

__all__ = ["Conn", "TurnTimes", "open_conn"]


@dataclass
class TurnTimes:
    first_delta: list[float] = field(default_factory=list)
    turn: list[float] = field(default_factory=list)
    failed: int = 0


class Conn:
    """One kept-alive connection; one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 host: str, token: str) -> None:
        self.reader = reader
        self.writer = writer
        self.auth = f"Host: {host}\r\nAuthorization: Bearer {token}\r\n".encode()

    def send(self, method: str, path: str, body: bytes = b"", accept: str = "*/*") -> None:
        head = f"{method} {path} HTTP/1.1\r\n".encode() + self.auth
        extra = f"Accept: {accept}\r\n"
        if method == "POST":
            extra += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write(head + extra.encode() + b"\r\n" + body)

    async def head(self) -> tuple[int, bool, int]:
        """Status, whether the body is chunked, and its length if not."""
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        chunked, length = False, 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"content-length":
                length = int(value)
        return status, chunked, length

    async def chunk(self) -> bytes:
        """The next chunk of a chunked body (b"" at its end)."""
        size = int((await self.reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            await self.reader.readuntil(b"\r\n")
            return b""
        return (await self.reader.readexactly(size + 2))[:-2]

    async def body(self, chunked: bool, length: int) -> bytes:
        if not chunked:
            return await self.reader.readexactly(length) if length else b""
        parts = []
        while part := await self.chunk():
            parts.append(part)
        return b"".join(parts)

    async def get(self, path: str) -> tuple[int, bytes]:
        self.send("GET", path)
        status, chunked, length = await self.head()
        return status, await self.body(chunked, length)

    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.send("POST", path, body, accept="application/json")
        status, chunked, length = await self.head()
        return status, await self.body(chunked, length)

    async def turn(self, path: str, body: bytes, times: TurnTimes | None) -> bool:
        """POST a message and read its SSE stream to the end; record first delta and total."""
        started = time.perf_counter()
        self.send("POST", path, body, accept="text/event-stream")
        status, chunked, length = await self.head()
        if status != 200 or not chunked:
            await self.body(chunked, length)
            if times is not None:
                times.failed += 1
            return False
        first = None
        ended = False
        while part := await self.chunk():
            if first is None and b"event: delta" in part:
                first = time.perf_counter() - started
            if b"event: assistant" in part:
                ended = True
        if times is not None:
            if first is not None:
                times.first_delta.append(first)
            if ended:
                times.turn.append(time.perf_counter() - started)
            else:
                times.failed += 1
        return ended

    async def follow(self, path: str) -> int:
        """Open a follower stream (GET …/stream); its status. Read on with :meth:`next_event`."""
        self.send("GET", path, accept="text/event-stream")
        status, chunked, length = await self.head()
        if status != 200 or not chunked:
            await self.body(chunked, length)
        return status

    async def next_event(self) -> bytes:
        """The next chunk that holds an event (not a ``:`` comment such as a ping)."""
        while True:
            part = await self.chunk()
            if not part or b"event:" in part or b"data:" in part:
                return part

    def abort(self) -> None:
        self.writer.transport.abort()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


async def open_conn(host: str, port: int, token: str) -> Conn:
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    return Conn(reader, writer, f"{host}:{port}", token)
