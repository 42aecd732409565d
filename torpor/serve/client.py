"""A small HTTP/1.1 and Server-Sent Events client on asyncio streams (stdlib only).

What ``torpor top``, ``torpor loadtest --url`` and the benchmarks talk to a
server with. Thousands of concurrent streams cost a socket and two buffers
each, and a test can cut one mid-stream exactly where it wants (``abort``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

__all__ = ["Client", "Connection", "HTTPStatusError", "Response", "SSEEvent"]

_MAX_LINE = 64 * 1024


class HTTPStatusError(Exception):
    """A response whose status is not the one expected; ``problem`` is its JSON body, if any."""

    def __init__(self, status: int, problem: dict[str, Any] | None, text: str) -> None:
        detail = ""
        if problem:
            detail = f"{problem.get('title', '')}: {problem.get('detail', '')}"
        super().__init__(f"HTTP {status} {detail or text[:200]}".strip())
        self.status = status
        self.problem = problem or {}


@dataclass(slots=True)
class SSEEvent:
    event: str
    data: str
    id: str | None = None

    def json(self) -> Any:
        return json.loads(self.data)


@dataclass(slots=True)
class Response:
    status: int
    headers: dict[str, str]
    _conn: Connection = field(repr=False)
    _remaining: int | None = None  # content-length left; None: chunked or until EOF
    _chunked: bool = False
    _chunk_left: int = 0
    _done: bool = False

    async def _read_some(self) -> bytes:
        reader = self._conn.reader
        assert reader is not None
        if self._done:
            return b""
        if self._chunked:
            if self._chunk_left == 0:
                line = await reader.readline()
                if not line:
                    raise ConnectionResetError("connection closed inside a chunked body")
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    await reader.readline()  # the blank line after the last chunk
                    self._done = True
                    return b""
                self._chunk_left = size
            data = await reader.read(self._chunk_left)
            if not data:
                raise ConnectionResetError("connection closed inside a chunk")
            self._chunk_left -= len(data)
            if self._chunk_left == 0:
                await reader.readexactly(2)
            return data
        if self._remaining is not None:
            if self._remaining == 0:
                self._done = True
                return b""
            data = await reader.read(min(self._remaining, 65536))
            if not data:
                raise ConnectionResetError("connection closed before the body ended")
            self._remaining -= len(data)
            return data
        data = await reader.read(65536)
        if not data:
            self._done = True
            self._conn.reusable = False
        return data

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            data = await self._read_some()
            if not data:
                return
            yield data

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.chunks()]
        return b"".join(parts)

    async def json(self) -> Any:
        return json.loads(await self.read() or b"null")

    @property
    def complete(self) -> bool:
        return self._done

    async def events(self) -> AsyncIterator[SSEEvent]:
        """The body as Server-Sent Events (comments skipped); ends with the body."""
        buffer = b""
        name, event_id = "message", None
        data: list[str] = []
        async for chunk in self.chunks():
            buffer += chunk
            while True:
                cut = buffer.find(b"\n")
                if cut < 0:
                    if len(buffer) > _MAX_LINE * 16:
                        raise ValueError("an SSE line is too long")
                    break
                line = buffer[:cut].rstrip(b"\r").decode("utf-8")
                buffer = buffer[cut + 1:]
                if not line:
                    if data:
                        yield SSEEvent(name, "\n".join(data), event_id)
                    name, data, event_id = "message", [], None
                    continue
                if line.startswith(":"):
                    continue
                key, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if key == "event":
                    name = value
                elif key == "data":
                    data.append(value)
                elif key == "id":
                    event_id = value


class Connection:
    """One HTTP/1.1 connection (kept alive between complete responses)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.reusable = False

    async def _ensure(self) -> None:
        if self.writer is None or not self.reusable or self.writer.is_closing():
            await self.close()
            self.reader, self.writer = await asyncio.open_connection(
                self.host, self.port, limit=_MAX_LINE * 16
            )
            self.reusable = True

    async def request(
        self, method: str, target: str, *, headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
    ) -> Response:
        await self._ensure()
        assert self.writer is not None and self.reader is not None
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        for key, value in (headers or {}).items():
            lines.append(f"{key}: {value}")
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")
        self.writer.write(head + (body or b""))
        await self.writer.drain()
        status_line = await self.reader.readline()
        if not status_line:
            self.reusable = False
            raise ConnectionResetError("the server closed the connection")
        parts = status_line.decode("latin-1").split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            self.reusable = False
            raise ConnectionResetError(f"not an HTTP status line: {status_line[:60]!r}")
        status = int(parts[1])
        response_headers: dict[str, str] = {}
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            key, _, value = line.decode("latin-1").partition(":")
            response_headers[key.strip().lower()] = value.strip()
        response = Response(status, response_headers, self)
        if response_headers.get("connection", "").lower() == "close":
            self.reusable = False
        if "chunked" in response_headers.get("transfer-encoding", "").lower():
            response._chunked = True
        elif "content-length" in response_headers:
            response._remaining = int(response_headers["content-length"])
        elif method == "HEAD" or status in (204, 304):
            response._done = True
        return response

    def abort(self) -> None:
        """Cut the connection now, mid-response if need be (a network drop)."""
        if self.writer is not None:
            transport = self.writer.transport
            transport.abort()
        self.reusable = False

    async def close(self) -> None:
        writer, self.writer, self.reader = self.writer, None, None
        self.reusable = False
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()


