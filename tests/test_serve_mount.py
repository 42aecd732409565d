"""torpor.serve.app in a host: the README's FastAPI example over real HTTP, and SIGTERM
under plain uvicorn (the app as the ASGI app, and mounted in a FastAPI host)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import uvicorn

from torpor import Runtime
from torpor.serve import Server, bind

pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "fastapi_app.py"
ALICE = {"Authorization": "Bearer alice-token"}
BOB = {"Authorization": "Bearer bob-token"}


def readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- example: examples/fastapi_app.py -->\n```python\n(.*?)```\n",
                      readme, re.S)
    assert found, "the README lost its FastAPI example"
    return found.group(1)


def load_example(db: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setenv("CHAT_DB", f"sqlite:///{db}")
    spec = importlib.util.spec_from_file_location(f"fastapi_example_{id(db)}", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@asynccontextmanager
async def uvicorn_on_loopback(app: Any, *, lifespan: str) -> AsyncIterator[str]:
    sock = bind("127.0.0.1", 0)
    server = Server(uvicorn.Config(app, lifespan=lifespan, log_config=None, access_log=False))  # type: ignore[arg-type]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:  # the socket listens already: connections wait for the host's lifespan startup
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    event, data = "message", ""
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data += line[6:]
        elif line == "":
            if data:
                yield event, json.loads(data)
            event, data = "message", ""


def test_the_readme_example_is_the_file_the_tests_run() -> None:
    assert readme_example() == EXAMPLE.read_text()


async def test_the_readme_fastapi_app_serves_a_streamed_turn_under_chat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    example = load_example(tmp_path / "chat.db", monkeypatch)
    async with uvicorn_on_loopback(example.app, lifespan="on") as url, \
            httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/chat/v1/conversations/alice/messages",
                                 json={"text": "hello"}, headers=ALICE) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [e async for e in sse_events(response)]
        assert events[0][0] == "user"
        assert events[-1][0] == "assistant"
        assert events[-1][1]["body"]["text"] == "echo: hello"
        assert (await client.get("/")).status_code == 200  # the host's own routes
        other = await client.post("/chat/v1/conversations/alice/messages",
                                  json={"text": "hi"}, headers=BOB)
        assert other.status_code == 403 and other.json()["error"] == "Forbidden"
        anonymous = await client.post("/chat/v1/conversations/alice/messages",
                                      json={"text": "hi"})
        assert anonymous.status_code == 401
        history = await client.get("/chat/v1/conversations/alice/history", headers=ALICE)
        assert [e["kind"] for e in history.json()["events"]] == ["assistant", "user"]


async def test_a_runtime_never_entered_answers_503_saying_what_to_add(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    example = load_example(tmp_path / "chat.db", monkeypatch)
    # the host's lifespan does not run: nobody enters the runtime
    async with uvicorn_on_loopback(example.app, lifespan="off") as url, \
            httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/chat/v1/conversations/alice/messages",
                                     json={"text": "hello"}, headers=ALICE)
        assert response.status_code == 503
        problem = response.json()
        assert problem["error"] == "RuntimeClosed"
        assert "async with rt:" in problem["detail"]
        assert "lifespan" in problem["detail"]
        health = await client.get("/chat/healthz")
        assert health.status_code == 503 and "async with rt:" in health.json()["detail"]


# -- SIGTERM under plain uvicorn ----------------------------------------------------------

SLOW_APPS = '''
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI

import torpor
import torpor.serve
from torpor.llm.scripted import Pause, ScriptedModel, Text

# A model that starts its answer and then takes an hour: the turn is in flight at SIGTERM.
model = ScriptedModel([(Text("thinking "), Pause(3600))], loop=True)
rt = torpor.Runtime(os.environ["CHAT_DB"], model=model)
grace = float(os.environ["GRACE"])
chat = torpor.serve.app(rt, authorize=torpor.serve.bearer_tokens({"alice-token": "alice"}),
                        shutdown_grace=grace)


@asynccontextmanager
async def lifespan(app):
    async with rt:
        yield


host = FastAPI(lifespan=lifespan)
host.mount("/chat", chat)
'''


class Uvicorn:
    """``python -m uvicorn`` serving ``target`` from a module in ``directory``."""

    def __init__(self, process: asyncio.subprocess.Process, url: str) -> None:
        self.process = process
        self.url = url
        self.lines: list[str] = []
        self._drain = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, directory: Path, target: str, grace: float) -> Uvicorn:
        import os

        env = {**os.environ, "CHAT_DB": f"sqlite:///{directory / 'chat.db'}",
               "GRACE": str(grace), "PYTHONPATH": os.pathsep.join([str(directory), *sys.path])}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "uvicorn", target, "--host", "127.0.0.1", "--port", "0",
            "--log-level", "info", cwd=directory, env=env, stderr=asyncio.subprocess.PIPE)
        assert process.stderr is not None
        while True:
            line = (await process.stderr.readline()).decode()
            if not line:
                raise AssertionError(f"uvicorn exited: {await process.wait()}")
            found = re.search(r"running on (http://\S+)", line)
            if found:
                return cls(process, found.group(1))

    async def _read(self) -> None:
        assert self.process.stderr is not None
        async for line in self.process.stderr:
            self.lines.append(line.decode())

    async def exit_code(self) -> int:
        try:
            code = await asyncio.wait_for(self.process.wait(), 60)
        finally:
            if self.process.returncode is None:  # a test that failed: no process left over
                self.process.kill()
                await self.process.wait()
            await self._drain
        return code


async def logged(db: Path, conversation_id: str) -> list[Any]:
    async with Runtime(f"sqlite:///{db}") as rt:
        return await rt.history(conversation_id, limit=10)


@pytest.mark.parametrize(("target", "prefix"), [("slow_apps:chat", ""),
                                                ("slow_apps:host", "/chat")])
async def test_sigterm_under_uvicorn_ends_a_streamed_turn_with_the_logged_abort(
    tmp_path: Path, target: str, prefix: str,
) -> None:
    (tmp_path / "slow_apps.py").write_text(SLOW_APPS)
    server = await Uvicorn.start(tmp_path, target, grace=0.2)
    kinds = []
    # the bound fails the test rather than hanging it (pings keep a held stream alive)
    async with asyncio.timeout(60), httpx.AsyncClient(base_url=server.url) as client, \
            client.stream(
        "POST", f"{prefix}/v1/conversations/alice/messages", json={"text": "go"},
        headers=ALICE,
    ) as response:
        assert response.status_code == 200
        async for kind, data in sse_events(response):
            kinds.append(kind)
            if kind == "delta":
                server.process.send_signal(signal.SIGTERM)  # mid-stream
            last = data
    assert kinds[-1] == "aborted" and last["body"]["reason"] == "shutdown"
    assert await server.exit_code() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    history = await logged(tmp_path / "chat.db", "alice")
    assert history[0].kind == "aborted" and history[0].body.reason == "shutdown"


@pytest.mark.parametrize(("target", "prefix"), [("slow_apps:chat", ""),
                                                ("slow_apps:host", "/chat")])
async def test_a_turn_whose_client_left_does_not_hold_the_shutdown(
    tmp_path: Path, target: str, prefix: str,
) -> None:
    """A grace of an hour: the process still exits, since nobody waits for the turn's end
    (which the log holds: aborted at the end of a drain that waited for nothing)."""
    (tmp_path / "slow_apps.py").write_text(SLOW_APPS)
    server = await Uvicorn.start(tmp_path, target, grace=3600)
    async with httpx.AsyncClient(base_url=server.url) as client, client.stream(
        "POST", f"{prefix}/v1/conversations/alice/messages", json={"text": "go"},
        headers=ALICE,
    ) as response:
        async for kind, _ in sse_events(response):
            if kind == "delta":
                break  # the client leaves mid-turn
    server.process.send_signal(signal.SIGTERM)
    assert await server.exit_code() in (0, -signal.SIGTERM)
    history = await logged(tmp_path / "chat.db", "alice")
    assert history[0].kind == "aborted" and history[0].body.reason == "shutdown"
