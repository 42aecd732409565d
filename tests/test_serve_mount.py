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


# -- the README app against an OpenAI-compatible server, a tool that knows its caller ------


async def test_the_readme_app_with_a_model_server_tells_tools_the_user_and_measures_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The issue's first contact, end to end: the README's FastAPI app on an OpenAI-compatible
    server (a stand-in on 127.0.0.1, as a LiteLLM proxy would answer), its tool reading the
    authenticated user from ToolContext, then a 429 the app reports as a structured abort
    and counts in its /metrics by model and error type."""
    pytest.importorskip("openai")
    from prometheus_client.parser import text_string_to_metric_families
    from replay import ReplayServer, Reply, openai_error, openai_stream

    def rate_limited(request: Any) -> Reply:  # every call after the scripted ones
        return openai_error(429, "LiteLLM: model group 'mock-429' failed, see "
                            "https://docs.example/limits", kind="rate_limit_error",
                            headers={"retry-after-ms": "20"})

    async with ReplayServer(default=rate_limited) as provider:
        provider.add(
            Reply(openai_stream(calls=[("call_a", "order_status", ['{"order_id"', ': "17"}'])])),
            Reply(openai_stream(["Order 17 has shipped."])),
            Reply(openai_stream(calls=[("call_b", "order_status", ['{"order_id": "17"}'])])),
            Reply(openai_stream(["I cannot find that order."])),
        )
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        monkeypatch.setenv("OPENAI_BASE_URL", provider.url + "/v1")
        monkeypatch.setenv("ADMIN_TOKEN", "admin-token")
        example = load_example(tmp_path / "chat.db", monkeypatch)
        async with uvicorn_on_loopback(example.app, lifespan="on") as url, \
                httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def turn(conversation: str, text: str, who: dict[str, str]) -> list[Any]:
                async with client.stream("POST", f"/chat/v1/conversations/{conversation}"
                                         "/messages", json={"text": text},
                                         headers=who) as response:
                    assert response.status_code == 200
                    return [e async for e in sse_events(response)]

            alice = await turn("alice", "where is order 17?", ALICE)
            results = [d["body"]["content"] for k, d in alice if k == "tool_result"]
            assert results == ["order 17: shipped"]
            assert alice[-1][0] == "assistant"
            # bob asks for alice's order in his own conversation: the tool sees bob
            bob = await turn("bob", "where is order 17?", BOB)
            assert [d["body"]["content"] for k, d in bob if k == "tool_result"] == [
                "no such order"]

            failed = await turn("alice", "and order 18?", ALICE)
            kind, aborted = failed[-1]
            assert kind == "aborted"
            body = aborted["body"]
            assert body["error"] == "ModelRateLimited" and body["retryable"] is True
            assert body["status"] == 429 and body["retry_after"] == pytest.approx(0.02)
            assert "LiteLLM" not in body["message"] and "http" not in body["message"]

            scrape = await client.get("/chat/metrics",
                                      headers={"Authorization": "Bearer admin-token"})
            assert scrape.status_code == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(scrape.text)
               for s in family.samples}
    model = (("model", "openai:gpt-4o-mini"),)
    assert samples[("torpor_model_call_seconds_count", model)] == 5
    assert samples[("torpor_model_errors_total", (*model, ("type", "ModelRateLimited")))] == 1
    assert samples[("torpor_model_errors_total", (*model, ("type", "ModelTimeout")))] == 0
