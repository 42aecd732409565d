"""`torpor serve`'s connections against hostile clients, over real loopback sockets
(issue 21, items 1 and 4): TCP_NODELAY, header, body and keep-alive deadlines, a cap on
open connections, and error logs rate-limited under a descriptor exhaustion."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from torpor.serve import bind

TOKEN = "conn-chat-token"
ADMIN = "conn-admin-token"
SLACK = 5.0  # seconds a deadline may run late on a loaded machine
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
FAST = all(importlib.util.find_spec(name) is not None for name in ("uvloop", "httptools"))
# Each event loop and HTTP parser gets the deadlines and the cap (the guard wraps either).
VARIANTS = [
    pytest.param(("asyncio", "h11"), id="asyncio+h11"),
    pytest.param(("uvloop", "httptools"), id="uvloop+httptools", marks=pytest.mark.skipif(
        not FAST, reason="uvloop and httptools (the fast extra) are not installed")),
]


@dataclass
class Served:
    process: subprocess.Popen[str]
    host: str
    port: int
    stderr: Path
    banner: str  # the "listening on" line: it names the event loop and the HTTP parser

    def log_lines(self) -> list[str]:
        return self.stderr.read_text().splitlines()


def start(tmp: Path, *extra: str, nofile: int | None = None) -> Served:
    """``torpor serve`` on a free loopback port (stderr to a file: a flood never blocks it);
    ``nofile``: its open-file limit (``ulimit -n``)."""

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    stderr = tmp / "stderr.log"
    with stderr.open("w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "torpor", "serve", "--db", str(tmp / "serve.db"),
             "--port", "0", "--model", "echo", "--token", TOKEN, "--admin-token", ADMIN, *extra],
            stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=limit,
            env={**os.environ, "TORPOR_TOKEN": "", "TORPOR_ADMIN_TOKEN": ""},
        )
    assert process.stdout is not None
    first = process.stdout.readline()
    if "listening on http://" not in first:
        raise AssertionError(f"torpor serve exited: {process.wait()} {stderr.read_text()}")
    while not process.stdout.readline().startswith("open http://"):
        pass
    address = first.split("listening on http://", 1)[1].split("/", 1)[0]
    host, port = address.rsplit(":", 1)
    return Served(process, host, int(port), stderr, first.strip())


def stop(served: Served) -> None:
    if served.process.poll() is None:
        served.process.send_signal(signal.SIGTERM)
    try:
        served.process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        served.process.kill()
        served.process.communicate()


@contextlib.contextmanager
def serving(tmp: Path, *extra: str, nofile: int | None = None) -> Iterator[Served]:
    served = start(tmp, *extra, nofile=nofile)
    try:
        yield served
    finally:
        stop(served)


@pytest.fixture(scope="module", params=VARIANTS)
def quick(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A server whose every deadline is a second, on each event loop and HTTP parser."""
    loop, http = request.param
    with serving(tmp_path_factory.mktemp("quick"), "--timeout-headers", "1", "--timeout-body",
                 "1", "--timeout-keep-alive", "1", "--loop", loop, "--http", http) as served:
        assert served.banner.endswith(f", {loop} + {http})"), served.banner
        yield served


def test_without_a_choice_it_runs_on_uvloop_and_httptools_when_installed(
    tmp_path: Path,
) -> None:
    with serving(tmp_path) as served:
        expected = "uvloop + httptools" if FAST else "asyncio + h11"
        assert served.banner.endswith(f", {expected})"), served.banner


async def connect(served: Served) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(served.host, served.port)


async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes (a reset counts as the close)."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := await reader.read(65536):
            out += chunk
    return out


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return int(head.split(b" ", 2)[1]), await reader.readexactly(length)


