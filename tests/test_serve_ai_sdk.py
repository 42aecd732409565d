"""The Vercel AI SDK's own client (the npm ``ai`` package on Node: ``AbstractChat`` and
``DefaultChatTransport``, no React) against ``/v1/ai-sdk/chat``: a streamed answer, a
tool call with its result, approvals answered (approved and denied) through the SDK's
approval response, a resume after the network drops mid-answer, and an abort as the
protocol's error chunk.

``npm ci`` installs the pinned ``ai`` (tests/ai_sdk/package-lock.json) once into a cache
folder (see :mod:`npm_packages`; ``.ci/run`` installs it before the tests). Without
node and npm, or when npm cannot install, the test skips saying why, unless
``TORPOR_REQUIRE_NPM=1`` (CI sets it): then it fails."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
from cut_proxy import CutProxy
from npm_packages import NpmUnavailable, ai_sdk
from serve_support import ADMIN, TOKEN, serving

from torpor import AgentConfig, ExternalTool, Runtime, ScriptedModel, tool
from torpor.errors import ModelRateLimited
from torpor.llm.scripted import Call, Fail, Signal, Text, Wait
from torpor.serve import app, bearer_token

FIRST, SECOND = "The first half of a long answer, ", "and its second half. 🎉"
SECRET = "provider says: account 1234 over quota"

APPROVE = ExternalTool("approve", "Ask a person.",
                       {"type": "object", "properties": {"action": {"type": "string"}}})


@tool
async def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def chat_script() -> Path:
    try:
        return ai_sdk() / "chat.mjs"
    except NpmUnavailable as exc:
        if os.environ.get("TORPOR_REQUIRE_NPM") == "1":
            pytest.fail(f"TORPOR_REQUIRE_NPM=1, but {exc}")
        pytest.skip(str(exc))


def _script(halfway: anyio.Event, go: anyio.Event) -> ScriptedModel:
    """The model's steps, in the order the Node script's cases call it."""
    return ScriptedModel([
        [Text("Hello "), Text("from torpor.")],  # answer
        [Text("Looking it up."), Call("lookup", {"city": "Paris"}, id="call-lookup")],  # tool
        "It is sunny in Paris.",
        [Text("I need a yes."), Call("approve", {"action": "deploy"}, id="call-yes")],  # approved
        "Deployed.",
        [Call("approve", {"action": "delete"}, id="call-no")],  # denied
        "Not deleting, then.",
        [Text(FIRST), Signal(halfway), Wait(go), Text(SECOND)],  # resume
        [Text("partial "), Fail(ModelRateLimited(SECRET, provider="p", status=429))],  # error
    ])


async def _run(script: Path) -> dict[str, dict[str, Any]]:
    halfway, go = anyio.Event(), anyio.Event()
    agent = AgentConfig(tools=[lookup, APPROVE])
    async with Runtime("sqlite://", model=_script(halfway, go), agent=agent) as rt:
        application = app(rt, authorize=bearer_token(TOKEN), admin_token=ADMIN)
        async with serving(application) as url, CutProxy(url) as proxy:
            node = await asyncio.create_subprocess_exec(
                "node", str(script), url, proxy.url, TOKEN, cwd=script.parent,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            cases: dict[str, dict[str, Any]] = {}
            lines: list[str] = []
            try:
                with anyio.fail_after(120):
                    assert node.stdout is not None
                    while line := await node.stdout.readline():
                        lines.append(line.decode())
                        got = json.loads(line)
                        if got.get("event") == "first-half":
                            await halfway.wait()  # the model is between the halves
                            proxy.cut()  # the network drops mid-answer
                        elif got.get("event") == "resume-open":
                            go.set()  # the resume is connected: the model goes on
                        elif "case" in got:
                            cases[got["case"]] = got
                    code = await node.wait()
                stderr = (await node.stderr.read()).decode() if node.stderr else ""
            finally:
                if node.returncode is None:
                    node.kill()
                    await node.wait()
    print("".join(lines))  # the SDK's view of each case (pytest -s shows it)
    assert code == 0 and "crash" not in cases, (cases.get("crash"), stderr[-2000:])
    return cases


def _assistant(case: dict[str, Any]) -> dict[str, Any]:
    messages = case["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"], messages
    return messages[1]  # type: ignore[no-any-return]


def _kinds(message: dict[str, Any]) -> list[str]:
    return [p["type"] for p in message["parts"]]


async def test_the_ai_sdk_chat_client_streams_tools_approvals_resumes_and_errors(
    chat_script: Path,
) -> None:
    cases = await _run(chat_script)

    # (1) a streamed answer, assembled by the SDK into one assistant message
    answer = cases["answer"]
    assert answer["status"] == "ready" and answer["error"] is None
    message = _assistant(answer)
    assert message["parts"] == [{"type": "step-start"},
                                {"type": "text", "text": "Hello from torpor.", "state": "done"}]
    assert message["id"] == "turn-1"
    request = answer["requests"][0]
    assert (request["method"], request["status"], request["protocol"]) == ("POST", 200, "v1")
    chunks = [c for i, c in enumerate(request["chunks"])  # deltas may coalesce in a buffer
              if not (c == "text-delta" == request["chunks"][i - 1])]
    assert chunks == ["start", "start-step", "text-start", "text-delta", "text-end",
                      "finish-step", "finish", "[DONE]"]
    assert cases["nothing-to-resume"]["stream"] is None  # GET …/stream answered 204

    # (2) a local tool's call and its result, then the answer, in two steps
    tooled = cases["tool"]
    assert tooled["status"] == "ready" and tooled["error"] is None
    parts = _assistant(tooled)["parts"]
    assert _kinds(_assistant(tooled)) == ["step-start", "text", "tool-lookup", "step-start",
                                          "text"]
    assert parts[2]["state"] == "output-available"
    assert parts[2]["input"] == {"city": "Paris"} and parts[2]["output"] == "sunny in Paris"
    assert parts[4]["text"] == "It is sunny in Paris."

    # (3) an ExternalTool call as an approval request, approved through the SDK
    approved = cases["approved"]
    assert approved["status"] == "ready" and approved["error"] is None
    asked = approved["asked"][1]["parts"]
    assert asked[-1]["state"] == "approval-requested"
    assert asked[-1]["approval"] == {"id": "call-yes"}
    assert asked[-1]["input"] == {"action": "deploy"}
    message = _assistant(approved)  # the continuation is the same message, not a new one
    assert _kinds(message) == ["step-start", "text", "tool-approve", "step-start", "text"]
    assert message["parts"][2]["state"] == "output-available"
    assert message["parts"][2]["output"] == "approved"
    assert message["parts"][4]["text"] == "Deployed."
    assert [(r["method"], r["status"]) for r in approved["requests"]] == [("POST", 200)] * 2
    assert approved["requests"][0]["chunks"][-4:] == [
        "tool-approval-request", "finish-step", "finish", "[DONE]"]

    denied = cases["denied"]
    assert denied["status"] == "ready" and denied["error"] is None
    message = _assistant(denied)
    assert _kinds(message) == ["step-start", "tool-approve", "step-start", "text"]
    assert message["parts"][1]["state"] == "output-denied"
    assert message["parts"][1]["approval"]["approved"] is False
    assert message["parts"][3]["text"] == "Not deleting, then."

    # (4) the network drops mid-answer; the SDK's resume rebuilds the answer exactly
    resumed = cases["resume"]
    cut = resumed["cut"]
    assert cut["messages"][-1]["parts"][-1]["text"] == FIRST  # what arrived before the cut
    assert resumed["status"] == "ready" and resumed["error"] is None
    message = _assistant(resumed)  # replaced in place: one assistant message, not two
    assert message["parts"] == [{"type": "step-start"},
                                {"type": "text", "text": FIRST + SECOND, "state": "done"}]
    gets = [r for r in resumed["requests"] if r["method"] == "GET"]
    assert [(r["path"], r["status"], r["protocol"]) for r in gets] == [
        ("/v1/ai-sdk/chat/ai-resume/stream", 200, "v1")]

    # (5) an abort is the protocol's error chunk with the user-safe message, never the
    # provider's text; its fields ride along as a data part
    failed = cases["error"]
    assert failed["status"] == "error"
    assert failed["error"] == ("The model provider is rate limiting requests; "
                               "try again in a moment.")
    message = _assistant(failed)
    assert _kinds(message)[:2] == ["step-start", "text"]
    abort = next(p for p in message["parts"] if p["type"] == "data-abort")["data"]
    assert abort["error"] == "ModelRateLimited" and abort["retryable"] is True
    assert SECRET not in json.dumps(failed)
