"""OpenTelemetry traces (torpor.otel): GenAI spans of a turn, errors, the W3C trace
context over real HTTP (postponed and continued turns too), an OTLP/HTTP export, and
tracing that turns itself on only when a tracer provider is configured."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from opentelemetry import propagate, trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from serve_support import ADMIN, TOKEN, serving

import torpor
from torpor import (
    AgentConfig,
    ExternalTool,
    ModelContextTooLong,
    ModelRateLimited,
    Runtime,
    ScriptedModel,
    TurnAborted,
)
from torpor.llm.scripted import Call, Fail, Report, Signal, Text, Wait
from torpor.otel import TracingObserver, instrument
from torpor.serve import app, bearer_token
from torpor.serve import traces as serve_traces

ROOT = Path(__file__).resolve().parents[1]
TRACE_A = "0af7651916cd43dd8448eb211c80319c"
PARENT_A = "b7ad6b7169203331"
TRACE_B = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_B = "00f067aa0ba902b7"
TRACE_C = "5bf92f3577b34da6a3ce929d0e0e4737"
PARENT_C = "10f067aa0ba902b8"


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """A provider of the test's own (the global one can be set once per process)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def by_start(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return sorted(exporter.get_finished_spans(), key=lambda s: s.start_time or 0)


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def trace_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.trace_id


TOOL_TRACER: list[trace.Tracer] = []


@torpor.tool
async def lookup(order: str) -> str:
    """Look an order up."""
    with TOOL_TRACER[0].start_as_current_span("db.query"):  # a tool's own span
        return f"order {order}: shipped"


def gpt(steps: list[Any]) -> ScriptedModel:
    """A scripted model that names itself as an OpenAI adapter does."""
    model = ScriptedModel(steps, name="openai:gpt-test")
    model.provider = "openai"  # type: ignore[attr-defined]
    model.model = "gpt-test"  # type: ignore[attr-defined]
    return model


async def test_a_turn_with_a_tool_call_is_turn_model_tool_model_spans_with_genai_attributes(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    TOOL_TRACER[:] = [provider.get_tracer("test-tools")]
    model = gpt([
        [Text("let me look"), Call("lookup", {"order": "A1"}, id="call_7"),
         Report(100, 7, cache_read_tokens=64, cache_write_tokens=12)],
        [Text("it shipped"), Report(120, 3)],
    ])
    async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[lookup])) as rt:
        instrument(rt, provider)
        turn = await rt.send("c", "where is A1?")
        assert (await turn.result()).text == "it shipped"
    found = by_start(exporter)
    assert [s.name for s in found] == [
        "invoke_agent", "chat gpt-test", "execute_tool lookup", "db.query", "chat gpt-test"]
    agent, first, tool, query, second = found
    assert agent.parent is None and agent.kind is SpanKind.INTERNAL
    assert {parent_of(s) for s in (first, tool, second)} == {span_id(agent)}
    assert parent_of(query) == span_id(tool)  # the tool's own spans nest under its call
    assert len({trace_id(s) for s in found}) == 1
    assert dict(agent.attributes or {}) == {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "c",
        "torpor.turn": 1, "torpor.continuation": False, "torpor.postponed": False,
    }
    assert agent.status.status_code is StatusCode.UNSET
    a1 = first.attributes or {}
    assert first.kind is SpanKind.CLIENT
    assert a1["gen_ai.operation.name"] == "chat"
    assert a1["gen_ai.request.model"] == "gpt-test"
    assert a1["gen_ai.provider.name"] == "openai"
    assert a1["gen_ai.conversation.id"] == "c"
    assert (a1["gen_ai.usage.input_tokens"], a1["gen_ai.usage.output_tokens"]) == (100, 7)
    assert a1["gen_ai.usage.cache_read.input_tokens"] == 64
    assert a1["gen_ai.usage.cache_creation.input_tokens"] == 12
    assert a1["gen_ai.response.finish_reasons"] == ("tool_calls",)
    assert a1["torpor.model_call"] == 1 and a1["torpor.model"] == "openai:gpt-test"
    assert float(a1["gen_ai.response.time_to_first_chunk"]) >= 0  # type: ignore[arg-type]
    a2 = second.attributes or {}
    assert (a2["gen_ai.usage.input_tokens"], a2["gen_ai.usage.output_tokens"]) == (120, 3)
    assert "gen_ai.usage.cache_read.input_tokens" not in a2  # not reported: not made up
    assert a2["gen_ai.response.finish_reasons"] == ("stop",)
    assert a2["torpor.model_call"] == 2
    assert dict(tool.attributes or {}) == {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup",
        "gen_ai.tool.call.id": "call_7", "gen_ai.tool.type": "function",
        "gen_ai.conversation.id": "c",
    }