def keep_alive_p50(served: Served, requests: int = 200) -> float:
    """Median milliseconds of a GET /healthz on one kept-alive connection."""
    with socket.create_connection((served.host, served.port)) as sock:
        stream = sock.makefile("rb")
        times = []
        for _ in range(requests):
            started = time.perf_counter()
            sock.sendall(HEALTHZ)
            length = 0
            while (line := stream.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            assert stream.read(length) == b'{"ok":true}'
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def test_every_socket_torpor_binds_or_accepts_has_tcp_nodelay(quick: Served) -> None:
    listening = bind("127.0.0.1", 0)
    with listening, socket.create_connection(listening.getsockname()) as client:
        accepted, _ = listening.accept()
        with accepted:
            assert listening.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            # asyncio sets it again on the sockets it accepts only when proto says TCP
            assert accepted.proto == socket.IPPROTO_TCP
        assert client.fileno() >= 0
    # without it, Nagle held each response's body for the client's delayed ACK (~40 ms)
    print(f"\nkeep-alive GET /healthz p50 on loopback: {keep_alive_p50(quick):.3f} ms")


async def test_a_silent_connection_is_closed_after_the_header_timeout(quick: Served) -> None:
    reader, writer = await connect(quick)
    with anyio.fail_after(1 + SLACK):
        assert await read_to_eof(reader) == b""  # closed, without an answer
    writer.close()


async def test_a_slowloris_is_answered_408_and_closed(quick: Served) -> None:
    reader, writer = await connect(quick)
    writer.write(b"GET /healthz HTTP/1.1\r\n")
    closed = asyncio.ensure_future(read_to_eof(reader))
    with anyio.fail_after(1 + SLACK):
        for byte in b"X-Drip: " + b"a" * 1000:  # a header byte a second, never done
            with contextlib.suppress(ConnectionError):
                writer.write(bytes([byte]))
            done, _ = await asyncio.wait({closed}, timeout=1.0)
            if done:
                break
        answer = await closed
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    writer.close()


async def test_a_slowloris_after_a_kept_alive_request_is_answered_408_and_closed(
    quick: Served,
) -> None:
    """The next request's headers have the same deadline (uvicorn's keep-alive timer stops
    at the first byte of it)."""
    reader, writer = await connect(quick)
    writer.write(HEALTHZ)
    assert await read_response(reader) == (200, b'{"ok":true}')
    writer.write(b"GET /healthz HTTP/1.1\r\n")
    closed = asyncio.ensure_future(read_to_eof(reader))
    with anyio.fail_after(1 + SLACK):
        for byte in b"X-Drip: " + b"a" * 1000:
            with contextlib.suppress(ConnectionError):
                writer.write(bytes([byte]))
            done, _ = await asyncio.wait({closed}, timeout=0.5)
            if done:
                break
        answer = await closed
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    writer.close()


async def test_a_stalled_body_is_answered_408_and_closed(quick: Served) -> None:
    reader, writer = await connect(quick)
    writer.write(b"POST /v1/conversations/c/messages HTTP/1.1\r\nHost: t\r\n"
                 b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"text\": ")
    with anyio.fail_after(1 + SLACK):
        answer = await read_to_eof(reader)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    writer.close()


async def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(quick: Served) -> None:
    reader, writer = await connect(quick)
    writer.write(HEALTHZ)
    assert await read_response(reader) == (200, b'{"ok":true}')
    with anyio.fail_after(1 + 3):  # --timeout-keep-alive 1, where the default is 5
        assert await read_to_eof(reader) == b""
    writer.close()


def many_silent_connections(served: Served, count: int) -> list[socket.socket]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 200:  # this process holds the client ends
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 1000), hard))
    return [socket.create_connection((served.host, served.port)) for _ in range(count)]


async def healthz(served: Served) -> int:
    reader, writer = await connect(served)
    try:
        writer.write(HEALTHZ)
        status, _ = await read_response(reader)
        return status
    finally:
        writer.close()


def closed_by_server(sockets: list[socket.socket]) -> int:
    count = 0
    for sock in sockets:
        sock.setblocking(False)
        try:
            count += sock.recv(1) == b""
        except BlockingIOError:
            pass
        except ConnectionResetError:
            count += 1
    return count


