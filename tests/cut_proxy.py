"""A TCP proxy on 127.0.0.1 between a client and a server, cutting connections on cue.

It forwards bytes both ways unchanged, except that it can cut (reset both sides of)
the next ``cut_deltas`` connections right after one forwards a chunk carrying a
``delta`` event (``mid_char``: inside the first four-byte UTF-8 character after it,
so the client holds half an event and half an emoji), drop the next
``drop_responses`` responses as they begin (the server did the work, the client
hears nothing), and rewrite bytes of what the server sends (``rewrite``); :meth:`cut`
drops every open connection at once (the network fails).
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

__all__ = ["CutProxy"]


class CutProxy:
    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self._upstream = (host, int(port))
        self.cut_deltas = 0
        self.mid_char = False
        self.drop_responses = 0
        self.rewrite: tuple[bytes, bytes] | None = None
        self.cuts = 0
        self.drops = 0
        self.sent = bytearray()  # everything the client sent (its requests' heads are in it)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._open: set[asyncio.WriteTransport] = set()
        self.url = ""

    async def __aenter__(self) -> CutProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, kind: type[BaseException] | None, value: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()  # every connection ends: its task returns
        for task in list(self._tasks):
            await task
        await self._server.wait_closed()

    def cut(self) -> None:
        """Reset every open connection, both sides, now."""
        for transport in list(self._open):
            transport.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._open.add(writer.transport)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
            self._open.add(up_writer.transport)
            up = asyncio.create_task(self._up(reader, up_writer))
            try:
                await self._down(up_reader, writer)
            finally:
                up_writer.transport.abort()
                writer.transport.abort()
                with contextlib.suppress(OSError):
                    await up
                self._open.discard(up_writer.transport)
        finally:
            self._open.discard(writer.transport)
            self._tasks.discard(task)

    async def _up(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while chunk := await reader.read(65536):
                self.sent += chunk
                writer.write(chunk)
                await writer.drain()

    async def _down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Server to client; returns to cut the connection."""
        with contextlib.suppress(OSError):
            while chunk := await reader.read(65536):
                if self.rewrite is not None:
                    chunk = chunk.replace(*self.rewrite)
                if self.drop_responses > 0:
                    self.drop_responses -= 1
                    self.drops += 1
                    return
                at = chunk.find(b"event: delta")
                if self.cut_deltas > 0 and at >= 0:
                    self.cut_deltas -= 1
                    self.cuts += 1
                    if self.mid_char:
                        lead = chunk.find(b"\xf0", at)
                        chunk = chunk[: lead + 2] if lead >= 0 else chunk[: at + 20]
                    writer.write(chunk)
                    await writer.drain()
                    return
                writer.write(chunk)
                await writer.drain()