class Client:
    """Requests against one base URL with an optional bearer token; a connection per call
    unless one is given (``conn=``)."""

    def __init__(self, base_url: str, token: str | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected an http:// URL, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.token = token

    def connection(self) -> Connection:
        return Connection(self.host, self.port)

    def _headers(self, extra: Mapping[str, str] | None, token: str | None) -> dict[str, str]:
        out = {"Accept": "*/*"}
        use = token if token is not None else self.token
        if use:
            out["Authorization"] = f"Bearer {use}"
        out.update(extra or {})
        return out

    async def open(
        self, method: str, path: str, *, json_body: Any = None,
        headers: Mapping[str, str] | None = None, conn: Connection | None = None,
        token: str | None = None,
    ) -> tuple[Connection, Response]:
        """Send a request; the caller reads the response (and closes ``conn`` if it was made)."""
        connection = conn if conn is not None else self.connection()
        merged = self._headers(headers, token)
        body = None
        if json_body is not None:
            body = json.dumps(json_body).encode("utf-8")
            merged.setdefault("Content-Type", "application/json")
        if conn is None:
            merged["Connection"] = "close"
        response = await connection.request(method, self.prefix + path, headers=merged, body=body)
        return connection, response

    async def call(
        self, method: str, path: str, *, json_body: Any = None,
        headers: Mapping[str, str] | None = None, expect: tuple[int, ...] = (200,),
        token: str | None = None, conn: Connection | None = None,
    ) -> Any:
        """A request whose JSON answer is returned; another status raises HTTPStatusError."""
        connection, response = await self.open(method, path, json_body=json_body,
                                               headers=headers, conn=conn, token=token)
        try:
            raw = await response.read()
        finally:
            if conn is None:
                await connection.close()
        if response.status not in expect:
            problem = None
            with contextlib.suppress(ValueError):
                parsed = json.loads(raw)
                problem = parsed if isinstance(parsed, dict) else None
            raise HTTPStatusError(response.status, problem, raw.decode("utf-8", "replace"))
        return json.loads(raw) if raw else None

    # -- the chat API, acknowledged in JSON -------------------------------------------------
    async def send(self, conversation_id: str, text: str, *, key: str | None = None) -> Any:
        """``POST …/messages`` answered 202 once the message is in the log
        (``{"position", "turn", "postponed", "replayed", …}``); ``key`` is sent as
        ``Idempotency-Key``, so a retry is applied once."""
        return await self.call(
            "POST", f"/v1/conversations/{quote(conversation_id, safe='/')}/messages",
            json_body={"text": text}, headers=_acknowledged(key), expect=(202,),
        )

    async def resolve(
        self, conversation_id: str, call_id: str, result: str, *, is_error: bool = False,
        key: str | None = None,
    ) -> Any:
        """``POST …/calls/{call_id}`` answered 202 (``{"resolved", "continuation",
        "replayed"}``); ``key`` is sent as ``Idempotency-Key``: a retry after the first one
        committed gets the same answer instead of 404 ``UnknownCall``."""
        path = (f"/v1/conversations/{quote(conversation_id, safe='/')}"
                f"/calls/{quote(call_id, safe='')}")
        return await self.call("POST", path, json_body={"result": result, "is_error": is_error},
                               headers=_acknowledged(key), expect=(202,))


def _acknowledged(key: str | None) -> dict[str, str]:
    headers = {"Accept": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return headers