@torpor.tool
async def broken(order: str) -> str:
    """A tool that fails."""
    raise RuntimeError("inventory service down")


async def test_a_failing_tool_call_is_an_error_span_and_the_turn_goes_on(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    model = ScriptedModel([[Call("broken", {"order": "A1"}, id="call_9")], "sorry"])
    async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[broken])) as rt:
        instrument(rt, provider)
        assert (await (await rt.send("c", "where is A1?")).result()).text == "sorry"
    (tool,) = [s for s in exporter.get_finished_spans() if s.name == "execute_tool broken"]
    assert tool.status.status_code is StatusCode.ERROR
    assert (tool.attributes or {})["error.type"] == "tool_error"
    (agent,) = [s for s in exporter.get_finished_spans() if s.name == "invoke_agent"]
    assert agent.status.status_code is StatusCode.UNSET  # the model got the error and answered


async def test_a_429_is_an_error_model_call_span_and_an_aborted_turn_span(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    model = ScriptedModel([[Text("par"), Fail(ModelRateLimited("slow down", retry_after=2.0))]])
    async with Runtime("sqlite://", model=model) as rt:
        rt.observe(TracingObserver(provider))
        turn = await rt.send("c", "hi")
        with pytest.raises(TurnAborted):
            await turn.result()
    agent, call = by_start(exporter)
    assert call.name == "chat scripted" and parent_of(call) == span_id(agent)
    assert "gen_ai.provider.name" not in (call.attributes or {})  # not known: not made up
    assert call.status.status_code is StatusCode.ERROR
    assert "slow down" in (call.status.description or "")
    assert (call.attributes or {})["error.type"] == "ModelRateLimited"
    assert [e.name for e in call.events] == ["exception"]
    assert agent.status.status_code is StatusCode.ERROR
    assert (agent.status.description or "").startswith("model_error")
    assert (agent.attributes or {})["torpor.abort.reason"] == "model_error"
    assert (agent.attributes or {})["error.type"] == "ModelRateLimited"


async def test_a_fold_is_a_span_between_the_failed_call_and_the_retried_one(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    model = ScriptedModel(["a", "b", "c", [Fail(ModelContextTooLong("too long"))], "fits now"])
    async with Runtime("sqlite://", model=model) as rt:
        for text in ("one", "two", "three"):  # something to fold, before tracing
            await (await rt.send("c", text)).result()
        instrument(rt, provider)
        assert (await (await rt.send("c", "hi")).result()).text == "fits now"
    agent, failed, fold, retried = by_start(exporter)
    assert [agent.name, failed.name, fold.name, retried.name] == [
        "invoke_agent", "chat scripted", "fold", "chat scripted"]
    assert {parent_of(s) for s in (failed, fold, retried)} == {span_id(agent)}
    assert (fold.attributes or {})["torpor.fold.cycle"] == 1
    assert failed.status.status_code is StatusCode.ERROR
    assert retried.status.status_code is StatusCode.UNSET
    assert agent.status.status_code is StatusCode.UNSET  # the turn recovered


async def test_a_turn_is_a_child_of_its_senders_span_and_only_of_its_own(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    """The agent's task is created in the first sender's context; a later turn sent with
    no trace must not become that request's child."""
    provider, exporter = spans
    tracer = provider.get_tracer("test")
    async with Runtime("sqlite://", model=ScriptedModel.replies("a", "b")) as rt:
        instrument(rt, provider)
        with tracer.start_as_current_span("request"):
            await (await rt.send("c", "1")).result()
        await (await rt.send("c", "2")).result()
    request = next(s for s in exporter.get_finished_spans() if s.name == "request")
    first, second = [s for s in by_start(exporter) if s.name == "invoke_agent"]
    assert parent_of(first) == span_id(request) and trace_id(first) == trace_id(request)
    assert second.parent is None and trace_id(second) != trace_id(request)


APPROVE = ExternalTool("approve", "Ask a person.", {"type": "object", "properties": {}})


def _turns(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in by_start(exporter) if s.name == "invoke_agent"]


async def test_traceparent_over_http_parents_the_turn_also_postponed_and_continued(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    reached, go = anyio.Event(), anyio.Event()
    model = ScriptedModel([[Text("one "), Signal(reached), Wait(go), Text("two")],
                           [Call("approve", {}, id="k1")], "approved"])
    rt = Runtime("sqlite://", model=model, agent=AgentConfig(tools=[APPROVE]))
    async with rt:
        instrument(rt, provider)
        application = app(rt, authorize=bearer_token(TOKEN), admin_token=ADMIN, page=False)
        async with serving(application) as url, httpx.AsyncClient(base_url=url) as http:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            stream = {**auth, "Accept": "text/event-stream"}
            async with http.stream(
                "POST", "/v1/conversations/c/messages", json={"text": "first"},
                headers={**stream, "traceparent": traceparent(TRACE_A, PARENT_A)},
            ) as first:
                assert first.status_code == 200
                await reached.wait()
                async with http.stream(
                    "POST", "/v1/conversations/c/messages", json={"text": "second"},
                    headers={**stream, "traceparent": traceparent(TRACE_B, PARENT_B)},
                ) as later:
                    go.set()
                    assert "two" in (await first.aread()).decode()  # the first turn ended
                    # the postponed turn's stream ends as it suspends on the approval
                    assert "event: suspended" in (await later.aread()).decode()
            resolved = await http.post(
                "/v1/conversations/c/calls/k1", json={"result": "yes"},
                headers={**stream, "traceparent": traceparent(TRACE_C, PARENT_C)})
            assert resolved.status_code == 200 and "approved" in resolved.text
    first_turn, postponed, continued = _turns(exporter)
    for span, (tid, pid) in zip((first_turn, postponed, continued),
                                ((TRACE_A, PARENT_A), (TRACE_B, PARENT_B), (TRACE_C, PARENT_C)),
                                strict=True):
        assert f"{trace_id(span):032x}" == tid
        assert span.parent is not None and span.parent.is_remote
        assert f"{span.parent.span_id:016x}" == pid
    assert (postponed.attributes or {})["torpor.postponed"] is True
    assert (continued.attributes or {})["torpor.continuation"] is True
    assert (continued.attributes or {})["torpor.turn"] == 2


async def test_a_suspended_turn_cancelled_later_still_shows_its_abort(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    model = ScriptedModel([[Call("approve", {}, id="k1")]])
    async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[APPROVE])) as rt:
        instrument(rt, provider)
        assert isinstance(await (await rt.send("c", "pay")).result(), torpor.Suspended)
        assert await rt.cancel("c")
    suspended, cancelled = _turns(exporter)
    assert suspended.status.status_code is StatusCode.UNSET  # it ended waiting, not failed
    assert cancelled.status.status_code is StatusCode.ERROR
    assert (cancelled.attributes or {})["torpor.abort.reason"] == "cancelled"
    assert (cancelled.attributes or {})["gen_ai.conversation.id"] == "c"


class ServerSpans:
    """What OpenTelemetry's ASGI middleware does: a server span per request, current
    while the app runs, a child of the request's traceparent."""

    def __init__(self, app: Any, tracer: trace.Tracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        with self.tracer.start_as_current_span(
            f"{scope['method']} {scope['path']}", propagate.extract(headers),
            kind=SpanKind.SERVER,
        ):
            await self.app(scope, receive, send)


async def test_under_a_hosts_asgi_tracing_the_turn_is_a_child_of_the_server_span(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    async with Runtime("sqlite://") as rt:
        instrument(rt, provider)
        application = app(rt, authorize=bearer_token(TOKEN), admin_token=ADMIN, page=False)
        application.add_middleware(ServerSpans, tracer=provider.get_tracer("asgi"))
        async with serving(application) as url, httpx.AsyncClient(base_url=url) as http:
            response = await http.post(
                "/v1/conversations/c/messages", json={"text": "hi"},
                headers={"Authorization": f"Bearer {TOKEN}", "Accept": "text/event-stream",
                         "traceparent": traceparent(TRACE_A, PARENT_A)})
            assert response.status_code == 200
    server = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER)
    assert server.parent is not None and f"{server.parent.span_id:016x}" == PARENT_A
    (turn,) = _turns(exporter)
    assert parent_of(turn) == span_id(server)  # not the remote parent extracted a second time
    assert f"{trace_id(turn):032x}" == TRACE_A


def test_a_proxied_request_carries_the_current_span_else_the_clients_traceparent(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, _ = spans
    TracingObserver(provider)  # tracing is on in this process
    given = [("traceparent", traceparent(TRACE_A, PARENT_A)), ("accept", "text/event-stream")]
    assert serve_traces.forwarded(list(given)) == given  # no span here: the client's own
    with provider.get_tracer("asgi").start_as_current_span("POST", kind=SpanKind.SERVER) as s:
        sent = dict(serve_traces.forwarded(list(given)))
    context = s.get_span_context()
    assert sent["traceparent"].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")
    assert sent["accept"] == "text/event-stream"


class _Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf."""

    received: list[ExportTraceServiceRequest]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces" or \
                self.headers.get("Content-Type") != "application/x-protobuf":
            self.send_response(404)
            self.end_headers()
            return
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.received.append(request)
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


async def test_spans_reach_an_otlp_http_receiver() -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource

    received: list[ExportTraceServiceRequest] = []
    handler = type("Receiver", (_Receiver,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
        provider = TracerProvider(resource=Resource.create({"service.name": "torpor-test"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        TOOL_TRACER[:] = [provider.get_tracer("test-tools")]
        model = ScriptedModel([[Call("lookup", {"order": "B2"}), Report(50, 5)],
                               [Text("done"), Report(60, 2)]])
        async with Runtime("sqlite://", model=model, agent=AgentConfig(tools=[lookup])) as rt:
            instrument(rt, provider)
            await (await rt.send("otlp", "where is B2?")).result()
        assert await anyio.to_thread.run_sync(provider.force_flush)
        provider.shutdown()
    finally:
        server.shutdown()
        server.server_close()
    spans = [(scope.scope.name, span)
             for request in received for resource in request.resource_spans
             for scope in resource.scope_spans for span in scope.spans]
    names = sorted(span.name for _, span in spans)
    assert names == ["chat scripted", "chat scripted", "db.query", "execute_tool lookup",
                     "invoke_agent"]
    assert {scope for scope, span in spans if span.name != "db.query"} == {"torpor"}
    resources = {a.key: a.value.string_value for request in received
                 for resource in request.resource_spans for a in resource.resource.attributes}
    assert resources["service.name"] == "torpor-test"
    root = next(span for _, span in spans if span.name == "invoke_agent")
    calls = [span for _, span in spans if span.name == "chat scripted"]
    assert all(c.parent_span_id == root.span_id and c.trace_id == root.trace_id for c in calls)
    tokens = sorted(next(a.value.int_value for a in c.attributes
                         if a.key == "gen_ai.usage.input_tokens") for c in calls)
    assert tokens == [50, 60]


_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    {setup}
    import torpor
    import torpor.serve  # the HTTP routes' tracing shim imports nothing of OpenTelemetry

    async def main():
        async with torpor.Runtime("sqlite://") as rt:
            await (await rt.send("c", "hi")).result()
            return bool(rt._host.observers)

    observed = asyncio.run(main())
    print(json.dumps({{
        "observed": observed,
        "imported": sorted(m for m in sys.modules if m.startswith("opentelemetry")
                           or m.startswith("torpor.otel")),
        "spans": {spans},
    }}))
""")


def _run(setup: str, spans: str = "None") -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OTEL_PYTHON_TRACER_PROVIDER", None)
    done = subprocess.run([sys.executable, "-c", _SCRIPT.format(setup=setup, spans=spans)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_tracing_is_automatic_with_a_global_provider_and_absent_without() -> None:
    configured = _run(textwrap.dedent("""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
    """), "[s.name for s in exporter.get_finished_spans()]")
    assert configured["observed"] is True
    assert configured["spans"] == ["chat echo", "invoke_agent"]
    # OpenTelemetry loaded, no provider: nothing observed.
    assert _run("import opentelemetry.trace")["observed"] is False
    # Never loaded by the host: torpor does not load it either.
    assert _run("") == {"observed": False, "imported": [], "spans": None}


async def test_a_proxied_turn_on_the_owner_node_is_a_child_of_the_requests_trace(
    pg_url: str, spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    from test_cluster_proxy import node, owned_by, split

    from torpor.llm.echo import EchoModel
    from torpor.serve.proxy import OWNER_HEADER

    provider, exporter = spans
    # A longer lease than the proxy tests' 1 s: this test is about the trace, and a renewal
    # a loaded machine delays past 1 s would move the shard mid-request (a 503, not a trace).
    async with node(pg_url, "a", EchoModel(), lease_ttl=10.0) as a, \
            node(pg_url, "b", EchoModel(), lease_ttl=10.0) as b:
        instrument(a.rt, provider)
        instrument(b.rt, provider)
        held = await split(a, b)
        cid = owned_by(held["a"], "t")
        async with httpx.AsyncClient(timeout=20) as http:
            response = await http.post(
                f"{b.url}/v1/conversations/{cid}/messages", json={"text": "hi"},
                headers={"Authorization": f"Bearer {TOKEN}", "Accept": "text/event-stream",
                         "traceparent": traceparent(TRACE_A, PARENT_A)})
            assert response.status_code == 200
            assert response.headers[OWNER_HEADER] == a.url.removeprefix("http://")
    (turn,) = _turns(exporter)
    assert (turn.attributes or {})["gen_ai.conversation.id"] == cid
    assert f"{trace_id(turn):032x}" == TRACE_A
    assert turn.parent is not None and f"{turn.parent.span_id:016x}" == PARENT_A