@pytest.mark.parametrize("variant", VARIANTS)
async def test_1100_silent_connections_under_ulimit_1024_leave_healthz_answering(
    tmp_path: Path, variant: tuple[str, str],
) -> None:
    """The default cap stays under the open-file limit: each connection past it closes the
    one idle longest, so /healthz still gets in; nothing floods the log."""
    loop, http = variant
    with serving(tmp_path, "--timeout-headers", "60", "--loop", loop, "--http", http,
                 nofile=1024) as served:
        sockets = many_silent_connections(served, 1100)
        try:
            started = time.perf_counter()
            with anyio.fail_after(SLACK):  # the header deadline (60 s) never helps here
                assert await healthz(served) == 200
            print(f"\n/healthz answered in {(time.perf_counter() - started) * 1000:.1f} ms "
                  f"behind 1,100 silent connections (ulimit -n 1024)")
            assert closed_by_server(sockets) >= 1100 - 1024
        finally:
            for sock in sockets:
                sock.close()
    lines = served.log_lines()
    print(f"{len(lines)} log lines")
    assert len(lines) < 100, lines[-5:]
    assert not any("out of system resource" in line for line in lines)


@pytest.mark.parametrize("variant", VARIANTS)
async def test_a_descriptor_exhaustion_floods_no_log(
    tmp_path: Path, variant: tuple[str, str],
) -> None:
    """Without the cap, accept() fails with EMFILE in a loop: asyncio logs each failure
    (106,000 lines in 20 s were measured); the rate limit lets a few through and counts
    the rest. The header deadline then frees descriptors and /healthz answers. (uvloop's
    libuv closes what it cannot accept without a word: nothing to limit there.)"""
    loop, http = variant
    with serving(tmp_path, "--limit-connections", "0", "--timeout-headers", "2",
                 "--loop", loop, "--http", http, nofile=1024) as served:
        sockets = many_silent_connections(served, 1100)
        try:
            with anyio.fail_after(2 + 30):
                while True:  # answered once the silent connections were timed out
                    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                        if await healthz(served) == 200:
                            break
        finally:
            for sock in sockets:
                sock.close()
    lines = served.log_lines()
    assert len(lines) < 100, len(lines)
    if loop == "uvloop":
        return
    assert any("out of system resource" in line for line in lines)  # it was exhausted
    summaries = [json.loads(line) for line in lines if "log_records_suppressed" in line]
    suppressed = sum(s["suppressed"] for s in summaries)
    print(f"\n{len(lines)} log lines, {suppressed} records suppressed")
    assert suppressed > 0


@pytest.mark.parametrize("variant", VARIANTS)
async def test_past_the_cap_an_idle_connection_makes_room_and_busy_ones_get_503(
    tmp_path: Path, variant: tuple[str, str],
) -> None:
    loop, http = variant
    with serving(tmp_path, "--limit-connections", "2", "--loop", loop, "--http", http) as served:
        first, first_writer = await connect(served)
        second, second_writer = await connect(served)
        assert await healthz(served) == 200  # a third connection: the oldest idle one went
        with anyio.fail_after(SLACK):
            assert await read_to_eof(first) == b""
        second_writer.write(HEALTHZ)  # the younger idle one stayed
        assert await read_response(second) == (200, b'{"ok":true}')
        second_writer.close()
        first_writer.close()
        # two followers hold both places with requests in progress: a third gets 503
        streams = []
        for _ in range(2):
            reader, writer = await connect(served)
            writer.write(b"GET /v1/conversations/c/stream HTTP/1.1\r\nHost: t\r\n"
                         b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
            streams.append(writer)
        assert await healthz(served) == 503
        streams[0].close()
        with anyio.fail_after(SLACK):
            while await healthz(served) != 200:  # once the server saw the follower leave
                pass
        streams[1].close()
